"""Latency of the durablequeue Spark source: the idle ``latestOffset`` and end to end.

Part 1, ``latestOffset`` when there is nothing new (no JVM): the stream reader is built the way
Spark builds it in its driver-side reader process (``DurableQueueDataSource(options)``,
``schema()``, ``streamReader(schema)``, ``initialOffset()``, ``getDefaultReadLimit()``), reads
and commits a backlog of ``--backlog`` sends (one page and one commit-log entry each) to the
end, then calls ``latestOffset(end, limit)`` ``--calls`` times. Reported per call, in
microseconds, with two baselines measured in the same run: one ``os.stat`` of the newest
commit-log entry, and one ``CommitLog.refresh()`` of the reader's own (current) log view. The
store operations of one idle call are counted by wrapping the reader's storage, and the calls
are profiled with cProfile (top functions printed).

Part 2, end to end: ``readStream.format("durablequeue")`` -> ``writeStream.foreachBatch(fn)``,
where ``fn`` collects ``id`` and ``sent`` and records ``time.time() - sent`` per row. A thread
in this (the driver's) process sends one message ``{"id": i, "sent": time.time()}`` every
``--interval-ms`` for ``--seconds``, with the default trigger and with
``trigger(processingTime="0 seconds")`` (a new address and consumer for each). Every id must be
seen exactly once. The floor: the same query (default trigger) over an in-memory Python stream
source whose message ``i`` comes due at ``t0 + i * interval`` (no storage, no sender): what Spark
and the Python Data Source API cost by themselves. Spark's ``durationMs`` per phase is printed
for each query.

Part 3, an idle query: the CPU of the query's driver-side reader process while there is nothing
to read, and (with ``strace``) how often it looks for the next commit-log entry.

Usage::

    .venv/bin/python benchmarks/bench_stream_latency.py [--quick] [--seconds 25]
        [--interval-ms 100] [--calls 20000] [--backlog 300]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit
from pyspark.sql.types import StructType

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue.spark import DurableQueueDataSource
from pyspark_durable_queue.spark._source import DurableQueueStreamReader

#: Spark's per-batch timings (``durationMs`` of the query progress), in table order.
PHASES = ("triggerExecution", "latestOffset", "queryPlanning", "addBatch", "walCommit",
          "commitOffsets")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def timed(fn: Any, n: int) -> list[float]:
    """Microseconds of each of ``n`` calls of ``fn``."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000)
    return out


def row(name: str, us: list[float]) -> str:
    return (f"| {name:<38} | {statistics.fmean(us):9.1f} | {pct(us, 0.5):8.1f} | "
            f"{pct(us, 0.99):8.1f} |")


# -- part 1: latestOffset when idle -------------------------------------------------------------
def build_reader(root: str, address: str, consumer: str) -> DurableQueueStreamReader:
    """The stream reader as Spark's driver-side reader process builds it."""
    source = DurableQueueDataSource({"path": root, "address": address, "consumer": consumer})
    reader = source.streamReader(source.schema())  # type: ignore[arg-type]
    assert isinstance(reader, DurableQueueStreamReader)
    return reader


def drain(reader: DurableQueueStreamReader, limit: ReadLimit) -> dict:
    """Run the driver side of micro-batches until nothing is left; the last end offset."""
    start = reader.initialOffset()
    while True:
        end = reader.latestOffset(start, limit)
        reader.reportLatestOffset()
        if end == start:
            return end
        reader.partitions(start, end)
        reader.commit(end)
        start = end


def count_store_calls(reader: DurableQueueStreamReader, fn: Any, n: int) -> Counter[str]:
    """Store operations made by ``n`` calls of ``fn``, by wrapping the reader's storage."""
    storage = reader._driver.address.storage
    counts: Counter[str] = Counter()
    names = ["read", "read_range", "map", "exists", "size", "list_detailed", "create",
             "replace", "begin_write", "open_append", "delete", "touch"]

    def wrap(name: str) -> Any:
        inner = getattr(storage, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return inner(*args, **kwargs)
        return counted

    for name in names:
        setattr(storage, name, wrap(name))
    try:
        for _ in range(n):
            fn()
    finally:
        for name in names:
            delattr(storage, name)  # back to the class's methods
    return counts


def idle_latest_offset(work: Path, backlog: int, calls: int) -> dict[str, Any]:
    root = str(work / "idle")
    address = DurableQueue(root).address("idle")
    for i in range(backlog):  # one page and one commit-log entry per send
        address.send([{"id": j, "sent": time.time()} for j in range(i * 10, i * 10 + 10)])
    reader = build_reader(root, "idle", "bench")
    try:
        limit = reader.getDefaultReadLimit()
        end = drain(reader, limit)
        assert end == {"seq": backlog * 10}, end
        drv = reader._driver
        log = drv.address.log
        newest = Path(root) / "idle" / "log"
        entry = max(newest.iterdir(), key=lambda p: p.stat().st_mtime)

        def latest() -> None:
            reader.latestOffset(end, limit)

        def trigger() -> None:  # what Spark asks for on an idle trigger
            reader.latestOffset(end, limit)
            reader.reportLatestOffset()

        timed(latest, min(calls, 1000))  # warm-up
        results = {
            "os.stat (newest log entry)": timed(lambda: os.stat(entry), calls),
            "CommitLog.refresh() (idle)": timed(log.refresh, calls),
            "latestOffset(end, limit) (idle)": timed(latest, calls),
            "latestOffset + reportLatestOffset": timed(trigger, calls),
        }
        ops = count_store_calls(reader, latest, 100)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            latest()
        prof.disable()
        return {"results": results, "ops": ops, "profile": prof, "end": end}
    finally:
        reader.stop()


# -- part 2: end to end -------------------------------------------------------------------------
class _ClockReader(DataSourceStreamReader):
    """The floor: message ``i`` becomes available at ``t0 + i * interval`` with no storage at
    all (``t0`` is read from a file the driver writes when it starts "sending"). Before that,
    one warm-up row (id -1)."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.path = options["clock"]
        self.interval = float(options["interval"])
        self.count = int(options["count"])

    def _t0(self) -> float | None:
        try:
            return float(Path(self.path).read_text())
        except (OSError, ValueError):
            return None

    def initialOffset(self) -> dict:
        return {"n": 0}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        t0 = self._t0()
        due = 0 if t0 is None else int((time.time() - t0) / self.interval) + 1
        return {"n": 1 + max(0, min(self.count, due))}  # row 0 is the warm-up row

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        return [InputPartition((start["n"], end["n"], self._t0() or 0.0))]

    def read(self, partition: InputPartition) -> Iterator[tuple[int, float]]:
        lo, hi, t0 = partition.value
        for k in range(lo, hi):
            yield k - 1, (time.time() if k == 0 else t0 + (k - 1) * self.interval)


class ClockSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "bench-clock"

    def schema(self) -> str:
        return "id long, sent double"

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _ClockReader(self.options)


def end_to_end(spark: SparkSession, work: Path, name: str, trigger: dict[str, str] | None,
               seconds: float, interval: float, *, floor: bool = False) -> dict[str, Any]:
    """One query; ``floor`` reads from :class:`ClockSource` instead of an address."""
    n = max(1, int(seconds / interval))
    root = str(work / "e2e")
    clock = work / f"clock-{name}"
    address = DurableQueue(root).address(name)
    if floor:
        df = (spark.readStream.format("bench-clock").option("clock", str(clock))
              .option("interval", str(interval)).option("count", str(n)).load())
    else:
        address.send([{"id": -1, "sent": time.time()}])  # the schema, and a first batch
        df = (spark.readStream.format("durablequeue").option("address", name)
              .option("consumer", "latency").load(root))
    seen: list[tuple[int, float]] = []  # (id, latency s)
    batches: list[int] = []
    lock = threading.Lock()

    def record(df: Any, batch_id: int) -> None:  # runs in this process (Py4J callback)
        rows = df.select("id", "sent").collect()
        now = time.time()
        with lock:
            seen.extend((r["id"], now - r["sent"]) for r in rows)
            batches.append(len(rows))

    writer = (df.writeStream.foreachBatch(record)
              .option("checkpointLocation", str(work / f"ck-{name}")))
    if trigger is not None:
        writer = writer.trigger(**trigger)  # type: ignore[arg-type]
    q = writer.start()
    try:
        deadline = time.time() + 120
        while not seen and time.time() < deadline:  # the warm-up message went through
            time.sleep(0.05)
        sending: list[float] = []

        def sender() -> None:
            t0 = time.perf_counter()
            if floor:  # the clock source's messages come due from now on, by themselves
                clock.write_text(repr(time.time()))
                time.sleep(n * interval)
                sending.append(time.perf_counter() - t0)
                return
            for i in range(n):
                pause = t0 + i * interval - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                address.send([{"id": i, "sent": time.time()}])
            sending.append(time.perf_counter() - t0)

        thread = threading.Thread(target=sender, name=f"sender-{name}", daemon=True)
        thread.start()
        thread.join()
        deadline = time.time() + 60
        while time.time() < deadline:
            with lock:
                if sum(1 for i, _ in seen if i >= 0) >= n:
                    break
            time.sleep(0.05)
        time.sleep(1.0)  # a duplicate would show up in the next batch
    finally:
        q.stop()
    if q.exception() is not None:
        raise RuntimeError(f"{name}: {q.exception()}")
    ids = Counter(i for i, _ in seen if i >= 0)
    progress = [p["durationMs"] for p in q.recentProgress if p["numInputRows"] > 0]
    phases = {k: statistics.median(d.get(k, 0) for d in progress) for k in PHASES} \
        if progress else {}
    lat = [s * 1000 for i, s in seen if i >= 0]
    return {
        "sent": n, "seen": sum(ids.values()), "sending_s": sending[0] if sending else float("nan"),
        "missing": sorted(set(range(n)) - set(ids)),
        "duplicated": sorted(i for i, c in ids.items() if c > 1),
        "batches": len(batches) - 1, "phases": phases,  # without the warm-up batch
        "p50": pct(lat, 0.5) if lat else float("nan"),
        "p99": pct(lat, 0.99) if lat else float("nan"),
        "max": max(lat) if lat else float("nan"),
    }


# -- part 3: an idle query ---------------------------------------------------------------------
def _descendants(pid: int) -> list[tuple[int, str]]:
    """``(pid, args)`` of every process below ``pid``."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True,
                         text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if len(line.split(None, 2)) == 3]
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for p, pp, args in rows:
            if int(pp) == parent:
                found.append((int(p), args))
                todo.append(int(p))
    return found


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_query(spark: SparkSession, work: Path, seconds: float) -> dict[str, Any]:
    """A durablequeue -> foreachBatch query with nothing to read: CPU of its driver-side reader
    process (Linux ``/proc``) and, with ``strace``, how often it looks for the next log entry
    (one failed open per ``latestOffset`` and per ``reportLatestOffset``)."""
    root = str(work / "e2e")
    DurableQueue(root).address("idle").send([{"id": -1, "sent": time.time()}])

    def count(df: Any, batch_id: int) -> None:
        df.count()

    q = (spark.readStream.format("durablequeue").option("address", "idle")
         .option("consumer", "idle").load(root).writeStream
         .foreachBatch(count)
         .option("checkpointLocation", str(work / "ck-idle")).start())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not any(p["numInputRows"] for p in q.recentProgress):
            time.sleep(0.1)
        time.sleep(2)  # the first batch went through; the query is idle
        runner = [p for p, args in _descendants(os.getpid())
                  if "python_streaming_source_runner" in args]
        if not runner or not Path("/proc").is_dir():
            return {}
        pid = runner[0]
        c0, t0 = _cpu_s(pid), time.perf_counter()
        time.sleep(seconds)
        out: dict[str, Any] = {"cpu": (_cpu_s(pid) - c0) / (time.perf_counter() - t0)}
        if shutil.which("strace"):
            t0 = time.perf_counter()
            traced = subprocess.run(["timeout", str(seconds), "strace", "-f", "-e",
                                     "trace=openat", "-p", str(pid)],
                                    capture_output=True, text=True)
            opens = sum(1 for line in traced.stderr.splitlines() if "/idle/log/" in line)
            out["opens_per_s"] = opens / (time.perf_counter() - t0)
        return out
    finally:
        q.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--seconds", type=float, default=25.0, help="sending time per trigger")
    ap.add_argument("--interval-ms", type=float, default=100.0)
    ap.add_argument("--calls", type=int, default=20_000, help="idle latestOffset calls")
    ap.add_argument("--backlog", type=int, default=300, help="sends in the consumed backlog")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.calls, args.backlog = 4.0, 2_000, 30
    print(f"load before: {uptime()}")
    work = Path(tempfile.mkdtemp(prefix="dq-bench-latency-"))
    try:
        idle = idle_latest_offset(work, args.backlog, args.calls)
        print(f"\nlatestOffset with nothing new ({args.backlog} sends, {idle['end']['seq']} "
              f"messages consumed; {args.calls} calls each, microseconds)\n")
        print(f"| {'call':<38} | {'mean':>9} | {'p50':>8} | {'p99':>8} |")
        print(f"|{'-' * 40}|{'-' * 10}:|{'-' * 9}:|{'-' * 9}:|")
        for name, us in idle["results"].items():
            print(row(name, us))
        per_call = {k: v / 100 for k, v in sorted(idle["ops"].items())}
        print(f"\nstore operations per idle latestOffset: {per_call or 'none'}")
        print("\ncProfile of the idle latestOffset calls (top 12 by own time):")
        stats = pstats.Stats(idle["profile"])
        stats.sort_stats("tottime").print_stats(12)

        spark = (SparkSession.builder.master("local[2]").appName("bench-stream-latency")
                 .config("spark.ui.enabled", "false")
                 .config("spark.sql.shuffle.partitions", "2").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        spark.dataSource.register(ClockSource)
        polling = spark.conf.get("spark.sql.streaming.pollingDelay")
        try:
            idle_q = idle_query(spark, work, 2.0 if args.quick else 10.0)
            runs = {
                "default trigger": end_to_end(spark, work, "default", None, args.seconds,
                                                args.interval_ms / 1000),
                'processingTime="0 seconds"': end_to_end(
                    spark, work, "zero", {"processingTime": "0 seconds"}, args.seconds,
                    args.interval_ms / 1000),
                "floor: in-memory clock source": end_to_end(
                    spark, work, "floor", None, args.seconds, args.interval_ms / 1000,
                    floor=True),
            }
        finally:
            spark.stop()
        print(f"\ndurablequeue -> foreachBatch, one message every {args.interval_ms:.0f} ms "
              f"for {args.seconds:.0f} s (latency = time.time() in foreachBatch after "
              "collect() - time.time() at send)\n")
        print("| query                          | sent | seen | lost | dup | batches | p50 ms | "
              "p99 ms | max ms |")
        print("|--------------------------------|-----:|-----:|-----:|----:|--------:|-------:|"
              "-------:|-------:|")
        for name, r in runs.items():
            print(f"| {name:<30} | {r['sent']:4d} | {r['seen']:4d} | {len(r['missing']):4d} | "
                  f"{len(r['duplicated']):3d} | {r['batches']:7d} | {r['p50']:6.0f} | "
                  f"{r['p99']:6.0f} | {r['max']:6.0f} |")
        print("\nmedian Spark durationMs of the batches with input (ms):\n")
        print("| query                          | " + " | ".join(PHASES) + " |")
        print("|--------------------------------|" + "|".join("-" * (len(k) + 1) + ":"
                                                         for k in PHASES) + "|")
        for name, r in runs.items():
            print(f"| {name:<30} | " + " | ".join(f"{r['phases'].get(k, 0):>{len(k)}.0f}"
                                                  for k in PHASES) + " |")
        print(f"\nspark.sql.streaming.pollingDelay = {polling} (the wait between idle triggers)")
        if idle_q:
            rate = idle_q.get("opens_per_s")
            print(f"idle query: its driver-side reader process uses {100 * idle_q['cpu']:.1f}% "
                  "of a core" + ("" if rate is None else
                                 f"; it looks for the next log entry {rate:.0f} times/s"))
        print(f"\nload after: {uptime()}")
        bad = {n: r for n, r in runs.items() if r["missing"] or r["duplicated"]}
        if bad:
            detail = {n: (r["missing"][:10], r["duplicated"][:10]) for n, r in bad.items()}
            raise SystemExit(f"lost or duplicated messages (missing, duplicated): {detail}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
