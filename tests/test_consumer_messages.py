"""Consumers one message at a time: the read-ahead behind ``receive(1)``, waiting for messages
(``timeout_ms``), ``messages()``, deferred acknowledgements, ``close``. A representative subset
(the ``any_address`` fixture) runs on every backend: local, memory://, S3 and Azure."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pyspark_durable_queue import ConsumerClosedError, DurableQueue, InvalidOptionError
from pyspark_durable_queue.consumer import READ_AHEAD_ROWS


def rows(first: int, n: int, **extra):
    return [{"id": i, "region": "EU" if i % 3 == 0 else "US", **extra}
            for i in range(first, first + n)]


@pytest.fixture
def address(tmp_path):
    return DurableQueue(str(tmp_path / "q")).address("orders")


@pytest.fixture
def any_address(root):
    """The address on every backend of the ``root`` fixture (local, memory://, S3, Azure):
    the tests that use it are the subset run everywhere."""
    return DurableQueue(root).address("orders")


def stored_position(address, name: str) -> int:
    return int(address.consumers()[name]["position"])


# -- receive(1) and the read-ahead --------------------------------------------------------------
def test_receive_one_at_a_time_in_order_across_read_ahead_refills(address):
    n = READ_AHEAD_ROWS + 50
    address.send(rows(0, n // 2))
    address.send(rows(n // 2, n - n // 2))
    c = address.consumer("c")
    seen = []
    for _ in range(n):
        t = c.receive(1)
        assert t.num_rows == 1
        seen.append(t.column("id")[0].as_py())
        assert c.cursor == t.column("_seq")[0].as_py() + 1
    assert seen == list(range(n))
    assert c.receive(1).num_rows == 0


def test_ack_of_a_single_received_message_moves_the_watermark_just_past_it(any_address):
    address = any_address
    address.send(rows(0, 100))
    c = address.consumer("c")
    c.receive(1)
    second = c.receive(1)
    c.ack(second)
    assert c.position == 2 and stored_position(address, "c") == 2
    # a new handle resumes right after it, although the first handle read ahead
    again = address.consumer("c")
    assert again.receive(1).column("id")[0].as_py() == 2


def test_receive_n_from_the_read_ahead_respects_max_messages_and_max_bytes(address):
    address.send(rows(0, 200, body="x" * 1000))
    c = address.consumer("c")
    assert c.receive(1).num_rows == 1
    assert c.receive(7).num_rows == 7
    small = c.receive(100, max_bytes=3000)
    assert 1 <= small.num_rows <= 3
    rest = c.receive(10_000)
    assert rest.num_rows == 200 - 8 - small.num_rows
    assert rest.column("id")[0].as_py() == 8 + small.num_rows


def test_selector_consumer_one_at_a_time_acks_past_unmatched_messages(address):
    address.send(rows(0, 30))
    c = address.consumer("eu", selector="region = 'EU'")
    got = []
    while (t := c.receive(1)).num_rows:
        got.append(t.column("id")[0].as_py())
        c.ack(t)
    assert got == list(range(0, 30, 3))
    assert c.position == 30  # the unmatched messages after the last match too


def test_new_messages_after_the_read_ahead_was_used_up_are_received(address):
    address.send(rows(0, 3))
    c = address.consumer("c")
    assert [c.receive(1).column("id")[0].as_py() for _ in range(3)] == [0, 1, 2]
    assert c.receive(1).num_rows == 0
    address.send(rows(3, 2))
    assert c.receive(5).column("id").to_pylist() == [3, 4]


def test_seek_and_ack_past_the_cursor_drop_the_read_ahead(address):
    address.send(rows(0, 100))
    c = address.consumer("c")
    c.receive(1)
    c.seek(50)
    assert c.receive(1).column("_seq")[0].as_py() == 50
    c.ack(79)  # acknowledged past what was received: reading goes on from there
    assert c.receive(1).column("_seq")[0].as_py() == 80
    c.seek("earliest")
    assert c.receive(1).column("_seq")[0].as_py() == 0


def test_a_schema_grown_by_merge_schema_is_seen_once_the_read_ahead_is_used_up(address):
    address.send(rows(0, 2))
    c = address.consumer("c")
    assert "extra" not in c.receive(1).column_names
    address.send([{"id": 9, "region": "EU", "extra": 1.5}], merge_schema=True)
    assert "extra" not in c.receive(1).column_names  # from the read-ahead, as received before
    last = c.receive(1)
    assert last.column("extra").to_pylist() == [1.5]


# -- waiting: timeout_ms --------------------------------------------------------------------------
def test_receive_waits_for_a_message_sent_by_another_thread(address):
    c = address.consumer("c")
    assert c.receive(1).num_rows == 0  # timeout_ms=0: at once, as before

    def later():
        time.sleep(0.2)
        address.send(rows(7, 1))

    threading.Thread(target=later).start()
    started = time.monotonic()
    got = c.receive(1, timeout_ms=10_000)
    waited = time.monotonic() - started
    assert got.column("id").to_pylist() == [7]
    assert 0.15 < waited < 5


def test_receive_waits_for_a_message_sent_by_another_process(address, tmp_path):
    c = address.consumer("c", start="latest")
    script = textwrap.dedent(f"""
        import time
        from pyspark_durable_queue import DurableQueue
        a = DurableQueue({str(tmp_path / "q")!r}).address("orders")
        time.sleep(0.5)
        a.send([{{"id": 42, "region": "EU"}}])
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        got = c.receive(1, timeout_ms=30_000)
    finally:
        proc.wait(30)
    assert got.column("id").to_pylist() == [42]


def test_receive_returns_empty_after_its_timeout(address):
    c = address.consumer("c")
    started = time.monotonic()
    assert c.receive(1, timeout_ms=150).num_rows == 0
    assert time.monotonic() - started >= 0.14


def test_a_waiting_selector_consumer_ignores_messages_it_does_not_match(address):
    c = address.consumer("eu", selector="region = 'EU'")

    def later():
        time.sleep(0.1)
        address.send([{"id": 1, "region": "US"}])
        time.sleep(0.1)
        address.send([{"id": 2, "region": "EU"}])

    threading.Thread(target=later).start()
    assert c.receive(1, timeout_ms=10_000).column("id").to_pylist() == [2]


def test_bad_timeouts_are_refused(address):
    c = address.consumer("c")
    with pytest.raises(InvalidOptionError, match="timeout_ms"):
        c.receive(1, timeout_ms=-1)


def test_a_waiting_receive_does_not_block_acks_from_another_thread(address):
    address.send(rows(0, 1))
    c = address.consumer("c")
    first = c.receive(1)
    waiter = threading.Thread(target=lambda: c.receive(1, timeout_ms=1500))
    waiter.start()
    time.sleep(0.1)
    started = time.monotonic()
    c.ack(first)
    assert time.monotonic() - started < 1.0
    waiter.join()


# -- messages() -----------------------------------------------------------------------------
def test_messages_yields_dicts_in_order_and_stops_when_drained(address):
    address.send(rows(0, 10))
    c = address.consumer("c")
    got = list(c.messages(timeout_ms=0))
    assert [m["id"] for m in got] == list(range(10))
    assert [m["_seq"] for m in got] == list(range(10))
    assert {"id", "region", "_seq", "_timestamp"} <= set(got[0])


def test_leaving_messages_early_acknowledges_only_what_was_yielded(address):
    address.send(rows(0, 10))
    c = address.consumer("c")
    for m in c.messages(timeout_ms=0):
        if m["id"] == 3:
            break
    c.ack()
    assert c.position == 4
    assert next(iter(c.messages(timeout_ms=0)))["id"] == 4


def test_messages_per_message_ack(any_address):
    address = any_address
    address.send(rows(0, 5))
    c = address.consumer("c")
    for m in c.messages(timeout_ms=0):
        c.ack(m["_seq"])
    assert stored_position(address, "c") == 5


# -- deferred acknowledgements --------------------------------------------------------------
def test_deferred_acks_stay_in_memory_until_flushed(address):
    address.send(rows(0, 10))
    c = address.consumer("c", ack_flush_ms=60_000)
    for _ in range(4):
        c.ack(c.receive(1), flush=False)
    assert c.position == 4 and c.flushed == 0
    assert stored_position(address, "c") == 0
    c.flush()
    assert stored_position(address, "c") == 4 and c.flushed == 4


def test_a_flushing_ack_writes_earlier_deferred_ones(any_address):
    address = any_address
    address.send(rows(0, 10))
    c = address.consumer("c", ack_flush_ms=60_000)
    c.ack(c.receive(3), flush=False)
    c.receive(1)
    c.ack(c.receive(1))
    assert stored_position(address, "c") == 5


def test_deferred_acks_are_written_within_ack_flush_ms(address):
    address.send(rows(0, 10))
    c = address.consumer("c", ack_flush_ms=100)
    c.ack(c.receive(2), flush=False)
    assert stored_position(address, "c") == 0
    deadline = time.monotonic() + 10
    while stored_position(address, "c") != 2:
        assert time.monotonic() < deadline, "the deferred ack was never written"
        time.sleep(0.02)


def test_ack_flush_ms_zero_writes_every_ack(address):
    address.send(rows(0, 3))
    c = address.consumer("c", ack_flush_ms=0)
    c.ack(c.receive(1), flush=False)
    assert stored_position(address, "c") == 1


def test_close_writes_deferred_acks_and_refuses_more_work(any_address):
    address = any_address
    address.send(rows(0, 10))
    with address.consumer("c", ack_flush_ms=60_000) as c:
        c.ack(c.receive(5), flush=False)
    assert stored_position(address, "c") == 5
    with pytest.raises(ConsumerClosedError, match="closed"):
        c.receive(1)
    with pytest.raises(ConsumerClosedError):
        c.ack()
    c.close()  # twice is fine
    assert address.consumer("c").receive(1).column("id").to_pylist() == [5]


def test_deferred_acks_are_written_when_the_process_exits(address, tmp_path):
    address.send(rows(0, 10))
    script = textwrap.dedent(f"""
        from pyspark_durable_queue import DurableQueue
        c = DurableQueue({str(tmp_path / "q")!r}).address("orders").consumer(
            "c", ack_flush_ms=600_000)
        c.ack(c.receive(6), flush=False)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert stored_position(address, "c") == 6


def test_deferred_ack_of_a_deleted_consumer_is_dropped_with_a_warning(address, caplog):
    address.send(rows(0, 3))
    c = address.consumer("c", ack_flush_ms=50)
    c.ack(c.receive(1), flush=False)
    address.consumer("c").delete()
    time.sleep(0.3)  # the flusher's turn comes and goes without bringing it back
    assert "c" not in address.consumers()


def test_deleting_a_consumer_drops_its_own_deferred_acks_quietly(address, caplog):
    address.send(rows(0, 3))
    c = address.consumer("c", ack_flush_ms=50)
    c.ack(c.receive(1), flush=False)
    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        c.delete()  # this handle knows: nothing is left to write
        time.sleep(0.3)
        c.flush()
    assert "could not write deferred" not in caplog.text
    assert "c" not in address.consumers()


def test_receive_waits_for_a_message_sent_by_another_process_on_every_shared_store(
        shared_root):
    """On object stores the wait polls (backing off to 1 s): the message still arrives."""
    a = DurableQueue(shared_root).address("orders")
    a.send(rows(0, 1))
    c = a.consumer("c", start="latest")
    script = textwrap.dedent(f"""
        import time
        from pyspark_durable_queue import DurableQueue
        a = DurableQueue({shared_root!r}).address("orders")
        time.sleep(0.5)
        a.send([{{"id": 42, "region": "EU"}}])
    """)
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        started = time.monotonic()
        got = c.receive(1, timeout_ms=60_000)
        waited = time.monotonic() - started
    finally:
        proc.wait(60)
    assert got.column("id").to_pylist() == [42]
    assert waited < 30
