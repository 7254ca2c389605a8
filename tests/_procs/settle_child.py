"""A worker that receives a few messages at a time, nacks some of them one by one (delay 0),
acknowledges part of the table now and then, then the table (cumulative: never the nacked
rows), for tests/test_consumer_settle_crash.py (run as a script; SIGKILLed by the test).

Usage: settle_child.py ROOT ADDRESS AUDIT SEED

AUDIT is the worker's own file, one line per event, each written and fsynced before the next
step: ``D <seq>:<delivery count> ...`` a received table, ``N <seq>`` after its ``nack``
returned, ``K <seq> ...`` after an ``ack`` returned, with the rows it settled (those of the
acknowledged table, or part, not nacked and not settled by an earlier line), ``E`` when
nothing is left to receive.
"""

from __future__ import annotations

import os
import random
import sys
import time

from pyspark_durable_queue import DurableQueue


def main(root: str, name: str, audit: str, seed: int) -> None:
    rng = random.Random(seed)
    fd = os.open(audit, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def say(*words: object) -> None:
        os.write(fd, (" ".join(map(str, words)) + "\n").encode())
        os.fsync(fd)

    consumer = DurableQueue(root).address(name).consumer("worker")
    while True:
        table = consumer.receive(rng.randint(1, 5), timeout_ms=200)
        if not table.num_rows:
            say("E")
            time.sleep(60)  # wait for the kill
            return
        seqs = table.column("_seq").to_pylist()
        counts = table.column("_delivery_count").to_pylist()
        say("D", *(f"{s}:{c}" for s, c in zip(seqs, counts, strict=True)))
        nacked = set()
        for s in seqs:
            if rng.random() < 0.12:
                consumer.nack(s, delay_ms=0)
                nacked.add(s)
                say("N", s)
        done: set[int] = set()
        if len(seqs) > 1 and rng.random() < 0.3:
            k = rng.randint(1, len(seqs) - 1)
            consumer.ack(table.slice(0, k))  # up to its own last row, not the table's
            done = {s for s in seqs[:k] if s not in nacked}
            say("K", *sorted(done))
        consumer.ack(table)
        say("K", *sorted(set(seqs) - nacked - done))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
