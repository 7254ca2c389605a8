"""Shared consumers and expiry: a row whose TTL (``send(..., ttl_ms=)``) or the address's
``expiry_delay_ms`` ended while it waited for redelivery (nacked, or its lease lapsed) is not
delivered again: it is settled as expired, and the address's expiry pass moves it to the
``expiry_address`` when one is set, as for an exclusive consumer.

Time is real: messages are made old by waiting a few hundred milliseconds.
"""

from __future__ import annotations

import time

from conftest import taken_in_time

from pyspark_durable_queue import DurableQueue

TTL_MS = 300


def seqs(table):
    return table.column("_seq").to_pylist()


def test_a_nacked_row_whose_ttl_ended_is_settled_not_delivered_again(tmp_path):
    def setup(ttl):
        a = DurableQueue(str(tmp_path / str(ttl))).address("jobs")
        a.send([{"id": 0}], ttl_ms=ttl)
        a.send([{"id": 1}])
        c = a.consumer("pool", shared=True)
        return c, c.receive(2)

    ttl, c, got = taken_in_time(setup, TTL_MS)
    assert seqs(got) == [0, 1]
    c.nack(0, delay_ms=ttl + 100)  # due after it expired
    c.ack(1)
    time.sleep((ttl + 250) / 1000)
    assert c.receive(10, timeout_ms=300).num_rows == 0  # before: row 0 again
    state = c.state()
    assert not state.pending and not state.leases and state.ack_point == 2
    assert state.counters.get("expired") == 1 and not state.counters.get("redelivered")
    c.close()


def test_a_lapsed_lease_on_a_row_whose_ttl_ended_is_settled(tmp_path):
    def setup(ttl):
        a = DurableQueue(str(tmp_path / str(ttl))).address("jobs")
        a.send([{"id": 0}, {"id": 1}], ttl_ms=ttl)
        a.send([{"id": 2}])
        one = a.consumer("pool", shared=True, lease_ms=100, prefetch=1)
        return one, one.receive(1)  # held, never acknowledged: its lease lapses

    ttl, one, first = taken_in_time(setup, TTL_MS)
    assert seqs(first) == [0]
    time.sleep((ttl + 150) / 1000)
    two = DurableQueue(str(tmp_path / str(ttl))).address("jobs").consumer("pool", shared=True)
    assert seqs(two.receive(10)) == [2]  # not 0 (lapsed, expired), not 1 (expired)
    two.ack(2)
    assert two.state().ack_point == 3
    one.close()
    two.close()


def test_the_expiry_delay_applies_to_rows_waiting_for_redelivery(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", expiry_delay_ms=TTL_MS)
    a.send([{"id": 0}])
    c = a.consumer("pool", shared=True)
    c.nack(c.receive(1), delay_ms=TTL_MS + 100)
    time.sleep((TTL_MS + 250) / 1000)
    assert c.receive(10, timeout_ms=200).num_rows == 0
    assert c.state().ack_point == 1
    c.close()


def test_an_expired_row_a_shared_consumer_nacked_goes_to_the_expiry_address(tmp_path):
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", expiry_address="EXP")
    c = a.consumer("pool", shared=True)
    a.send([{"id": 0}], ttl_ms=TTL_MS)
    a.send([{"id": 1}])
    got = c.receive(2)
    c.nack(0, delay_ms=TTL_MS + 100)
    c.ack(1)
    time.sleep((TTL_MS + 250) / 1000)
    assert c.receive(10, timeout_ms=200).num_rows == 0
    report = a.move_expired()
    assert report.moved == 1
    exp = DurableQueue(root).address("EXP").consumer("check", start="earliest")
    dead = exp.receive(10)
    assert dead.column("origin_seq").to_pylist() == [0]
    assert dead.column("reason").to_pylist() == ["expired"]
    assert seqs(got) == [0, 1]
    exp.close()
    c.close()


# -- rows claimed ahead (prefetched) are checked again when handed out ---------------------------

def test_a_prefetched_row_whose_ttl_ended_is_not_handed_out(tmp_path):
    def setup(ttl):
        a = DurableQueue(str(tmp_path / str(ttl))).address("jobs")
        a.send([{"id": 0}, {"id": 1}, {"id": 2}], ttl_ms=ttl)
        a.send([{"id": 3}])
        c = a.consumer("pool", shared=True, prefetch=10)
        return c, c.receive(1)  # claims all four, hands out one

    ttl, c, first = taken_in_time(setup, TTL_MS)
    assert seqs(first) == [0]
    c.ack(0)
    time.sleep((ttl + 150) / 1000)
    assert seqs(c.receive(10)) == [3]  # before: 1 and 2 too, expired in memory
    c.ack(3)
    state = c.state()
    assert not state.pending and not state.leases and state.ack_point == 4
    assert state.counters.get("expired") == 2 and not state.counters.get("redelivered")
    c.close()


def test_a_prefetched_row_past_the_expiry_delay_is_not_handed_out(tmp_path):
    def setup(ttl):
        a = DurableQueue(str(tmp_path / str(ttl))).address("jobs", expiry_delay_ms=ttl)
        a.send([{"id": 0}, {"id": 1}])
        c = a.consumer("pool", shared=True, prefetch=10)
        return c, c.receive(1)

    ttl, c, first = taken_in_time(setup, TTL_MS)
    assert seqs(first) == [0]
    c.ack(0)
    time.sleep((ttl + 150) / 1000)
    assert c.receive(10, timeout_ms=100).num_rows == 0
    assert c.state().ack_point == 2
    c.close()


def test_prefetched_rows_read_again_keep_their_own_deadline(tmp_path):
    # the rows given back and claimed again are read again with the horizon of the read:
    # a long TTL row stays deliverable after a short one beside it expired
    def setup(ttl):
        a = DurableQueue(str(tmp_path / str(ttl))).address("jobs")
        a.send([{"id": 0}, {"id": 1}], ttl_ms=ttl)
        a.send([{"id": 2}], ttl_ms=60_000)
        c = a.consumer("pool", shared=True, prefetch=10)
        return c, c.receive(1)

    ttl, c, first = taken_in_time(setup, TTL_MS)
    assert seqs(first) == [0]
    time.sleep((ttl + 150) / 1000)
    assert seqs(c.receive(10)) == [2]
    assert seqs(c.receive(10)) == []
    c.ack([0, 2])
    assert c.state().ack_point == 3
    c.close()
