"""Throughput of the durablequeue Spark source against two references, in one run, same data.

* ``durablequeue``: ``readStream.format("durablequeue")`` with a fresh consumer, default read
  limit (the memory budget, so a large backlog runs as several micro-batches);
* ``parquet``: Spark's built-in file stream source over the same rows as Parquet files;
* ``memory``: a Python ``DataSourceStreamReader`` that yields the same Arrow batches from memory
  with the same micro-batch and task plan as the durablequeue run: the ceiling of the Python
  Data Source API's transport (Python worker -> Arrow -> JVM).

Every query uses ``Trigger.AvailableNow`` into the ``noop`` sink; the time is wall clock from
``start()`` to termination, best of ``--repeat`` interleaved runs, after one warm-up run each.

``durablequeue-files`` reads the same messages from an address created with ``journal=False``
(page files; ``durablequeue`` reads the local disk's default, journal units).

Second part: a selector matching ~0.1% of the messages (``kind = 'rare'``, scattered at random,
so page statistics cannot skip pages and every message is examined) against the Parquet source
with the same ``where``; ``memory-empty`` runs the in-memory source with the same plan but
yielding nothing, the fixed cost of any Python source. Third part: a 0.1% selector on ids that
are clustered (the last 0.1%), where page statistics skip the other pages.

Data: ``--rows`` messages (default 4M) of ~125 bytes: ``id`` int64, ``kind`` string (one of 8
values, ``rare`` for 0.1%), ``amount`` double, ``body`` 100 random letters.

``--addresses K`` (issue 42, target 2) runs only another comparison: one query over ``K``
addresses (``multi.0`` .. ``multi.K-1``, read with the pattern ``multi.*``) against one query over
one address holding the same number of messages, alternating, best and median of ``--repeat``
runs each; target: the K-address query >= 0.8x as fast.

Usage::

    .venv/bin/python benchmarks/bench_source.py [--rows 4000000] [--repeat 3]
        [--yield-rows 8192] [--keep DIR]
    .venv/bin/python benchmarks/bench_source.py --addresses 10 [--rows 2000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow

from pyspark_durable_queue import DurableQueue

BODY = 100
KINDS = np.array(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"])
CHUNK = 262_144
#: the same messages in an address created with journal=False (page files, not journal units)
FILES = "bench-files"


def chunk(start: int, n: int, seed: int = 7) -> pa.Table:
    """Rows ``start..start+n`` of the data set (deterministic, so any process can rebuild it)."""
    rng = np.random.default_rng(seed + start)
    letters = rng.integers(97, 123, size=n * BODY, dtype=np.uint8)
    offsets = np.arange(0, (n + 1) * BODY, BODY, dtype=np.int32)
    body = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(letters))
    kind = KINDS[rng.integers(0, len(KINDS), size=n)].astype(object)
    kind[rng.random(n) < 0.001] = "rare"
    return pa.table({
        "id": pa.array(np.arange(start, start + n, dtype=np.int64)),
        "kind": pa.array(kind, pa.string()),
        "amount": pa.array(rng.random(n) * 1000),
        "body": body,
    })


def make_data(root: Path, rows: int) -> tuple[int, int]:
    """The durablequeue address ``bench`` and the Parquet folder; returns (bytes, rare rows)."""
    q = DurableQueue(str(root / "dq"))
    address = q.address("bench", fsync=False)  # a local disk's default: the journal
    files = q.address(FILES, fsync=False, journal=False)  # a page file per send
    (root / "parquet").mkdir(parents=True)
    nbytes = rare = 0
    schema = chunk(0, 1).schema
    with pa.ipc.new_file(str(root / "data.arrow"), schema) as ipc:
        for k, start in enumerate(range(0, rows, CHUNK)):
            t = chunk(start, min(CHUNK, rows - start))
            nbytes += t.nbytes
            rare += t.column("kind").to_pylist().count("rare")
            address.send(t)
            files.send(t)
            pq.write_table(t, root / "parquet" / f"part-{k:05d}.parquet")
            for b in t.to_batches(max_chunksize=8192):
                ipc.write_batch(b)
    return nbytes, rare


# -- the in-memory ceiling ----------------------------------------------------------------------
def _data(path: str) -> pa.Table:
    """The whole data set, memory-mapped from an Arrow IPC file in the OS page cache: the
    batches are already in memory, reading them costs no copy and no decoding."""
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


class _MemReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options):
        self.rows = int(options["rows"])
        self.path = options["path"]
        self.batch_rows = int(options["batchrows"])
        self.tasks = int(options["tasks"])
        self.yield_rows = int(options["yieldrows"])

    def initialOffset(self):
        return {"seq": 0}

    def prepareForTriggerAvailableNow(self):
        pass

    def getDefaultReadLimit(self) -> ReadLimit:
        from pyspark.sql.streaming.datasource import ReadMaxRows

        return ReadMaxRows(self.batch_rows)

    def latestOffset(self, start, limit):
        return {"seq": min(self.rows, start["seq"] + self.batch_rows)}

    def partitions(self, start, end):
        lo, hi = start["seq"], end["seq"]
        step = -(-(hi - lo) // self.tasks)
        return [InputPartition((a, min(hi, a + step))) for a in range(lo, hi, step)]

    def read(self, partition) -> Iterator[pa.RecordBatch]:
        lo, hi = partition.value
        table = _data(self.path)
        ts_type = pa.timestamp("us", tz="UTC")
        schema = pa.schema([*table.schema, pa.field("_seq", pa.int64(), False),
                            pa.field("_timestamp", ts_type, False)])
        if self.yield_rows == 0:
            return
        for at in range(lo, hi, self.yield_rows):
            for part in table.slice(at, min(self.yield_rows, hi - at)).to_batches():
                n = part.num_rows
                seq = pa.array(np.arange(at, at + n, dtype=np.int64))
                ts = pa.array(np.full(n, 1_700_000_000_000_000, dtype=np.int64)).view(ts_type)
                yield pa.RecordBatch.from_arrays([*part.columns, seq, ts], schema=schema)
                at += n


class MemSource(DataSource):
    @classmethod
    def name(cls):
        return "bench-memory"

    def schema(self):
        return ("id long, kind string, amount double, body string, _seq long not null, "
                "_timestamp timestamp not null")

    def streamReader(self, schema):
        return _MemReader(self.options)


# -- runs ---------------------------------------------------------------------------------------
def run(spark: SparkSession, df, work: Path, name: str) -> tuple[float, int, int]:
    """Seconds, input rows and micro-batches of one AvailableNow query into ``noop``."""
    ck = work / f"ck-{name}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    q = (df.writeStream.format("noop").option("checkpointLocation", str(ck))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    elapsed = time.perf_counter() - t0
    if q.exception() is not None:
        raise RuntimeError(f"{name}: {q.exception()}")
    progress = [p for p in q.recentProgress if p["numInputRows"]]
    shutil.rmtree(ck, ignore_errors=True)
    return elapsed, sum(p["numInputRows"] for p in progress), len(progress)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--yield-rows", type=int, default=None,
                    help="override the source's rows per yielded batch (experiments)")
    ap.add_argument("--keep", type=Path, default=None, help="reuse/keep data in this folder")
    ap.add_argument("--addresses", type=int, default=0,
                    help="only compare one query over this many addresses with one over one")
    args = ap.parse_args()
    if args.addresses:
        multi_main(args)
        return

    work = args.keep or Path(tempfile.mkdtemp(prefix="dq-bench-source-"))
    t0 = time.perf_counter()
    if not (work / "dq").exists():
        nbytes, rare = make_data(work, args.rows)
        print(f"data: {args.rows} rows, {nbytes / 1e6:.0f} MB Arrow, {rare} rare, "
              f"written in {time.perf_counter() - t0:.0f} s")
    if args.yield_rows:  # inherited by Spark's Python workers (set before the JVM starts)
        os.environ["PYSPARK_DQ_YIELD_ROWS"] = str(args.yield_rows)
    yield_rows = args.yield_rows or 8192

    spark = (SparkSession.builder.master("local[2]").appName("bench-source")
             .config("spark.ui.enabled", "false").config("spark.driver.memory", "4g")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(MemSource)
    root = str(work / "dq")
    pq_schema = spark.read.parquet(str(work / "parquet")).schema

    # Every run reads with a new consumer; create them all now, so that cleanup after one run
    # (every consumer acknowledges everything) keeps the pages the next runs read.
    run_id = uuid.uuid4().hex[:6]
    for name in ("bench", FILES):
        address = DurableQueue(root).address(name)
        old = list(address.consumers())
        for k in range(4 + 5 * args.repeat):
            address.consumer(f"c{run_id}-{k}", start="earliest")
        for gone in old:  # consumers of an earlier run (--keep)
            address.consumer(gone).delete()
        assert address.log.refresh().first_seq == 0, "pages were cleaned up: rebuild the data"
    consumer = iter(range(10**6))

    def dq(selector: str | None = None, address: str = "bench"):
        r = (spark.readStream.format("durablequeue").option("address", address)
             .option("consumer", f"c{run_id}-{next(consumer)}"))
        if selector:
            r = r.option("selector", selector)
        return r.load(root)

    def parquet(where: str | None = None):
        df = spark.readStream.schema(pq_schema).parquet(str(work / "parquet"))
        return df.where(where) if where else df

    # The durablequeue plan (batches) decides the ceiling's plan, so both move the same batches.
    _, rows, batches = run(spark, dq(), work, "warm-dq")
    assert rows == args.rows, rows

    def memory():
        return (spark.readStream.format("bench-memory").option("rows", args.rows)
                .option("batchRows", -(-args.rows // batches)).option("tasks", 2)
                .option("yieldRows", yield_rows).load(str(work / "data.arrow")))

    def empty():  # the same plan, yielding nothing: the API's fixed cost per query
        return (spark.readStream.format("bench-memory").option("rows", args.rows)
                .option("batchRows", -(-args.rows // batches)).option("tasks", 2)
                .option("yieldRows", 0).load(str(work / "data.arrow")))

    rare_ids = f"id >= {args.rows - args.rows // 1000}"  # 0.1%, clustered: stats can skip
    cases = {
        "full scan": {"durablequeue": dq, "parquet": parquet, "memory": memory,
                      "durablequeue-files": lambda: dq(address=FILES)},
        "0.1% scattered": {"durablequeue+selector": lambda: dq("kind = 'rare'"),
                           "parquet+where": lambda: parquet("kind = 'rare'"),
                           "memory-empty": empty},
        "0.1% clustered": {"durablequeue+selector ": lambda: dq(rare_ids),
                           "parquet+where ": lambda: parquet(rare_ids)},
    }
    for group in cases.values():  # warm-up: JIT, Python workers, OS page cache
        for make in group.values():
            run(spark, make(), work, "warm")
    times: dict[str, list[float]] = {}
    for title, group in cases.items():
        for _ in range(args.repeat):
            for name, make in group.items():
                secs, n, b = run(spark, make(), work, name.strip())
                if title == "full scan":
                    assert n == args.rows, (name, n)
                times.setdefault(name, []).append(secs)
                print(f"  {title:15s} {name:23s} {secs:6.2f} s  ({n} input rows, {b} batches)")
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print()
    print(f"rows={args.rows} yield_rows={yield_rows} durablequeue micro-batches={batches} "
          f"repeat={args.repeat}")
    print(f"  {'':24s} {'best':>7s} {'median':>7s}")
    for name in times:
        print(f"  {name:24s} {best[name]:6.2f}s {med[name]:6.2f}s  "
              f"{args.rows / best[name] / 1e6:5.2f} M msg/s (best)")
    for label, stat in (("best", best), ("median", med)):
        print(f"  [{label}] full scan durablequeue / memory ceiling = "
              f"{stat['memory'] / stat['durablequeue']:.2f}x (target >= 0.9); "
              f"vs parquet {stat['parquet'] / stat['durablequeue']:.2f}x; journal address vs "
              f"journal=False {stat['durablequeue-files'] / stat['durablequeue']:.2f}x")
        print(f"  [{label}] 0.1% scattered: durablequeue vs parquet+where = "
              f"{stat['parquet+where'] / stat['durablequeue+selector']:.2f}x (target >= 10); "
              f"floor of any Python source (memory-empty) vs parquet+where = "
              f"{stat['parquet+where'] / stat['memory-empty']:.2f}x")
        print(f"  [{label}] 0.1% clustered: durablequeue vs parquet+where = "
              f"{stat['parquet+where '] / stat['durablequeue+selector ']:.2f}x")
    spark.stop()
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


def multi_main(args: argparse.Namespace) -> None:
    """One query over ``--addresses`` addresses against one over one address, same messages."""
    work = Path(tempfile.mkdtemp(prefix="dq-bench-multi-"))
    try:
        root = str(work / "dq")
        q = DurableQueue(root)
        one = q.address("single", fsync=False)
        k = args.addresses
        many = [q.address(f"multi.{i}", fsync=False) for i in range(k)]
        t0 = time.perf_counter()
        for start in range(0, args.rows, CHUNK):
            t = chunk(start, min(CHUNK, args.rows - start))
            one.send(t)
            per = -(-t.num_rows // k)
            for i, address in enumerate(many):
                if i * per < t.num_rows:
                    address.send(t.slice(i * per, per))
        print(f"data: {args.rows} rows in 1 address and in {k} addresses, written in "
              f"{time.perf_counter() - t0:.0f} s")
        spark = (SparkSession.builder.master("local[2]").appName("bench-source-multi")
                 .config("spark.ui.enabled", "false").config("spark.driver.memory", "4g")
                 .config("spark.sql.shuffle.partitions", "2").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        counter = iter(range(10**6))
        # A new consumer each run, all created now: cleanup after one run keeps the pages the
        # next runs read.
        for address in [one, *many]:
            for c in range(2 * (args.repeat + 1)):
                address.consumer(f"c{c}", start="earliest")

        def dq(address: str):
            return (spark.readStream.format("durablequeue").option("address", address)
                    .option("consumer", f"c{next(counter)}").load(root))

        cases = {"1 address": "single", f"{k} addresses": "multi.*"}
        for address in cases.values():  # warm-up
            run(spark, dq(address), work, "warm")
        times: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for name, address in cases.items():
                secs, n, b = run(spark, dq(address), work, name.replace(" ", "-"))
                assert n == args.rows, (name, n)
                times.setdefault(name, []).append(secs)
                print(f"  {name:14s} {secs:6.2f} s  ({n} input rows, {b} batches)")
        one_name, many_name = cases
        for label, stat in (("best", min), ("median", statistics.median)):
            a, b = stat(times[one_name]), stat(times[many_name])
            print(f"  [{label}] {many_name}: {args.rows / b / 1e6:.2f} M msg/s, 1 address: "
                  f"{args.rows / a / 1e6:.2f} M msg/s; ratio {a / b:.2f}x (target >= 0.8)")
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
