"""Where a journal's sync should run relative to its publish lock: the file-level floor.

Issue 43: P processes each loop ``flock`` + 200-byte (``--bytes``) ``pwrite`` at the shared end
of one preallocated file + ``fdatasync``, in three shapes, writes per second over all of them:

``inside``
    the sync under the ``flock`` (the journal before issue 43: one sync at a time);
``outside``
    the ``flock`` let go before the sync (each process syncs its own write; the kernel serves
    concurrent syncs of one file together): what ``CommitLog._sync_unit`` does;
``leader``
    the ``flock`` let go, then a second ``flock`` around "sync unless the shared synced-up-to
    counter already covers my write" (PostgreSQL's ``XLogFlush`` shape: one sync for all who
    wrote before it), with the fraction of writes that skipped their sync.

Run::

    .venv/bin/python benchmarks/profile_sync_lock.py [--procs 1,4,8] [--seconds 2] [--bytes 200]

(``--bytes 10500``: the unit of a ``send`` of 100 ~100-byte rows, issue 43's target 2.)

Figures are ratios within one run (the machine is shared); the scratch folder is deleted.
"""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Any

RECORD = 200


def _offset(fd: int) -> int:
    return int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little")


def worker(folder: str, shape: str, seconds: float, out: Any, go: Any,
           record: int = RECORD) -> None:
    data = os.open(f"{folder}/journal", os.O_WRONLY)
    lock = os.open(f"{folder}/lock", os.O_RDWR)
    synced = os.open(f"{folder}/synced", os.O_RDWR)
    payload = b"m" * record
    go.wait()
    done = skipped = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        fcntl.flock(lock, fcntl.LOCK_EX)
        at = _offset(lock)
        os.pwrite(data, payload, 4096 + at)
        mine = at + record
        os.pwrite(lock, mine.to_bytes(8, "little"), 0)
        if shape == "inside":
            os.fdatasync(data)
        fcntl.flock(lock, fcntl.LOCK_UN)
        if shape == "outside":
            os.fdatasync(data)
        elif shape == "leader":
            fcntl.flock(synced, fcntl.LOCK_EX)
            if _offset(synced) < mine:
                written = _offset(lock)
                os.fdatasync(data)
                os.pwrite(synced, written.to_bytes(8, "little"), 0)
            else:
                skipped += 1
            fcntl.flock(synced, fcntl.LOCK_UN)
        done += 1
    out.put((done, skipped))


def run(procs: int, shape: str, seconds: float, record: int = RECORD) -> tuple[float, float]:
    folder = tempfile.mkdtemp(prefix="dq-sync-lock-", dir=os.environ.get("DQ_BENCH_DIR"))
    try:
        with open(f"{folder}/journal", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(256 << 20, 20_000 * procs * record))
        for name in ("lock", "synced"):
            with open(f"{folder}/{name}", "wb") as f:
                f.write(bytes(8))
        ctx = multiprocessing.get_context("spawn")
        out, go = ctx.Queue(), ctx.Event()
        workers = [ctx.Process(target=worker, args=(folder, shape, seconds, out, go, record))
                   for _ in range(procs)]
        for w in workers:
            w.start()
        time.sleep(0.5)
        go.set()
        results = [out.get(timeout=seconds + 60) for _ in workers]
        for w in workers:
            w.join()
        done = sum(r[0] for r in results)
        return done / seconds, sum(r[1] for r in results) / max(1, done)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="1,4,8")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--bytes", type=int, default=RECORD, help="bytes a write")
    args = parser.parse_args()
    if args.bytes < 1 or args.seconds <= 0:
        parser.error(f"--bytes {args.bytes} / --seconds {args.seconds}: expected >= 1 and > 0")
    print(f"{'procs':>5} {'inside/s':>9} {'outside/s':>10} {'leader/s':>9} "
          f"{'out/in':>7} {'lead/in':>8} {'skipped':>8}")
    for procs in (int(p) for p in args.procs.split(",")):
        inside, _ = run(procs, "inside", args.seconds, args.bytes)
        outside, _ = run(procs, "outside", args.seconds, args.bytes)
        leader, skipped = run(procs, "leader", args.seconds, args.bytes)
        print(f"{procs:>5} {inside:>9,.0f} {outside:>10,.0f} {leader:>9,.0f} "
              f"{outside / inside:>6.2f}x {leader / inside:>7.2f}x {skipped:>7.0%}")


if __name__ == "__main__":
    main()
