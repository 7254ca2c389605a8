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
    ERROR text              a check failed (exit status 3)

With ``DQ_CHILD_NO_LINKS`` set, ``os.link`` fails as it does where there are no hard links.

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


def main() -> int:
    if os.environ.get("DQ_CHILD_NO_LINKS"):
        # As on filesystems without hard links (cloud FUSE volumes): link(2) fails with EPERM,
        # so the store publishes log entries with O_EXCL, visible while being written.
        def no_link(*_args: object, **_kwargs: object) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

        os.link = no_link
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
