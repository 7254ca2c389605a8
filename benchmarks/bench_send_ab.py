"""A/B of the send path between two checkouts of the package, in alternating runs.

Run with ``python benchmarks/bench_send_ab.py --a /path/to/old/checkout --b . [--rounds 3]
[--seconds 3] [--fsync never]``. Each round runs every scenario once with checkout A's package
and once with B's (``PYTHONPATH``), alternating, each in a fresh process on a fresh journal
address (the local disk's default), fsync on (``--fsync never``: the Python path alone); the
medians and the ratio B / A are printed per scenario, for the rate and for the CPU time of the
process per row (user + system, ``time.process_time``: on a shared machine whose load moves
from run to run the rate measures the load as much as the code, the CPU a row costs much less).
Alternating runs see the same load, so their ratio holds on a busy machine (issue 36's
target 3: statistics must not cost the send path).

Scenarios: ``single-1`` (``send([row])`` from one thread), ``single-16`` (16 threads on one
address), ``batch-100`` (``send`` of a list of 100 row dicts from one thread), ``rows-10k``
(``send`` of a 10,000-row Arrow table: ``id`` int64, ``kind`` string, a 100-byte body).

``--spark`` adds, once per side a round, one Spark session (``local[2]``, in a fresh process)
that runs one sink micro-batch (``--spark-rows`` rows of Parquet files into
``writeStream.format("durablequeue")``, ``Trigger.AvailableNow``) and then one source
micro-batch (``readStream.format("durablequeue")`` with a new consumer into ``noop``), after a
warm-up of 1,000 rows each: ``spark-sink`` and ``spark-source``, rows/s from ``start()`` to
termination (the driver's CPU is not the work, so no CPU column). Issue 43's target 5 in one
command, against the commit before a change (``git archive REV | tar -x -C DIR``)::

    bench_send_ab.py --a DIR --b . --rounds 3 --seconds 2 --spark
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

SCENARIOS = ("single-1", "single-16", "batch-100", "rows-10k")
SPARK_SCENARIOS = ("spark-sink", "spark-source")

CHILD = r'''
import json, shutil, sys, tempfile, threading, time
import numpy as np, pyarrow as pa
import pyspark_durable_queue
from pyspark_durable_queue import DurableQueue
scenario, seconds = sys.argv[1], float(sys.argv[2])
tree = sys.argv[5]
assert pyspark_durable_queue.__file__.startswith(tree), (pyspark_durable_queue.__file__, tree)
root = tempfile.mkdtemp(dir=sys.argv[3])
address = DurableQueue(root).address("ab", fsync=sys.argv[4])
row = {"id": 1, "kind": "a", "body": b"x" * 100}
n = 10_000
ids = np.arange(n, dtype=np.int64)
table = pa.table({"id": ids, "kind": pa.array(np.array(["a", "b", "c"])[ids % 3]),
                  "body": pa.array([b"x" * 100] * n)})
threads = 16 if scenario == "single-16" else 1
batch = [dict(row, id=i) for i in range(100)]
count = [0] * threads
stop = time.perf_counter() + 0.5  # warm-up
def loop(k, until, payload, per):
    while time.perf_counter() < until:
        address.send(payload)
        count[k] += per
payload, per = {"rows-10k": (table, n), "batch-100": (batch, 100)}.get(scenario, ([row], 1))
loop(0, stop, payload, per)
count = [0] * threads
start, cpu = time.perf_counter(), time.process_time()
workers = [threading.Thread(target=loop, args=(k, start + seconds, payload, per))
           for k in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
rate = sum(count) / (time.perf_counter() - start)
cpu_us = (time.process_time() - cpu) / max(sum(count), 1) * 1e6
shutil.rmtree(root)  # a run of 10k-row sends without fsync writes gigabytes
print(json.dumps({"rate": rate, "cpu_us": cpu_us}))
'''

# One Spark micro-batch of each kind, in one JVM: Parquet files -> the durablequeue sink
# (Trigger.AvailableNow, one micro-batch), then the durablequeue source -> noop (a fresh
# consumer, one micro-batch); a small warm-up of both first. The time is start() to
# termination; the driver's CPU is not the work (that is in the JVM and Python workers), so
# only the rate is compared. Spark's Python workers inherit PYTHONPATH, so they import the
# same checkout as the driver (checked against the data source's module path).
SPARK_CHILD = r'''
import json, os, shutil, sys, tempfile, time
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
from pyspark.sql import SparkSession
import pyspark_durable_queue
from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue.spark import DurableQueueDataSource
rows, work, tree = int(sys.argv[1]), tempfile.mkdtemp(dir=sys.argv[2]), sys.argv[3]
assert pyspark_durable_queue.__file__.startswith(tree), (pyspark_durable_queue.__file__, tree)
spark = (SparkSession.builder.master("local[2]").appName("ab-spark")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "2").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
spark.dataSource.register(DurableQueueDataSource)
def data(name, n):
    folder = os.path.join(work, name)
    os.makedirs(folder)
    ids = np.arange(n, dtype=np.int64)
    for f in range(2):
        part = ids[f::2]
        pq.write_table(pa.table({"id": part, "kind": pa.array(np.array(["a", "b", "c"])[part % 3]),
                                 "body": pa.array([b"x" * 100] * len(part))}),
                       os.path.join(folder, f"part-{f}.parquet"))
    return folder
def timed(writer, out=None):
    start = time.perf_counter()
    q = writer.trigger(availableNow=True).start(*([out] if out else []))
    q.awaitTermination()
    elapsed = time.perf_counter() - start
    assert q.exception() is None, q.exception()
    got = sum(p["numInputRows"] for p in q.recentProgress)
    q.stop()
    return elapsed, got
def sink(name, n):
    src = data(name, n)
    df = spark.readStream.schema(spark.read.parquet(src).schema).parquet(src)
    w = (df.writeStream.format("durablequeue").option("address", name)
         .option("checkpointLocation", os.path.join(work, "ck-w-" + name)))
    return timed(w, os.path.join(work, "dq"))
def source(name):
    df = (spark.readStream.format("durablequeue").option("address", name)
          .option("consumer", "ab").load(os.path.join(work, "dq")))
    w = df.writeStream.format("noop").option("checkpointLocation",
                                            os.path.join(work, "ck-r-" + name))
    return timed(w)
sink("warm", 1000)
source("warm")
s_sink, n_sink = sink("ab", rows)
stored = DurableQueue(os.path.join(work, "dq")).address("ab").stats()["messages"]
s_source, n_source = source("ab")
assert n_sink == rows == stored == n_source, (n_sink, rows, stored, n_source)
spark.stop()
shutil.rmtree(work)
print(json.dumps({"spark-sink": rows / s_sink, "spark-source": rows / s_source}))
'''


def run(tree: str, scenario: str, seconds: float, scratch: str,
        fsync: str) -> tuple[float, float]:
    """(rows/s, CPU microseconds per row) of one run."""
    tree = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=tree)
    # cwd: ``python -c`` puts the working folder first on sys.path, before PYTHONPATH; run
    # from a checkout, both sides would import that checkout's package
    proc = subprocess.run([sys.executable, "-c", CHILD, scenario, str(seconds), scratch,
                           fsync, tree], env=env, cwd=scratch, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {scenario} run of {tree} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(result["rate"]), float(result["cpu_us"])


def run_spark(tree: str, rows: int, scratch: str) -> dict[str, float]:
    """Rows/s of one sink micro-batch and one source micro-batch of ``rows`` rows, one JVM."""
    tree = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=tree, PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, "-c", SPARK_CHILD, str(rows), scratch, tree],
                          env=env, cwd=scratch, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the Spark run of {tree} failed:\n{proc.stderr[-3000:]}")
    return {k: float(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--a", required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", default=".", help="checkout B (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--spark", action="store_true", help="also A/B one Spark sink micro-batch "
                    "and one source micro-batch of --spark-rows rows (a JVM a run: slow)")
    ap.add_argument("--spark-rows", type=int, default=200_000)
    ap.add_argument("--fsync", default="always", choices=["always", "periodic", "never"],
                    help="the addresses' fsync setting (never: the Python path alone)")
    args = ap.parse_args()
    unknown = {x for x in args.scenarios.split(",") if x} - set(SCENARIOS)  # "": Spark only
    if unknown:
        ap.error(f"unknown scenario(s) {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    scratch = tempfile.mkdtemp(prefix="dq-ab-")
    try:
        measure(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(args: argparse.Namespace, scratch: str) -> None:
    rates: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    scenarios = [x for x in args.scenarios.split(",") if x]
    for r in range(args.rounds):
        for scenario in scenarios:
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            for side in order:
                tree = args.a if side == "a" else args.b
                rate, cpu = run(tree, scenario, args.seconds, scratch, args.fsync)
                rates.setdefault((scenario, side), []).append(rate)
                cpus.setdefault((scenario, side), []).append(cpu)
                print(f"round {r + 1} {scenario:<12} {side}: {rate:>12,.0f} rows/s "
                      f"{cpu:>9.2f} us CPU/row", flush=True)
        if args.spark:
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                got = run_spark(args.a if side == "a" else args.b, args.spark_rows, scratch)
                for scenario, rate in got.items():
                    rates.setdefault((scenario, side), []).append(rate)
                    print(f"round {r + 1} {scenario:<12} {side}: {rate:>12,.0f} rows/s",
                          flush=True)
    if args.spark:
        scenarios += SPARK_SCENARIOS
    print(f"\n{'scenario':<12} {'A median':>12} {'B median':>12} {'B / A':>7}  (rows/s)"
          f"   {'A CPU':>9} {'B CPU':>9} {'B / A':>7}  (us/row)")
    for scenario in scenarios:
        a = statistics.median(rates[(scenario, "a")])
        b = statistics.median(rates[(scenario, "b")])
        cpu = ""
        if (scenario, "a") in cpus:
            ca = statistics.median(cpus[(scenario, "a")])
            cb = statistics.median(cpus[(scenario, "b")])
            cpu = f"   {ca:>9.2f} {cb:>9.2f} {cb / ca:>7.3f}"
        print(f"{scenario:<12} {a:>12,.0f} {b:>12,.0f} {b / a:>7.3f}{cpu}")


if __name__ == "__main__":
    main()
