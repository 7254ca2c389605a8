"""What asking for a file's name or times costs the ``fdatasync`` after the next write.

Why the journal's writer and the watermark file no longer ``stat`` the file they write to tell
whether its path still names it (``_storage/local.py``, ``_Named``): on a kernel with
fine-grained timestamps (ext4 since Linux 6.13) a ``stat`` marks the file's ctime as seen, the
next write then stamps a new ctime, and the ``fdatasync`` journals it. Each case below is a
loop of ``pwrite`` (650 bytes, a single send's journal unit) + ``fdatasync`` into space made
ahead with ``posix_fallocate``, with one call before each write; the cases take turns (these
machines are noisy) and the medians are printed against the loop with no call. Run::

    .venv/bin/python benchmarks/bench_stat_sync.py [--writes 2000] [--rounds 4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

Before = Callable[[str, str, int], object]


def loop(folder: str, writes: int, before: Before | None) -> float:
    """Microseconds per write + fdatasync, ``before(path, other path, fd)`` called ahead of
    each write."""
    path = os.path.join(folder, "segment")
    other = os.path.join(folder, "other")
    open(other, "wb").close()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, writes * 650 + 4096)
        os.fsync(fd)
        data = b"x" * 650
        started = time.perf_counter()
        for i in range(writes):
            if before is not None:
                before(path, other, fd)
            os.pwrite(fd, data, i * len(data))
            os.fdatasync(fd)
        return (time.perf_counter() - started) / writes * 1e6
    finally:
        os.close(fd)
        os.unlink(path)


CASES: dict[str, Before | None] = {
    "nothing": None,
    "stat of the file": lambda path, other, fd: os.stat(path),
    "fstat of the descriptor": lambda path, other, fd: os.fstat(fd),
    "stat of another file": lambda path, other, fd: os.stat(other),
    "readlink /proc/self/fd/N": lambda path, other, fd: os.readlink(f"/proc/self/fd/{fd}"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=None, help="a folder on the disk to measure (default: "
                    "the system's temporary folder)")
    args = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for _ in range(args.rounds):
            for name, before in CASES.items():
                times[name].append(loop(folder, args.writes, before))
    base = statistics.median(times["nothing"])
    print(f"{'call before each write + fdatasync':<34} {'us a write':>10} {'vs nothing':>10}"
          "  (medians of the rounds)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<34} {median:>10.0f} {median - base:>+9.0f}  "
              f"{' '.join(f'{v:.0f}' for v in values)}")
    print(f"kernel {os.uname().release}")


if __name__ == "__main__":
    main()
