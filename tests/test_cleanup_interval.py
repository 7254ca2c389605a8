"""``cleanup_interval_ms`` holds across processes (Spark commits run in fresh processes)."""

from __future__ import annotations

from pyspark_durable_queue import DurableQueue


def pages(root: str) -> int:
    return DurableQueue(root).address("a").stats()["pages"]


def test_interval_is_shared_by_every_opener(root):
    # a page per send (journal=False), so that each cleanup frees pages one can count
    a = DurableQueue(root).address("a", cleanup_interval_ms=3_600_000, journal=False)
    for i in range(3):
        a.send({"i": i})
    c = a.consumer("c")
    c.ack(c.receive(max_messages=1))  # first cleanup ever: runs, frees page 0
    assert pages(root) == 2

    # a fresh opener (a new process) must not clean up again within the interval
    fresh = DurableQueue(root).address("a").consumer("c")
    fresh.ack(fresh.receive(max_messages=1))
    assert pages(root) == 2

    # once the interval is over, the next acknowledgement cleans up
    DurableQueue(root).address("a", cleanup_interval_ms=0)
    later = DurableQueue(root).address("a").consumer("c")
    later.ack(later.receive(max_messages=1))
    assert pages(root) == 0
