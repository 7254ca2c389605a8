"""A sender that also moves expired messages, for tests/test_expiry_crash.py (run as a script;
SIGKILLed by the test).

Usage: expiry_child.py ROOT ADDRESS

Sends rounds of 10 messages, one send each (``id`` = the ``_seq`` it gets: one thread), every
message whose ``id`` is not a multiple of 3 with ``ttl_ms=1`` (expired at once), the others
without a TTL (never expire); after each send it moves what expired (moves of at most 7
messages, so that a kill often lands inside one), and every other round it runs a cleanup,
which moves first and then removes the pages whose messages all expired.

stdout lines (each flushed): ``S <first id>`` after a send returned, ``M <moves> <moved>`` after a
pass returned, ``C`` after a cleanup returned.
"""

from __future__ import annotations

import sys

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops import expiry


def main(root: str, name: str) -> None:
    expiry.MOVE_ROWS = 7  # small moves: many intents and settles per second
    a = DurableQueue(root).address(name, expiry_address="EXP")
    first = a.stats()["next_seq"]
    k = 0
    while True:
        for i in range(first, first + 10):  # one send per message, in order: ids are _seqs
            a.send([{"id": i}], ttl_ms=1 if i % 3 else None)
        print("S", first, flush=True)
        report = a.move_expired()
        print("M", report.moves, report.moved, flush=True)
        k += 1
        if k % 2:  # rounds 1, 3, 5...: a kill lands in cleanups too
            a.cleanup(dry_run=False)
            print("C", flush=True)
        first += 10

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
