"""Small pages: what many small commits leave behind, and what it costs readers (issue 28).

Every commit writes at least one page file, so single sends, short-lived producers and Spark
streams with short triggers leave many small pages. This measures, in one run, against the
same messages sent as one batch (the baseline):

* ``fresh``: ``--fresh`` sends of one message, each from a fresh ``DurableQueue(root).address()``
  (a short-lived producer): page files left, and a consumer's drain time from ``earliest``;
* ``small``: ``--messages`` messages in commits of ``--commit-rows``: page files, bytes on
  disk, and the drain rate of ``receive(10_000)`` + ``ack`` (compaction's target is >= 0.5x the
  one-batch rate).

Run::

    .venv/bin/python benchmarks/bench_small_pages.py [--fresh 600] [--messages 100000]
        [--commit-rows 10] [--root DIR] [--journal | --no-journal]

Addresses get the default layout (the local journal on local disks: commits appended to
journal segments rolled at ``pageSizeBytes``; page files counted are then segments);
``--no-journal`` creates them with a file per commit (``journal=False``).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pyspark_durable_queue import DurableQueue

BODY = "x" * 90


def rows(first: int, n: int) -> list[dict]:
    return [{"id": i, "body": BODY} for i in range(first, first + n)]


def folder_stats(address) -> tuple[int, int]:
    pages = [e for e in os.scandir(address.pages_folder) if e.name.endswith((".page", ".dqj"))]
    return len(pages), sum(e.stat().st_size for e in pages)


def drain(address, name: str) -> tuple[int, float]:
    consumer = address.consumer(name, start="earliest")
    started = time.perf_counter()
    count = 0
    while True:
        batch = consumer.receive(10_000)
        if batch.num_rows == 0:
            break
        count += batch.num_rows
        consumer.ack(batch)
    return count, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fresh", type=int, default=600)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--commit-rows", type=int, default=10)
    ap.add_argument("--root", default=None)
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--journal", dest="journal", action="store_true", default=None,
                      help="addresses with journal=True (the default on local disks)")
    kind.add_argument("--no-journal", dest="journal", action="store_false",
                      help="addresses with a file per commit (journal=False)")
    args = ap.parse_args()
    settings = {} if args.journal is None else {"journal": args.journal}
    root = args.root or tempfile.mkdtemp(prefix="dq-small-pages-", dir="/tmp")
    try:
        # -- fresh handles, one message each
        started = time.perf_counter()
        for i in range(args.fresh):
            DurableQueue(root).address("fresh", **settings).send(rows(i, 1))
        send_s = time.perf_counter() - started
        fresh = DurableQueue(root).address("fresh", **settings)
        pages, nbytes = folder_stats(fresh)
        got, fresh_drain = drain(fresh, "reader")
        one = DurableQueue(root).address("fresh-batch", **settings)
        one.send(rows(0, args.fresh))
        one_pages, one_bytes = folder_stats(one)
        _, one_drain = drain(one, "reader")
        page_size = fresh.settings.page_size_bytes
        print(f"{args.fresh} single sends from fresh handles ({args.fresh / send_s:,.0f}/s): "
              f"{pages} page files, {nbytes:,} bytes (as one batch: {one_pages} page, "
              f"{one_bytes:,} bytes); compaction's target: at most "
              f"{math.ceil(nbytes / page_size) + 4} files")
        print(f"  drain from earliest: {got} messages in {fresh_drain * 1e3:.1f} ms vs "
              f"{one_drain * 1e3:.1f} ms as one batch ({one_drain / fresh_drain:.3f}x the "
              "one-batch rate)")

        # -- many small commits vs one batch
        small = DurableQueue(root).address("small", **settings)
        step = args.commit_rows
        started = time.perf_counter()
        for first in range(0, args.messages, step):
            small.send(rows(first, min(step, args.messages - first)))
        send_s = time.perf_counter() - started
        pages, nbytes = folder_stats(small)
        got, small_drain = drain(small, "reader")
        batch = DurableQueue(root).address("batch", **settings)
        batch.send(rows(0, args.messages))
        b_pages, b_bytes = folder_stats(batch)
        b_got, batch_drain = drain(batch, "reader")
        assert got == b_got == args.messages, (got, b_got)
        print(f"{args.messages:,} messages in commits of {step} ({args.messages / send_s:,.0f} "
              f"msg/s to send): {pages:,} page files, {nbytes:,} bytes; as one batch: "
              f"{b_pages} page files, {b_bytes:,} bytes")
        print(f"  drain with receive(10_000) + ack: {args.messages / small_drain:,.0f} msg/s vs "
              f"{args.messages / batch_drain:,.0f} msg/s as one batch: "
              f"{batch_drain / small_drain:.3f}x (compaction's target >= 0.5x)")
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
