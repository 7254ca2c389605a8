"""A worker of a shared consumer that acknowledges some rows and then holds the rest, for
tests/test_shared_takeover.py (run as a script; SIGKILLed by the test once it holds them).

Usage: holder_child.py ROOT ACKED HELD LEASE_MS [elsewhere|other-pid-namespace]

Receives ``ACKED + HELD`` rows in one claim (``prefetch`` as many), acknowledges the first
``ACKED`` one by one (each flushed), and holds the other ``HELD``, renewed for ``LEASE_MS``
from then.
``elsewhere``: the handle says it runs on another host (``_ops.shared.HOST`` set before it
opens), so that other processes cannot tell when it dies and wait for its leases to run out,
as the handles of other hosts do on an object store. ``other-pid-namespace``: the handle
says it runs in another pid namespace of this host (a container sharing the hostname but not
the pids): its pid means nothing here, so the others wait for its leases too.

stdout lines (each flushed): ``K <seq> <t>`` after an ``ack`` returned (``<t>``:
``time.monotonic_ns()``, one clock for every process of the host), ``H <holder> <seq>...``
with the rows it holds, then ``held``.
"""

from __future__ import annotations

import sys
import time

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops import shared


def main(root: str, acked: str, held: str, lease_ms: str, where: str = "") -> None:
    if where == "elsewhere":
        shared.HOST = "another-host.invalid"
    elif where == "other-pid-namespace":
        shared.PID_NAMESPACE = -1
    n, k = int(acked) + int(held), int(acked)
    consumer = DurableQueue(root).address("jobs").consumer(
        "pool", shared=True, prefetch=n, lease_ms=int(lease_ms))
    table = consumer.receive(n, timeout_ms=60_000)
    seqs = table.column("_seq").to_pylist()
    assert len(seqs) == n, seqs
    for seq in seqs[:k]:
        consumer.ack(seq)
        print("K", seq, time.monotonic_ns(), flush=True)
    consumer.renew()  # every row it holds: their lease starts now, whatever the acks took
    print("H", consumer.holder, *seqs[k:], flush=True)
    print("held", flush=True)
    time.sleep(600)  # until the kill


if __name__ == "__main__":
    main(*sys.argv[1:])
