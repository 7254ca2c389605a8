"""Expiry (``expiry_delay_ms``, Artemis' ``expiry-delay``): a message is never delivered once it
is older than the delay, and counts as settled for every consumer; Spark reads apply expiry as
of the batch's plan, recorded in the end offset, so a replayed batch reads the same rows.

Time is real (messages are made old by waiting a few hundred milliseconds): ``_timestamp`` is
the commit time the store wrote, which nothing in the client can set.
"""

from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._options import parse_options
from pyspark_durable_queue.errors import InvalidOptionError
from pyspark_durable_queue.settings import AddressSettings

DELAY_MS = 400


def aged(root, **settings):
    """An address with ids 0..4 sent more than ``DELAY_MS`` ago and 5..9 just now."""
    a = DurableQueue(root).address("jobs", expiry_delay_ms=DELAY_MS, **settings)
    a.consumer("w")  # created before the sends: it starts at the first one
    a.send([{"id": i} for i in range(5)])
    time.sleep(DELAY_MS / 1000 + 0.1)
    aged.fresh_sent = time.time()  # before the fresh ones were committed
    a.send([{"id": i} for i in range(5, 10)])
    return a


def test_the_option_has_artemis_name_and_defaults_to_never():
    assert AddressSettings().expiry_delay_ms == -1 and AddressSettings().expire_before() is None
    assert parse_options({"expiryDelayMs": "30s"}, "address")["expiry_delay_ms"] == 30_000
    assert parse_options({"expiry-delay": 5}, "address")["expiry_delay_ms"] == 5
    with pytest.raises(InvalidOptionError):
        parse_options({"expiry_delay_ms": 0}, "address")


def test_expired_messages_are_never_delivered_and_the_rest_are(root):
    a = aged(root)
    c = a.consumer("w")
    got = c.receive(100)
    done = time.time()
    ids = got.column("id").to_pylist()
    assert set(ids) <= {5, 6, 7, 8, 9}  # the old ones expired
    if done - aged.fresh_sent < DELAY_MS / 1000:  # none of the fresh ones can have expired yet
        assert ids == [5, 6, 7, 8, 9]
    c.ack(got)
    assert DurableQueue(root).address("jobs").stats()["consumers"]["w"]["position"] == 10


def test_a_receive_of_one_skips_expired_messages_without_returning_empty(tmp_path):
    a = aged(str(tmp_path))
    c = a.consumer("w")
    assert [m["id"] for m in c.messages(timeout_ms=0)] == [5, 6, 7, 8, 9]


def test_without_expiry_old_messages_are_delivered(tmp_path):
    a = aged(str(tmp_path))
    a = DurableQueue(str(tmp_path)).address("jobs", expiry_delay_ms=-1)  # switched off
    assert a.consumer("w").receive(100).column("id").to_pylist() == list(range(10))


def test_a_nacked_message_that_expires_while_it_waits_is_settled(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", expiry_delay_ms=DELAY_MS)
    a.send([{"id": 0}, {"id": 1}])
    c = a.consumer("w")
    got = c.receive(2)
    c.nack(got.slice(0, 1), delay_ms=DELAY_MS + 200)  # due after it expired
    c.ack(got)  # cumulative: 1 settles, 0 stays pending
    assert c.position == 0
    time.sleep((DELAY_MS + 300) / 1000)
    assert c.receive(10).num_rows == 0
    c.flush()
    stats = DurableQueue(str(tmp_path)).address("jobs").stats()["consumers"]["w"]
    assert stats["position"] == 2 and stats["redelivery_pending"] == 0


def test_stats_count_expired_messages(tmp_path):
    a = aged(str(tmp_path), journal=False)  # a page file per send: whole pages expire
    assert a.stats()["expired_messages"] == 5
    assert DurableQueue(str(tmp_path)).address("other").stats()["expired_messages"] == 0


def test_the_stream_reader_replays_a_planned_batch_with_the_same_rows(tmp_path):
    # the source's own methods, as Spark's driver and executors call them (no JVM needed)
    from pyspark_durable_queue.spark._reader import read_schema
    from pyspark_durable_queue.spark._source import DurableQueueStreamReader

    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", expiry_delay_ms=DELAY_MS)
    a.send([{"id": i} for i in range(5)])
    options = {"path": root, "address": "jobs", "consumer": "spark"}
    reader = DurableQueueStreamReader(options, read_schema(options))
    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert end["seq"] == 5 and end["expire_before"] <= time.time() * 1e6 - DELAY_MS * 1000

    def rows():
        return sorted(i for p in reader.partitions(start, end) for b in reader.read(p)
                      for i in pa.Table.from_batches([b]).column("id").to_pylist())

    assert rows() == [0, 1, 2, 3, 4]
    time.sleep(DELAY_MS / 1000 + 0.1)  # every message has expired since the plan
    assert rows() == [0, 1, 2, 3, 4]  # a replay after a driver restart: the same rows
    # a batch planned now drops them; with nothing new, the offset does not change
    fresh = reader.latestOffset(end, reader.getDefaultReadLimit())
    assert fresh == end
    a.send([{"id": 5}])
    time.sleep(0.01)
    later = reader.latestOffset(end, reader.getDefaultReadLimit())
    assert later["seq"] == 6 and later["expire_before"] > end["expire_before"]


@pytest.mark.spark
def test_spark_reads_drop_expired_messages_and_record_the_cutoff_in_the_offset(spark, tmp_path):
    # every message has expired before Spark plans (a query takes seconds to start, longer
    # than a test should wait for fresh ones to stay fresh): none is read, the batch's offset
    # holds its cutoff, and the consumer settles past them
    import json

    from conftest import finish_query

    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("jobs", expiry_delay_ms=DELAY_MS)
    a.send([{"id": i} for i in range(5)])
    time.sleep(DELAY_MS / 1000 + 0.1)
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (spark.readStream.format("durablequeue").option("address", "jobs")
         .option("consumer", "spark").load(root).writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True)
         .start())
    finish_query(q)
    assert spark.table(name).count() == 0
    offsets = (tmp_path / "ck" / "offsets" / "0").read_text().splitlines()
    end = json.loads(offsets[-1])
    assert end["seq"] == 5 and end["expire_before"] > 0
    batch = spark.read.format("durablequeue").option("address", "jobs").load(root)
    assert batch.count() == 0
    unexpired = DurableQueue(root).address("jobs", expiry_delay_ms=-1)  # switched off
    assert unexpired.consumer("look").receive(10).num_rows == 5
