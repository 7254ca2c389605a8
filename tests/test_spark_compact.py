"""Compaction under Spark: ``Address.compact`` swapping pages while ``format("durablequeue")``
reads and writes them, end to end through ``spark.readStream`` / ``spark.read`` /
``writeStream`` (no mocks).

* A streaming query with a durable consumer reads a backlog of small commits in many
  micro-batches while the test sends more, compacts and cleans up with ``compactGraceMs=0``
  (the replaced files go at once), and while ``foreachBatch`` itself compacts between two
  collects of the same micro-batch (the second runs the tasks planned before the swap): every
  message arrives once, in ``_seq`` order, with the payload and ``_timestamp`` a plain
  consumer saw before any compaction. For a journal address and for ``journal=False``.
* The streaming sink's many tiny micro-batches leave a page each; compaction makes them one;
  a batch read and a new streaming consumer return every row once afterwards.
* A batch read planned before a swap (a DataFrame plans its partitions once; collected again
  after the compaction and cleanup, it reads the same ``_seq`` range from the new pages).
"""

from __future__ import annotations

import threading
import uuid

import pyarrow as pa
import pytest
from conftest import finish_query, json_input_files

pytest.importorskip("pyspark")

from pyspark.sql import functions as F

from pyspark_durable_queue import DurableQueue

pytestmark = pytest.mark.spark

PAGE = 64 * 1024
BODY = "b" * 60
#: address settings of every test: compaction only when the test asks, replaced files
#: deleted by the next cleanup
SETTINGS = {"page_size_bytes": PAGE, "compact_small_pages": 0, "compact_grace_ms": 0}

Row = tuple[int, int, str, int]  # _seq, id, body, _timestamp in microseconds


def _rows(table: pa.Table) -> list[Row]:
    ts = table.column("_timestamp").cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
    return list(zip(table.column("_seq").to_pylist(), table.column("id").to_pylist(),
                    table.column("body").to_pylist(), ts.to_pylist(), strict=True))


def _spark_rows(df) -> list[Row]:
    """``(_seq, id, body, _timestamp in us)`` of a DataFrame, in the order ``collect`` returns."""
    return [tuple(r) for r in df.select(
        "_seq", "id", "body", F.unix_micros("_timestamp").alias("ts")).collect()]


def _send_commits(address, first: int, commits: int, rows: int) -> int:
    """``commits`` sends of ``rows`` messages each (``id`` from ``first``); the next id."""
    for _ in range(commits):
        address.send([{"id": i, "body": f"{BODY}{i}"} for i in range(first, first + rows)])
        first += rows
    return first


def _receive_all(consumer) -> list[Row]:
    out: list[Row] = []
    while True:
        t = consumer.receive(max_messages=10_000)
        if not t.num_rows:
            return out
        consumer.ack(t)
        out += _rows(t)


def _peek(address) -> list[Row]:
    """Every retained message, read without a consumer (nothing acknowledged)."""
    snap = address.snapshot()
    batches = [b for b, _ in snap.messages(snap.first_seq) if b is not None]
    return _rows(pa.Table.from_batches(batches)) if batches else []


def _page_files(address) -> list[str]:
    """The page files on disk (a journal address also keeps its segment, ``.dqj``)."""
    return sorted(n for n, _s, _m in address.storage.list_detailed(address.pages_folder)
                  if n.endswith(".page"))


# -- a streaming read while compaction swaps its pages ------------------------------------------
def _overlapping(address, lo: int, hi: int) -> set[str]:
    """The rows of the page index (page files, journal rows) holding part of ``[lo, hi)``."""
    idx = address.state.pages
    return {idx.names[i] for i in range(len(idx)) if idx.seq[i] < hi and idx.ends[i] > lo}


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "file-per-commit"])
def test_a_streaming_read_gets_every_message_once_while_compaction_swaps_its_pages(
        spark, tmp_path, journal):
    root = str(tmp_path / "dq")
    # pages of 16 KiB: a journal row (segment) every ~130 messages, compacted pages of ~130
    # (a swapped-out journal row stays readable in its segment, which cleanup deletes only
    # before the newest checkpoint's; the page files of journal=False go at once)
    address = DurableQueue(root).address("orders", journal=journal, cleanup_interval_ms=0,
                                         **{**SETTINGS, "page_size_bytes": 16 * 1024})
    assert address.format.journal == journal
    probe = address.consumer("probe", start="earliest")  # what a plain consumer sees
    address.consumer("etl", start="earliest")  # the Spark query's, from the first message
    lock = threading.Lock()  # sends and the probe's reads vs compactions
    reference: list[Row] = []
    reports = []

    def compact(handle, max_bytes: int | None = None) -> None:
        with lock:  # the probe has read everything sent before the swap
            reports.append(handle.compact(max_bytes=max_bytes))
            handle.cleanup(dry_run=False)  # the replaced files go (grace 0)

    def send_round(first: int, commits: int = 40) -> int:
        with lock:
            first = _send_commits(address, first, commits, 3)
            reference.extend(_receive_all(probe))
        return first

    batches: dict[int, list[Row]] = {}
    again: dict[int, list[Row]] = {}
    swapped: list[int] = []
    in_batch = DurableQueue(root).address("orders")

    def collect(df, batch_id: int) -> None:
        batches[batch_id] = rows = _spark_rows(df)
        if batch_id % 2 and rows:
            # this micro-batch's tasks are planned, once for every action on df: swap the rows
            # they read out under them (compaction starts at the oldest row a consumer needs,
            # this batch's first: about its bytes swap its rows alone) and delete their files,
            # then run the same tasks again
            idx = in_batch.state.pages
            planned = [i for i in range(len(idx))
                       if idx.seq[i] <= rows[-1][0] and idx.ends[i] > rows[0][0]]
            compact(in_batch, max_bytes=sum(idx.bytes[i] for i in planned))
            if not {idx.names[i] for i in planned} & set(in_batch.state.pages.names):
                swapped.append(batch_id)
            again[batch_id] = _spark_rows(df)

    # a backlog of small commits, read while foreachBatch swaps the rows of every other batch
    next_id = send_round(0, commits=90)
    stream = (spark.readStream.format("durablequeue").option("address", "orders")
              .option("consumer", "etl").option("maxMessagesPerTrigger", 45).load(root))
    q = (stream.writeStream.foreachBatch(collect)
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    try:
        q.processAllAvailable()
        # more commits, each lot compacted as soon as sent while the query reads them
        for _ in range(3):
            next_id = send_round(next_id)
            compact(address)
        q.processAllAvailable()
        assert q.exception() is None
    finally:
        q.stop()
    assert q.exception() is None

    total = next_id
    assert [r[0] for r in reference] == list(range(total))  # the probe saw every message
    got = [row for b in sorted(batches) for row in batches[b]]
    assert len([b for b in batches.values() if b]) >= total // 45  # many micro-batches
    assert [r[0] for r in got] == list(range(total))  # each once, in _seq order
    assert got == reference  # payloads and commit times unchanged
    assert all(again[b] == batches[b] for b in again)  # the tasks planned before a swap
    assert len(swapped) >= 2, (swapped, sorted(again))
    assert sum(r.runs for r in reports) >= 4
    assert sum(r.pages_before for r in reports) > sum(r.pages_after for r in reports)
    assert address.consumers()["etl"]["position"] == total


# -- the sink's tiny micro-batches, compacted ---------------------------------------------------
def test_the_sinks_tiny_micro_batches_compact_into_one_page_read_once_afterwards(
        spark, tmp_path):
    root, src = str(tmp_path / "dq"), tmp_path / "in"
    DurableQueue(root).address("s", **SETTINGS)
    total = json_input_files(src, 30, 10, BODY)
    q = (spark.readStream.schema("id long, body string").option("maxFilesPerTrigger", 1)
         .json(str(src)).writeStream.format("durablequeue").option("address", "s")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True)
         .start(root))
    finish_query(q, 300)
    assert len([p for p in q.recentProgress if p["numInputRows"]]) == 30
    address = DurableQueue(root).address("s")
    before = _peek(address)
    assert sorted(r[1] for r in before) == list(range(total))
    pages_before = len(address.state.pages)
    assert pages_before >= 30 and len(_page_files(address)) == pages_before

    report = address.compact()
    cleaned = address.cleanup(dry_run=False)

    assert report.messages == total and report.pages_before == pages_before
    assert report.abandoned == 0 and report.pages_after == len(address.state.pages) == 1
    assert len(cleaned.orphans) == pages_before  # the replaced files, at once (no grace)
    assert _page_files(address) == sorted(address.state.pages.names)
    assert _peek(address) == before

    batch = spark.read.format("durablequeue").option("address", "s").load(root)
    assert sorted(_spark_rows(batch)) == before
    stream = (spark.readStream.format("durablequeue").option("address", "s")
              .option("consumer", "late").option("startingPosition", "earliest").load(root))
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (stream.writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck-late")).trigger(availableNow=True)
         .start())
    finish_query(q)
    assert sorted(_spark_rows(spark.table(name))) == before
    assert address.consumers()["late"]["position"] == total


# -- a batch read planned before the swap -------------------------------------------------------
@pytest.mark.parametrize("journal", [True, False], ids=["journal", "file-per-commit"])
def test_a_batch_read_planned_before_the_swap_reads_the_same_range_from_the_new_pages(
        spark, tmp_path, journal):
    root = str(tmp_path / "dq")
    address = DurableQueue(root).address("a", journal=journal, **SETTINGS)
    _send_commits(address, 0, 150, 2)
    before = _peek(address)
    df = spark.read.format("durablequeue").option("address", "a").load(root)
    assert sorted(_spark_rows(df)) == before  # plans df's partitions, on the small rows
    old = set(address.state.pages.names)

    _send_commits(address, 300, 5, 2)  # after planning: not in df
    report = address.compact()
    address.cleanup(dry_run=False)  # no grace: the files df planned on go at once

    assert report.messages == 310 and len(address.state.pages) == 1
    assert not old & set(address.state.pages.names)
    if not journal:  # (a journal keeps the segment being written)
        assert not old & set(_page_files(address))
    # the planned range, each message once, from the new page
    assert sorted(_spark_rows(df)) == before
    fresh = spark.read.format("durablequeue").option("address", "a").load(root)
    assert sorted(_spark_rows(fresh)) == _peek(address) and len(_peek(address)) == 310
