"""Throughput against message size and against batch size (issue 17): durable sends and
acknowledged receives, each against a bare write+fdatasync loop of the same bytes measured in
the same run. ``benchmarks/run_all.py`` plots the ``--json`` output.

    .venv/bin/python benchmarks/bench_sizes.py [--quick] [--seconds 2] [--json out.json]

Two sweeps:

1. message size (100 B, 1 KiB, 10 KiB, 100 KiB) at ``--size-batch`` messages per send (100);
2. batch size (1, 10, 100, 1,000, 10,000 messages per send) at ``--batch-message-bytes``
   (1 KiB).

Each point uses a fresh address (fsync on, the default). The messages are an ``id`` and a
``body`` of random bytes; the payload counted in MB/s is the bodies' bytes. Steps:

* send: one ``Address.send`` of an Arrow table per batch, until ``--seconds`` pass or
  ``--max-bytes`` of payload were sent (at least two batches);
* receive: one consumer receives everything, a batch at a time (``max_messages`` = the batch
  size), acknowledging each batch (a durable watermark write, as a consumer that acknowledges
  what it processed does);
* baseline: the same number of batches of the same payload bytes appended to one file with an
  ``fdatasync`` after each: a single-file journal, the least a durable batch costs. A batch is
  written 1 MiB at a time, as pages write their frames: on the disks measured here one 10 MiB
  ``write`` before the sync ran at 290-470 MB/s against 880-1,100 MB/s in 1 MiB writes, which
  would have let the project beat its own baseline at large batches.

The ratios are the project's rate over the baseline's (1.00x: as fast as the bare loop).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pyspark_durable_queue import DurableQueue

KiB = 1024
SIZES = [100, KiB, 10 * KiB, 100 * KiB]
BATCHES = [1, 10, 100, 1_000, 10_000]
QUICK = {"sizes": [100, KiB, 10 * KiB], "batches": [1, 10, 100, 1_000], "seconds": 0.25,
         "max_bytes": 8 << 20}


def table(batch: int, message_bytes: int) -> pa.Table:
    """``batch`` messages: an ``id`` and a ``body`` of ``message_bytes`` random bytes each."""
    data = np.frombuffer(os.urandom(batch * message_bytes), dtype=np.uint8)
    offsets = np.arange(0, (batch + 1) * message_bytes, message_bytes, dtype=np.int32)
    body = pa.Array.from_buffers(pa.binary(), batch, [None, pa.py_buffer(offsets),
                                                       pa.py_buffer(data)])
    return pa.table({"id": pa.array(np.arange(batch, dtype=np.int64)), "body": body})


#: The baseline writes a batch this much at a time (the size of a page's frames).
WRITE_BYTES = 1 << 20


def bare(folder: str, batches: int, nbytes: int) -> float:
    """Seconds to append ``batches`` batches of ``nbytes`` to one file (``WRITE_BYTES`` per
    ``write``), ``fdatasync`` after each batch."""
    path = os.path.join(folder, "journal.bin")
    data = memoryview(os.urandom(nbytes))
    writes = [data[i:i + WRITE_BYTES] for i in range(0, nbytes, WRITE_BYTES)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t = time.perf_counter()
        for _ in range(batches):
            for chunk in writes:
                os.write(fd, chunk)
            os.fdatasync(fd)
        return time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(path)


def point(root: str, message_bytes: int, batch: int, seconds: float,
          max_bytes: int) -> dict[str, float | int]:
    """Send, receive and the baseline at one message size and batch size (see the module
    docstring)."""
    folder = os.path.join(root, f"p-{message_bytes}-{batch}")
    q = DurableQueue(folder)
    q.address("warmup").send(table(1, message_bytes))  # imports and folders are not throughput
    a = q.address("bench")
    data = table(batch, message_bytes)
    per_send = batch * message_bytes
    sends = 0
    t = time.perf_counter()
    while sends < 2 or (time.perf_counter() - t < seconds
                        and (sends + 1) * per_send <= max_bytes):
        a.send(data)
        sends += 1
    send_s = time.perf_counter() - t
    messages = sends * batch
    c = a.consumer("reader")
    got = 0
    t = time.perf_counter()
    while got < messages:
        received = c.receive(max_messages=batch)
        got += received.num_rows
        c.ack(received)
    receive_s = time.perf_counter() - t
    assert got == messages, (got, messages)
    bare_s = bare(folder, sends, per_send)
    shutil.rmtree(folder, ignore_errors=True)
    payload = messages * message_bytes
    return {"message_bytes": message_bytes, "batch": batch, "messages": messages,
            "payload_bytes": payload, "send_s": send_s, "receive_s": receive_s,
            "bare_s": bare_s,
            "send_mb_s": payload / send_s / 1e6, "send_msgs_s": messages / send_s,
            "receive_mb_s": payload / receive_s / 1e6, "receive_msgs_s": messages / receive_s,
            "bare_mb_s": payload / bare_s / 1e6, "bare_msgs_s": messages / bare_s,
            "send_ratio": bare_s / send_s, "receive_ratio": bare_s / receive_s}


def show(title: str, rows: list[dict[str, float | int]]) -> None:
    print(f"\n{title}")
    print(f"{'message':>8} {'batch':>6} {'messages':>9}  {'send MB/s':>9} {'msg/s':>9}  "
          f"{'recv MB/s':>9} {'msg/s':>9}  {'bare MB/s':>9} {'msg/s':>9}  "
          f"{'send/bare':>9} {'recv/bare':>9}")
    for r in rows:
        print(f"{_size(int(r['message_bytes'])):>8} {r['batch']:>6,} {r['messages']:>9,}  "
              f"{r['send_mb_s']:>9.1f} {r['send_msgs_s']:>9,.0f}  "
              f"{r['receive_mb_s']:>9.1f} {r['receive_msgs_s']:>9,.0f}  "
              f"{r['bare_mb_s']:>9.1f} {r['bare_msgs_s']:>9,.0f}  "
              f"{r['send_ratio']:>8.2f}x {r['receive_ratio']:>8.2f}x", flush=True)


def _size(n: int) -> str:
    return f"{n // KiB} KiB" if n >= KiB and n % KiB == 0 else f"{n} B"


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer and smaller points, a few seconds in all (make bench)")
    ap.add_argument("--sizes", type=_ints, default=None,
                    help="message sizes in bytes, comma-separated (default: 100,1024,10240,"
                         "102400)")
    ap.add_argument("--batches", type=_ints, default=None,
                    help="messages per send, comma-separated (default: 1,10,100,1000,10000)")
    ap.add_argument("--size-batch", type=int, default=100,
                    help="messages per send in the message-size sweep (default: %(default)s)")
    ap.add_argument("--batch-message-bytes", type=int, default=KiB,
                    help="message size in the batch-size sweep (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="sending time per point (default: 2; --quick: 0.25)")
    ap.add_argument("--max-bytes", type=int, default=None,
                    help="most payload bytes sent per point (default: 256 MiB; --quick: "
                         "8 MiB)")
    ap.add_argument("--root", default=None, help="where the addresses go (default: a "
                    "temporary folder on the disk of /tmp)")
    ap.add_argument("--json", default=None, help="also write the figures here as JSON")
    args = ap.parse_args(argv)
    sizes = args.sizes or (QUICK["sizes"] if args.quick else SIZES)
    batches = args.batches or (QUICK["batches"] if args.quick else BATCHES)
    seconds = args.seconds if args.seconds is not None else (
        QUICK["seconds"] if args.quick else 2.0)
    max_bytes = args.max_bytes or (QUICK["max_bytes"] if args.quick else 256 << 20)
    root = args.root or tempfile.mkdtemp(prefix="dq-bench-sizes-")
    os.makedirs(root, exist_ok=True)
    print(f"durable send + acknowledged receive against append+fdatasync of the same bytes; "
          f"up to {seconds:g} s or {max_bytes / 2**20:g} MiB of payload per point, in {root}")
    try:
        by_size = [point(root, s, args.size_batch, seconds, max_bytes) for s in sizes]
        show(f"by message size, {args.size_batch:,} messages per send", by_size)
        by_batch = [point(root, args.batch_message_bytes, b, seconds, max_bytes)
                    for b in batches]
        show(f"by batch size, messages of {_size(args.batch_message_bytes)}", by_batch)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "max_bytes": max_bytes,
                       "size_batch": args.size_batch,
                       "batch_message_bytes": args.batch_message_bytes,
                       "sizes": by_size, "batches": by_batch}, f, indent=1)


if __name__ == "__main__":
    main()
