"""A worker that receives one message at a time and acknowledges with deferred acks, for
tests/test_consumer_crash.py (run as a script; SIGKILLed by the test).

Usage: ack_child.py ROOT ADDRESS SEED

stdout lines (each flushed): ``S <seq>`` the first message it received, ``F <position>`` after a
``flush()`` returned (the watermark written), ``D`` when the backlog is drained.
"""

from __future__ import annotations

import random
import sys
import time

from pyspark_durable_queue import DurableQueue


def main(root: str, name: str, seed: int) -> None:
    rng = random.Random(seed)
    consumer = DurableQueue(root).address(name).consumer("worker", ack_flush_ms=20)
    first = True
    done = 0
    while True:
        table = consumer.receive(1)
        if not table.num_rows:
            print("D", flush=True)
            time.sleep(60)  # wait for the kill
            return
        if first:
            print("S", table.column("_seq")[0].as_py(), flush=True)
            first = False
        time.sleep(0.0002)  # some work
        consumer.ack(table, flush=False)
        done += 1
        if rng.random() < 0.02:
            consumer.flush()
            print("F", consumer.flushed, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
