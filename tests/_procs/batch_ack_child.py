"""A worker that receives batches and settles random parts of what it holds, closing and
opening its consumer again now and then, for tests/test_consumer_batch_ack_crash.py (run as a
script; SIGKILLed by the test).

Usage: batch_ack_child.py ROOT ADDRESS HISTORY SEED

Each turn it receives up to 1-20 messages, then may nack some of the rows it holds (delay 0
or a few ms), acknowledge in one of four ways (``ack()``; ``ack(table)`` of a table it
received; ``ack`` of a slice of one; ``ack(_seq)`` of a row it holds), or close its consumer
and open it again (what it held is then abandoned: delivered again, never acknowledged).

stdout: ``started`` once it received its first rows, ``E`` when it is done.

HISTORY gets one line per event, written, flushed and fsynced before the worker goes on (a
line cut by the kill is dropped by the reader)::

    O [again]                           a consumer handle was opened (again: by this
                                        process, after it closed the last): nothing held
    R <seq>:<delivery count> ...        a receive returned these rows (now held)
    I <n> <how> <arg> C <cursor> [S <seq>...] H <seq>...
                                        call number n is about to start, holding the rows
                                        after H, the consumer's cursor at cursor: how is all
                                        (ack(), arg -), table / slice / seq (ack of a table,
                                        a slice, a _seq; arg its last _seq) or nack (arg the
                                        delay_ms; S the rows nacked)
    F <n>                               call n returned
    E                                   nothing is left to receive and nothing is held

The audit works out what a call covers from the line alone: ``ack()`` the rows held, an ack
of a table, a slice or a ``_seq`` the rows held up to its last ``_seq``, a nack the rows after
S.
"""

from __future__ import annotations

import os
import random
import sys
import time

import pyarrow as pa

from pyspark_durable_queue import DurableQueue

DELAYS_MS = (0, 0, 5, 40)
RECEIVE_TIMEOUT_MS = 300  # longer than every delay: an empty receive means nothing is due


class Worker:
    """One consumer handle at a time, what it holds, and the history file."""

    def __init__(self, root: str, name: str, history_path: str) -> None:
        self.address = DurableQueue(root).address(name)
        self._history = open(history_path, "a")  # open until the kill
        self.calls = 0
        self.open()

    def write(self, *words: object) -> None:
        self._history.write(" ".join(map(str, words)) + "\n")
        self._history.flush()
        os.fsync(self._history.fileno())

    def open(self, *again: str) -> None:
        self.consumer = self.address.consumer("worker")
        self.held: set[int] = set()
        #: first deliveries held: read from the cursor, at or above the ack point
        self.first: set[int] = set()
        self.tables: list[pa.Table] = []  # received by this handle (the last few)
        self.write("O", *again)

    def reopen(self) -> None:
        self.consumer.close()
        self.open("again")

    def receive(self, k: int) -> pa.Table:
        table = self.consumer.receive(k, timeout_ms=RECEIVE_TIMEOUT_MS)
        if table.num_rows:
            counts = table.column("_delivery_count").to_pylist()
            self.write("R", *(f"{s}:{c}" for s, c in zip(seqs(table), counts, strict=True)))
            self.held.update(seqs(table))
            self.first.update(s for s, c in zip(seqs(table), counts, strict=True) if c == 1)
            self.tables = [*self.tables[-7:], table]
        return table

    def _begin(self, how: str, arg: object, nacked: list[int] | None = None) -> None:
        self.calls += 1
        named = ["S", *nacked] if nacked is not None else []
        self.write("I", self.calls, how, arg, "C", self.consumer.cursor, *named,
                   "H", *sorted(self.held))

    def nack(self, seq: int, delay_ms: int) -> None:
        self._begin("nack", delay_ms, [seq])
        self.consumer.nack(seq, delay_ms=delay_ms)
        self.write("F", self.calls)
        self.held.discard(seq)
        self.first.discard(seq)

    def ack(self, how: str, last: int | None, batch: pa.Table | int | None) -> None:
        """``ack(batch)``, which covers the rows held up to ``last`` (``None``: all)."""
        self._begin(how, "-" if last is None else last)
        self.consumer.ack(batch)
        self.write("F", self.calls)
        self.held -= {s for s in self.held if last is None or s <= last}
        self.first &= self.held


def seqs(table: pa.Table) -> list[int]:
    return table.column("_seq").to_pylist()


def ack_some(worker: Worker, rng: random.Random, top: pa.Table | None) -> None:
    """Acknowledge in a way drawn at random: what the worker holds (``ack()``), or up to a
    table it received, a slice of one, or a ``_seq`` it holds; the last row of ``top`` (a
    table just received) when given."""
    how = rng.choice(["all", "table", "slice", "seq"])
    mine = [top] if top is not None else [
        t for t in worker.tables if worker.held.intersection(seqs(t))]
    if how == "all" or not mine:
        worker.ack("all", None, None)
    elif how == "table":
        chosen = rng.choice(mine)
        worker.ack("table", max(seqs(chosen)), chosen)
    elif how == "slice":
        chosen = rng.choice(mine)
        start = rng.randrange(chosen.num_rows)
        end = chosen.num_rows if top is not None else rng.randint(start + 1, chosen.num_rows)
        part = chosen.slice(start, end - start)
        worker.ack("slice", max(seqs(part)), part)
    else:
        seq = max(seqs(top)) if top is not None else rng.choice(sorted(worker.held))
        worker.ack("seq", seq, seq)


def main(root: str, name: str, history_path: str, seed: int) -> None:
    rng = random.Random(seed)
    worker = Worker(root, name, history_path)
    started = False
    kept = False  # reopened with a row kept above rows delivered: it comes first
    while True:
        table = worker.receive(rng.randint(1, 20))
        if not table.num_rows:
            if worker.held:
                worker.ack("all", None, None)
                continue
            worker.write("E")
            print("E", flush=True)
            time.sleep(60)  # wait for the kill
            return
        if not started:  # the test's kill timer starts now
            print("started", flush=True)
            started = True
        if rng.random() < 0.5 and not kept:  # give some back
            for seq in rng.sample(sorted(worker.held), min(len(worker.held), rng.randint(1, 3))):
                worker.nack(seq, rng.choice(DELAYS_MS))
        for _ in range(1 if kept else rng.randint(0, 2)):
            if worker.held:
                ack_some(worker, rng, table if kept else None)
        kept = False
        if rng.random() < 0.4:  # the trigger: opened again at its ack point, ...
            top = max(worker.held, default=-1)
            if any(s < top for s in worker.first):
                # ... its window keeping a row above a row delivered first (the ack point
                # is at most that one), due at once: the next turn acknowledges it (in a
                # way drawn at random) first
                worker.nack(top, 0)
                kept = True
            worker.reopen()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
