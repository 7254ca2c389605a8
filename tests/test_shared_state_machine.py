"""Shared consumers (issue 40): what the state machine (added next) found, as plain tests."""

from __future__ import annotations

import time

import pytest

from pyspark_durable_queue import DurableQueue, shared_consumer

NAME = "jobs"
POOL = "pool"


# -- what the machine found, as plain tests ---------------------------------------------------
@pytest.fixture
def clock(monkeypatch):
    """The module's clock, set by the test (ms)."""
    now = [int(time.time() * 1000)]
    monkeypatch.setattr(shared_consumer, "now_ms", lambda: now[0])
    return now


@pytest.mark.parametrize("settle", ["ack", "nack"])
def test_a_row_settled_late_by_the_handle_that_claimed_it_again_is_not_handed_out_again(
        root, clock, settle):
    # a slow worker: rows 0 and 1 run out, the same handle's next claim takes them back
    # (0 handed out at once, 1 prefetched) and the worker then settles its first delivery of 1
    a = DurableQueue(root).address(NAME)
    a.send([{"id": i} for i in range(4)])
    one = a.consumer(POOL, shared=True, lease_ms=1000, prefetch=3)
    assert one.receive(2).column("_seq").to_pylist() == [0, 1]
    clock[0] += 1001
    again = one.receive(1)
    assert again.column("_seq").to_pylist() == [0]
    assert again.column("_delivery_count").to_pylist() == [2]
    if settle == "ack":
        one.ack(1)  # its lease is this handle's still: accepted, and the row settled
        assert 1 not in one.state().leases
    else:
        one.nack(1, delay_ms=60_000)
        assert one.state().pending[1][0] == 2
    rest = one.receive(5)
    assert 1 not in rest.column("_seq").to_pylist()  # was: handed out again with count 2
    if settle == "nack":  # still given back, leased to no handle (was: in one's hands)
        assert 1 in one.state().pending and 1 not in one.state().leases
    one.close()


def test_a_closed_handle_writes_nothing_at_flush_even_when_its_consumer_is_gone(root):
    # the ack flusher keeps a handle with deferred acks until exit and flushes it then, also
    # after close() wrote them: that flush must not read the store (the consumer may be gone)
    a = DurableQueue(root).address(NAME)
    a.send([{"id": 0}])
    one = a.consumer(POOL, shared=True, prefetch=1)
    one.ack(one.receive(1), flush=False)
    one.close()
    a.consumer(POOL, shared=True).delete()
    one.flush()  # was: ConsumerNotFoundError
