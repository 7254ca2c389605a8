"""Time to live per send (``send(rows, ttl_ms=N)``, issue 41): those messages expire at
``_timestamp + N`` (or at the address's ``expiry_delay_ms`` if earlier), are never delivered
after, and count as settled for every consumer. The TTL is stored with the messages (a hidden
``_ttl_ms`` column in their frames, never returned), so it survives compaction and is the same
for every reader; Spark plans record the time they judge TTLs at, so a replay reads the same
rows.

Time is real: messages are made old by waiting a few hundred milliseconds.
"""

from __future__ import annotations

import io
import threading
import time

import pyarrow as pa
import pytest
from conftest import taken_in_time

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.page import read_page
from pyspark_durable_queue._format.schema import TTL
from pyspark_durable_queue.errors import InvalidOptionError, SchemaMismatchError

TTL_MS = 300
LONG_MS = 600_000


def ids(table: pa.Table) -> list[int]:
    return sorted(table.column("id").to_pylist())


def expire(seconds: float = TTL_MS / 1000 + 0.15) -> None:
    time.sleep(seconds)


def test_messages_sent_with_a_ttl_expire_and_the_others_do_not(root):
    a = DurableQueue(root).address("jobs")
    a.consumer("w")
    sent = time.time()
    a.send([{"id": 0}, {"id": 1}], ttl_ms=TTL_MS)
    a.send([{"id": 2}])
    a.send([{"id": 3}], ttl_ms=LONG_MS)
    look = DurableQueue(root).address("jobs").consumer("look", start="earliest")
    before = look.receive(10)
    look.close()
    if time.time() - sent < TTL_MS / 1000:  # a slow store may take longer than the TTL
        assert ids(before) == [0, 1, 2, 3]
    assert TTL not in before.schema.names  # hidden: never returned
    expire()
    w = DurableQueue(root).address("jobs").consumer("w")
    got = w.receive(10)
    w.close()
    assert ids(got) == [2, 3]
    assert got.schema.names == ["id", "_seq", "_timestamp", "_delivery_count"]


def test_a_receive_right_after_the_send_delivers_messages_with_a_long_ttl(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs")
    c = a.consumer("w")
    a.send([{"id": i} for i in range(5)], ttl_ms=LONG_MS)
    assert ids(c.receive(10)) == [0, 1, 2, 3, 4]


def test_expired_messages_count_as_settled_for_the_consumer(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs")
    c = a.consumer("w")
    a.send([{"id": i} for i in range(4)], ttl_ms=TTL_MS)
    expire()
    assert c.receive(10).num_rows == 0
    c.ack()
    assert DurableQueue(str(tmp_path)).address("jobs").stats()["consumers"]["w"]["position"] == 4


def test_the_address_expiry_applies_when_it_comes_before_the_ttl(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", expiry_delay_ms=TTL_MS)
    c = a.consumer("w")
    a.send([{"id": 0}], ttl_ms=LONG_MS)
    expire()
    assert c.receive(10).num_rows == 0


def test_ttl_ms_must_be_a_positive_int(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs")
    for bad in (0, -5, True, 1.5, "100"):
        with pytest.raises(InvalidOptionError, match="ttl_ms"):
            a.send([{"id": 0}], ttl_ms=bad)
        with pytest.raises(InvalidOptionError, match="ttl_ms"):
            a.producer(ttl_ms=bad)
    with pytest.raises(SchemaMismatchError, match="_ttl_ms"):
        a.send([{"id": 0, TTL: 5}])  # the hidden column's name is reserved
    assert a.stats()["next_seq"] == 0


def test_the_ttl_survives_compaction(tmp_path):
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", journal=False)  # a small page per send
    c = a.consumer("w")
    for i in range(0, 6, 2):
        a.send([{"id": i}], ttl_ms=TTL_MS)
        a.send([{"id": i + 1}])
    report = a.compact()
    assert report.runs == 1 and report.pages_before == 6 and report.pages_after == 1
    page = read_page(a.storage, a.layout.page(report.pages[0]))
    frames = page.batches
    assert any(TTL in b.schema.names for b in frames)
    stored = pa.Table.from_batches([b.select(["id", TTL]) for b in frames])
    assert dict(zip(stored.column("id").to_pylist(), stored.column(TTL).to_pylist(),
                    strict=True)) == {0: TTL_MS, 1: None, 2: TTL_MS, 3: None, 4: TTL_MS, 5: None}
    expire()
    assert ids(c.receive(10)) == [1, 3, 5]


def test_compaction_leaves_the_column_out_of_frames_without_ttls(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", journal=False)
    a.consumer("w")
    for i in range(4):
        a.send([{"id": i}])
    report = a.compact()
    assert report.runs == 1
    page = read_page(a.storage, a.layout.page(report.pages[0]))
    assert all(TTL not in b.schema.names for b in page.batches)


def test_sends_with_and_without_ttl_committed_together_keep_their_own(tmp_path):
    # concurrent sends share group commits (a frame may mix rows with and without a TTL)
    a = DurableQueue(str(tmp_path)).address("jobs")
    c = a.consumer("w")

    def sender(k: int) -> None:
        for i in range(k * 100, k * 100 + 50):
            a.send([{"id": i}], ttl_ms=TTL_MS if i % 2 else None)

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.stats()["next_seq"] == 200
    expire()
    got = []
    for batch in c.batches(max_messages=1000):
        got += batch.column("id").to_pylist()
    assert sorted(got) == sorted(i for k in range(4) for i in range(k * 100, k * 100 + 50)
                                 if i % 2 == 0)


def test_a_producer_with_a_ttl(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs")
    c = a.consumer("w")
    with a.producer(ttl_ms=TTL_MS) as p:
        futures = [p.send({"id": i}) for i in range(10)]
    assert [f.result() for f in futures] == list(range(10))
    a.send([{"id": 10}])
    expire()
    assert ids(c.receive(100)) == [10]


def test_the_cli_sends_with_a_ttl(tmp_path, capsys, monkeypatch):
    from conftest import run_cli

    root = str(tmp_path)
    a = DurableQueue(root).address("jobs")
    c = a.consumer("w")
    monkeypatch.setattr("sys.stdin", io.StringIO('{"id": 1}\n{"id": 2}\n'))
    code, out, _ = run_cli(capsys, root, "send", "jobs", "--ttl-ms", str(TTL_MS))
    assert code == 0 and "sent 2 messages" in out
    assert a.state.ttl or DurableQueue(root).address("jobs").state.ttl
    monkeypatch.setattr("sys.stdin", io.StringIO('{"id": 3}\n'))
    assert run_cli(capsys, root, "send", "jobs")[0] == 0
    expire()
    assert ids(c.receive(10)) == [3]
    monkeypatch.setattr("sys.stdin", io.StringIO('{"id": 4}\n'))
    with pytest.raises(SystemExit) as exc:
        run_cli(capsys, root, "send", "jobs", "--ttl-ms", "0")
    assert exc.value.code == 2


def test_a_scheduled_send_keeps_its_ttl_from_its_release(tmp_path):
    from pyspark_durable_queue._format.schema import TTL_FIELD
    from pyspark_durable_queue._read.scan import Scan

    a = DurableQueue(str(tmp_path)).address("jobs")
    c = a.consumer("w")
    scheduled_at = time.time()
    result = a.send([{"id": 0}], delay_ms=600, ttl_ms=500)  # due after its TTL would end
    assert result.scheduled is not None
    time.sleep(0.65)
    assert a.release_due(force=True) == 1
    released = time.time()
    got = c.receive(10)
    if time.time() - released < 0.5:  # a loaded machine may take longer than the TTL
        assert ids(got) == [0]
    # what is stored: the TTL, counted from the release's commit time
    state = a.log.refresh()
    (batch, _), = [(b, p) for b, p in Scan(a.storage, a.layout.pages, state.pages.refs(0), 0,
                                           1, schema=state.schema.append(TTL_FIELD))
                   if b is not None]
    assert batch.column(TTL).to_pylist() == [500]
    assert batch.column("_timestamp")[0].value >= (scheduled_at + 0.6) * 1e6
    time.sleep(0.55)
    assert a.consumer("late", start="earliest").receive(10).num_rows == 0


def test_a_nacked_message_whose_ttl_ends_while_it_waits_is_settled(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs")
    a.send([{"id": 0}], ttl_ms=TTL_MS)
    a.send([{"id": 1}])
    c = a.consumer("w", start="earliest")
    got = c.receive(2)
    c.nack(got.slice(0, 1), delay_ms=TTL_MS + 100)  # due after it expired
    c.ack(got)
    expire(TTL_MS / 1000 + 0.3)
    assert c.receive(10).num_rows == 0
    c.flush()
    stats = DurableQueue(str(tmp_path)).address("jobs").stats()["consumers"]["w"]
    assert stats["position"] == 2 and stats["redelivery_pending"] == 0


def test_the_log_state_remembers_ttls_across_checkpoints(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs")
    a.send([{"id": 0}])
    assert not a.state.ttl
    a.send([{"id": 1}], ttl_ms=LONG_MS)
    assert a.state.ttl
    a.log.checkpoint_now()
    version = a.state.version
    assert a.log.read_checkpoint(version).ttl
    assert DurableQueue(str(tmp_path)).address("jobs").state.ttl  # a fresh load


def test_the_stream_reader_records_its_ttl_time_and_replays_the_same_rows(tmp_path):
    from pyspark_durable_queue.spark._reader import read_schema
    from pyspark_durable_queue.spark._source import DurableQueueStreamReader

    root = str(tmp_path)
    a = DurableQueue(root).address("jobs")
    a.send([{"id": 0}])
    options = {"path": root, "address": "jobs", "consumer": "spark"}
    reader = DurableQueueStreamReader(options, read_schema(options))
    start = reader.initialOffset()
    assert reader.latestOffset(start, reader.getDefaultReadLimit()) == {"seq": 1}  # no TTLs
    a.send([{"id": i} for i in range(1, 5)], ttl_ms=TTL_MS)
    a.send([{"id": 5}])
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert end["seq"] == 6 and end["ttl_now"] <= time.time() * 1e6

    def rows(end):
        return sorted(i for p in reader.partitions(start, end) for b in reader.read(p)
                      for i in pa.Table.from_batches([b]).column("id").to_pylist())

    planned = rows(end)
    expire()
    assert rows(end) == planned  # a replay after the TTLs ended: the same rows
    later = dict(end, ttl_now=int(time.time() * 1e6))
    assert rows(later) == [0, 5]
    assert reader.latestOffset(end, reader.getDefaultReadLimit()) == end  # nothing new


@pytest.mark.spark
def test_spark_reads_drop_messages_whose_ttl_ended_and_record_the_time(spark, tmp_path):
    import json
    import uuid

    from conftest import finish_query

    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("jobs")
    a.send([{"id": i} for i in range(5)], ttl_ms=TTL_MS)
    a.send([{"id": 5}])
    expire()
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (spark.readStream.format("durablequeue").option("address", "jobs")
         .option("consumer", "spark").load(root).writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True)
         .start())
    finish_query(q)
    assert [r.id for r in spark.table(name).collect()] == [5]
    end = json.loads((tmp_path / "ck" / "offsets" / "0").read_text().splitlines()[-1])
    assert end["seq"] == 6 and end["ttl_now"] > 0 and "expire_before" not in end
    batch = spark.read.format("durablequeue").option("address", "jobs").load(root)
    assert [r.id for r in batch.collect()] == [5]


@pytest.mark.spark
@pytest.mark.parametrize("journal", [True, False], ids=["journal", "pages"])
def test_the_spark_sink_writes_rows_with_the_ttl_of_its_option(spark, tmp_path, journal):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("jobs", journal=journal)

    def write(first: int, **options) -> None:
        writer = spark.createDataFrame([(i,) for i in range(first, first + 4)], "id long") \
            .write.format("durablequeue").option("address", "jobs")
        for k, v in options.items():
            writer = writer.option(k, v)
        writer.mode("append").save(root)

    write(0, ttlMs=LONG_MS)  # alive for the test's length
    write(10, ttlMs=TTL_MS)  # expired by the time it is read (a Spark write takes longer)
    write(20)  # no TTL
    a = DurableQueue(root).address("jobs")
    assert a.state.ttl  # the entries say their frames carry TTLs
    expire()
    c = a.consumer("w")
    got = c.receive(100)
    assert TTL not in got.column_names  # hidden, as for send(ttl_ms=)
    assert ids(got) == [0, 1, 2, 3, 20, 21, 22, 23]
    c.close()
    with pytest.raises(Exception, match="ttlMs"):
        write(30, ttlMs="0")


@pytest.mark.parametrize("how", ["ttl", "delay"])
def test_messages_read_ahead_are_not_handed_out_after_they_expire(tmp_path, how):
    # receive(1) reads up to 4,096 messages ahead and hands them out one by one: a slow
    # worker must not be given one that expired meanwhile (it was alive when read ahead)
    def setup(short):
        settings = {"expiry_delay_ms": short} if how == "delay" else {}
        a = DurableQueue(str(tmp_path / f"dq{short}")).address("jobs", **settings)
        ttl = short if how == "ttl" else None
        for i in range(6):  # short-lived and long-lived interleaved (ttl), or all (delay)
            a.send([{"id": i}], ttl_ms=ttl if i % 2 == 0 else (LONG_MS if ttl else None))
        c = a.consumer("slow")
        return c, c.receive(1)

    short, c, first = taken_in_time(setup, TTL_MS)
    assert ids(first) == [0]
    expire(short / 1000 + 0.15)
    rest = c.receive(100)
    assert ids(rest) == ([1, 3, 5] if how == "ttl" else [])
    c.ack(rest if rest.num_rows else first)
    c.close()
