"""Options the README documents, each set through the real ``format("durablequeue")`` path and
checked for its effect, not only for being accepted: admission control by pages and by bytes,
log retention, orphan grace, archiving, compression, explicit registration; and the scripts in
``examples/`` run as users run them.

Spark tests share the session-scoped ``spark`` fixture; every streaming query has a ``tmp_path``
checkpoint, is stopped, and must end in time without an error.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._log.commit_log import CHECKPOINT_EVERY, checkpoint_name, entry_name

EXAMPLES = Path(__file__).parent.parent / "examples"


# -- helpers ------------------------------------------------------------------------------------
def finish(q, timeout: float = 180) -> None:
    """Wait for a query that should end by itself, stop it whatever happens, and check that it
    ended in time and without an error."""
    try:
        ended = q.awaitTermination(timeout)
    finally:
        q.stop()
    assert ended, f"the query did not finish in {timeout} s"
    assert q.exception() is None


def consume_to_memory(spark, root: Path, consumer: str, ckpt: Path, **options):
    """Run a durable consumer of ``orders`` to the end (``availableNow``) into a memory table;
    returns the rows and the query's progress reports of batches that read something."""
    reader = (spark.readStream.format("durablequeue").option("address", "orders")
              .option("consumer", consumer))
    for k, v in options.items():
        reader = reader.option(k, v)
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (reader.load(str(root)).writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
    finish(q)
    batches = [p for p in q.recentProgress if p["numInputRows"]]
    return spark.table(name).collect(), batches


def send_ids(address, start: int, n: int) -> None:
    ids = list(range(start, start + n))
    address.send(pa.table({"id": pa.array(ids, pa.int64()),
                           "body": [f"message-{i:06d}" for i in ids]}))


def offsets(batch: dict) -> tuple[int, int]:
    """``[start, end)`` ``_seq`` offsets of one micro-batch, from its progress report."""
    src = batch["sources"][0]
    start = json.loads(src["startOffset"] or "null")  # null: the first batch of a new consumer
    return (0 if start is None else start["seq"]), json.loads(src["endOffset"])["seq"]


# -- admission control --------------------------------------------------------------------------
@pytest.mark.spark
def test_max_pages_per_trigger_bounds_each_batch_by_pages(spark, tmp_path):
    # one page per send (far below pageSizeBytes), of uneven sizes: a batch of two pages is
    # told apart from a batch bounded by messages or bytes (journal=False: a journal keeps
    # these sends in one segment, one index row)
    address = DurableQueue(str(tmp_path)).address("orders", journal=False)
    sizes = [50, 150, 30, 120, 10]
    start = 0
    for n in sizes:
        send_ids(address, start, n)
        start += n
    pages = address.log.refresh().pages
    assert pages.rows == sizes  # the scenario: five pages of these sizes
    address.consumer("unbounded")  # keeps the pages for the second run
    rows, batches = consume_to_memory(spark, tmp_path, "paged", tmp_path / "ck",
                                      maxPagesPerTrigger=2)
    assert [b["numInputRows"] for b in batches] == [50 + 150, 30 + 120, 10]
    assert [offsets(b) for b in batches] == [(0, 200), (200, 350), (350, 360)]
    assert sorted(r.id for r in rows) == list(range(360))
    # without the option the whole backlog is one batch (the default budget is far larger)
    _, unbounded = consume_to_memory(spark, tmp_path, "unbounded", tmp_path / "ck2")
    assert [b["numInputRows"] for b in unbounded] == [360]


@pytest.mark.spark
def test_max_bytes_per_trigger_bounds_each_batch_by_bytes(spark, tmp_path):
    address = DurableQueue(str(tmp_path)).address("orders")
    send_ids(address, 0, 1000)  # one page of same-sized messages
    pages = address.log.refresh().pages
    assert len(pages) == 1
    per_message = pages.bytes[0] / pages.rows[0]
    limit = int(per_message * 300) + 1  # room for 300 messages, not 301
    rows, batches = consume_to_memory(spark, tmp_path, "sized", tmp_path / "ck",
                                      maxBytesPerTrigger=str(limit))
    assert [b["numInputRows"] for b in batches] == [300, 300, 300, 100]
    for b in batches:
        first, end = offsets(b)
        assert (end - first) * per_message <= limit
    assert sorted(r.id for r in rows) == list(range(1000))


# -- address settings given as sink options -------------------------------------------------------
def _log_mtimes(folder: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in (folder / "log").iterdir()
            if p.name.endswith(".json")}


@pytest.mark.spark
def test_log_retention_ms_set_through_spark_expires_covered_entries(spark, tmp_path):
    root = tmp_path / "dq"
    (spark.range(0, 10).selectExpr("id", "'spark' AS src").write.format("durablequeue")
     .option("address", "ret").option("logRetentionMs", 300_000).option("fsync", "false")
     .option("journal", "false")  # log entry files, whose retention this is
     .mode("append").save(str(root)))
    address = DurableQueue(str(root)).address("ret")
    assert address.settings.log_retention_ms == 300_000  # not the one-hour default
    assert json.loads((root / "ret" / "address.json").read_text())["settings"][
        "log_retention_ms"] == 300_000
    sends = CHECKPOINT_EVERY + 10  # entries 2..111: a checkpoint at entry 100 covers 1..99
    for i in range(sends):
        address.send(pa.Table.from_pylist([{"id": 10 + i, "src": "client"}],
                                          schema=address.schema))
    folder = root / "ret"
    assert (folder / "log" / checkpoint_name(CHECKPOINT_EVERY)).exists()
    mtimes = _log_mtimes(folder)
    newest, oldest = max(mtimes.values()), min(mtimes.values())
    # Younger than 300 s (the entries' own times, not the wall clock, decide): nothing goes.
    assert newest + 290 - oldest < 300
    assert address.cleanup(dry_run=False, now=newest + 290).log_files == []
    assert _log_mtimes(folder) == mtimes
    # Older than 300 s but far younger than the default hour: covered entries go.
    report = address.cleanup(dry_run=False, now=newest + 310)
    assert sorted(report.log_files) == sorted(
        [entry_name(v) for v in range(1, CHECKPOINT_EVERY)])
    left = sorted(_log_mtimes(folder))
    assert left == [entry_name(v) for v in range(CHECKPOINT_EVERY, 1 + sends + 1)]
    # Spark opens the address from the checkpoint and still sees every message.
    df = spark.read.format("durablequeue").option("address", "ret").load(str(root))
    assert sorted(r.id for r in df.select("id").collect()) == list(range(10 + sends))


def _frames(path: Path) -> list[bytes]:
    """The message frames' payloads of a page file, parsed here from the documented layout
    (``DQPAGE01``, then ``DQFR`` | u64 length | u32 rows | u32 crc | payload ..., footer)."""
    data = path.read_bytes()
    assert data[:8] == b"DQPAGE01"
    at, out = 8, []
    while data[at:at + 4] == b"DQFR":
        length = struct.unpack_from("<Q", data, at + 4)[0]
        out.append(data[at + 20:at + 20 + length])
        at += 20 + length
    assert data[at:at + 4] == b"DQFT"  # the footer follows the last frame
    return out


#: first bytes of a compressed buffer in Arrow IPC: LZ4 frame / zstd frame magic numbers
CODEC_MAGIC = {"lz4": b"\x04\x22\x4d\x18", "zstd": b"\x28\xb5\x2f\xfd"}


@pytest.mark.spark
@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_archive_orphan_grace_and_compression_set_as_sink_options(spark, tmp_path, codec):
    root = tmp_path / "dq"
    rows = [(i, "EU" if i % 3 == 0 else "US", "compressible text " * 8 + str(i))
            for i in range(3000)]
    df = spark.createDataFrame(rows, "id long, region string, body string").repartition(2)
    (df.write.format("durablequeue").option("address", "orders")
     .option("archiveDataLogs", "true").option("directoryArchive", "attic")
     .option("orphanGraceMs", 60_000).option("compression", codec)
     .option("pageSizeBytes", "16KiB").option("cleanupIntervalMs", 0)
     .mode("append").save(str(root)))
    folder = root / "orders"
    settings = DurableQueue(str(root)).address("orders").settings
    assert (settings.archive_data_logs, settings.directory_archive, settings.orphan_grace_ms,
            settings.compression) == (True, "attic", 60_000, codec)
    persisted = json.loads((folder / "address.json").read_text())["settings"]
    assert (persisted["archive_data_logs"], persisted["directory_archive"],
            persisted["orphan_grace_ms"], persisted["compression"]) == (True, "attic", 60_000,
                                                                       codec)

    # compression: every frame is compressed with the codec, and much smaller than the same
    # batch without compression
    published = set(DurableQueue(str(root)).address("orders").log.refresh().pages.names)
    assert len(published) > 2
    for name in published:
        for payload in _frames(folder / "pages" / name):
            batch = pa.ipc.open_stream(payload).read_next_batch()
            plain = pa.BufferOutputStream()
            with pa.ipc.new_stream(plain, batch.schema) as w:
                w.write_batch(batch)
            assert CODEC_MAGIC[codec] in payload, name
            assert len(payload) < plain.getvalue().size / 3, name

    # a durable consumer reads everything back identically through Spark; once it committed
    # past every page, its cleanup moves each page into the archive folder named by the option
    got, _ = consume_to_memory(spark, root, "all", tmp_path / "ck", cleanupIntervalMs=0)
    assert sorted((r.id, r.region, r.body) for r in got) == rows
    assert {p.name for p in (folder / "pages").glob("*.page")} == set()
    assert {p.name for p in (folder / "attic").glob("*")} == published
    assert not (folder / "archive").exists()

    # orphanGraceMs: an unpublished page file goes once older than 60 s, not before
    orphan = folder / "pages" / f"{uuid.uuid4().hex}.page"
    orphan.write_bytes(b"DQPAGE01 half written")
    now = time.time()
    os.utime(orphan, (now - 30, now - 30))
    address = DurableQueue(str(root)).address("orders")
    assert address.cleanup(dry_run=False, now=now).orphans == []
    assert orphan.exists()
    os.utime(orphan, (now - 90, now - 90))  # far younger than the one-hour default
    assert address.cleanup(dry_run=False, now=now).orphans == [orphan.name]
    assert not orphan.exists()  # deleted: never published, so not worth archiving
    assert {p.name for p in (folder / "attic").glob("*")} == published


# -- registration ---------------------------------------------------------------------------------
@pytest.mark.spark
def test_explicit_register_works_beside_the_auto_registered_format(spark, tmp_path):
    """What Databricks documents (``spark.dataSource.register``) is accepted in a session where
    Spark already auto-registered the format, and the format keeps working. A subclass under a
    name that only an explicit registration provides proves that the explicit route itself
    serves batch writes, batch reads and a durable consumer.

    (The suite's session is used: in a ``newSession()`` that is not the active session, Spark
    4.3 looks the format of a ``df.write`` up in the active session's registrations.)"""
    import pyspark_durable_queue

    class Explicit(pyspark_durable_queue.DefaultSource):  # local: pickled by value
        @classmethod
        def name(cls) -> str:
            return "durablequeue_explicit"

    root = str(tmp_path / "dq")
    # No cleanup until the last read: the stream acknowledges all 9 messages, and a cleanup
    # due by then (30 s after the first write's, which a loaded machine passes) removes them.
    DurableQueue(root).address("reg", cleanup_interval_ms=3_600_000)
    spark.range(0, 3).write.format("durablequeue").option("address", "reg") \
        .mode("append").save(root)  # the auto-registered format
    spark.dataSource.register(pyspark_durable_queue.DefaultSource)
    spark.range(3, 6).write.format("durablequeue").option("address", "reg") \
        .mode("append").save(root)
    spark.dataSource.register(Explicit)
    spark.range(6, 9).write.format("durablequeue_explicit").option("address", "reg") \
        .mode("append").save(root)
    browsed = spark.read.format("durablequeue_explicit").option("address", "reg").load(root)
    assert sorted(r.id for r in browsed.collect()) == list(range(9))
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (spark.readStream.format("durablequeue_explicit").option("address", "reg")
         .option("consumer", "c").load(root).writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True)
         .start())
    finish(q)
    assert sorted(r.id for r in spark.table(name).collect()) == list(range(9))
    assert DurableQueue(root).address("reg").consumers()["c"]["position"] == 9
    # the auto-registered name still works after both registrations
    again = spark.read.format("durablequeue").option("address", "reg").load(root)
    assert again.count() == 9


# -- examples ---------------------------------------------------------------------------------
def run_example(script: str, *args: str, cwd: Path, timeout: float = 600):
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script}: {proc.stderr[-3000:]}"
    return proc.stdout


def every_message(root: Path, address: str) -> pa.Table:
    c = DurableQueue(str(root)).address(address, create=False).consumer(
        f"check-{uuid.uuid4().hex[:8]}", start="earliest")
    table = c.receive(max_messages=10**9, max_bytes=1 << 40)
    c.delete()
    return table


def test_example_client_quickstart(tmp_path):
    root = tmp_path / "store"
    out = run_example("client_quickstart.py", str(root), cwd=tmp_path, timeout=120)
    address = DurableQueue(str(root)).address("client-orders", create=False)
    consumers = address.consumers()
    billing = consumers["billing"]["position"]
    assert 0 < billing <= 5000 and f"watermark {billing}" in out
    assert consumers["audit"]["position"] == 10
    table = every_message(root, "client-orders")
    eu = sum(1 for r in table.to_pylist() if r["region"] == "EU" and r["amount"] > 100)
    assert f"billing received {eu} EU orders over 100" in out
    assert table.column("order_id").to_pylist()[:3] == [0, 1, 2]
    assert not (tmp_path / "demo-data").exists()  # it used the root it was given


@pytest.mark.slow  # three spawned worker processes, each importing pyarrow
def test_example_shared_workers(tmp_path):
    root = tmp_path / "store"
    out = run_example("shared_workers.py", str(root), "3", "30", cwd=tmp_path, timeout=300)
    # every job that does not fail settled once, by one worker; every failing one (0, 10, 20)
    # nacked until max_delivery_attempts (3) and then dead-lettered
    assert "27 jobs acknowledged (27 distinct), 3 in jobs-DLQ, 0 still leased, watermark 30" \
        in out, out
    assert len(re.findall(r"^worker \d \(pid \d+\)", out, re.M)) == 3
    renewals = sum(int(n) for n in re.findall(r"(\d+) lease renewals", out))
    assert renewals == 2 * 4  # jobs 7, 14, 21, 28: two renewals each
    dlq = every_message(root, "jobs-DLQ")
    assert sorted(dlq.column("origin_seq").to_pylist()) == [0, 10, 20]
    assert set(dlq.column("delivery_count").to_pylist()) == {3}
    stats = DurableQueue(str(root)).address("jobs", create=False).stats()["consumers"]["pool"]
    assert stats["shared"] and stats["leased"] == 0 and stats["acknowledged"] == 27


@pytest.mark.spark
@pytest.mark.slow
def test_example_stream_orders(tmp_path):
    root = tmp_path / "store"
    out = run_example("stream_orders.py", str(root), "3", cwd=tmp_path)
    table = every_message(root, "orders")
    n = table.num_rows
    assert n > 0
    # exactly once per micro-batch: the rate source's values, each once, in order
    assert sorted(table.column("order_id").to_pylist()) == list(range(n))
    assert table.column("_seq").to_pylist() == list(range(n))
    assert f"{n} messages" in out
    s = DurableQueue(str(root)).address("orders").settings
    assert (s.page_size_bytes, s.max_size_bytes, s.address_full_policy) == (
        1 << 20, 1 << 30, "BLOCK")
    assert (root / "_checkpoints" / "stream_orders" / "commits").is_dir()


@pytest.mark.spark
@pytest.mark.slow
def test_example_demo(tmp_path):
    root = tmp_path / "store"
    out = run_example("demo.py", str(root), "3", cwd=tmp_path)
    orders = DurableQueue(str(root)).address("orders", create=False)
    stats = orders.stats()
    produced = stats["next_seq"]
    assert produced > 0
    # both consumers committed to the end, so every page was removed
    assert {n: c["position"] for n, c in stats["consumers"].items()} == {
        "billing": produced, "apac": produced}
    assert stats["pages"] == 0
    invoices = every_message(root, "invoices").to_pylist()
    billed = int(re.search(r"billing \(EU, amount > 100\): ([\d,]+) orders", out)
                 .group(1).replace(",", ""))
    assert len(invoices) == billed > 0
    assert all(i["order_id"] % 4 == 0 and i["amount"] > 100 for i in invoices)
    assert len({i["order_id"] for i in invoices}) == len(invoices)
