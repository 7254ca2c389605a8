"""Selector evaluation throughput on 10M rows.

Run with ``python benchmarks/bench_selector.py [--rows N] [--chunk-rows N]``. For each selector
it prints rows/s of :meth:`Selector.mask` (the consumer's per-batch path) and the ratio to a
baseline measured in the same run: a raw ``pc.greater(amount, 500)`` on the same data. Each
figure is the best of several repetitions, first with ``pa.set_cpu_count(1)`` (the one-core
figure the target of 50M rows/s refers to) and then with Arrow's default thread count.
Page-skipping (``may_match``) cost is reported per call. Last, a consumer's ``receive`` of a
whole backlog (``--receive-messages``, default 2M) with a 0.1% selector, scattered and clustered,
against a full scan without a selector, in the same run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pyspark_durable_queue._format.stats import batch_stats
from pyspark_durable_queue.selector import Selector

SELECTORS = [
    ("simple comparison", "amount > 500"),
    ("string equality", "color = 'red'"),
    ("AND/OR/LIKE combo", "amount > 500 AND (color = 'red' OR name LIKE 'user-1%') AND NOT flag"),
    ("BETWEEN/IN", "amount BETWEEN 100 AND 200 OR color IN ('blue', 'green')"),
    ("arithmetic", "amount * 2.5 + price > 1000"),
]


def make_table(rows: int, chunk_rows: int) -> pa.Table:
    rng = np.random.default_rng(42)
    colors = np.array(["red", "blue", "green", "yellow", "black"])
    chunks = []
    for start in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - start)
        chunks.append(
            pa.record_batch(
                {
                    "amount": pa.array(rng.integers(0, 1000, n)),
                    "price": pa.array(rng.random(n) * 100),
                    "color": pa.array(colors[rng.integers(0, len(colors), n)]),
                    "name": pa.array(np.char.add("user-", rng.integers(0, 100_000, n).astype(str))),
                    "flag": pa.array(rng.random(n) < 0.5),
                }
            )
        )
    return pa.Table.from_batches(chunks)


def best_of(fn, repeat: int) -> float:
    fn()  # warm-up: compile caches, allocator
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(table: pa.Table, repeat: int, label: str) -> None:
    rows = table.num_rows
    amount = table.column("amount")
    base = best_of(lambda: pc.greater(amount, 500), repeat)
    print(f"\n[{label}] Arrow threads: {pa.cpu_count()}")
    print(f"  {'baseline pc.greater(amount, 500)':42s} {rows / base / 1e6:9.1f} M rows/s")
    for name, text in SELECTORS:
        sel = Selector(text)
        t = best_of(lambda sel=sel: sel.mask(table), repeat)
        selected = pc.sum(sel.mask(table)).as_py() or 0
        print(
            f"  {name:42s} {rows / t / 1e6:9.1f} M rows/s  "
            f"{t / base:5.2f}x baseline time  ({selected / rows:.1%} selected)"
        )
    sel = Selector(SELECTORS[0][1])
    expr = sel.expression(table.schema)
    t = best_of(lambda: table.filter(expr), repeat)
    print(f"  {'Table.filter(expression) simple':42s} {rows / t / 1e6:9.1f} M rows/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--chunk-rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--receive-messages", type=int, default=2_000_000)
    args = parser.parse_args()

    table = make_table(args.rows, args.chunk_rows)
    print(
        f"{table.num_rows:,} rows in {table.column('amount').num_chunks} chunks, "
        f"{table.nbytes / 1e6:.0f} MB"
    )
    default_threads = pa.cpu_count()
    pa.set_cpu_count(1)
    run(table, args.repeat, "one core")
    pa.set_cpu_count(default_threads)
    run(table, args.repeat, "default")

    page = table.slice(0, 100_000)
    stats = batch_stats(page)
    start = time.perf_counter()
    n = 0
    for _, text in SELECTORS:
        sel = Selector(text)
        for _ in range(200):
            sel.may_match(stats)
            n += 1
    per_call = (time.perf_counter() - start) / n
    skip = Selector("color = 'purple' OR amount > 5000")
    print(
        f"\nmay_match: {per_call * 1e6:.1f} us per page check; "
        f"'{skip.text}' may match a page: {skip.may_match(stats)}"
    )
    receive_benchmark(args.receive_messages, args.repeat)


def receive_benchmark(n: int, repeat: int) -> None:
    """Consumer receive of a whole backlog: a 0.1% selector against a full scan (no selector),
    in the same run, with matches scattered over every page and clustered in one."""
    import shutil
    import tempfile

    import numpy as np

    from pyspark_durable_queue import DurableQueue
    from pyspark_durable_queue._read.cache import page_cache

    root = tempfile.mkdtemp(prefix="dq-bench-sel-")
    rng = np.random.default_rng(3)
    a = DurableQueue(root).address("orders", fsync=False)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    for start in range(0, n, 100_000):
        k = min(100_000, n - start)
        kind = np.where(rng.random(k) < 0.001, "rare", "common")
        body = alphabet[rng.integers(0, 26, size=k * 80)].tobytes()
        offsets = np.arange(0, (k + 1) * 80, 80, dtype=np.int32)
        a.send(pa.table({
            "id": pa.array(np.arange(start, start + k)),
            "kind": pa.array(kind),
            "body": pa.StringArray.from_buffers(k, pa.py_buffer(offsets), pa.py_buffer(body)),
        }))

    def drain(selector: str | None) -> tuple[float, int]:
        page_cache().clear()
        c = a.consumer("bench", selector=selector or "")
        c.seek("earliest")
        t = time.perf_counter()
        got = 0
        while (batch := c.receive(max_messages=1_000_000, max_bytes=256 << 20)).num_rows:
            got += batch.num_rows
        return time.perf_counter() - t, got

    cases = [("full scan (no selector)", None),
             ("0.1% scattered: kind = 'rare'", "kind = 'rare'"),
             (f"0.1% clustered: id >= {n - n // 1000}", f"id >= {n - n // 1000}")]
    print(f"\nreceive of a {n:,}-message backlog ({a.stats()['bytes'] / 1e6:.0f} MB, "
          f"{a.stats()['pages']} pages), best of {repeat}:")
    full = None
    for label, selector in cases:
        best = min(drain(selector)[0] for _ in range(repeat))
        got = drain(selector)[1]
        full = full or best
        print(f"  {label:40s} {best * 1000:7.0f} ms  {got:>9,} messages  "
              f"{full / best:5.1f}x faster than the full scan")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
