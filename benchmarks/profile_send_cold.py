"""The CPU of one thread's single sends warm (back to back) and cold (each after the thread
slept, as it does in every durable send's ``fdatasync``), and an A/B of two checkouts in one
process.

Run::

    .venv/bin/python benchmarks/profile_send_cold.py [--rounds 8]
    .venv/bin/python benchmarks/profile_send_cold.py --ab OLD_CHECKOUT NEW_CHECKOUT [--rounds 12]

Without ``--ab`` it times, in alternating blocks of one process, on an address with
``fsync="never"`` (so that no sync is in the send): ``send([row])`` back to back; each send
followed by a 150 us sleep; each followed by a 900-byte ``pwrite`` + ``fdatasync`` of an
unrelated file; each followed by 150 us of busy waiting (no sleep); and that sync alone. The
figure is the process's CPU time per iteration (user + system, ``getrusage``), the medians
of the blocks. A send whose thread slept before it costs several times its back-to-back CPU
on a shared virtual machine (caches, TLB and branch predictors cold after the core idled):
what a durable send costs around its sync is the cold figure, not the warm one.

``--ab`` loads both checkouts' packages side by side under other names (copied into a
scratch folder) and alternates blocks of each, warm and after a sleep: same process, same
hash seed, same load. Across processes the CPU per send of the same code moves by a quarter
on this machine, more than most cuts. ``--ab X X`` shows the method's own spread.
The scratch folders are deleted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

ROW = {"id": 1, "kind": "a", "body": b"x" * 100}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _per_call(fn: Callable[[], object], n: int) -> float:
    """CPU microseconds per call of ``fn`` over ``n`` calls."""
    start = _cpu()
    for _ in range(n):
        fn()
    return (_cpu() - start) / n * 1e6


def _sleep() -> None:
    time.sleep(150e-6)


def _spin() -> None:
    until = time.perf_counter() + 150e-6
    while time.perf_counter() < until:
        pass


def _medians(cases: dict[str, Callable[[], object]], rounds: int, n: int) -> dict[str, float]:
    """Median CPU per call of each case over ``rounds`` blocks, the order turned each round."""
    got: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            got[name].append(_per_call(cases[name], n))
    return {k: statistics.median(v) for k, v in got.items()}


def cold(rounds: int, scratch: str) -> None:
    from pyspark_durable_queue import DurableQueue

    address = DurableQueue(scratch).address("cold", fsync="never")
    for _ in range(1000):
        address.send([ROW])
    fd = os.open(os.path.join(scratch, "unrelated"), os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 64 << 20)
    os.fsync(fd)
    data, at = b"y" * 900, [0]

    def sync() -> None:
        os.pwrite(fd, data, at[0])
        at[0] += len(data)
        os.fdatasync(fd)

    def send() -> None:
        address.send([ROW])

    try:
        medians = _medians({
            "send back to back": send,
            "send + 150 us sleep": lambda: (send(), _sleep()),
            "send + unrelated 900 B fdatasync": lambda: (send(), sync()),
            "send + 150 us busy wait": lambda: (send(), _spin()),
            "unrelated 900 B fdatasync alone": sync,
            "150 us busy wait alone": _spin,
        }, rounds, 500)
    finally:
        os.close(fd)
    for name, us in medians.items():
        print(f"{name:34s} {us:7.1f} us CPU per iteration")
    warm = medians["send back to back"]
    after_sync = medians["send + unrelated 900 B fdatasync"] - \
        medians["unrelated 900 B fdatasync alone"]
    after_spin = medians["send + 150 us busy wait"] - medians["150 us busy wait alone"]
    print(f"a send after a sleep: {medians['send + 150 us sleep'] / warm:.2f}x its warm CPU; "
          f"after an fdatasync: {after_sync / warm:.2f}x; "
          f"after busy waiting: {after_spin / warm:.2f}x")


def ab(old: str, new: str, rounds: int, scratch: str) -> None:
    addresses = {}
    for key, checkout in (("A", old), ("B", new)):
        name = f"dq_ab_{key.lower()}"
        shutil.copytree(os.path.join(checkout, "pyspark_durable_queue"),
                        os.path.join(scratch, "pkgs", name))
        sys.path.insert(0, os.path.join(scratch, "pkgs"))
        package = importlib.import_module(name)
        addresses[key] = package.DurableQueue(os.path.join(scratch, key)).address(
            "ab", fsync="never")
        for _ in range(1000):
            addresses[key].send([ROW])
    a, b = addresses["A"], addresses["B"]
    for mode, n, cases in (
            ("warm", 3000, {"A": lambda: a.send([ROW]), "B": lambda: b.send([ROW])}),
            ("after a 150 us sleep", 800, {"A": lambda: (a.send([ROW]), _sleep()),
                                           "B": lambda: (b.send([ROW]), _sleep())})):
        medians = _medians(cases, rounds, n)
        print(f"{mode:22s} CPU per send A {medians['A']:6.1f} us, B {medians['B']:6.1f} us, "
              f"B / A {medians['B'] / medians['A']:.3f} ({rounds} alternating blocks of {n})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--ab", nargs=2, metavar=("OLD", "NEW"),
                    help="two checkouts (folders holding pyspark_durable_queue/)")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="dq-send-cold-")
    try:
        print(f"load average {os.getloadavg()[0]:.2f}")
        if args.ab:
            ab(*args.ab, args.rounds, scratch)
        else:
            cold(args.rounds, scratch)
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
