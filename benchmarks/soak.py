"""The soak (issue 43): every kind of client on one local store at once, for a long time, while
resources are sampled; fails on a trend, not on a level. ``make soak`` runs it.

    .venv/bin/python benchmarks/soak.py [--seconds 1800] [--interval 5] [--warmup SECONDS]
        [--no-spark] [--results soak-results/STAMP] [--root /tmp/dq-soak-XXXX] [--keep]

Real subprocesses on one store (a temporary folder under /tmp, deleted at the end):

- ``producer``: a :class:`Producer` (batch sends), ~200 rows/s, each tick's futures awaited;
- ``senders``: 4 threads of single ``Address.send`` calls, ~10/s each (one sync per send);
- ``consumer``: an exclusive consumer: ``ack(flush=False)`` (deferred), a flushing ack every
  10th batch, a ``nack`` of one row every 20th batch (redelivered after 200 ms);
- ``shared-1``, ``shared-2``: a shared consumer's pool (``consumer(..., shared=True)``):
  receive, ack, a nack every 10th batch;
- ``maintenance``: ``cleanup(dry_run=False)`` every 5 s and ``compact()`` every 10 s, on top of
  what the address's settings start by themselves (``cleanup_interval_ms=2000``,
  ``compact_small_pages=20``: the consumers' acks run cleanup and compaction);
- ``spark`` (not with ``--no-spark``): a streaming query, ``format("durablequeue")`` with its own
  consumer -> the ``noop`` sink, a micro-batch every 2 s.

Every ``--interval`` seconds this process samples, per process (a Spark driver's JVM, its
streaming source runner and its Python workers apart): RSS, open descriptors, threads; and of the
address: its files, bytes, files in ``log/``, commit-log entries after the newest checkpoint
(what an opening process replays), each consumer's backlog. After ``--warmup`` (default a third
of the run, at least 10 minutes in runs of 30 minutes or more: longer than the minimum
``log_retention_ms`` of 5 minutes, before which checkpoints only accumulate) it fits a
least-squares line to each series and fails when one rises faster than its limit
(:data:`LIMITS`): the slope extrapolated to an hour above ``per_hour`` AND the rise fitted over
the measured window above ``floor`` (the noise of a level: allocator arenas, a segment rolling,
a checkpoint's sawtooth), and the same slope fitted to the window's second half alone passes
both too (a step up that then stays level, a JVM's thread pool or heap growing to its size, is
not a trend). A short run therefore only catches fast leaks; the 30-minute run is
the one that bounds slow ones (its window is 20 minutes: ``per_hour`` decides there).

A process can reach its level late (a loaded machine runs its first compaction late in a short
window): when a series fails that rule at the planned end, the clients run on for up to
``--extend`` seconds (default: the measured window again) and every series is judged again, by
the same rule, over the whole longer window (:func:`suspects`). A level reached late is flat in
the longer window's second half and passes; a leak still rises there and fails (its rise over
the longer window only grows). A healthy run ends on time.

Also fails when a role exits during the run, when one did nothing (no rows sent, received,
acknowledged, nacked, no cleanup or compaction), or when a role reports an error. Writes to
the results folder: ``samples.csv`` (``t, series, value``), ``summary.json`` (slopes, maxima,
verdicts, what each role did), ``soak.png`` (the series; matplotlib from the ``test`` extra),
and each role's stdout/stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADDRESS = "in"
ROLES = ("producer", "senders", "consumer", "shared-1", "shared-2", "maintenance")
SPARK_ROLE = "spark"
MiB = 1 << 20
#: Address settings of the soak: small segments so that they roll and get cleaned up often;
#: cleanup every 2 s from the consumers' acks, compaction once 20 small pieces wait, files
#: compaction replaced kept 30 s (not 10 minutes) for readers that planned on them.
ADDRESS_SETTINGS: dict[str, Any] = {
    "page_size_bytes": 256 * 1024, "cleanup_interval_ms": 2000, "compact_small_pages": 20,
    "compact_grace_ms": 30_000, "log_retention_ms": 300_000}


@dataclass(frozen=True)
class Limit:
    """A series fails when it rises faster than ``per_hour`` (the fitted slope, extrapolated)
    and by more than ``floor`` over the measured window (the fitted rise), and its slope fitted
    to the window's second half alone, as if over the whole window, does too. ``settles_s``: how
    long a healthy series takes to reach its level (a shorter warm-up reports it, unjudged)."""

    per_hour: float
    floor: float
    unit: str
    settles_s: float = 0


#: The trend limits, by the kind of series (the part of its name before ``:``).
LIMITS: dict[str, Limit] = {
    "rss": Limit(64 * MiB, 16 * MiB, "bytes"),
    "fds": Limit(20, 8, "descriptors"),
    "threads": Limit(10, 4, "threads"),
    "files": Limit(200, 20, "files"),
    "bytes": Limit(64 * MiB, 8 * MiB, "bytes"),
    # checkpoints (one per 1,000 commits) stay for log_retention_ms (5 minutes) before cleanup
    # takes them: they pile up for that long, then stay level
    "log_files": Limit(100, 10, "files", settles_s=ADDRESS_SETTINGS["log_retention_ms"] / 1000
                       + 60),
    "log_entries": Limit(1000, 1000, "entries"),
    "backlog": Limit(36_000, 2_000, "messages"),
    "ckpt_files": Limit(200, 20, "files"),
}


# -- the roles (each runs in its own process) ----------------------------------------------------
class Role:
    """What a role process shares: the stop file, its counters, written as JSON every 2 s."""

    def __init__(self, root: str, stop: str, status: str) -> None:
        self.root, self.stop_path, self.status_path = root, stop, status
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self._written = 0.0

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def stopping(self) -> bool:
        return os.path.exists(self.stop_path)

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._written < 2:
            return
        self._written = now
        with self.lock:
            text = json.dumps(self.counts)
        tmp = self.status_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.status_path)

    def address(self) -> Any:
        from pyspark_durable_queue import DurableQueue

        return DurableQueue(self.root).address(ADDRESS, **ADDRESS_SETTINGS)


def _row(n: int, who: str) -> dict[str, Any]:
    return {"id": n, "who": who, "region": ("EU", "US", "APAC")[n % 3], "body": "x" * 120}


def run_producer(role: Role) -> None:
    addr = role.address()
    n = 0
    with addr.producer(linger_ms=20) as producer:
        previous: list[Any] = []
        while not role.stopping():
            tick = time.monotonic()
            futures = [producer.send(_row(n + i, "producer")) for i in range(20)]
            n += 20
            for f in previous:  # the tick before: durable by now, or the send failed
                f.result(timeout=60)
            role.add("sent", len(previous))
            previous = futures
            role.report()
            time.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))
        producer.flush(timeout=60)
        for f in previous:
            f.result(timeout=60)
        role.add("sent", len(previous))


def run_senders(role: Role) -> None:
    addr = role.address()
    errors: list[BaseException] = []

    def sender(k: int) -> None:
        n = 0
        try:
            while not role.stopping():
                tick = time.monotonic()
                addr.send([_row(n, f"sender-{k}")])
                n += 1
                role.add("sent")
                time.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))
        except BaseException as exc:
            errors.append(exc)
            traceback.print_exc()

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        role.report()
        time.sleep(0.5)
    if errors:
        raise errors[0]


def run_consumer(role: Role) -> None:
    addr = role.address()
    consumer = addr.consumer("excl", ack_flush_ms=500)
    batches = 0
    try:
        while not role.stopping():
            table = consumer.receive(500, timeout_ms=500)
            role.report()
            if table.num_rows == 0:
                continue
            batches += 1
            role.add("received", table.num_rows)
            counts = table.column("_delivery_count").to_pylist()
            role.add("redelivered", sum(1 for c in counts if c > 1))
            if batches % 20 == 0 and counts[0] == 1:
                consumer.nack(int(table.column("_seq")[0].as_py()), delay_ms=200)
                role.add("nacked")
            flush = batches % 10 == 0
            consumer.ack(table, flush=flush)
            role.add("acks_flushed" if flush else "acks_deferred")
    finally:
        consumer.close()


def run_shared(role: Role) -> None:
    addr = role.address()
    pool = addr.consumer("pool", shared=True, lease_ms=15_000, prefetch=100)
    batches = 0
    try:
        while not role.stopping():
            table = pool.receive(100, timeout_ms=500)
            role.report()
            if table.num_rows == 0:
                continue
            batches += 1
            seqs = table.column("_seq").to_pylist()
            counts = table.column("_delivery_count").to_pylist()
            role.add("received", len(seqs))
            role.add("redelivered", sum(1 for c in counts if c > 1))
            if batches % 10 == 0 and counts[0] == 1:
                pool.nack(seqs[0], delay_ms=200)
                role.add("nacked")
                seqs = seqs[1:]
            if seqs:
                pool.ack(seqs)
                role.add("acked", len(seqs))
    finally:
        pool.close()


#: Seconds between the maintenance role's explicit compactions (cleanup runs every 5 s).
COMPACT_EVERY_S = 10


def run_maintenance(role: Role) -> None:
    addr = role.address()
    last_compact = 0.0  # the first compaction at once: its imports and buffers in the warm-up
    while not role.stopping():
        report = addr.cleanup(dry_run=False)
        role.add("cleanups")
        role.add("pages_removed", len(report.pages))
        role.add("log_files_removed", len(report.log_files))
        if time.monotonic() - last_compact >= COMPACT_EVERY_S:
            last_compact = time.monotonic()
            compacted = addr.compact()
            role.add("compactions")
            role.add("runs_compacted", compacted.runs)
        role.report()
        for _ in range(50):
            if role.stopping():
                break
            time.sleep(0.1)


def run_spark(role: Role, checkpoint: str) -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    role.address()  # the address exists before the query plans (the other roles race to make it)
    spark = (SparkSession.builder.master("local[1]").appName("soak")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "512m")
             .config("spark.sql.shuffle.partitions", "1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = (spark.readStream.format("durablequeue").option("address", ADDRESS)
          .option("consumer", "spark").option("maxMessagesPerTrigger", 5000)
          .option("cleanupIntervalMs", 2000).load(role.root))
    q = (df.writeStream.format("noop").option("checkpointLocation", checkpoint)
         .trigger(processingTime="2 seconds").start())
    seen: set[int] = set()
    try:
        while not role.stopping():
            if q.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {q.exception()}")
            for p in q.recentProgress:
                if p["batchId"] not in seen:
                    seen.add(p["batchId"])
                    role.add("received", int(p.get("numInputRows", 0)))
                    role.add("batches")
            seen = {b for b in seen if b >= max(seen, default=0) - 1000}
            role.report()
            time.sleep(1)
    finally:
        q.stop()
        spark.stop()
    if q.exception() is not None:
        raise RuntimeError(f"the streaming query failed: {q.exception()}")


def role_main(name: str, root: str, stop: str, status: str, checkpoint: str) -> int:
    role = Role(root, stop, status)
    # SIGTERM from the driver (it gave up waiting): finish as if the stop file were there
    signal.signal(signal.SIGTERM, lambda *_: Path(stop).touch())
    try:
        if name == "producer":
            run_producer(role)
        elif name == "senders":
            run_senders(role)
        elif name == "consumer":
            run_consumer(role)
        elif name.startswith("shared-"):
            run_shared(role)
        elif name == "maintenance":
            run_maintenance(role)
        elif name == SPARK_ROLE:
            run_spark(role, checkpoint)
        else:
            raise SystemExit(f"unknown role {name!r}")
    except Exception:
        traceback.print_exc()
        role.add("errors")
        role.report(force=True)
        return 1
    role.report(force=True)
    return 0


# -- sampling ------------------------------------------------------------------------------------
def _proc_series(name: str, proc: Any, children: bool = True) -> dict[str, float]:
    """RSS, descriptors and threads of a role's process and, for Spark, of its JVM, its streaming
    source runner and (the largest of) its Python workers."""
    import psutil

    out: dict[str, float] = {}

    def put(label: str, p: Any) -> None:
        with p.oneshot():
            out[f"rss:{label}"] = p.memory_info().rss
            out[f"fds:{label}"] = p.num_fds()
            out[f"threads:{label}"] = p.num_threads()

    try:
        put(name, proc)
        tree = proc.children(recursive=True) if children else []
    except psutil.Error:
        return out
    forked = []  # pyspark.daemon (started by the JVM) and the workers it forks: same command
    for child in tree:
        try:
            cmd = " ".join(child.cmdline())
            if child.name() == "java" and "launcher.Main" not in cmd:
                put(f"{name}-jvm", child)
            elif "python_streaming_source_runner" in cmd:
                put(f"{name}-source-runner", child)
            elif "pyspark.daemon" in cmd or "pyspark.worker" in cmd:
                forked.append((child.pid, child.ppid(), child.memory_info().rss))
        except psutil.Error:
            continue
    pids = {pid for pid, _, _ in forked}
    workers = [rss for _, ppid, rss in forked if ppid in pids]
    if workers:
        out[f"worker_rss:{name}-workers"] = max(workers)
    return out


def _folder(path: str) -> tuple[int, int]:
    files = size = 0
    for folder, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):  # removed between the listing and the stat
                size += os.stat(os.path.join(folder, n)).st_size
                files += 1
    return files, size


class Sampler:
    """The address's series, read as any other process would (its own handle)."""

    def __init__(self, root: str, checkpoint: str) -> None:
        self.root, self.checkpoint = root, checkpoint
        self._address: Any = None

    def sample(self) -> dict[str, float]:
        from pyspark_durable_queue import DurableQueue

        out: dict[str, float] = {}
        folder = os.path.join(self.root, ADDRESS)
        files, size = _folder(folder)
        log = os.path.join(folder, "log")
        names = os.listdir(log) if os.path.isdir(log) else []
        out["files:address"] = files - len(names)  # data: pages, consumers' files, leases
        out["log_files:address"] = len(names)
        out["bytes:address"] = size
        if os.path.isdir(self.checkpoint):
            out["ckpt_files:spark-checkpoint"] = _folder(self.checkpoint)[0]
        if self._address is None:
            self._address = DurableQueue(self.root).address(ADDRESS, create=False)
        stats = self._address.stats()
        checkpoints = [int(n.split(".")[0]) for n in names if n.endswith(".checkpoint.arrow")]
        out["log_entries:address"] = stats["commits"] - max(checkpoints, default=0)
        out["pages:address"] = stats["pages"]
        for consumer, c in stats["consumers"].items():
            out[f"backlog:{consumer}"] = c["backlog_messages"]
        return out


# -- judging -------------------------------------------------------------------------------------
def slope(ts: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` against ``ts`` (per second)."""
    n = len(ts)
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def judge(samples: list[tuple[float, str, float]], warmup: float,
          limits: dict[str, Limit] = LIMITS) -> dict[str, dict[str, Any]]:
    """Per series: its slope after ``warmup`` seconds (per hour), the rise it fits over the
    measured window, its maximum, and whether it failed its limit (see :class:`Limit`). A
    series without a limit (``pages``, the Spark workers' RSS: workers come and go) is
    reported, not judged; a series with fewer than 5 samples after the warm-up fails (the run
    was too short to tell)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for t, name, value in samples:
        series.setdefault(name, []).append((t, value))
    verdicts: dict[str, dict[str, Any]] = {}
    for name, points in sorted(series.items()):
        kind = name.split(":", 1)[0]
        after = [(t, v) for t, v in points if t >= warmup]
        verdict: dict[str, Any] = {"max": max(v for _, v in points), "samples": len(after)}
        if len(after) >= 2:
            ts, ys = [t for t, _ in after], [v for _, v in after]
            per_s = slope(ts, ys)
            window = ts[-1] - ts[0]
            verdict.update(per_hour=per_s * 3600, rise=per_s * window, window_s=window,
                           first=ys[0], last=ys[-1])
        limit = limits.get(kind)
        if limit is None:
            verdict["judged"] = False
        elif warmup < limit.settles_s:
            verdict.update(judged=False, reason=f"settles after {limit.settles_s:.0f} s: a "
                           f"warm-up of {warmup:.0f} s cannot tell its level from a trend")
        elif len(after) < 5:
            verdict.update(judged=True, failed=True,
                           reason=f"only {len(after)} samples after the warm-up")
        else:
            # a trend still rises in the window's second half: a step up (a thread pool or a
            # heap growing to its size once, a level that follows the load) is flat there
            late = [(t, v) for t, v in after if t >= (after[0][0] + after[-1][0]) / 2]
            late_per_s = slope([t for t, _ in late], [v for _, v in late])
            verdict["late_per_hour"] = late_per_s * 3600
            failed = (verdict["per_hour"] > limit.per_hour and verdict["rise"] > limit.floor
                      and late_per_s * 3600 > limit.per_hour
                      and late_per_s * window > limit.floor)
            verdict.update(judged=True, failed=failed, limit_per_hour=limit.per_hour,
                           floor=limit.floor)
            if failed:
                verdict["reason"] = (
                    f"rises {_fmt(verdict['per_hour'], limit.unit)}/h (limit "
                    f"{_fmt(limit.per_hour, limit.unit)}/h), {_fmt(verdict['rise'], limit.unit)} "
                    f"over {window:.0f} s (floor {_fmt(limit.floor, limit.unit)})")
        verdicts[name] = verdict
    return verdicts


def suspects(verdicts: dict[str, dict[str, Any]]) -> list[str]:
    """The series that failed on their trend (not for want of samples): the ones a longer
    window can tell apart, a level reached late from a leak."""
    return sorted(name for name, v in verdicts.items()
                  if v.get("failed") and "late_per_hour" in v)


def _fmt(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / MiB:.1f} MiB"
    return f"{value:.1f} {unit}"


# -- the driver ----------------------------------------------------------------------------------
def plot(samples: list[tuple[float, str, float]], warmup: float, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the `test` extra has it): no PNG, see samples.csv")
        return False
    panels = [("rss", "RSS (MiB)", MiB), ("fds", "open descriptors", 1),
              ("threads", "threads", 1), ("files", "files in the address", 1),
              ("log_entries", "log entries after the newest checkpoint", 1),
              ("backlog", "backlog (messages)", 1)]
    fig, axes = plt.subplots(3, 2, figsize=(13, 11), sharex=True)
    for ax, (kind, title, scale) in zip(axes.flat, panels, strict=True):
        names = sorted({n for _, n, _ in samples if n.split(":")[0] == kind
                        or (kind == "rss" and n.startswith("worker_rss:"))
                        or (kind == "files" and n.split(":")[0] in ("log_files", "ckpt_files"))})
        for name in names:
            pts = [(t, v / scale) for t, n, v in samples if n == name]
            ax.plot([t / 60 for t, _ in pts], [v for _, v in pts], label=name.split(":", 1)[1]
                    if kind != "files" else name, linewidth=1)
        ax.axvline(0, color="grey", linestyle=":", linewidth=0.8)
        ax.axvline(warmup / 60, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(title)
        ax.legend(fontsize=6, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel("minutes since every role was at work (dashed: end of the warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float,
                    default=float(os.environ.get("SOAK_SECONDS", 1800)),
                    help="how long the clients run (default: $SOAK_SECONDS or 1800)")
    ap.add_argument("--interval", type=float, default=None,
                    help="seconds between samples (default 5; 2 in runs under 5 minutes)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before the trend is measured (default: a third of the run; "
                         "at least 600 in runs of 30 minutes or more)")
    ap.add_argument("--extend", type=float, default=None,
                    help="seconds the clients run on when a series looks like a trend at the "
                         "planned end, to tell a level reached late from a leak (default: the "
                         "measured window, --seconds minus --warmup; 0: never)")
    ap.add_argument("--no-spark", action="store_true", help="without the Spark query")
    ap.add_argument("--results", default=None,
                    help="folder for samples.csv, summary.json, soak.png and the roles' logs "
                         "(default soak-results/<UTC time>, gitignored)")
    ap.add_argument("--root", default=None, help="the store (default: a new folder in /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the store afterwards")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--role-args", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return role_main(args.role, *args.role_args)
    if args.seconds <= 0:
        ap.error(f"--seconds must be positive, not {args.seconds}")
    interval = args.interval or (2.0 if args.seconds < 300 else 5.0)
    warmup = args.warmup if args.warmup is not None else (
        max(600.0, args.seconds / 3) if args.seconds >= 1800 else args.seconds / 3)
    if not 0 <= warmup < args.seconds:
        ap.error(f"--warmup must be within the run: 0 <= {warmup} < {args.seconds}")
    if args.extend is None:
        args.extend = args.seconds - warmup
    if args.extend < 0:
        ap.error(f"--extend must be 0 or more seconds, not {args.extend}")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    results = Path(args.results or Path(__file__).parent.parent / "soak-results" / stamp)
    results.mkdir(parents=True, exist_ok=True)
    made_root = args.root is None
    scratch = tempfile.mkdtemp(prefix="dq-soak-")
    root = args.root or os.path.join(scratch, "store")
    try:
        return drive(args, root, scratch, results, interval, warmup)
    finally:
        if not args.keep:
            if made_root:
                shutil.rmtree(scratch, ignore_errors=True)
            else:
                shutil.rmtree(scratch, ignore_errors=True)
                shutil.rmtree(os.path.join(root, ADDRESS), ignore_errors=True)


def drive(args: argparse.Namespace, root: str, scratch: str, results: Path, interval: float,
          warmup: float) -> int:
    import psutil

    from pyspark_durable_queue import DurableQueue

    DurableQueue(root).address(ADDRESS, **ADDRESS_SETTINGS)
    stop = os.path.join(scratch, "stop")
    checkpoint = os.path.join(scratch, "checkpoint")
    roles = [*ROLES, *(() if args.no_spark else (SPARK_ROLE,))]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = []
    for name in roles:
        out = open(results / f"{name}.log", "wb")  # closed below
        logs.append(out)
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--role", name, "--role-args", root, stop,
             os.path.join(scratch, f"{name}.status"), checkpoint],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    handles = {name: psutil.Process(p.pid) for name, p in procs.items()}
    me = psutil.Process()
    sampler = Sampler(root, checkpoint)
    samples: list[tuple[float, str, float]] = []
    problems: list[str] = []
    launched = time.monotonic()
    ready_at: float | None = None  # since launch: when every role had done its part once
    until = args.seconds  # since ready_at; the planned end, or the extended one
    looked_like_trends: list[str] = []  # at the planned end, when the run was extended
    print(f"soak: {len(roles)} roles; once each is at work, {args.seconds:.0f} s with a sample "
          f"every {interval:.0f} s, the trend after {warmup:.0f} s; store {root}; results "
          f"{results}", flush=True)
    try:
        next_at = launched
        while True:
            t = time.monotonic() - launched
            for name, p in procs.items():
                if p.poll() is not None:
                    problems.append(f"role {name} exited with status {p.returncode} after "
                                    f"{t:.0f} s (see {results / (name + '.log')})")
            if ready_at is None:
                idle = _idle({name: _status(scratch, name) for name in roles}, first=True)
                if not idle:
                    ready_at = t
                    print(f"  every role at work after {t:.0f} s: the clock starts", flush=True)
                elif t > READY_TIMEOUT_S:
                    problems.append(f"not every role at work after {t:.0f} s: " +
                                    "; ".join(idle))
            if ready_at is not None and t - ready_at >= until and not problems \
                    and until == args.seconds and args.extend > 0:
                looked_like_trends = suspects(judge(
                    [(st - ready_at, n, v) for st, n, v in samples], warmup))
                if looked_like_trends:
                    until += args.extend
                    print(f"  {', '.join(looked_like_trends)} look like a trend at the planned "
                          f"end: running {args.extend:.0f} s more to tell a level reached late "
                          "from a leak", flush=True)
            if problems or (ready_at is not None and t - ready_at >= until):
                break
            values = {}
            for name, h in handles.items():
                values.update(_proc_series(name, h))
            values.update(_proc_series("sampler", me, children=False))
            values.update(sampler.sample())
            samples.extend((t, k, float(v)) for k, v in values.items())
            if int(t) // 60 != int(t - interval) // 60:
                rss = {k.split(":", 1)[1]: v / MiB for k, v in values.items()
                       if k.startswith("rss:")}
                print(f"  {t / 60:5.1f} min: files {values['files:address']:.0f}, rss (MiB) " +
                      ", ".join(f"{k} {v:.0f}" for k, v in rss.items()), flush=True)
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
    finally:
        Path(stop).touch()
        for name, p in procs.items():
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                problems.append(f"role {name} did not stop within 90 s of the stop file")
        for out in logs:
            out.close()
    did = {}
    for name in roles:
        did[name] = _status(scratch, name)
        if procs[name].returncode not in (0, None) and not any(name in p for p in problems):
            problems.append(f"role {name} ended with status {procs[name].returncode}")
        if did[name].get("errors"):
            problems.append(f"role {name} reported an error (see {name}.log)")
    problems += _idle(did, window_s=until)
    start = ready_at if ready_at is not None else 0.0
    verdicts = judge([(t - start, n, v) for t, n, v in samples], warmup)
    problems += [f"{name}: {v['reason']}" for name, v in verdicts.items() if v.get("failed")]
    with open(results / "samples.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "series", "value"])
        w.writerows((f"{t:.1f}", n, f"{v:.0f}") for t, n, v in samples)
    png = plot([(t - start, n, v) for t, n, v in samples], warmup, results / "soak.png")
    summary = {"seconds": args.seconds, "interval": interval, "warmup": warmup,
               "ready_after_s": ready_at, "extended_s": until - args.seconds,
               "looked_like_trends_at_the_planned_end": looked_like_trends,
               "spark": not args.no_spark, "limits": {k: vars(v) for k, v in LIMITS.items()},
               "roles": did, "series": verdicts, "problems": problems, "png": png,
               "address_settings": ADDRESS_SETTINGS}
    (results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(summary)
    return 1 if problems else 0


def _status(scratch: str, name: str) -> dict[str, int]:
    path = os.path.join(scratch, f"{name}.status")
    try:
        with open(path) as f:
            return dict(json.load(f))
    except FileNotFoundError:
        return {}


#: How long the roles may take to start and each do its part once (a JVM starting on a loaded
#: 2-core machine took 100 s).
READY_TIMEOUT_S = 600


#: Below this window a cleanup that removed no page is chance, not idleness: the 30-minute run
#: removed ~3.4 pages a minute (102 in 30 min, 2026-11-28), and a 35-s run of the suite's test
#: removed none once (CI 16:20 UTC, load ~5).
PAGES_REMOVED_AFTER_S = 120


def _idle(did: dict[str, dict[str, int]], first: bool = False,
          window_s: float = float("inf")) -> list[str]:
    """The roles that did not do their part (the run must show each client at work); ``first``:
    the part each does first (the clock starts once every role did it). ``window_s``: how long
    the roles worked after the clock started."""
    if first:
        need = {"producer": ["sent"], "senders": ["sent"], "consumer": ["acks_deferred"],
                "shared-1": ["acked"], "shared-2": ["acked"],
                # a compaction that rewrote something: its first run of that path is warm-up
                "maintenance": ["runs_compacted"],
                "spark": ["received"]}
        return [f"role {name} did no {key!r} yet" for name, counts in did.items()
                for key in need.get(name, []) if not counts.get(key)]
    need = {"producer": ["sent"], "senders": ["sent"],
            "consumer": ["received", "acks_deferred", "acks_flushed", "nacked", "redelivered"],
            "shared-1": ["received", "acked"], "shared-2": ["received", "acked"],
            "maintenance": ["cleanups", "compactions"] + (
                ["pages_removed"] if window_s >= PAGES_REMOVED_AFTER_S else []),
            "spark": ["received"]}
    return [f"role {name} did no {key!r}" for name, counts in did.items()
            for key in need.get(name, []) if not counts.get(key)]


def print_summary(summary: dict[str, Any]) -> None:
    print("\nwhat each role did:")
    for name, counts in summary["roles"].items():
        print(f"  {name:12} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"\nseries after the {summary['warmup']:.0f} s warm-up (slope per hour; max):")
    for name, v in summary["series"].items():
        kind = name.split(":", 1)[0]
        unit = LIMITS[kind].unit if kind in LIMITS else (
            "bytes" if "rss" in kind else "")
        mark = "FAIL" if v.get("failed") else ("ok" if v.get("judged") else "--")
        per_hour = _fmt(v["per_hour"], unit) if "per_hour" in v else "n/a"
        print(f"  {mark:4} {name:34} {per_hour:>16}/h  max {_fmt(v['max'], unit)}")
    if summary.get("extended_s"):
        print(f"\nran {summary['extended_s']:.0f} s longer than planned: "
              f"{', '.join(summary['looked_like_trends_at_the_planned_end'])} looked like a "
              "trend at the planned end (judged above over the whole longer window)")
    if summary["problems"]:
        print("\nFAILED:\n  " + "\n  ".join(summary["problems"]))
    else:
        print("\nno trend above its limit; every role did its part")


if __name__ == "__main__":
    sys.exit(main())
