"""Cleanup removes pages whose every message expired (``expiry_delay_ms``, ``ttl_ms``), even
before consumers passed them: those messages are settled for every consumer, so a consumer
behind (the client, a Spark query) is not told they were lost. With an ``expiry_address``, only
pages the expiry moves have passed go.

Time is real: messages are made old by waiting a few hundred milliseconds.
"""

from __future__ import annotations

import logging
import time

import pytest

from pyspark_durable_queue import DurableQueue

TTL_MS = 300


def expire() -> None:
    time.sleep(TTL_MS / 1000 + 0.15)


def test_pages_whose_messages_all_expired_go_without_a_loss_for_consumers_behind(
        root, caplog):
    a = DurableQueue(root).address("jobs", journal=False, expiry_delay_ms=TTL_MS)
    c = a.consumer("w")  # behind: reads nothing before the cleanup
    for i in range(3):
        a.send([{"id": i}])
    expire()
    sent = time.time()
    a.send([{"id": 3}])
    report = a.cleanup(dry_run=False)
    assert len(report.pages) == 3 and report.expired_messages == 3
    assert report.expired == [(0, 3)] and report.retention_messages == 0
    state = a.log.refresh()
    assert len(state.pages) == 1 and state.expired_removed == [(0, 3)]
    assert state.lost_in(0, 4) == []
    with caplog.at_level(logging.WARNING):
        got = c.receive(10)
    if time.time() - sent < TTL_MS / 1000:  # a loaded machine may take longer than the delay
        assert got.column("id").to_pylist() == [3]
    assert "lost" not in caplog.text and c.position == 0  # nothing reported, nothing acked
    assert a.snapshot().gaps(0) == []
    c.close()


def test_pages_whose_messages_all_have_an_ended_ttl_go_and_the_others_stay(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", journal=False)
    c = a.consumer("w")
    a.send([{"id": 0}, {"id": 1}], ttl_ms=TTL_MS)  # a page of expired messages
    a.send([{"id": 2}])  # never expires
    a.send([{"id": 3}], ttl_ms=600_000)  # not yet
    expire()
    report = a.cleanup(dry_run=False)
    assert report.expired == [(0, 2)] and report.expired_messages == 2
    assert c.receive(10).column("id").to_pylist() == [2, 3]
    c.close()


def test_the_stream_reader_plans_over_removed_expired_pages_without_data_loss(tmp_path):
    from pyspark_durable_queue.spark._reader import read_schema
    from pyspark_durable_queue.spark._source import DurableQueueStreamReader

    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", journal=False, expiry_delay_ms=TTL_MS)
    a.send([{"id": 0}])
    options = {"path": root, "address": "jobs", "consumer": "spark",
               "startingOffsets": "earliest"}
    reader = DurableQueueStreamReader(options, read_schema(options))
    start = reader.initialOffset()
    assert start["seq"] == 0
    expire()
    a.send([{"id": 1}])
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert a.cleanup(dry_run=False).expired_messages == 1
    rows = [i for p in reader.partitions(start, end) for b in reader.read(p)
            for i in b.column("id").to_pylist()]
    assert rows == [1]  # failOnDataLoss (the default) did not fire
    reader.stop()


def test_with_an_expiry_address_pages_go_once_their_messages_were_moved(tmp_path):
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", journal=False, expiry_address="EXP")
    c = a.consumer("w")
    a.send([{"id": 0}], ttl_ms=TTL_MS)
    a.send([{"id": 1}], ttl_ms=600_000)  # holds the cursor: alive and not consumed
    a.send([{"id": 2}], ttl_ms=TTL_MS)
    expire()
    report = a.cleanup(dry_run=False)  # moves 0, stops at 1; removes only page 0
    assert report.expired == [(0, 1)]
    exp = DurableQueue(root).address("EXP")
    assert exp.stats()["next_seq"] == 1
    assert [r.name for r in a.log.refresh().pages.refs(0)] and len(a.log.refresh().pages) == 2
    c.close()


def test_checkpoints_keep_the_expired_ranges(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", journal=False, expiry_delay_ms=TTL_MS)
    a.consumer("w").close()
    a.send([{"id": 0}])
    expire()
    a.send([{"id": 1}])
    a.cleanup(dry_run=False)
    a.log.write_checkpoint(a.log.refresh())
    state = a.log.read_checkpoint(a.log.state.version)
    assert state is not None and state.expired_removed == [(0, 1)]
    assert state.expired_removed_messages == 1


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "page-files"])
def test_nothing_unexpired_goes(tmp_path, journal):
    a = DurableQueue(str(tmp_path)).address("jobs", journal=journal, expiry_delay_ms=60_000)
    c = a.consumer("w")
    a.send([{"id": i} for i in range(5)], ttl_ms=600_000)
    report = a.cleanup(dry_run=False)
    assert report.pages == [] and report.expired_messages == 0
    assert c.receive(10).num_rows == 5
    c.close()
