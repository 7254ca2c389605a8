"""Compaction of a Spark stream's small pages (issue 28): a stream of ``--batches`` micro-batches
of ``--rows`` rows each, written by ``writeStream.format("durablequeue")``, leaves a page per
micro-batch; how many compaction leaves, and what draining that backlog with
``readStream.format("durablequeue")`` costs before and after, in one run.

Steps:

1. ``--batches`` JSON files of ``--rows`` rows (id, region, amount, a body of ~88 bytes), read
   by a file stream with ``maxFilesPerTrigger=1`` and ``Trigger.AvailableNow``: one micro-batch
   (one task, one page) per file, into address ``bench`` (created first with
   ``compactSmallPages=0``, so that cleanup does not compact on its own, and a consumer
   ``holder`` at ``earliest`` that never acknowledges, so that the pages stay).
2. Source drain before: ``--repeat`` streaming queries, each with a new consumer from
   ``earliest``, ``Trigger.AvailableNow``, default read limits, into Spark's ``noop`` sink;
   seconds from ``start()`` to the end (query start and planning included: what a user
   waits), the best counts; and the micro-batches' ``addBatch`` time alone (reading the
   pages, without the query's start and stop, which dominate at 10,000 rows). A Python
   consumer's drain (``receive(10_000)`` + ``ack``) is shown alongside.
3. ``Address.compact()``, then ``cleanup`` (replaced files deleted at once), pages counted.
4. The same drains after; ratio after/before (rows/s).

Run::

    .venv/bin/python benchmarks/bench_spark_compact.py [--batches 1000] [--rows 10]
        [--repeat 3] [--json FILE] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pyspark.sql import SparkSession

from pyspark_durable_queue import DurableQueue

BODY_BYTES = 88
REGIONS = ["EU", "US", "APAC", "LATAM"]


def make_input(folder: Path, files: int, rows: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for f in range(files):
        lines = [json.dumps({"id": i, "region": REGIONS[i % 4], "amount": i % 1000 / 10,
                             "body": f"{i:08d}" + "x" * (BODY_BYTES - 8)})
                 for i in range(n, n + rows)]
        (folder / f"part-{f:05d}.json").write_text("\n".join(lines) + "\n")
        n += rows
    return n


def session() -> SparkSession:
    spark = (SparkSession.builder.master("local[2]").appName("bench-spark-compact")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.memory", "2g")
             .config("spark.sql.session.timeZone", "UTC")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def page_files(address) -> tuple[int, int]:
    """Page files in the pages folder and their bytes (the address's journal segment, empty
    here but made ahead at its full size, is not counted)."""
    entries = [e for e in os.scandir(address.pages_folder) if e.name.endswith(".page")]
    return len(entries), sum(e.stat().st_size for e in entries)


def write_stream(spark: SparkSession, src: Path, root: str, ckpt: Path) -> tuple[float, int]:
    q = (spark.readStream.schema("id long, region string, amount double, body string")
         .option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.format("durablequeue").option("address", "bench")
         .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start(root))
    started = time.perf_counter()
    q.awaitTermination()
    seconds = time.perf_counter() - started
    if q.exception() is not None:
        raise RuntimeError(f"the sink failed: {q.exception()}")
    batches = q.lastProgress["batchId"] + 1  # recentProgress keeps only the last 100
    q.stop()
    return seconds, batches


def spark_drain(spark: SparkSession, root: str, consumer: str,
                ckpt: Path) -> tuple[float, int, dict[str, int]]:
    """A new consumer from earliest to the end: seconds from start() to the end, rows, and the
    milliseconds Spark's progress reports per phase (summed over the micro-batches)."""
    q = (spark.readStream.format("durablequeue").option("address", "bench")
         .option("consumer", consumer).option("startingPosition", "earliest").load(root)
         .writeStream.format("noop").option("checkpointLocation", str(ckpt))
         .trigger(availableNow=True))
    started = time.perf_counter()
    q = q.start()
    q.awaitTermination()
    seconds = time.perf_counter() - started
    if q.exception() is not None:
        raise RuntimeError(f"the source failed: {q.exception()}")
    rows = sum(p["numInputRows"] for p in q.recentProgress)
    phases: dict[str, int] = {}
    for p in q.recentProgress:
        for k, v in p["durationMs"].items():
            phases[k] = phases.get(k, 0) + v
    q.stop()
    return seconds, rows, phases


def python_drain(address, consumer: str) -> tuple[float, int]:
    c = address.consumer(consumer, start="earliest")
    started = time.perf_counter()
    rows = 0
    while True:
        t = c.receive(10_000)
        if not t.num_rows:
            break
        rows += t.num_rows
        c.ack(t)
    return time.perf_counter() - started, rows


def drains(spark: SparkSession, root: str, work: Path, label: str, repeat: int,
           expected: int) -> dict[str, object]:
    address = DurableQueue(root).address("bench")
    spark_s, py_s, read_ms = [], [], []
    spark_drain(spark, root, f"{label}-warm-up", work / f"ck-{label}-warm-up")  # not counted
    address.consumer(f"{label}-warm-up").delete()
    for r in range(repeat):
        s, rows, phases = spark_drain(spark, root, f"{label}-spark-{r}",
                                      work / f"ck-{label}-{r}")
        assert rows == expected, (label, rows, expected)
        p, prow = python_drain(address, f"{label}-python-{r}")
        assert prow == expected, (label, prow, expected)
        spark_s.append(s)
        py_s.append(p)
        read_ms.append(phases.get("addBatch", 0))
        print(f"  {label:7s} round {r + 1}: Spark source {s:6.2f} s ({rows / s:9,.0f} rows/s), "
              f"Python consumer {p * 1e3:7.1f} ms ({prow / p:10,.0f} rows/s); Spark's "
              f"addBatch {phases.get('addBatch', 0)} ms, queryPlanning "
              f"{phases.get('queryPlanning', 0)} ms, latestOffset "
              f"{phases.get('latestOffset', 0)} ms", flush=True)
    # the drained consumers acknowledged everything: remove them (holder keeps the pages)
    for r in range(repeat):
        address.consumer(f"{label}-spark-{r}").delete()
        address.consumer(f"{label}-python-{r}").delete()
    return {"spark_seconds": [round(x, 3) for x in spark_s],
            "spark_rows_per_s": round(expected / min(spark_s)),
            # the micro-batches' addBatch: reading the pages and writing them to noop, without
            # the query's start and stop (most of the seconds above at this size)
            "spark_read_ms": read_ms,
            "spark_read_rows_per_s": round(expected / max(1, min(read_ms)) * 1000),
            "python_seconds": [round(x, 4) for x in py_s],
            "python_rows_per_s": round(expected / min(py_s))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=10, help="rows per micro-batch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="default: a temporary folder")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dq-bench-spark-compact-"))
    root = str(work / "dq")
    results: dict[str, object] = {"batches": args.batches, "rows_per_batch": args.rows}
    try:
        total = make_input(work / "in", args.batches, args.rows)
        address = DurableQueue(root).address("bench", compact_small_pages=0,
                                             compact_grace_ms=0)
        address.consumer("holder", start="earliest")  # never acknowledges: the pages stay
        spark = session()
        print(f"{args.batches} micro-batches of {args.rows} rows into the sink "
              f"(cpus {os.cpu_count()}, load average {os.getloadavg()}) ...", flush=True)
        seconds, batches = write_stream(spark, work / "in", root, work / "ck-sink")
        address = DurableQueue(root).address("bench")
        rows_before = len(address.state.pages)
        files_before, bytes_before = page_files(address)
        assert address.stats()["messages"] == total
        print(f"  {batches} micro-batches in {seconds:.1f} s ({batches / seconds:.1f}/s); "
              f"{rows_before} pages in the log, {files_before} files, {bytes_before:,} bytes",
              flush=True)
        results["sink"] = {"seconds": round(seconds, 1), "micro_batches": batches}
        results["before"] = {"pages": rows_before, "files": files_before,
                             "bytes": bytes_before,
                             **drains(spark, root, work, "before", args.repeat, total)}

        started = time.perf_counter()
        report = address.compact()
        compact_s = time.perf_counter() - started
        address.cleanup(dry_run=False)
        rows_after = len(address.state.pages)
        files_after, bytes_after = page_files(address)
        print(f"compact: {report.pages_before} pages -> {report.pages_after} in "
              f"{compact_s:.2f} s ({report.messages:,} messages, {report.bytes_read:,} bytes "
              f"read, {report.bytes_written:,} written); now {rows_after} pages in the log, "
              f"{files_after} files, {bytes_after:,} bytes", flush=True)
        results["compact"] = {**{k: v for k, v in report.to_dict().items() if k != "pages"},
                              "seconds": round(compact_s, 3)}
        results["after"] = {"pages": rows_after, "files": files_after, "bytes": bytes_after,
                            **drains(spark, root, work, "after", args.repeat, total)}
        spark.stop()

        before, after = results["before"], results["after"]
        spark_ratio = after["spark_rows_per_s"] / before["spark_rows_per_s"]  # type: ignore
        py_ratio = after["python_rows_per_s"] / before["python_rows_per_s"]  # type: ignore
        read_ratio = after["spark_read_rows_per_s"] / before["spark_read_rows_per_s"]  # type: ignore
        results["ratio_after_vs_before"] = {"spark": round(spark_ratio, 2),
                                            "spark_read": round(read_ratio, 2),
                                            "python": round(py_ratio, 2)}
        print(f"\npages {rows_before} -> {rows_after}; best drain of {total:,} rows: Spark "
              f"source {before['spark_rows_per_s']:,} -> {after['spark_rows_per_s']:,} "  # type: ignore
              f"rows/s ({spark_ratio:.2f}x), Python consumer "
              f"{before['python_rows_per_s']:,} -> {after['python_rows_per_s']:,} rows/s "  # type: ignore
              f"({py_ratio:.2f}x); the Spark micro-batches' addBatch alone (no query start): "
              f"{before['spark_read_rows_per_s']:,} -> {after['spark_read_rows_per_s']:,} "  # type: ignore
              f"rows/s ({read_ratio:.2f}x)")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
