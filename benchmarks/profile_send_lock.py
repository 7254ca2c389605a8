"""Where the publish lock's time goes when several processes send single rows at once.

Issue 43, part 1: of the time one process of ``--procs`` (default 4) holds
``log/_publish.lock`` while its threads (``--threads``, default 4) send single rows, how much
is the replay of units other processes wrote (``CommitLog._replay`` inside
``CommitLog._publish_unit``), how much the unit's write (``Journal.append``; its
``fdatasync`` runs after the lock is let go since issue 43's change, inside ``publish()``), and
how much the rest (entry building, encoding, applying). ``--rows``: rows a send (100: the batch
senders of issue 43's target 2).

Run::

    .venv/bin/python benchmarks/profile_send_lock.py [--procs 4] [--threads 4] [--seconds 4]
        [--rows 1]

The other processes send the same way, uninstrumented; all start at one wall-clock time. This
process wraps the three methods with timers (a few us a call: its own rate is a little lower
than theirs). The scratch address is deleted.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, ROOT)

from pyspark_durable_queue import DurableQueue  # noqa: E402
from pyspark_durable_queue._log import commit_log, journal  # noqa: E402

ROW = {"id": 0, "kind": "a", "body": b"x" * 100}

CHILD = r"""
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from pyspark_durable_queue import DurableQueue
a = DurableQueue(sys.argv[2]).address("p")
a.send([{"id": -1, "kind": "a", "body": b"x" * 100}])
threads, seconds, start = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
rows = int(sys.argv[6])
time.sleep(max(0.0, start - time.time()))
end = time.monotonic() + seconds
def send():
    i = 0
    while time.monotonic() < end:
        a.send([{"id": i + k, "kind": "a", "body": b"x" * 100} for k in range(rows)])
        i += rows
ts = [threading.Thread(target=send) for _ in range(threads)]
[t.start() for t in ts]
[t.join() for t in ts]
"""


class Timers:
    """Seconds spent in the wrapped methods, summed over this process's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()
        self.held = self.replay_held = self.append = self.publish = 0.0
        self.units = self.foreign = 0

    def _timed(self, fn: Any, field: str) -> Any:
        """``fn`` adding its wall time to the counter ``field``."""
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with timers.lock:
                    setattr(timers, field, getattr(timers, field) + time.perf_counter() - t)
        return timed

    def install(self) -> None:
        publish_unit = commit_log.CommitLog._publish_unit
        replay = commit_log.CommitLog._replay
        publish = commit_log.CommitLog.publish
        append = journal.Journal.append
        timers = self

        def timed_publish_unit(self: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            timers.local.held = True
            try:
                return publish_unit(self, *args, **kwargs)
            finally:
                timers.local.held = False
                with timers.lock:
                    timers.held += time.perf_counter() - t
                    timers.units += 1

        def timed_replay(self: Any, state: Any) -> Any:
            t, before = time.perf_counter(), state.version
            try:
                return replay(self, state)
            finally:
                if getattr(timers.local, "held", False):
                    with timers.lock:
                        timers.replay_held += time.perf_counter() - t
                        timers.foreign += state.version - before

        commit_log.CommitLog._publish_unit = timed_publish_unit  # type: ignore[method-assign]
        commit_log.CommitLog._replay = timed_replay  # type: ignore[method-assign]
        commit_log.CommitLog.publish = self._timed(publish, "publish")  # type: ignore[method-assign]
        journal.Journal.append = self._timed(append, "append")  # type: ignore[method-assign]

    def reset(self) -> None:
        with self.lock:
            self.held = self.replay_held = self.append = self.publish = 0.0
            self.units = self.foreign = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rows", type=int, default=1, help="rows a send (default 1)")
    args = ap.parse_args()
    if args.procs < 1 or args.threads < 1 or args.seconds <= 0:
        ap.error("--procs and --threads must be >= 1 and --seconds > 0")
    scratch = tempfile.mkdtemp(prefix="profile_send_lock-")
    timers = Timers()
    timers.install()
    try:
        address = DurableQueue(scratch).address("p")
        address.send([dict(ROW)])
        start = time.time() + 3.0
        kids = [subprocess.Popen([sys.executable, "-c", CHILD, ROOT, scratch,
                                  str(args.threads), str(args.seconds), str(start),
                                  str(args.rows)])
                for _ in range(args.procs - 1)]
        time.sleep(max(0.0, start - time.time()))
        timers.reset()
        end = time.monotonic() + args.seconds
        sent = [0]

        def send() -> None:
            i = 0
            while time.monotonic() < end:
                address.send([{**ROW, "id": i + k} for k in range(args.rows)])
                i += args.rows
            with timers.lock:
                sent[0] += i

        began = time.perf_counter()
        threads = [threading.Thread(target=send) for _ in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
        for k in kids:
            if k.wait() != 0:
                raise SystemExit(f"a sending process exited with {k.returncode}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    held, units = timers.held, max(timers.units, 1)
    print(f"this process: {sent[0]} rows in {wall:.2f} s ({sent[0] / wall:,.0f}/s), "
          f"{timers.units} units")
    print(f"publish lock held {held:.3f} s ({held / wall:.1%} of wall, "
          f"{held / units * 1e6:.0f} us a unit)")
    print(f"  replay of {timers.foreign} foreign units {timers.replay_held:.3f} s "
          f"({timers.replay_held / max(held, 1e-9):.1%}, "
          f"{timers.replay_held / max(timers.foreign, 1) * 1e6:.0f} us a unit)")
    print(f"  the unit's write {timers.append:.3f} s ({timers.append / max(held, 1e-9):.1%}, "
          f"{timers.append / units * 1e6:.0f} us a unit)")
    print(f"publish() with the wait for the lock {timers.publish:.3f} s")


if __name__ == "__main__":
    main()
