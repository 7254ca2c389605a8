"""A worker of a shared consumer (``pool``) for tests/test_shared_crash.py (run as a script,
several at once; SIGKILLed by the test at random moments).

Usage: shared_child.py ROOT ADDRESS SEED LEASE_MS PREFETCH

Receives one message at a time. A poison message (``id`` a multiple of 7) is nacked every
time, until ``max_delivery_attempts`` dead-letters it; of the others, picked at random:
most are acknowledged, some nacked (with a short delay), some renewed first, and some held
past their lease before the acknowledgement (another worker may have them by then: the
``ack`` raises ``LeaseExpiredError``).

stdout lines (each flushed; ``<t>`` is ``time.monotonic_ns()``, one clock for every process
of the host): ``D <seq> <delivery count> <t>`` once a message was received, ``<t>`` read
before ``receive`` was called; ``A <seq>`` before its ``ack`` is called; ``K <seq> <t>``
after the ``ack`` returned (written), ``<t>`` read after it returned; ``N <seq>`` after a
``nack`` returned; ``R <seq>`` after a ``renew`` returned; ``L <seq>`` when an ``ack``,
``nack`` or ``renew`` raised ``LeaseExpiredError``; ``E`` when nothing was there to receive.
"""

from __future__ import annotations

import random
import sys
import time

from pyspark_durable_queue import DurableQueue, LeaseExpiredError


def main(root: str, name: str, seed: str, lease: str, prefetch: str) -> None:
    rng = random.Random(int(seed))
    lease_ms = int(lease)
    consumer = DurableQueue(root).address(name).consumer(
        "pool", shared=True, lease_ms=lease_ms, prefetch=int(prefetch))
    while True:
        before = time.monotonic_ns()
        table = consumer.receive(1, timeout_ms=100)
        if not table.num_rows:
            print("E", flush=True)
            continue
        seq = table.column("_seq")[0].as_py()
        print("D", seq, table.column("_delivery_count")[0].as_py(), before, flush=True)
        pick = rng.random()
        try:
            if table.column("id")[0].as_py() % 7 == 0 or pick < 0.1:
                consumer.nack(table, delay_ms=rng.choice([0, 0, 20]))
                print("N", seq, flush=True)
                continue
            if pick < 0.2:
                consumer.renew(table)
                print("R", seq, flush=True)
            elif pick < 0.24:
                time.sleep((lease_ms + 30) / 1000)  # past the lease: another may take it
            print("A", seq, flush=True)
            consumer.ack(table)
            print("K", seq, time.monotonic_ns(), flush=True)
        except LeaseExpiredError:
            print("L", seq, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:6])
