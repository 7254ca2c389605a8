"""Where reads start and end, in the option language Spark users know (Kafka, Delta).

``startingOffsets`` / ``startingTimestamp`` for new consumers and batch reads, ``endingOffsets``
/ ``endingTimestamp`` for reproducible batch reads, ``maxOffsetsPerTrigger`` /
``maxFilesPerTrigger`` / ``minPartitions``, ``minOffsetsPerTrigger`` with ``maxTriggerDelay``,
the client's ``start=datetime`` and ``Consumer.seek(datetime)``, a warning when a start is given
for a consumer that exists, and messages lost to a consumer whose selector changed.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue, InvalidOptionError
from pyspark_durable_queue._positions import ReadPosition, parse_position, parse_time
from pyspark_durable_queue.settings import ReadSettings, parse_options

UTC = dt.timezone.utc
REGIONS = ["EU", "US", "APAC"]


def send(address, start: int, n: int, region: str | None = None) -> None:
    ids = list(range(start, start + n))
    address.send(pa.table({
        "id": pa.array(ids, pa.int64()),
        "region": [region or REGIONS[i % 3] for i in ids],
    }))


def commit_times(address) -> list[int]:
    """Commit time (microseconds) of each retained commit, from its messages' ``_timestamp``
    (a commit's messages share its time): the independent value that time positions are
    checked against, in any layout (a journal keeps many commits in one index row)."""
    c = address.consumer(f"times-{uuid.uuid4().hex[:8]}", start="earliest")
    stamps = c.receive(max_messages=10**6).column("_timestamp").cast(pa.int64()).to_pylist()
    c.delete()
    return sorted(set(stamps))


def at(ts_us: int) -> dt.datetime:
    """A commit time as an exact ``datetime`` (no float rounding)."""
    return dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(microseconds=ts_us)


def drain(consumer) -> list[int]:
    return [i for t in consumer.batches(max_messages=10_000) for i in t.column("id").to_pylist()]


def _three_commits(root, **settings):
    a = DurableQueue(str(root)).address("orders", **settings)
    for k in range(3):
        send(a, k * 10, 10)
        time.sleep(0.02)
    return a


@pytest.fixture(params=["journal", "pages"])
def three_commits(request, tmp_path):
    """An address with three commits of 10 messages each, 20 ms apart: in a journal (a local
    disk's default) and in a page file each (``journal=False``)."""
    return _three_commits(tmp_path, journal=request.param == "journal")


@pytest.fixture
def three_pages(tmp_path):
    """``three_commits`` with a page file per commit, for what is planned page by page."""
    return _three_commits(tmp_path, journal=False)


# -- parsing (no store) -------------------------------------------------------------------------
@pytest.mark.parametrize("given, expected", [
    ("earliest", ReadPosition("earliest")), (" LATEST ", ReadPosition("latest")),
    (17, ReadPosition("seq", 17)), ("17", ReadPosition("seq", 17)),
    ('{"seq": 5}', ReadPosition("seq", 5)), ({"seq": 5}, ReadPosition("seq", 5)),
    (dt.datetime(2026, 1, 1, tzinfo=UTC), ReadPosition("time", 1_767_225_600_000_000)),
    (dt.datetime(2026, 1, 1), ReadPosition("time", 1_767_225_600_000_000)),  # naive: UTC
], ids=["earliest", "latest", "int", "digits", "json-offset", "dict-offset", "aware", "naive"])
def test_positions_parse(given, expected):
    assert parse_position(given) == expected


@pytest.mark.parametrize("given", ["first", -1, "-3", '{"seq": -1}', '{"seq": "5"}',
                                   '{"offset": 5}', '{"seq": 5, "x": 1}', True, "{"],
                         ids=repr)
def test_bad_positions_name_the_option_and_the_accepted_forms(given):
    with pytest.raises(InvalidOptionError, match=r"startingOffsets=.* is invalid: .*"
                                                 r"(earliest, latest|_seq is >= 0)"):
        parse_position(given, "startingOffsets")


@pytest.mark.parametrize("given", [1_767_225_600_000, "1767225600000", "2026-01-01T00:00:00Z",
                                   "2026-01-01T01:00:00+01:00", "2026-01-01 00:00:00",
                                   dt.datetime(2026, 1, 1, tzinfo=UTC)], ids=repr)
def test_times_parse_as_epoch_milliseconds_or_iso(given):
    assert parse_time(given) == ReadPosition("time", 1_767_225_600_000_000)


def test_bad_time_is_a_clear_error():
    with pytest.raises(InvalidOptionError, match=r"startingTimestamp=.yesterday.*ISO-8601"):
        parse_time("yesterday", "startingTimestamp")


def test_kafka_and_delta_option_names_are_aliases():
    o = parse_options({"startingOffsets": '{"seq": 3}', "maxOffsetsPerTrigger": "10",
                       "maxFilesPerTrigger": "2", "minPartitions": "4",
                       "minOffsetsPerTrigger": "100", "maxTriggerDelay": "30s"}, "read")
    assert o == {"starting_position": ReadPosition("seq", 3), "max_messages_per_trigger": 10,
                 "max_pages_per_trigger": 2, "min_partitions": 4,
                 "min_offsets_per_trigger": 100, "max_trigger_delay": 30_000}
    for text, ms in (("15m", 900_000), ("500ms", 500), ("2h", 7_200_000), ("250", 250)):
        assert parse_options({"maxTriggerDelay": text}, "read")["max_trigger_delay"] == ms


def test_two_spellings_of_one_option_are_refused():
    with pytest.raises(InvalidOptionError, match="'startingPosition' and 'startingOffsets' "
                                                 "are the same option"):
        parse_options({"startingPosition": "earliest", "startingOffsets": "latest"}, "read")


def test_bad_values_name_the_spelling_the_user_gave():
    with pytest.raises(InvalidOptionError, match=r"option maxOffsetsPerTrigger='many'"):
        parse_options({"maxOffsetsPerTrigger": "many"}, "read")
    with pytest.raises(InvalidOptionError, match=r"maxTriggerDelay.*duration"):
        parse_options({"maxTriggerDelay": "soon"}, "read")


# -- the Python client --------------------------------------------------------------------------
def test_client_starts_a_consumer_at_a_time(three_commits):
    a = three_commits
    ts = commit_times(a)
    second = at(ts[1])
    assert drain(a.consumer("from-second", start=second)) == list(range(10, 30))
    just_after = second + dt.timedelta(microseconds=1)
    assert drain(a.consumer("after-second", start=just_after)) == list(range(20, 30))
    before_all = dt.datetime(2000, 1, 1, tzinfo=UTC)
    assert drain(a.consumer("from-all", start=before_all)) == list(range(30))
    future = dt.datetime.now(UTC) + dt.timedelta(days=1)
    late = a.consumer("future", start=future)
    assert late.position == 30 and drain(late) == []


def test_seek_to_a_time_moves_back_and_forward(three_commits):
    a = three_commits
    ts = commit_times(a)
    a.consumer("keeps-pages")  # so that acknowledging does not let cleanup remove them
    c = a.consumer("c")
    assert drain(c) == list(range(30))
    c.ack()
    c.seek(at(ts[2]))
    assert c.position == 20
    assert DurableQueue(a.storage.url).address("orders").consumers()["c"]["position"] == 20
    assert drain(c) == list(range(20, 30))
    c.seek(at(ts[0]))
    assert drain(c) == list(range(30))


def test_a_time_before_the_retained_messages_starts_at_the_first_retained(tmp_path):
    # a page per commit (journal=False): cleanup removes the first commit's page alone
    a = DurableQueue(str(tmp_path)).address("orders", cleanup_interval_ms=0, journal=False)
    send(a, 0, 10)
    send(a, 10, 10)
    gone = a.consumer("gone")
    gone.receive(max_messages=10)
    gone.ack()
    a.cleanup(dry_run=False)
    assert a.state.first_seq == 10
    c = a.consumer("late", start=dt.datetime(2000, 1, 1))
    assert c.position == 10


def test_start_given_for_an_existing_consumer_is_ignored_with_a_warning(tmp_path, caplog):
    a = DurableQueue(str(tmp_path)).address("orders")
    send(a, 0, 10)
    c = a.consumer("c")
    c.receive(max_messages=4)
    c.ack()
    with caplog.at_level(logging.WARNING, "pyspark_durable_queue"):
        again = DurableQueue(str(tmp_path)).address("orders").consumer("c", start="latest")
    assert again.position == 4
    assert "already exists: it resumes at its watermark _seq 4" in caplog.text
    assert "start=latest is ignored" in caplog.text and "seek" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "pyspark_durable_queue"):
        a.consumer("c")  # no start given: nothing to warn about
    assert caplog.text == ""


# -- a consumer whose selector changes ----------------------------------------------------------
def selective_backlog(root):
    """Pages: US-only (_seq 0..9), EU (10..19), US-only (20..29). Consumer ``c`` selects EU;
    cleanup removes the two US pages although ``c`` has not passed them. A page per commit
    (``journal=False``): cleanup by selector uses each page's column statistics."""
    a = DurableQueue(str(root)).address("orders", cleanup_interval_ms=0, journal=False)
    send(a, 0, 10, "US")
    send(a, 10, 10, "EU")
    send(a, 20, 10, "US")
    a.consumer("c", selector="region = 'EU'")
    a.cleanup(dry_run=False)
    assert [(s, r) for s, r in zip(a.state.pages.seq, a.state.pages.rows, strict=True)] == \
        [(10, 10)]
    return a


def test_changed_selector_reports_what_cleanup_removed_for_the_old_one(tmp_path, caplog):
    selective_backlog(tmp_path)
    with caplog.at_level(logging.WARNING, "pyspark_durable_queue"):
        c = DurableQueue(str(tmp_path)).address("orders").consumer(
            "c", selector="region = 'US'")
    assert "selector changed from \"region = 'EU'\" to \"region = 'US'\"" in caplog.text
    assert "_seq 0..9, 20..29 were removed by cleanup" in caplog.text
    assert [r[:2] for r in c.lost_in(0, 100)] == [(0, 10), (20, 30)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, "pyspark_durable_queue"):
        assert drain(c) == []  # the US messages are gone: said, not silent
    assert "_seq 0..9 are lost to this consumer" in caplog.text
    assert "_seq 20..29 are lost to this consumer" in caplog.text
    c.ack()
    reopened = DurableQueue(str(tmp_path)).address("orders").consumer("c")
    assert reopened.lost_in(0, 100) == []  # passed for good: forgotten


def test_adding_a_selector_loses_nothing(tmp_path, caplog):
    a = DurableQueue(str(tmp_path)).address("orders", cleanup_interval_ms=0)
    send(a, 0, 10, "US")
    a.consumer("c")
    a.cleanup(dry_run=False)
    with caplog.at_level(logging.WARNING, "pyspark_durable_queue"):
        c = a.consumer("c", selector="region = 'US'")
    assert c.lost_in(0, 100) == [] and "removed by cleanup" not in caplog.text
    assert drain(c) == list(range(10))


# -- Spark: planning without a JVM --------------------------------------------------------------
pyspark = pytest.importorskip("pyspark")

from pyspark_durable_queue._read.plan import plan_tasks  # noqa: E402
from pyspark_durable_queue.spark._batch import DurableQueueBatchReader  # noqa: E402
from pyspark_durable_queue.spark._reader import spark_schema  # noqa: E402
from pyspark_durable_queue.spark._source import DurableQueueStreamReader  # noqa: E402


def test_min_partitions_splits_small_batches():
    from pyspark_durable_queue._log.commit_log import PageIndex

    idx = PageIndex()
    for k in range(3):
        idx.add(f"p{k}.page", k * 100, 100, 10_000, 0, {"rows": 100, "columns": {}})
    assert len(plan_tasks(idx, 0, 300, slots=2)) == 1  # 30 KB: one task by size
    tasks = plan_tasks(idx, 0, 300, slots=2, min_tasks=6)
    assert len(tasks) == 6
    flat = [(s.lo, s.hi) for t in tasks for s in t]
    assert flat[0][0] == 0 and flat[-1][1] == 300
    assert all(a[1] == b[0] for a, b in itertools.pairwise(flat))
    assert len(plan_tasks(idx, 0, 3, slots=2, min_tasks=10)) == 3  # never more than messages


def test_read_option_combinations_that_make_no_sense_are_refused():
    base = {"path": "/tmp/x", "address": "a", "consumer": "c"}
    with pytest.raises(InvalidOptionError, match="startingTimestamp both say where to start"):
        ReadSettings.parse({**base, "startingOffsets": "earliest",
                           "startingTimestamp": "0"}, streaming=True)
    with pytest.raises(InvalidOptionError, match="endingOffsets applies to batch reads"):
        ReadSettings.parse({**base, "endingOffsets": "10"}, streaming=True)
    with pytest.raises(InvalidOptionError, match="consumer it names, or at startingOffsets"):
        ReadSettings.parse({**base, "startingOffsets": "5"}, streaming=False)
    with pytest.raises(InvalidOptionError, match="maxTriggerDelay applies only with"):
        ReadSettings.parse({**base, "maxTriggerDelay": "5s"}, streaming=True)


def _schema(root):
    return spark_schema(DurableQueue(str(root)).address("orders").schema)


def test_min_offsets_waits_at_most_max_trigger_delay(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders")
    send(a, 0, 10)
    reader = DurableQueueStreamReader(
        {"path": str(tmp_path), "address": "orders", "consumer": "c",
         "minOffsetsPerTrigger": "50", "maxTriggerDelay": "400ms"}, _schema(tmp_path))
    try:
        start = reader.initialOffset()
        limit = reader.getDefaultReadLimit()
        assert reader.latestOffset(start, limit) == {"seq": 10}  # the first trigger goes
        send(a, 10, 10)
        assert reader.latestOffset({"seq": 10}, limit) == {"seq": 10}  # 10 < 50: wait
        time.sleep(0.5)
        assert reader.latestOffset({"seq": 10}, limit) == {"seq": 20}  # waited long enough
        send(a, 20, 60)
        assert reader.latestOffset({"seq": 20}, limit) == {"seq": 80}  # 60 >= 50: at once
        send(a, 80, 5)
        reader.prepareForTriggerAvailableNow()
        assert reader.latestOffset({"seq": 80}, limit) == {"seq": 85}  # never waits
    finally:
        reader.stop()


def test_streaming_start_option_for_an_existing_consumer_warns(tmp_path, caplog):
    a = DurableQueue(str(tmp_path)).address("orders")
    send(a, 0, 10)
    a.consumer("c").ack(4)
    reader = DurableQueueStreamReader({"path": str(tmp_path), "address": "orders",
                                       "consumer": "c", "startingOffsets": "latest"},
                                      _schema(tmp_path))
    try:
        with caplog.at_level(logging.WARNING, "pyspark_durable_queue"):
            assert reader.initialOffset() == {"seq": 5}
    finally:
        reader.stop()
    assert "already exists: it resumes at its watermark _seq 5" in caplog.text


def test_batch_ranges_by_offset_and_time(three_pages):
    a = three_pages  # ranges are planned page by page
    root = a.storage.url
    ts = commit_times(a)

    def planned(**options):
        reader = DurableQueueBatchReader({"path": root, "address": "orders", **options},
                                         _schema(root))
        return [(s.lo, s.hi) for p in reader.partitions() for s in p.slices]

    assert planned(startingOffsets="5", endingOffsets='{"seq": 25}') == [(5, 10), (10, 20),
                                                                          (20, 25)]
    assert planned(startingTimestamp=str(ts[1] // 1000 + 1),
                   endingTimestamp=str(ts[2] // 1000 + 1)) == [(20, 30)]
    second = at(ts[1]).isoformat()
    assert planned(startingTimestamp=second, endingOffsets="20") == [(10, 20)]
    assert planned(endingOffsets="latest") == [(0, 10), (10, 20), (20, 30)]
    assert planned(startingOffsets="latest") == []


# -- Spark end to end ---------------------------------------------------------------------------
def _stream(spark, root, consumer, **options):
    reader = (spark.readStream.format("durablequeue").option("address", "orders")
              .option("consumer", consumer))
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load(str(root))


def _run(spark, df, ckpt: Path, **trigger):
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (df.writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(ckpt)).trigger(**(trigger or {"availableNow": True}))
         .start())
    assert q.awaitTermination(180), "the query did not finish"
    q.stop()
    assert q.exception() is None
    return sorted(r.id for r in spark.table(name).select("id").collect()), q


def test_kafka_style_start_and_limit_options_end_to_end(spark, three_pages, tmp_path):
    a = three_pages  # maxFilesPerTrigger counts page files
    a.consumer("keeps-pages")  # cleanup must not remove what the next queries read
    ts = commit_times(a)
    root = a.storage.url
    got, q = _run(spark, _stream(spark, root, "json", startingOffsets='{"seq": 12}',
                                 maxOffsetsPerTrigger=7), tmp_path / "ck1")
    assert got == list(range(12, 30))
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == [7, 7, 4]
    # the offset Spark prints in progress is the form startingOffsets takes
    printed = q.recentProgress[-1]["sources"][0]["endOffset"]
    assert json.loads(printed) == {"seq": 30}
    got, q = _run(spark, _stream(spark, root, "files", maxFilesPerTrigger=1),
                  tmp_path / "ck2")
    assert got == list(range(30))
    assert [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]] == [10, 10, 10]
    got, _ = _run(spark, _stream(spark, root, "by-time",
                                 startingTimestamp=str(ts[1] // 1000 + 1)), tmp_path / "ck3")
    assert got == list(range(20, 30))


def test_batch_backfill_reads_the_same_rows_every_time(spark, three_commits):
    a = three_commits
    root = a.storage.url
    ts = commit_times(a)

    def backfill():
        return sorted(r.id for r in spark.read.format("durablequeue").option("address", "orders")
                      .option("startingOffsets", "5").option("endingOffsets", "25")
                      .load(root).collect())

    def by_time():
        return sorted(r.id for r in spark.read.format("durablequeue").option("address", "orders")
                      .option("startingTimestamp", str(ts[0] // 1000))
                      .option("endingTimestamp",
                              at(ts[2]).isoformat())
                      .load(root).collect())

    first, first_by_time = backfill(), by_time()
    assert first == list(range(5, 25))
    assert first_by_time == list(range(20))
    send(a, 30, 10)  # more messages arrive: the same ranges read the same rows
    assert backfill() == first and by_time() == first_by_time


def test_min_partitions_end_to_end(spark, three_commits):
    df = (spark.read.format("durablequeue").option("address", "orders")
          .option("minPartitions", 5).load(three_commits.storage.url))
    assert df.rdd.getNumPartitions() == 5
    assert sorted(r.id for r in df.collect()) == list(range(30))


def test_selector_change_is_data_loss_in_spark(spark, tmp_path):
    selective_backlog(tmp_path)
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (_stream(spark, tmp_path, "c", selector="region = 'US'").writeStream.format("memory")
         .queryName(name).option("checkpointLocation", str(tmp_path / "ck1"))
         .trigger(availableNow=True).start())
    with pytest.raises(Exception, match="DataLossError"):
        q.awaitTermination(120)
    message = str(q.exception())
    assert "0..9, 20..29" in message and "selector changed" in message
    q.stop()
    got, _ = _run(spark, _stream(spark, tmp_path, "c", selector="region = 'US'",
                                 failOnDataLoss="false"), tmp_path / "ck2")
    assert got == []
