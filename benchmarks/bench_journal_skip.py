"""What a selective consumer reads of a journal backlog it cannot (mostly) match (issue 36).

Run with ``python benchmarks/bench_journal_skip.py [--rows 2000000] [--sends 10]``. It stores
``--rows`` messages (``id`` int64, ``kind`` string, a 100-byte body) in ``--sends`` equal
sends, once in a journal address (the local disk's default) and once in an address created
with ``journal=False`` (page files), then reads each from the start with one new consumer
per selector, each in a fresh process. Bytes are the kernel's count of what the process
read (``rchar`` of ``/proc/self/io``), split into opening the address (the log's replay
after its newest checkpoint) and receiving; the ratio is to the bytes the address stores.
A full read without a selector is the baseline of the same run. (Page files are read
through ``mmap``, which ``rchar`` does not count: their full read shows as ~0; their ranged
reads of a few frames do count.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

SELECTORS = [
    ("matches nothing", "id < 0"),
    ("outside every unit's range", "id > 1000000000000"),
    ("absent value", "kind = 'rare'"),
    ("clustered 0.1% tail", "id >= {tail}"),
    ("no selector (full read)", None),
]


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no /proc/self/io")


def fill(root: str, name: str, rows: int, sends: int, journal: bool) -> int:
    import numpy as np
    import pyarrow as pa

    from pyspark_durable_queue import DurableQueue

    address = DurableQueue(root).address(name, journal=journal, fsync="never")
    address.consumer("keep", start="earliest")  # never acks: cleanup removes nothing
    per = rows // sends
    kinds = np.array(["a", "b", "c", "d", "e"])
    for k in range(sends):
        ids = np.arange(k * per, (k + 1) * per, dtype=np.int64)
        address.send(pa.table({"id": ids, "kind": pa.array(kinds[ids % 5]),
                               "body": pa.array([b"x" * 100] * per)}))
    warm = DurableQueue(root).address("warm", journal=journal, fsync="never")
    warm.send(pa.table({"id": np.arange(10, dtype=np.int64), "kind": pa.array(kinds[:2].repeat(5)),
                        "body": pa.array([b"x"] * 10)}))
    folder = os.path.join(root, name, "pages")
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def child(root: str, name: str, selector: str | None) -> None:
    """One fresh process: open, then receive everything the selector takes."""
    from pyspark_durable_queue import DurableQueue

    # warm-up on a tiny address: the modules a read imports are read from disk too
    warm = DurableQueue(root).address("warm", create=False)
    warm.consumer(f"w{os.getpid()}", selector=selector, start="earliest").receive(
        max_messages=10, timeout_ms=0)
    r0, t0 = rchar(), time.perf_counter()
    address = DurableQueue(root).address(name, create=False)
    address.state  # noqa: B018 - the replay of the log
    r1, t1 = rchar(), time.perf_counter()
    consumer = address.consumer(f"c{os.getpid()}", selector=selector, start="earliest")
    got = 0
    while True:
        batch = consumer.receive(max_messages=100_000, timeout_ms=0)
        if batch.num_rows == 0:
            break
        got += batch.num_rows
        consumer.ack(batch, flush=False)
    r2, t2 = rchar(), time.perf_counter()
    consumer.close()
    address.delete_consumer_state(consumer.name)
    print(json.dumps({"open": r1 - r0, "receive": r2 - r1, "open_s": t1 - t0,
                      "receive_s": t2 - t1, "rows": got}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--sends", type=int, default=10)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, name, selector = args.child
        child(root, name, None if selector == "-" else selector)
        return
    root = tempfile.mkdtemp(prefix="dq-skip-")
    try:
        sizes = {name: fill(root, name, args.rows, args.sends, journal)
                 for name, journal in (("journal", True), ("files", False))}
        tail = args.rows - args.rows // 1000
        print(f"{args.rows:,} rows in {args.sends} sends; stored: journal "
              f"{sizes['journal'] / 2**20:.1f} MiB, page files {sizes['files'] / 2**20:.1f} MiB")
        print(f"{'selector':<28} {'address':<8} {'rows':>9} {'open MiB':>9} "
              f"{'receive MiB':>12} {'receive/stored':>15} {'receive s':>10}")
        for label, selector in SELECTORS:
            text = selector.format(tail=tail) if selector else None
            for name in ("journal", "files"):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", root, name, text or "-"],
                    check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(f"{label:<28} {name:<8} {r['rows']:>9,} {r['open'] / 2**20:>9.1f} "
                      f"{r['receive'] / 2**20:>12.1f} {r['receive'] / sizes[name]:>14.2%} "
                      f"{r['receive_s']:>10.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
