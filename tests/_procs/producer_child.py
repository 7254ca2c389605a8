"""Subprocess entry point for the producer tests (not a test module).

Usage: ``python producer_child.py MODE ROOT ADDRESS [N]``

``exit``
    Sends N rows ``{"k": i}`` and returns from the script without flush or close: the
    producer's exit hook must store them.
``fork``
    Sends N rows (``who="parent"``) and flushes; sends N more without flushing, then forks.
    The child sends N rows (``who="child"``), flushes, checks its futures and that the futures
    of the rows the parent had pending fail in it, and exits 0 (or 3, printing ``ERROR ...``).
    The parent flushes, waits for the child and prints ``child STATUS``.
``crash``
    Sends rows ``{"run": N, "k": i, "pad": ...}`` without end; each stored row's ``SEQ K`` is
    printed on stdout, 50 rows at a time, flushed, once their futures resolved. ``ready`` comes
    first. A failed future prints ``ERROR ...``. The parent SIGKILLs it.
"""

from __future__ import annotations

import os
import sys
import threading

from pyspark_durable_queue import DurableQueue, ProducerClosedError


def main() -> int:
    mode, root, name = sys.argv[1:4]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    address = DurableQueue(root).address(name)
    if mode == "exit":
        p = address.producer(linger_ms=60_000)  # only the exit hook sends them
        for i in range(n):
            p.send({"k": i})
        return 0
    if mode == "fork":
        return fork(address, n)
    if mode == "crash":
        return crash(address, run=n)
    raise SystemExit(f"unknown mode {mode}")


def fork(address, n: int) -> int:
    p = address.producer(linger_ms=60_000)
    first = [p.send({"who": "parent", "k": i}) for i in range(n)]
    p.flush()
    pending = [p.send({"who": "parent", "k": n + i}) for i in range(n)]
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            mine = [p.send({"who": "child", "k": i}) for i in range(n)]
            p.flush()
            seqs = [f.result(timeout=30) for f in mine]
            if seqs != list(range(seqs[0], seqs[0] + n)):
                print(f"ERROR child seqs not dense: {seqs}", flush=True)
                code = 3
            for f in pending:
                if not isinstance(f.exception(timeout=5), ProducerClosedError):
                    print(f"ERROR a parent's pending future in the child: {f!r}", flush=True)
                    code = 3
                    break
            p.close()
        except BaseException as exc:
            print(f"ERROR child {exc!r}", flush=True)
            code = 3
        os._exit(code)
    p.flush()
    _, status = os.waitpid(pid, 0)
    print(f"child {os.waitstatus_to_exitcode(status)}", flush=True)
    assert all(f.done() and f.exception() is None for f in first + pending)
    p.close()
    return 0


def crash(address, run: int) -> int:
    p = address.producer(linger_ms=2, max_batch_messages=500, max_buffer_bytes=100_000)
    lock = threading.Lock()  # callbacks run on the sender thread, or here when already done
    print("ready", flush=True)
    k = 0
    group = 50
    while True:
        keys = range(k, k + group)
        futures = [p.send({"run": run, "k": key, "pad": "x" * 60}) for key in keys]
        left = [group]

        def done(_f, futures=futures, keys=keys, left=left):
            with lock:
                left[0] -= 1
                if left[0]:
                    return
                # the group's last future resolved: one write for the group, in order
                lines = []
                for f, key in zip(futures, keys, strict=True):
                    exc = f.exception()
                    lines.append(f"ERROR {key} {exc!r}" if exc else f"{f.result()} {key}")
                sys.stdout.write("\n".join(lines) + "\n")
                sys.stdout.flush()

        for f in futures:
            f.add_done_callback(done)
        k += group


if __name__ == "__main__":
    sys.exit(main())
