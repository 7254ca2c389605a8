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
address), ``rows-10k`` (``send`` of a 10,000-row Arrow table: ``id`` int64, ``kind`` string,
a 100-byte body).
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

SCENARIOS = ("single-1", "single-16", "rows-10k")

CHILD = r'''
import json, shutil, sys, tempfile, threading, time
import numpy as np, pyarrow as pa
from pyspark_durable_queue import DurableQueue
scenario, seconds = sys.argv[1], float(sys.argv[2])
root = tempfile.mkdtemp(dir=sys.argv[3])
address = DurableQueue(root).address("ab", fsync=sys.argv[4])
row = {"id": 1, "kind": "a", "body": b"x" * 100}
n = 10_000
ids = np.arange(n, dtype=np.int64)
table = pa.table({"id": ids, "kind": pa.array(np.array(["a", "b", "c"])[ids % 3]),
                  "body": pa.array([b"x" * 100] * n)})
threads = 16 if scenario == "single-16" else 1
count = [0] * threads
stop = time.perf_counter() + 0.5  # warm-up
def loop(k, until, payload, per):
    while time.perf_counter() < until:
        address.send(payload)
        count[k] += per
payload, per = (table, n) if scenario == "rows-10k" else ([row], 1)
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


def run(tree: str, scenario: str, seconds: float, scratch: str,
        fsync: str) -> tuple[float, float]:
    """(rows/s, CPU microseconds per row) of one run."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, "-c", CHILD, scenario, str(seconds), scratch, fsync],
                         env=env, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return float(result["rate"]), float(result["cpu_us"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--a", required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", default=".", help="checkout B (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--fsync", default="always", choices=["always", "periodic", "never"],
                    help="the addresses' fsync setting (never: the Python path alone)")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="dq-ab-")
    try:
        measure(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(args: argparse.Namespace, scratch: str) -> None:
    rates: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for scenario in args.scenarios.split(","):
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            for side in order:
                tree = args.a if side == "a" else args.b
                rate, cpu = run(tree, scenario, args.seconds, scratch, args.fsync)
                rates.setdefault((scenario, side), []).append(rate)
                cpus.setdefault((scenario, side), []).append(cpu)
                print(f"round {r + 1} {scenario:<10} {side}: {rate:>12,.0f} rows/s "
                      f"{cpu:>9.2f} us CPU/row", flush=True)
    print(f"\n{'scenario':<10} {'A median':>12} {'B median':>12} {'B / A':>7}  (rows/s)"
          f"   {'A CPU':>9} {'B CPU':>9} {'B / A':>7}  (us/row)")
    for scenario in args.scenarios.split(","):
        a = statistics.median(rates[(scenario, "a")])
        b = statistics.median(rates[(scenario, "b")])
        ca = statistics.median(cpus[(scenario, "a")])
        cb = statistics.median(cpus[(scenario, "b")])
        print(f"{scenario:<10} {a:>12,.0f} {b:>12,.0f} {b / a:>7.3f}"
              f"   {ca:>9.2f} {cb:>9.2f} {cb / ca:>7.3f}")


if __name__ == "__main__":
    main()
