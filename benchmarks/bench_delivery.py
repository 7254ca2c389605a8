"""Delivery: the consumer's window, nack and redelivery (issue 39's targets), in one run.

Run::

    .venv/bin/python benchmarks/bench_delivery.py [--quick] [--baseline main] [--rounds 5]
        [--seconds 3] [--scenarios ab,nack-delay,open,shared] [--shared-repeat 3]

Scenarios:

``ab``
    ``receive(1)`` + flushing ``ack`` per message, in alternating runs (each a fresh process on
    a fresh address on the local disk, fsync on) of the baseline's package (``--baseline``, a
    git ref exported with ``git archive`` into a scratch folder: "today's" code) and of this
    checkout's: ``A`` the baseline with no nacks; ``B-window`` this checkout with 1% of the
    rows nacked once (``nack(delay_ms=0)``: delivered again at the next receive, then
    acknowledged); ``B-plain`` this checkout with no nacks (the fast path). Rates count
    messages settled per second; ratios are of medians (issue 39's target 1: ``B-window / A``
    >= 0.8).
``nack-delay``
    ``nack(delay_ms=500)`` of a message while a ``receive(1, timeout_ms=...)`` waits for it: the
    time from the nack to the redelivery, p50 / p99 / max over ``--nacks`` nacks (target 2:
    >= 500 ms, p99 <= 600 ms).
``open``
    Opening a consumer (``address.consumer(name)``) whose window holds ``--window`` rows
    waiting for redelivery, against one with none, alternating, median of ``--opens`` each
    (target 3: <= 2x).
``shared``
    Shared consumers (issue 40's targets 1-3), each a ratio of two sides measured one after
    the other in the same run, ``--shared-repeat`` times (the spread and the load average are
    printed). Every side's workers are processes (persist-queue: threads) started, opened and
    warmed up (a few messages each) before the clock starts; the messages are sent before they
    start; each worker counts what it settles in ``--shared-seconds``:

    1. ``shared-ack``: 4 processes on one shared consumer, each ``receive(1)`` + flushing
       ``ack``, no work, against ``sqlite3``: 4 processes on one SQLite work queue (WAL,
       ``synchronous=FULL``; a claim is one ``BEGIN IMMEDIATE`` transaction marking the oldest
       ready row taken, an ack one deleting it); persist-queue's ``SQLiteAckQueue``
       (``get`` + ``ack``, 4 threads of one process, its JSON serializer) beside them, when
       importable (target: shared-ack >= 1.0x sqlite3);
    2. ``shared-io``: the same with a 2 ms sleep per message, 4 processes against 1 (>= 3x);
    3. ``shared-defer``: ``receive(1)`` + ``ack(flush=False)``, 4 processes on one shared
       consumer against one process of one exclusive consumer doing the same (>= 0.25x).

Scratch data goes to a temporary folder that is deleted at the end.
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
import time

HERE = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCENARIOS = ("ab", "nack-delay", "open", "shared")

CHILD = r'''
import json, shutil, sys, tempfile, time
from pyspark_durable_queue import DurableQueue
mode, seconds, scratch, backlog = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
root = tempfile.mkdtemp(dir=scratch)
address = DurableQueue(root).address("ab")
for first in range(0, backlog, 10_000):
    address.send([{"id": i, "body": "x" * 90} for i in range(first, min(backlog, first + 10_000))])
consumer = address.consumer("w")
nacked = set()
def step():
    t = consumer.receive(1)
    if not t.num_rows:
        return None
    seq = t.column("_seq")[0].as_py()
    if mode == "window" and seq % 100 == 0 and seq not in nacked:
        nacked.add(seq)
        consumer.nack(t, delay_ms=0)
        return 0
    consumer.ack(t)
    return 1
until = time.perf_counter() + 0.3  # warm-up
while time.perf_counter() < until and step() is not None:
    pass
settled = 0
start = time.perf_counter()
until = start + seconds
while time.perf_counter() < until:
    done = step()
    if done is None:
        raise SystemExit("the backlog ran out: raise --backlog")
    settled += done
rate = settled / (time.perf_counter() - start)
consumer.close()
shutil.rmtree(root)
print(json.dumps({"rate": rate}))
'''


def export_baseline(ref: str, scratch: str) -> str:
    """The package as of git ``ref``, in a folder of ``scratch`` (``git archive``: this
    checkout's git state is not touched)."""
    tree = os.path.join(scratch, "baseline")
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", HERE, "archive", ref, "pyspark_durable_queue"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def run_child(tree: str, mode: str, seconds: float, scratch: str, backlog: int) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(seconds), scratch,
                          str(backlog)], env=env, check=True, capture_output=True,
                         text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["rate"])


def ab(args: argparse.Namespace, scratch: str) -> None:
    baseline = export_baseline(args.baseline, scratch)
    sides = {"A": (baseline, "plain"), "B-window": (HERE, "window"), "B-plain": (HERE, "plain")}
    rates: dict[str, list[float]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for side in order:
            tree, mode = sides[side]
            rate = run_child(tree, mode, args.seconds, scratch, args.backlog)
            rates[side].append(rate)
            print(f"round {r + 1} {side:<9} {rate:>10,.0f} settled/s", flush=True)
    a = statistics.median(rates["A"])
    print(f"\nreceive(1) + flushing ack, medians of {args.rounds} alternating runs "
          f"(A = {args.baseline}):")
    for side in names:
        m = statistics.median(rates[side])
        paired = statistics.median(x / y for x, y in zip(rates[side], rates["A"], strict=True))
        print(f"  {side:<9} {m:>10,.0f} settled/s  {m / a:>6.3f} x A  (median of the "
              f"rounds' own ratios: {paired:.3f})")


def nack_delay(args: argparse.Namespace, scratch: str) -> None:
    from pyspark_durable_queue import DurableQueue

    root = tempfile.mkdtemp(dir=scratch)
    address = DurableQueue(root).address("delay")
    consumer = address.consumer("w")
    waits = []
    for i in range(args.nacks):
        address.send([{"id": i}])  # the only message: the receive below waits for it
        t = consumer.receive(1)
        began = time.perf_counter()
        consumer.nack(t, delay_ms=500)
        again = consumer.receive(1, timeout_ms=5000)
        waits.append((time.perf_counter() - began) * 1000)
        assert again.column("_seq").to_pylist() == t.column("_seq").to_pylist()
        consumer.ack(again)
    waits.sort()
    p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
    print(f"\nnack(delay_ms=500) -> redelivered to a waiting receive, {len(waits)} nacks: "
          f"min {waits[0]:.1f} ms, p50 {statistics.median(waits):.1f} ms, p99 {p99:.1f} ms, "
          f"max {waits[-1]:.1f} ms")


def open_time(args: argparse.Namespace, scratch: str) -> None:
    from pyspark_durable_queue import DurableQueue

    root = tempfile.mkdtemp(dir=scratch)
    address = DurableQueue(root).address("open")
    address.send([{"id": i} for i in range(args.window)])
    full = address.consumer("full")
    full.nack(full.receive(args.window), delay_ms=3_600_000)
    empty = address.consumer("empty")
    empty.ack(empty.receive(args.window))
    full.close()
    empty.close()
    times: dict[str, list[float]] = {"empty": [], "full": []}
    for r in range(args.opens):
        for name in (("empty", "full") if r % 2 == 0 else ("full", "empty")):
            q = DurableQueue(root).address("open")  # a fresh handle: nothing cached
            began = time.perf_counter()
            c = q.consumer(name)
            times[name].append((time.perf_counter() - began) * 1000)
            c.close()
    e, f = statistics.median(times["empty"]), statistics.median(times["full"])
    print(f"\nopening a consumer, median of {args.opens}: no window {e:.2f} ms, "
          f"{args.window:,} rows waiting {f:.2f} ms ({f / e:.2f} x)")


# -- shared consumers (issue 40) -------------------------------------------------------------
WORKER = r"""
import json, os, sys, threading, time
kind, root, pause, warm, threads = (sys.argv[1], sys.argv[2], float(sys.argv[3]) / 1000,
                                    int(sys.argv[4]), int(sys.argv[5]))
ran_out = "the backlog ran out: raise --shared-backlog"

def ours(kind):
    from pyspark_durable_queue import DurableQueue
    address = DurableQueue(root).address("q")
    if kind == "exclusive-defer":
        consumer = address.consumer("one")
    else:
        consumer = address.consumer("pool", shared=True)
    flush = kind == "shared"
    def step():
        t = consumer.receive(1)
        if not t.num_rows:
            raise SystemExit(ran_out)
        if pause:
            time.sleep(pause)  # the work: simulated I/O
        consumer.ack(t, flush=flush)
    return step, consumer.close

def sqlite_queue():
    import sqlite3
    db = sqlite3.connect(os.path.join(root, "queue.db"), isolation_level=None, timeout=60)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    def step():
        db.execute("BEGIN IMMEDIATE")  # claim: the oldest ready row, marked taken
        row = db.execute("SELECT id, body FROM jobs WHERE taken = 0 ORDER BY id LIMIT 1"
                         ).fetchone()
        if row is None:
            db.execute("ROLLBACK")
            raise SystemExit(ran_out)
        db.execute("UPDATE jobs SET taken = 1 WHERE id = ?", (row[0],))
        db.execute("COMMIT")
        if pause:
            time.sleep(pause)
        db.execute("BEGIN IMMEDIATE")  # ack: the row deleted
        db.execute("DELETE FROM jobs WHERE id = ?", (row[0],))
        db.execute("COMMIT")
    return step, db.close

def persist_queue():
    import persistqueue
    from persistqueue.serializers import json as pq_json
    q = persistqueue.SQLiteAckQueue(os.path.join(root, "pq"), multithreading=True,
                                    serializer=pq_json, auto_resume=False)
    def step():
        try:
            item = q.get(block=False, raw=True)
        except persistqueue.Empty:
            raise SystemExit(ran_out) from None
        if pause:
            time.sleep(pause)
        q.ack(item)
    return step, q.close

if kind == "sqlite":
    step, close = sqlite_queue()
elif kind == "persistqueue":
    step, close = persist_queue()
else:
    step, close = ours(kind)
for _ in range(warm * threads):
    step()
print("ready", flush=True)
stop = float(sys.stdin.readline().split()[1])
counts = [0] * threads
failed = []

def loop(i):
    try:
        n = 0
        while time.time() < stop:
            step()
            n += 1
        counts[i] = n
    except BaseException as exc:
        failed.append(exc)

start = time.time()
if threads == 1:
    loop(0)
else:
    pool = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
elapsed = time.time() - start
if failed:
    raise failed[0]
close()
print(json.dumps({"count": sum(counts), "seconds": elapsed}), flush=True)
"""


def prefill(kind: str, root: str, messages: int) -> None:
    """Send ``messages`` rows of 100 bytes to the side's queue before its workers start."""
    if kind == "sqlite":
        import sqlite3

        db = sqlite3.connect(os.path.join(root, "queue.db"), isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, body TEXT NOT NULL, "
                   "taken INTEGER NOT NULL DEFAULT 0)")
        db.execute("BEGIN")
        db.executemany("INSERT INTO jobs (body) VALUES (?)",
                       ((f"{i:010d}" + "x" * 90,) for i in range(messages)))
        db.execute("COMMIT")
        db.close()
    elif kind == "persistqueue":
        import persistqueue  # type: ignore[import-not-found]
        from persistqueue.serializers import json as pq_json

        q = persistqueue.SQLiteAckQueue(os.path.join(root, "pq"), serializer=pq_json)
        q._putter.execute("PRAGMA synchronous=OFF")  # the fill only: the workers' are FULL
        for i in range(messages):
            q.put({"id": i, "body": "x" * 90})
        q.close()
    else:
        from pyspark_durable_queue import DurableQueue

        address = DurableQueue(root).address("q")
        if kind != "exclusive-defer":
            address.consumer("pool", shared=True).close()
        for first in range(0, messages, 10_000):
            address.send([{"id": i, "body": "x" * 90}
                          for i in range(first, min(messages, first + 10_000))])


def run_side(kind: str, workers: int, io_ms: float, args: argparse.Namespace, scratch: str,
             *, threads: int = 1, messages: int) -> float:
    """Messages settled per second by ``workers`` processes (of ``threads`` threads) of
    ``kind`` together, counted from a common start once every one is warm."""
    root = tempfile.mkdtemp(dir=scratch)
    try:
        prefill(kind, root, messages)
        env = dict(os.environ, PYTHONPATH=HERE)
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, kind, root, str(io_ms),
                                   str(args.shared_warm), str(threads)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
                 for _ in range(workers)]
        try:
            for p in procs:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a {kind} worker failed: {p.communicate()[1]}")
            stop = time.time() + args.shared_seconds
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(f"go {stop!r}\n")
                p.stdin.flush()
            rate = 0.0
            for p in procs:
                out, err = p.communicate()
                if p.returncode:
                    raise RuntimeError(f"a {kind} worker failed: {err}")
                done = json.loads(out.strip().splitlines()[-1])
                rate += done["count"] / done["seconds"]
            return rate
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def shared(args: argparse.Namespace, scratch: str) -> None:
    try:
        import persistqueue  # type: ignore[import-not-found]  # noqa: F401
        have_pq = True
    except ImportError:
        have_pq = False
    flushing = args.shared_backlog
    # an exclusive consumer's receive(1) + deferred ack runs at up to ~200,000/s on a quiet
    # machine: a side that runs out of messages fails rather than measure the wait
    deferred = args.shared_defer_backlog or int(250_000 * args.shared_seconds) + 10_000
    # (name, kind, processes, io ms, threads, messages)
    sides = [("shared-ack 4p", "shared", 4, 0, 1, flushing),
             ("sqlite3 4p", "sqlite", 4, 0, 1, flushing),
             ("persist-queue 4t", "persistqueue", 1, 0, 4, flushing),
             ("shared-io 4p", "shared", 4, 2, 1, flushing),
             ("shared-io 1p", "shared", 1, 2, 1, flushing),
             ("shared-defer 4p", "shared-defer", 4, 0, 1, deferred),
             ("exclusive-defer 1p", "exclusive-defer", 1, 0, 1, deferred)]
    if not have_pq:
        sides = [s for s in sides if s[1] != "persistqueue"]
    targets = [("1: shared-ack 4p / sqlite3 4p", "shared-ack 4p", "sqlite3 4p", 1.0),
               ("   persist-queue 4t / sqlite3 4p", "persist-queue 4t", "sqlite3 4p", None),
               ("2: shared-io 4p / shared-io 1p", "shared-io 4p", "shared-io 1p", 3.0),
               ("3: shared-defer 4p / exclusive-defer 1p", "shared-defer 4p",
                "exclusive-defer 1p", 0.25)]
    rates: dict[str, list[float]] = {s[0]: [] for s in sides}
    loads = [os.getloadavg()[0]]
    print(f"\nshared consumers: {args.shared_seconds:g} s per side, {args.shared_repeat} "
          f"round(s), load average {loads[0]:.2f} at the start"
          + ("" if have_pq else "; persist-queue: not installed"), flush=True)
    for r in range(args.shared_repeat):
        for name, kind, workers, io_ms, threads, messages in (sides if r % 2 == 0
                                                              else sides[::-1]):
            rate = run_side(kind, workers, io_ms, args, scratch, threads=threads,
                            messages=messages)
            rates[name].append(rate)
            print(f"round {r + 1} {name:<19} {rate:>10,.0f} settled/s", flush=True)
        loads.append(os.getloadavg()[0])
    print(f"\nshared consumers, ratios per round (load average {min(loads):.2f}-"
          f"{max(loads):.2f} over the rounds):")
    for label, top, bottom, goal in targets:
        if top not in rates or bottom not in rates:
            continue
        ratios = [a / b for a, b in zip(rates[top], rates[bottom], strict=True)]
        spread = " ".join(f"{x:.2f}" for x in ratios)
        verdict = "" if goal is None else (
            f"  target >= {goal:g}x: {'met' if statistics.median(ratios) >= goal else 'MISSED'}")
        print(f"  {label:<40} median {statistics.median(ratios):.2f}x  (rounds: {spread})"
              f"{verdict}")
    for name, values in rates.items():
        print(f"  {name:<19} median {statistics.median(values):>10,.0f} settled/s  (min "
              f"{min(values):,.0f}, max {max(values):,.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    ap.add_argument("--baseline", default="main", help="git ref of today's code (A)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--backlog", type=int, default=50_000)
    ap.add_argument("--nacks", type=int, default=40)
    ap.add_argument("--window", type=int, default=10_000)
    ap.add_argument("--opens", type=int, default=21)
    ap.add_argument("--shared-seconds", type=float, default=3.0,
                    help="shared: how long each side is timed")
    ap.add_argument("--shared-repeat", type=int, default=3, help="shared: rounds")
    ap.add_argument("--shared-backlog", type=int, default=20_000,
                    help="shared: messages sent before a flushing side starts")
    ap.add_argument("--shared-defer-backlog", type=int, default=0,
                    help="shared: messages sent before a side with deferred acks starts "
                         "(default 250,000 per timed second)")
    ap.add_argument("--shared-warm", type=int, default=20,
                    help="shared: messages each worker settles before the clock starts")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.nacks, args.opens = 2, 1.0, 10, 5
        args.shared_seconds, args.shared_repeat = 1.0, 1
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    sys.path.insert(0, HERE)
    scratch = tempfile.mkdtemp(prefix="dq-delivery-")
    try:
        for name, fn in (("ab", ab), ("nack-delay", nack_delay), ("open", open_time),
                         ("shared", shared)):
            if name in args.scenarios.split(","):
                fn(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
