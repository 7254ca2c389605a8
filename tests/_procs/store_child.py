"""Subprocess entry point for the crash and concurrency tests (not a test module).

Usage: ``python store_child.py ROOT ADDRESS RUN SEED MODE MAX_SENDS [SETTINGS_JSON]``

Sends numbered messages to ADDRESS and, in ``sendack`` mode, receives and acknowledges them
with the durable consumer ``worker``; ``expire`` mode only expires the commit log MAX_SENDS times.
Every operation that *returned* is reported on stdout, one flushed line each, so a parent
that SIGKILLs this process knows exactly what was acknowledged to the caller::

    ready                   warmed up; with DQ_CHILD_GO set, waits for that file to exist
    sent RUN K M SEQ        send K of this run (M messages) returned; its first _seq is SEQ
    acked POSITION          ack returned; the worker's watermark is POSITION
    done                    MAX_SENDS sends done (only when MAX_SENDS > 0)
    stalled PATH            half of commit-log entry PATH is written (DQ_CHILD_STALL_ENTRY)
    ERROR text              a check failed (exit status 3)

With ``DQ_CHILD_NO_LINKS`` set, ``os.link`` fails as it does where there are no hard links.
With ``DQ_CHILD_STALL_ENTRY=K`` too, the K-th commit-log entry this process creates with
``O_EXCL`` stops half-written (reported, then a long sleep): a parent that kills it then knows its
kill left a cut-short entry, which the crash test needs to see happen, not hope for.

Each message: ``run``, ``k`` (send number in this run), ``idx`` (0..M-1), ``m``, ``pad``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc

from pyspark_durable_queue import DurableQueue


def ready() -> None:
    print("ready", flush=True)
    go = os.environ.get("DQ_CHILD_GO")
    while go and not os.path.exists(go):  # concurrency tests start every child at once
        time.sleep(0.005)


class _StallingFile:
    """A file whose ``write`` writes half of the data, reports it and stops (to be killed)."""

    def __init__(self, f, path: str) -> None:
        self._f = f
        self._path = path

    def write(self, data: bytes) -> int:
        self._f.write(data[:len(data) // 2])
        self._f.flush()
        print(f"stalled {self._path}", flush=True)
        time.sleep(120)
        raise SystemExit("stalled in a commit-log entry and was not killed")

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def _stall_log_entry(k: int) -> None:
    """Make the ``k``-th commit-log entry that ``Storage.create`` writes through ``os.open``
    with ``O_EXCL`` (``log/<number>.json``) and ``os.fdopen`` stop half-written."""
    real_open, real_fdopen = os.open, os.fdopen
    seen = [0]
    stall: dict[int, str] = {}

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        name = os.fspath(path)
        if flags & os.O_EXCL and os.path.basename(os.path.dirname(name)) == "log" \
                and name.endswith(".json"):
            seen[0] += 1
            if seen[0] == k:
                stall[fd] = name
        return fd

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        return _StallingFile(f, stall.pop(fd)) if fd in stall else f

    os.open, os.fdopen = open_, fdopen


def main() -> int:
    if os.environ.get("DQ_CHILD_NO_LINKS"):
        # As on filesystems without hard links (cloud FUSE volumes): link(2) fails with EPERM,
        # so the store publishes log entries with O_EXCL, visible while being written.
        def no_link(*_args: object, **_kwargs: object) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

        os.link = no_link
        if os.environ.get("DQ_CHILD_STALL_ENTRY"):
            _stall_log_entry(int(os.environ["DQ_CHILD_STALL_ENTRY"]))
    root, address, run, seed, mode, max_sends = sys.argv[1:7]
    settings = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
    run_id, max_sends_n = int(run), int(max_sends)
    rng = random.Random(int(seed))
    a = DurableQueue(root).address(address, **settings)
    c = a.consumer("worker") if mode == "sendack" else None
    if mode == "expire":  # log retention of 0.2 s in a loop, MAX_SENDS times
        ready()
        for _ in range(max(1, max_sends_n)):
            a.log.expire(0.2)
            time.sleep(0.005)
        print("done", flush=True)
        return 0
    # warm up: pyarrow imports pandas on the first from_pylist (slow on a loaded machine);
    # kills are meant to land in sends and acks, not in imports
    pa.Table.from_pylist([{"run": run_id, "pad": ""}])
    pc.max(pa.array([1]))
    ready()
    k = 0
    while max_sends_n <= 0 or k < max_sends_n:
        k += 1
        m = rng.randint(1, 20)
        pad = "x" * rng.randint(0, 300)
        rows = [{"run": run_id, "k": k, "idx": j, "m": m, "pad": pad} for j in range(m)]
        r = a.send(rows)
        print(f"sent {run_id} {k} {m} {r.seq}", flush=True)
        if c is not None and rng.random() < 0.6:
            before = c.cursor
            t = c.receive(max_messages=rng.randint(1, 60))
            if t.num_rows:
                seqs = t.column("_seq").to_pylist()
                first = a.state.first_seq
                if seqs != list(range(seqs[0], seqs[0] + len(seqs))) or \
                        seqs[0] != max(before, first):
                    print(f"ERROR received {seqs[:5]}... after cursor {before}", flush=True)
                    return 3
            if rng.random() < 0.2:
                c.ack()
            else:
                c.ack(t)
            print(f"acked {c.position}", flush=True)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
