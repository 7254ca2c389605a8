"""A consumer that receives, acknowledges and nacks on command, for tests/test_metrics_stats.py
(run as a script; the test reads ``stats()`` in its own process, then SIGKILLs this one).

Usage: inflight_child.py ROOT ADDRESS CONSUMER LEASE_MS

Commands on stdin, one a line: ``receive N``, ``ack SEQ`` (up to and including ``_seq``
SEQ), ``nack SEQ`` (due in an hour). Each prints ``ok <detail>`` when done. The lease, and with
it the claim that says what is in flight, is renewed every third of LEASE_MS.
"""

from __future__ import annotations

import sys

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue import consumer as consumer_module


def main(root: str, address: str, name: str, lease_ms: int) -> None:
    consumer_module.OWNER_LEASE_MS = lease_ms  # renewals (and so reports) every third of it
    c = DurableQueue(root).address(address).consumer(name)
    for line in sys.stdin:
        verb, _, arg = line.strip().partition(" ")
        if verb == "receive":
            print("ok", c.receive(int(arg)).num_rows, flush=True)
        elif verb == "ack":
            c.ack(int(arg))
            print("ok", c.position, flush=True)
        elif verb == "nack":
            c.nack(int(arg), delay_ms=3_600_000)
            print("ok", c.position, flush=True)
        else:
            raise SystemExit(f"unknown command {line!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
