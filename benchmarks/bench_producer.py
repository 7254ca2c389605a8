"""Producer benchmark: one thread sends N rows of ~100 bytes through ``Address.producer``;
the time runs until ``flush()`` returned, when every row is durable (fsync on). Run::

    .venv/bin/python benchmarks/bench_producer.py [--messages 500000] [--repeat 3]

Two loops: fire-and-forget (``p.send(row)``) and keeping every future in a list (the list
itself costs). The rows are built before the clock starts. Each run checks that every row was
stored (the address's message count) and, with futures kept, that the last one resolved to the
last ``_seq``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pyspark_durable_queue import DurableQueue


def run(rows: list[dict], keep: bool, **options) -> float:
    root = tempfile.mkdtemp(prefix="dq-bench-producer-")
    try:
        a = DurableQueue(root).address("bench")
        p = a.producer(**options)
        send = p.send
        started = time.perf_counter()
        if keep:
            futures = [send(r) for r in rows]
        else:
            for r in rows:
                send(r)
        p.flush()
        elapsed = time.perf_counter() - started
        p.close()
        assert a.stats()["messages"] == len(rows)
        if keep:
            assert futures[-1].result(timeout=0) == len(rows) - 1
        return elapsed
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.messages
    rows = [{"id": i, "region": "EU", "payload": f"{i:080d}"} for i in range(n)]
    run(rows[: n // 10], keep=False)  # warm-up, not counted
    for keep in (False, True):
        times = [run(rows, keep) for _ in range(args.repeat)]
        best = min(times)
        print(f"{'futures kept' if keep else 'fire and forget'}: {n} rows, best of "
              f"{args.repeat} {best:.3f} s = {n / best:,.0f} msg/s "
              f"(all: {', '.join(f'{t:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
