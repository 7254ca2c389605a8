"""Store benchmarks (issue 2): send throughput vs the disk, receive+ack rate, open time.

Every figure is printed with a baseline measured in the same run, because these machines are
noisy. Run::

    .venv/bin/python benchmarks/bench_store.py [--messages 1000000] [--root /tmp/dq-bench]

1. send: N messages of ~100 bytes in batches of 10,000 (pyarrow tables, and lists of dicts;
   to an address with a file per commit, ``journal=False``, and to one with the local
   journal, the default on local disks),
   fsync on, against the disk's sequential write throughput (the same number of bytes written
   to one file in 1 MiB chunks, then fsync) and against the same write pattern done by hand
   (one file per batch, fsync each, plus the directory fsync), against a single-file journal
   (append + fdatasync per batch) and against the bare system calls of send's commit protocol
   (page file + folder fsync + log entry via temp file, fsync, link, folder fsync).
2. receive + ack of the whole backlog by one consumer, in messages per second.
3. opening an address with 100,000 commits (fsync off while building it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pyspark_durable_queue import DurableQueue


def make_batches(n: int, batch: int, seed: int = 0) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", dtype=np.uint8)
    out = []
    for start in range(0, n, batch):
        k = min(batch, n - start)
        raw = alphabet[rng.integers(0, len(alphabet), size=k * 72)].tobytes()
        bodies = pa.array([raw[i * 72:(i + 1) * 72].decode() for i in range(k)])
        out.append(pa.table({
            "id": pa.array(np.arange(start, start + k, dtype=np.int64)),
            "region": pa.array(rng.choice(["EU", "US", "APAC"], size=k)),
            "amount": pa.array(rng.random(k) * 1000),
            "body": bodies,
        }))
    return out


def disk_sequential(folder: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to one file in 1 MiB chunks and fsync it."""
    chunk = os.urandom(1 << 20)
    path = os.path.join(folder, "seq.bin")
    t = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    os.unlink(path)
    return dt


def memory_passes(tables: list[pa.Table]) -> tuple[float, float, float]:
    """Seconds for single passes over the same input, no I/O: one copy of every batch's
    bytes (what writing to the page cache costs at the least), one CRC32C pass, and one
    Arrow IPC serialisation. A durable, checksummed page does each of these at least once."""
    from crc32c import crc32c

    blobs = [t.combine_chunks().to_batches()[0] for t in tables]
    buffers = [b.serialize() for b in blobs]
    t = time.perf_counter()
    for buf in buffers:
        bytearray(memoryview(buf))  # one copy
    copy_s = time.perf_counter() - t
    t = time.perf_counter()
    for buf in buffers:
        crc32c(memoryview(buf))
    crc_s = time.perf_counter() - t
    t = time.perf_counter()
    for b in blobs:
        b.serialize()
    ipc_s = time.perf_counter() - t
    return copy_s, crc_s, ipc_s


def disk_pattern(folder: str, sizes: list[int]) -> float:
    """Seconds to write one file per batch, fsync each, and fsync the folder (what a durable
    commit needs at the least)."""
    os.makedirs(os.path.join(folder, "pattern"), exist_ok=True)
    t = time.perf_counter()
    for i, size in enumerate(sizes):
        path = os.path.join(folder, "pattern", f"{i}.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(size) if i == 0 else b"x" * size)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(os.path.join(folder, "pattern"), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    dt = time.perf_counter() - t
    shutil.rmtree(os.path.join(folder, "pattern"))
    return dt


def disk_append_each(folder: str, sizes: list[int]) -> float:
    """Seconds to append each batch to one file and fdatasync after each: a single-file
    journal, the least a durable per-send append can cost (no file or entry is created)."""
    path = os.path.join(folder, "journal.bin")
    chunk = os.urandom(max(sizes))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t = time.perf_counter()
    for size in sizes:
        os.write(fd, chunk[:size])
        os.fdatasync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    os.unlink(path)
    return dt


def protocol_floor(folder: str, sizes: list[int], entry_bytes: int = 600) -> float:
    """Seconds for the system calls of ``send``'s commit protocol with no other work: per
    batch, a page file (create, write, fsync), the pages folder fsync, then a log entry
    published as a temp file (write, fsync), ``link`` into the log folder, unlink of the temp
    and the log folder fsync."""
    pages, logs, tmp = (os.path.join(folder, "floor", d) for d in ("pages", "log", "tmp"))
    for d in (pages, logs, tmp):
        os.makedirs(d, exist_ok=True)
    chunk = os.urandom(max(sizes))
    entry = b"e" * entry_bytes
    pfd, lfd = os.open(pages, os.O_RDONLY), os.open(logs, os.O_RDONLY)
    t = time.perf_counter()
    for i, size in enumerate(sizes):
        fd = os.open(os.path.join(pages, f"{i}.page"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.write(fd, chunk[:size])
        os.fsync(fd)
        os.close(fd)
        os.fsync(pfd)
        temp = os.path.join(tmp, f"{i}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.write(fd, entry)
        os.fsync(fd)
        os.close(fd)
        os.link(temp, os.path.join(logs, f"{i:020d}.json"))
        os.unlink(temp)
        os.fsync(lfd)
    dt = time.perf_counter() - t
    os.close(pfd)
    os.close(lfd)
    shutil.rmtree(os.path.join(folder, "floor"))
    return dt


def bench_send(root: str, batches: list[pa.Table], compression: str = "none", *,
               journal: bool = False) -> tuple[float, int]:
    q = DurableQueue(root)
    # warm-up on another address: first-use imports (pyarrow.compute for statistics) and
    # folder creation are not send throughput
    q.address(f"warmup-{compression}", compression=compression,
              journal=journal).send(batches[0].slice(0, 100))
    a = q.address("bench", compression=compression, journal=journal)
    t = time.perf_counter()
    for b in batches:
        a.send(b)
    dt = time.perf_counter() - t
    return dt, a.stats()["bytes"]


def bench_send_dicts(root: str, batches: list[pa.Table]) -> float:
    q = DurableQueue(root)
    a = q.address("bench_dicts")
    rows = [b.to_pylist() for b in batches]
    t = time.perf_counter()
    for r in rows:
        a.send(r)
    return time.perf_counter() - t


def bench_receive(root: str, n: int) -> float:
    q = DurableQueue(root)
    a = q.address("bench")
    c = a.consumer("reader")
    t = time.perf_counter()
    got = 0
    while True:
        batch = c.receive(max_messages=100_000, max_bytes=64 << 20)
        if batch.num_rows == 0:
            break
        got += batch.num_rows
        c.ack(batch)
    dt = time.perf_counter() - t
    assert got == n, (got, n)
    return dt


def bench_open(root: str, commits: int) -> tuple[float, float]:
    q = DurableQueue(root)
    a = q.address("many", fsync=False)
    one = pa.table({"i": pa.array([1], pa.int64())})
    t = time.perf_counter()
    for _ in range(commits):
        a.send(one)
    build = time.perf_counter() - t
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fresh = DurableQueue(root).address("many")
        st = fresh.state
        times.append(time.perf_counter() - t)
        assert st.version == commits
    return build, min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--commits", type=int, default=100_000)
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    base = args.root or tempfile.mkdtemp(prefix="dq-bench-")
    os.makedirs(base, exist_ok=True)
    batches = make_batches(args.messages, args.batch)
    avg = sum(b.nbytes for b in batches) / args.messages
    print(f"input: {args.messages:,} messages, ~{avg:.0f} bytes each (Arrow), "
          f"batches of {args.batch:,}")

    send_s, stored = bench_send(os.path.join(base, "s1"), batches, journal=False)
    seq_s = disk_sequential(base, stored)
    sizes = [stored // len(batches)] * len(batches)
    pat_s = disk_pattern(base, sizes)
    app_s = disk_append_each(base, sizes)
    floor_s = protocol_floor(base, sizes)
    copy_s, crc_s, ipc_s = memory_passes(batches)
    dicts_s = bench_send_dicts(os.path.join(base, "s2"), batches[: max(1, len(batches) // 10)])
    dict_n = sum(b.num_rows for b in batches[: max(1, len(batches) // 10)])
    mb = stored / 1e6
    print(f"send (Arrow tables, fsync on, a file per commit): {send_s:.3f} s, "
          f"{mb / send_s:.0f} MB/s, "
          f"{args.messages / send_s / 1e6:.2f} M msg/s")
    print(f"disk sequential write, same bytes, fsync once: {seq_s:.3f} s, "
          f"{mb / seq_s:.0f} MB/s")
    print(f"disk, same pattern by hand (file per batch, fsync each): {pat_s:.3f} s, "
          f"{mb / pat_s:.0f} MB/s")
    print(f"disk, one file, append + fdatasync per batch (a journal): {app_s:.3f} s, "
          f"{mb / app_s:.0f} MB/s")
    print(f"disk, send's commit protocol as bare system calls: {floor_s:.3f} s, "
          f"{mb / floor_s:.0f} MB/s")
    print(f"memory, one pass over the same bytes, no I/O: copy {mb / copy_s:.0f} MB/s, "
          f"CRC32C {mb / crc_s:.0f} MB/s, Arrow IPC serialise {mb / ipc_s:.0f} MB/s")
    print(f"  ratio send / sequential disk = {seq_s / send_s:.2f}x   (target >= 0.70)")
    print(f"  ratio send / same-pattern disk = {pat_s / send_s:.2f}x")
    print(f"  ratio send / journal append = {app_s / send_s:.2f}x")
    print(f"  ratio send / bare commit protocol = {floor_s / send_s:.2f}x")
    print(f"  the bare protocol itself / sequential disk = {seq_s / floor_s:.2f}x")
    print(f"send (lists of dicts): {dict_n / dicts_s / 1e6:.2f} M msg/s "
          f"({dicts_s / dict_n * args.messages:.2f} s per {args.messages:,})")
    journal_s, _ = bench_send(os.path.join(base, "s-journal"), batches, journal=True)
    print(f"send on a journal address (the default): {journal_s:.3f} s, {mb / journal_s:.0f} "
          f"MB/s, {send_s / journal_s:.2f}x the send above, "
          f"{seq_s / journal_s:.2f}x sequential disk")
    for comp in ("lz4", "zstd"):
        cs, cb = bench_send(os.path.join(base, f"s-{comp}"), batches, compression=comp,
                            journal=False)
        print(f"send compression={comp}: {cs:.3f} s ({send_s / cs:.2f}x of none), "
              f"stored {cb / 1e6:.0f} MB vs {mb:.0f} MB")

    recv_s = bench_receive(os.path.join(base, "s1"), args.messages)
    print(f"receive + ack: {recv_s:.3f} s, {args.messages / recv_s / 1e6:.2f} M msg/s "
          "(target >= 1 M msg/s)")

    build_s, open_s = bench_open(os.path.join(base, "s3"), args.commits)
    print(f"open an address with {args.commits:,} commits: {open_s * 1000:.0f} ms "
          f"(target < 500 ms; building it took {build_s:.0f} s)")
    if not args.root:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
