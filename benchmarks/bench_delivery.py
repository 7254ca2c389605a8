"""Delivery: the consumer's window, nack and redelivery (issue 39's targets), in one run.

Run::

    .venv/bin/python benchmarks/bench_delivery.py [--quick] [--baseline main] [--rounds 5]
        [--seconds 3] [--scenarios ab,nack-delay,open]

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
SCENARIOS = ("ab", "nack-delay", "open")

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
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.nacks, args.opens = 2, 1.0, 10, 5
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    sys.path.insert(0, HERE)
    scratch = tempfile.mkdtemp(prefix="dq-delivery-")
    try:
        for name, fn in (("ab", ab), ("nack-delay", nack_delay), ("open", open_time)):
            if name in args.scenarios.split(","):
                fn(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
