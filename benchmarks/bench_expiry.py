"""Expiry (issue 41, target 3): ``receive`` on an address with ``expiry_delay_ms`` set, where
nothing has expired, against the same ``receive`` without expiry: within 5%.

One address of ``--messages`` messages (an int64 ``id`` and a ``--row-bytes`` body, sent in
batches of 1,000) is read by fresh consumers, alternating A (``expiry_delay_ms`` unset) and B
(``expiry_delay_ms`` = one day: every message is checked and none has expired) for ``--rounds``
rounds, with ``receive(--batch)`` and a deferred ``ack`` per call (the worker's loop). With
``--ttl``, B is instead a second address holding the same messages sent with ``ttl_ms`` = one
day (every frame stores the hidden TTL column; none has expired) and no expiry delay. Each
run's time is the whole drain; the ratio is B/A of the medians, and the per-round pairs are
printed too (the machine is noisy; pairs run back to back).

Run::

    .venv/bin/python benchmarks/bench_expiry.py [--messages 200000] [--batch 1]
        [--row-bytes 100] [--rounds 7] [--ttl] [--json out.json]

Data goes to a temporary folder that is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from pyspark_durable_queue import DurableQueue  # noqa: E402

DAY_MS = 86_400_000


def drain(root: str, name: str, expiry: int, batch: int, expected: int,
          address: str = "feed") -> float:
    """Seconds to receive and acknowledge every message with a fresh consumer ``name``."""
    a = DurableQueue(root).address(address, expiry_delay_ms=expiry)
    c = a.consumer(name, start="earliest")
    received = 0
    began = time.perf_counter()
    while True:
        got = c.receive(batch)
        if not got.num_rows:
            break
        received += got.num_rows
        c.ack(got, flush=False)
    took = time.perf_counter() - began
    if received != expected:
        raise SystemExit(f"{name} received {received:,} messages, expected {expected:,}")
    c.close()
    a.consumer(name).delete()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1, help="messages per receive")
    ap.add_argument("--row-bytes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ttl", action="store_true",
                    help="B: messages sent with ttl_ms (one day), no expiry delay")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-expiry-")
    try:
        body = pa.array([b"x" * args.row_bytes] * 1000, pa.binary())
        for name, ttl in (("feed", None), *((("feed_ttl", DAY_MS),) if args.ttl else ())):
            a = DurableQueue(root).address(name, fsync="never")
            # An idle consumer that never acknowledges keeps every page: without it the first
            # drain's acknowledgements let cleanup remove the pages and later rounds read nothing.
            a.consumer("hold", start="earliest").close()
            for first in range(0, args.messages, 1000):
                n = min(1000, args.messages - first)
                a.send(pa.table({"id": np.arange(first, first + n, dtype=np.int64),
                                 "body": body.slice(0, n)}), ttl_ms=ttl)
        times: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for which in order:
                if args.ttl:
                    address = "feed" if which == "A" else "feed_ttl"
                    times[which].append(drain(root, f"{which}{r}", -1, args.batch, args.messages,
                                             address))
                    continue
                expiry = -1 if which == "A" else DAY_MS
                times[which].append(drain(root, f"{which}{r}", expiry, args.batch, args.messages))
            b_is = "ttl_ms, none due" if args.ttl else "expiry, none due"
            print(f"round {r}: A (no expiry) {times['A'][-1]:.3f} s, B ({b_is}) "
                  f"{times['B'][-1]:.3f} s, B/A {times['B'][-1] / times['A'][-1]:.3f}",
                  flush=True)
        a_med, b_med = statistics.median(times["A"]), statistics.median(times["B"])
        ratio = b_med / a_med
        print(f"\n{args.messages:,} messages, receive({args.batch}) + deferred ack, median of "
              f"{args.rounds}: A {a_med:.3f} s ({args.messages / a_med:,.0f} msg/s), "
              f"B {b_med:.3f} s ({args.messages / b_med:,.0f} msg/s): B/A {ratio:.3f} "
              f"(target <= 1.05)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"messages": args.messages, "batch": args.batch, "ttl": args.ttl,
                           "times": times,
                           "ratio": ratio}, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
