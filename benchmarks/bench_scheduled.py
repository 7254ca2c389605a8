"""Scheduled delivery (issue 42, target 1).

1. Cost: ``--scheduled`` messages (100,000) scheduled over the next hour, as ``--scheduled-sends``
   sends (1,000 of 100 rows; due 5 to 60 minutes ahead, so none falls due during the run), must
   leave ``receive(1)`` + deferred ``ack`` within 10% of an address without schedules. Two
   addresses with the same backlog of ``--messages`` messages (an int64 ``id`` and a
   ``--row-bytes`` body, sent in batches of 1,000), one of them also holding the schedules, are
   drained by fresh consumers, alternating A (no schedules) and B (schedules) for ``--rounds``
   rounds; the ratio is B/A of the medians (per-round pairs printed too: the machine is noisy).
2. Latency: ``--latency-messages`` single-row sends scheduled ``--min-delay-ms`` to
   ``--max-delay-ms`` ahead while a consumer waits in ``receive(1, timeout_ms=...)``; each row
   carries its due time, and the consumer notes when it got it. Two cases: the schedules are
   written by a thread of the consumer's process, and by another process (the consumer finds them
   by listing the folder while it waits). p50 / p99 / max of (received - due), in ms.

Run::

    .venv/bin/python benchmarks/bench_scheduled.py [--messages 100000] [--scheduled 100000]
        [--scheduled-sends 1000] [--rounds 5] [--latency-messages 200] [--json out.json]

Data goes to a temporary folder that is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from pyspark_durable_queue import DurableQueue  # noqa: E402

_SCHEDULER = """
import random, sys, time
sys.path.insert(0, {path!r})
from pyspark_durable_queue import DurableQueue
a = DurableQueue({root!r}).address("latency")
rng = random.Random(7)
for i in range({n}):
    delay = rng.randint({lo}, {hi})
    a.send({{"i": i, "due_ms": int(time.time() * 1000) + delay}}, delay_ms=delay)
    time.sleep(rng.uniform(0, {gap}))
"""


def drain(root: str, name: str, consumer: str) -> float:
    """Seconds to receive and acknowledge every message of ``name`` with a fresh consumer."""
    a = DurableQueue(root).address(name)
    c = a.consumer(consumer, start="earliest")
    began = time.perf_counter()
    while True:
        got = c.receive(1)
        if not got.num_rows:
            break
        c.ack(got, flush=False)
    took = time.perf_counter() - began
    c.close()
    a.consumer(consumer).delete()
    return took


def cost(root: str, args: argparse.Namespace) -> dict:
    body = pa.array([b"x" * args.row_bytes] * 1000, pa.binary())
    for name in ("plain", "scheduled"):
        a = DurableQueue(root).address(name, fsync="never")
        for first in range(0, args.messages, 1000):
            n = min(1000, args.messages - first)
            a.send(pa.table({"id": np.arange(first, first + n, dtype=np.int64),
                             "body": body.slice(0, n)}))
    a = DurableQueue(root).address("scheduled", fsync="never")
    rng = random.Random(1)
    per = args.scheduled // args.scheduled_sends
    began = time.perf_counter()
    for k in range(args.scheduled_sends):
        a.send(pa.table({"id": np.arange(k * per, (k + 1) * per, dtype=np.int64),
                         "body": body.slice(0, per)}),
               delay_ms=rng.randint(5 * 60_000, 60 * 60_000))
    scheduling = time.perf_counter() - began
    stats = a.stats()
    print(f"scheduled {stats['scheduled_messages']} messages in {stats['scheduled_sends']} "
          f"sends in {scheduling:.2f} s ({scheduling / args.scheduled_sends * 1000:.2f} ms "
          "a send)")
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for which in (("A", "B") if r % 2 == 0 else ("B", "A")):
            name = "plain" if which == "A" else "scheduled"
            times[which].append(drain(root, name, f"{which}{r}"))
        print(f"round {r}: A (no schedules) {times['A'][-1]:.3f} s, B ({args.scheduled} "
              f"scheduled) {times['B'][-1]:.3f} s, B/A {times['B'][-1] / times['A'][-1]:.3f}")
    a_med, b_med = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"median: A {a_med:.3f} s ({args.messages / a_med:,.0f} msg/s), B {b_med:.3f} s "
          f"({args.messages / b_med:,.0f} msg/s), B/A {b_med / a_med:.3f}")
    assert DurableQueue(root).address("scheduled").stats()["scheduled_messages"] == \
        args.scheduled, "a schedule fell due during the run"
    return {"A_s": times["A"], "B_s": times["B"], "ratio": b_med / a_med,
            "scheduling_s": scheduling}


def latency(root: str, args: argparse.Namespace, other_process: bool) -> dict:
    a = DurableQueue(root).address("latency")
    a.send({"i": -1, "due_ms": 0})
    consumer = a.consumer(f"waiter-{int(other_process)}", start="latest")
    lags: list[float] = []
    n = args.latency_messages
    gap = args.max_delay_ms / n / 1000  # schedules written over about the delay's span

    def schedule() -> None:
        rng = random.Random(7)
        for i in range(n):
            delay = rng.randint(args.min_delay_ms, args.max_delay_ms)
            a.send({"i": i, "due_ms": int(time.time() * 1000) + delay}, delay_ms=delay)
            time.sleep(rng.uniform(0, gap))

    if other_process:
        code = _SCHEDULER.format(path=os.path.join(HERE, ".."), root=root, n=n,
                                 lo=args.min_delay_ms, hi=args.max_delay_ms, gap=gap)
        worker: threading.Thread | subprocess.Popen = subprocess.Popen([sys.executable, "-c",
                                                                        code])
    else:
        worker = threading.Thread(target=schedule)
        worker.start()
    deadline = time.monotonic() + 120 + n * gap
    while len(lags) < n and time.monotonic() < deadline:
        got = consumer.receive(1, timeout_ms=1000)
        now = time.time() * 1000
        lags += [now - due for due in got.column("due_ms").to_pylist()] if got.num_rows else []
        if got.num_rows:
            consumer.ack(got, flush=False)
    if isinstance(worker, subprocess.Popen):
        worker.wait(60)
    else:
        worker.join()
    consumer.close()
    lags.sort()
    case = "another process" if other_process else "the consumer's process"
    out = {"received": len(lags), "p50_ms": lags[len(lags) // 2],
           "p99_ms": lags[min(len(lags) - 1, int(len(lags) * 0.99))], "max_ms": lags[-1],
           "min_ms": lags[0]}
    print(f"latency, scheduled by {case}: {len(lags)}/{n} received; after their time: "
          f"min {out['min_ms']:.1f} ms, p50 {out['p50_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms, "
          f"max {out['max_ms']:.1f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--row-bytes", type=int, default=100)
    ap.add_argument("--scheduled", type=int, default=100_000)
    ap.add_argument("--scheduled-sends", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--latency-messages", type=int, default=200)
    ap.add_argument("--min-delay-ms", type=int, default=200)
    ap.add_argument("--max-delay-ms", type=int, default=3000)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-scheduled-")
    try:
        result = {} if args.skip_cost else {"cost": cost(root, args)}
        result["latency_same_process"] = latency(root, args, other_process=False)
        result["latency_other_process"] = latency(root, args, other_process=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
