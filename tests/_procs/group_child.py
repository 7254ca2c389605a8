"""Subprocess entry point for the group-commit crash test (not a test module).

Usage: ``python group_child.py ROOT ADDRESS RUN SEED THREADS SETTINGS_JSON``

THREADS threads send single-row messages to ADDRESS until the process is killed, so that their
sends are committed in groups. The first half of the threads share one ``Address``, the others
open a handle each; about half of the sends are idempotent (``txn=("g<RUN>-<thread>", k)``,
unique per send), so that a group carries several transactions. Every send that *returned* is
reported on stdout in ``history.py``'s format, one ``os.write`` per line (threads share
stdout; a line is never split or mixed with another)::

    ready                     the threads are about to start
    sent WRITER K 1 SEQ       send K of thread WRITER returned; its row is at _seq SEQ
    ERROR text                a send returned something a plain send must not (exit status 3)

WRITER is ``RUN * THREADS + thread``: unique per thread of each run. Each row: ``run`` (the
WRITER, the column ``history.audit`` keys sends on), ``k``, ``idx`` = 0, ``m`` = 1, and, so the
audit can tell a whole row, ``proc`` (RUN), ``thread``, ``txn`` (sent with one) and ``pad``
(``row_pad(WRITER, K)``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading

import pyarrow as pa

from pyspark_durable_queue import DurableQueue


def row_pad(writer: int, k: int) -> str:
    """The padding of a row, a function of its id (so a whole row is recognisable)."""
    return f"{writer}:{k}:" + "x" * ((writer * 31 + k * 7) % 90)


def report(line: str) -> None:
    os.write(1, (line + "\n").encode())


def main() -> int:
    root, address, run, seed, threads = sys.argv[1:6]
    settings = json.loads(sys.argv[6])
    run_id, n_threads = int(run), int(threads)
    shared = DurableQueue(root).address(address, **settings)
    # warm up: pyarrow imports pandas on the first from_pylist (slow on a loaded machine);
    # kills are meant to land in sends, not in imports
    pa.Table.from_pylist([{"run": run_id, "pad": ""}])
    handles = [shared if t < n_threads // 2 else DurableQueue(root).address(address, **settings)
               for t in range(n_threads)]
    failed = threading.Event()

    def work(t: int) -> None:
        a = handles[t]
        rng = random.Random(int(seed) * 1000 + t)
        writer = run_id * n_threads + t
        k = 0
        while not failed.is_set():
            k += 1
            txn = (f"g{run_id}-{t}", k) if rng.random() < 0.5 else None
            row = {"run": writer, "k": k, "idx": 0, "m": 1, "proc": run_id, "thread": t,
                   "txn": txn is not None, "pad": row_pad(writer, k)}
            try:
                r = a.send([row], txn=txn)
            except BaseException as exc:
                report(f"ERROR send {writer} {k} raised {exc!r}")
                failed.set()
                return
            if r.duplicate or r.count != 1 or r.seq < 0:
                report(f"ERROR send {writer} {k} txn={txn} returned {r}")
                failed.set()
                return
            report(f"sent {writer} {k} 1 {r.seq}")

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(n_threads)]
    report("ready")
    for w in workers:
        w.start()
    failed.wait()
    return 3


if __name__ == "__main__":
    sys.exit(main())
