"""A worker that receives one message at a time and acknowledges or nacks it (flushing), for
tests/test_consumer_window_crash.py and tests/test_dead_letter_crash.py (run as a script;
SIGKILLed by the test).

Usage: nack_child.py ROOT ADDRESS SEED|poison

SEED: nacks 15% of the messages at random; ``poison``: nacks every message whose ``id`` is a
multiple of 3, every time (until ``max_delivery_attempts`` dead-letters it), acknowledges the
others.

stdout lines (each flushed): ``D <seq> <delivery count>`` when a message was received (before
it is settled), ``K <seq>`` after its ``ack`` returned (written), ``N <seq>`` after its ``nack``
returned (written), ``E`` when nothing is left to receive.
"""

from __future__ import annotations

import random
import sys
import time

from pyspark_durable_queue import DurableQueue


def main(root: str, name: str, mode: str) -> None:
    if mode == "poison":
        def failing(table) -> bool:
            return table.column("id")[0].as_py() % 3 == 0
    else:
        rng = random.Random(int(mode))

        def failing(table) -> bool:
            return rng.random() < 0.15

    consumer = DurableQueue(root).address(name).consumer("worker")
    while True:
        table = consumer.receive(1, timeout_ms=200)
        if not table.num_rows:
            print("E", flush=True)
            time.sleep(60)  # wait for the kill
            return
        seq = table.column("_seq")[0].as_py()
        count = (table.column("_delivery_count")[0].as_py()
                 if "_delivery_count" in table.column_names else 0)
        print("D", seq, count, flush=True)
        if failing(table):
            consumer.nack(table)
            print("N", seq, flush=True)
        else:
            consumer.ack(table)
            print("K", seq, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
