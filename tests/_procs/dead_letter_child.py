"""A worker that receives one message at a time, acknowledges the good ones and nacks the
poison ones (``id % 3 == 0``) until ``max_delivery_attempts`` sends them to the dead-letter
address, for tests/test_dead_letter_crash.py (run as a script; SIGKILLed by the test).

Usage: dead_letter_child.py ROOT ADDRESS

stdout lines (each flushed): ``D <seq> <delivery count>`` when a message was received, ``K <seq>``
after its ``ack`` returned, ``N <seq>`` after its ``nack`` returned (which dead-letters it at the
limit), ``E`` when nothing is left to receive.
"""

from __future__ import annotations

import sys
import time

from pyspark_durable_queue import DurableQueue


def main(root: str, name: str) -> None:
    consumer = DurableQueue(root).address(name).consumer("worker")
    while True:
        table = consumer.receive(1, timeout_ms=200)
        if not table.num_rows:
            print("E", flush=True)
            time.sleep(60)  # wait for the kill
            return
        seq = table.column("_seq")[0].as_py()
        print("D", seq, table.column("_delivery_count")[0].as_py(), flush=True)
        if table.column("id")[0].as_py() % 3 == 0:
            consumer.nack(table, delay_ms=0)
            print("N", seq, flush=True)
        else:
            consumer.ack(table)
            print("K", seq, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
