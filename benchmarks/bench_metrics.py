"""Prometheus scrapes (issue 41, target 2): a steady-state scrape of a root with 100 addresses x
10 consumers under 1 s, and with a 10x larger backlog within 1.1x of that.

Two roots are built with the same shape: ``--addresses`` addresses, each with ``--consumers``
consumers and a backlog of ``--sends`` sends of ``--rows`` rows (an int64 ``id`` and a
``--row-bytes`` body); the second root's backlog is ``--factor`` (10) times larger. Consumer
``j`` of an address stands at ``j/consumers`` of its backlog plus 37, inside a send and inside a
page (so every oldest-message lookup is one inside an index row, not at its start), and one
consumer has nacked rows (its delivery window is read too). Addresses use the local journal (the
default on a local disk) with ``--page-size`` pages: 64 KiB by default, so that the larger
backlog has about ten times the index rows too (with 10 MiB pages both fit in one segment).

Each root has its own collector (``DurableQueueCollector``, as ``durablequeue ROOT metrics``
and ``register_collector`` use it) in a ``CollectorRegistry``; a scrape is
``generate_latest(registry)``: reading every address's ``stats()`` and writing the text
exposition. The first scrape of each root (opening every address, listing journal units) is
reported apart; then ``--scrapes`` steady-state scrapes of each, alternating A (the backlog)
and B (the larger backlog) so that the machine's load falls on both alike; medians and the
B/A ratio are reported, of wall-clock time and of the process's CPU time (which the load of
other processes on a shared machine inflates much less). Consumers do not move between scrapes
(idle consumers, the case alerts are about).

Run::

    .venv/bin/python benchmarks/bench_metrics.py [--addresses 100] [--consumers 10]
        [--sends 20] [--rows 100] [--row-bytes 100] [--factor 10] [--page-size 64KiB]
        [--scrapes 10] [--profile] [--json out.json] [--root DIR]

Data goes to a temporary folder that is deleted at the end (about 25 MB and 250 MB with the
defaults).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pyspark_durable_queue import DurableQueue  # noqa: E402
from pyspark_durable_queue._options import _to_int  # noqa: E402
from pyspark_durable_queue.metrics import register_collector  # noqa: E402


def build(root: str, sends: int, args: argparse.Namespace) -> int:
    """The store: every address, its backlog and its consumers; its messages per address."""
    q = DurableQueue(root)
    body = pa.array([b"x" * args.row_bytes] * args.rows)
    ids = np.arange(args.rows, dtype=np.int64)
    total = sends * args.rows
    for i in range(args.addresses):
        a = q.address(f"address-{i:03d}", page_size_bytes=args.page_size, fsync="never")
        for k in range(sends):
            a.send(pa.table({"id": ids + k * args.rows, "body": body}))
        for j in range(args.consumers):
            c = a.consumer(f"consumer-{j:02d}", start=j * total // args.consumers + 37)
            if j == 1:  # a delivery window with rows waiting for redelivery
                batch = c.receive(10)
                c.nack(batch.slice(0, 3), delay_ms=3_600_000)
                c.ack(batch)
                c.close()
    return total


def scrape(registry: CollectorRegistry) -> tuple[float, float, bytes]:
    """One scrape: its wall-clock seconds, the CPU seconds of this process, the text."""
    t0, c0 = time.perf_counter(), time.process_time()
    text = generate_latest(registry)
    return time.perf_counter() - t0, time.process_time() - c0, text


def check(text: bytes, args: argparse.Namespace, messages: int) -> None:
    """The scrape says what was built: every address up, every consumer, every message."""
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    up = [s.value for s in families["durablequeue_address_up"].samples]
    assert up == [1.0] * args.addresses, up
    backlog = families["durablequeue_consumer_backlog_messages"].samples
    assert len(backlog) == args.addresses * args.consumers
    sent = families["durablequeue_messages_sent"].samples
    assert all(s.value == messages for s in sent), sent[:3]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--addresses", type=int, default=100)
    p.add_argument("--consumers", type=int, default=10)
    p.add_argument("--sends", type=int, default=20, help="sends per address in A")
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--row-bytes", type=int, default=100)
    p.add_argument("--factor", type=int, default=10, help="B's backlog over A's")
    p.add_argument("--page-size", default="64KiB")
    p.add_argument("--scrapes", type=int, default=10, help="steady-state scrapes of each")
    p.add_argument("--profile", action="store_true",
                   help="print cProfile's top functions of B's steady-state scrapes")
    p.add_argument("--json")
    p.add_argument("--root", default=None, help="folder for the data (default: a temp dir)")
    args = p.parse_args(argv)
    args.page_size = _to_int(args.page_size)
    top = tempfile.mkdtemp(prefix="bench-metrics-", dir=args.root)
    try:
        t0 = time.perf_counter()
        roots = {"A": os.path.join(top, "a"), "B": os.path.join(top, "b")}
        messages = {"A": build(roots["A"], args.sends, args),
                    "B": build(roots["B"], args.sends * args.factor, args)}
        print(f"built {args.addresses} addresses x {args.consumers} consumers, backlogs of "
              f"{messages['A']} (A) and {messages['B']} (B) messages per address, in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        registries = {}
        first = {}
        for which, root in roots.items():
            registries[which] = CollectorRegistry()
            register_collector(root, registries[which])
            first[which], _, text = scrape(registries[which])
            check(text, args, messages[which])
        print(f"first scrape: A {first['A']:.3f} s, B {first['B']:.3f} s", flush=True)
        times: dict[str, list[float]] = {"A": [], "B": []}
        cpu: dict[str, list[float]] = {"A": [], "B": []}
        profile = cProfile.Profile() if args.profile else None
        for r in range(args.scrapes):
            for which in (("A", "B") if r % 2 == 0 else ("B", "A")):
                if profile is not None and which == "B":
                    profile.enable()
                took, used, text = scrape(registries[which])
                if profile is not None and which == "B":
                    profile.disable()
                times[which].append(took)
                cpu[which].append(used)
        check(text, args, messages[which])
        if profile is not None:
            pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    ca, cb = statistics.median(cpu["A"]), statistics.median(cpu["B"])
    summary: dict[str, Any] = {
        "addresses": args.addresses, "consumers": args.consumers,
        "backlog_messages_per_address": messages, "page_size_bytes": args.page_size,
        "first_scrape_seconds": first, "steady_scrape_seconds_median": {"A": a, "B": b},
        "steady_scrape_cpu_seconds_median": {"A": ca, "B": cb},
        "ratio_B_A": b / a, "cpu_ratio_B_A": cb / ca, "under_1s": b < 1 and a < 1,
        "within_1_1x": b / a <= 1.1, "load_average": os.getloadavg(),
        "scrapes": times, "cpu": cpu,
    }
    print(f"steady-state scrape (median of {args.scrapes}): A {a * 1000:.1f} ms, B (backlog "
          f"x{args.factor}) {b * 1000:.1f} ms, B/A {b / a:.3f}; CPU A {ca * 1000:.1f} ms, "
          f"B {cb * 1000:.1f} ms, B/A {cb / ca:.3f} (targets: under 1 s: {summary['under_1s']}; "
          f"B/A <= 1.1: {summary['within_1_1x']}); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
