"""Several addresses in one Spark query: a list or Artemis wildcards in the option ``address``
on reads (streaming and batch), and routing by an ``_address`` column on writes. End to end
through ``format("durablequeue")`` with the session-scoped ``spark`` fixture; data is written
and checked with the Python client.
"""

from __future__ import annotations

import json
import pickle
import time
import uuid

import pytest
from test_address_names import legacy_comma_address

pytest.importorskip("pyspark")

import pyarrow as pa
from pyspark.sql import functions as F
from pyspark.sql import types as T

from pyspark_durable_queue import DurableQueue, InvalidNameError, InvalidOptionError
from pyspark_durable_queue._log.txn import streaming_txn
from pyspark_durable_queue._read.plan import Limits, share_limits
from pyspark_durable_queue.spark import DurableQueueDataSource
from pyspark_durable_queue.spark._sink import DurableQueueBatchWriter, DurableQueueStreamWriter


def send(root, name: str, ids: range, **settings) -> None:
    DurableQueue(str(root)).address(name, **settings).send(
        [{"id": i, "body": f"{name}-{i}"} for i in ids])


def finish(q, timeout: float = 180) -> None:
    try:
        ended = q.awaitTermination(timeout)
    finally:
        q.stop()
    assert ended, f"the query did not finish in {timeout} s"
    assert q.exception() is None


def stream_to_memory(spark, root, ckpt, address: str, consumer: str = "etl", *,
                     out=None, **options):
    """Run an AvailableNow query of ``address`` into a memory table (or parquet files at
    ``out``: a query restarting from its checkpoint needs a sink that recovers)."""
    reader = (spark.readStream.format("durablequeue").option("address", address)
              .option("consumer", consumer))
    for k, v in options.items():
        reader = reader.option(k, v)
    name = f"t_{uuid.uuid4().hex[:10]}"
    writer = reader.load(str(root)).writeStream
    writer = (writer.format("memory").queryName(name) if out is None
              else writer.format("parquet").option("path", str(out)))
    q = (writer.option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
    finish(q)
    return (spark.table(name) if out is None else spark.read.parquet(str(out))), q


def test_limits_are_shared_by_backlog():
    shares = share_limits(Limits(rows=100, bytes=1000, pages=None), {"a": 300, "b": 100, "c": 0})
    assert shares["a"] == Limits(75, 750, None) and shares["b"] == Limits(25, 250, None)
    assert shares["c"].rows == 0
    # one address keeps every limit, min_rows included; a tiny limit still moves each address
    assert share_limits(Limits(rows=5, min_rows=3), {"a": 9}) == {"a": Limits(5, None, None, 3)}
    assert share_limits(Limits(rows=1), {"a": 9, "b": 1}) == {"a": Limits(1), "b": Limits(1)}


def test_reader_plans_one_offset_per_address_and_partitions_name_theirs(root):
    """Without a JVM: the stream reader's calls as Spark makes them, the executor's pickled;
    on every backend."""
    send(root, "orders", range(30))
    send(root, "returns", range(100, 110))
    source = DurableQueueDataSource({"path": str(root), "address": "orders,returns",
                                     "consumer": "c", "maxMessagesPerTrigger": "20"})
    reader = source.streamReader(source.schema())
    try:
        start = reader.initialOffset()
        assert start == {"addresses": {"orders": {"seq": 0}, "returns": {"seq": 0}}}
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        assert end == {"addresses": {"orders": {"seq": 15}, "returns": {"seq": 5}}}
        parts = reader.partitions(start, end)
        # small tasks of several addresses share a Spark task (one task's overhead, not two)
        assert [type(p).__name__ for p in parts] == ["GroupPartition"]
        assert sorted(q.address for q in parts[0].parts) == ["orders", "returns"]
        copy = pickle.loads(pickle.dumps(reader))
        got = [(b.column("_address")[i].as_py(), b.column("id")[i].as_py())
               for p in parts for b in copy.read(pickle.loads(pickle.dumps(p)))
               for i in range(b.num_rows)]
        assert sorted(got) == [("orders", i) for i in range(15)] + \
            [("returns", i) for i in range(100, 105)]
        assert all(len(pickle.dumps(p)) < 2000 for p in parts)
        reader.commit(end)
        assert positions(root, ["orders", "returns"], "c") == {"orders": 15, "returns": 5}
        with pytest.raises(InvalidOptionError, match="several addresses"):
            reader.partitions({"seq": 0}, end)  # a one-address checkpoint: refused, named
    finally:
        reader.stop()


def test_a_quoted_name_reads_an_address_with_a_comma(spark, tmp_path):
    legacy_comma_address(tmp_path)
    df = (spark.read.format("durablequeue").option("address", "`a,b`").load(str(tmp_path)))
    assert sorted(r.id for r in df.collect()) == [1, 2]
    assert df.columns == ["id", "_seq", "_timestamp"]  # one address: no _address column
    got, _ = stream_to_memory(spark, tmp_path, tmp_path / "ck", "`a,b`")
    assert sorted(r.id for r in got.collect()) == [1, 2]


def rows_of(df) -> list[tuple[str, int]]:
    return sorted((r._address, r.id) for r in df.select("_address", "id").collect())


def positions(root, names, consumer: str) -> dict[str, int]:
    q = DurableQueue(str(root))
    return {n: q.address(n).consumers()[consumer]["position"] for n in names}


def test_one_stream_reads_several_addresses_with_one_offset_each(spark, tmp_path):
    send(tmp_path, "orders", range(0, 300), page_size_bytes=4096)
    send(tmp_path, "returns", range(1000, 1100), page_size_bytes=4096)
    ck, out = tmp_path / "ck", tmp_path / "out"
    got, q = stream_to_memory(spark, tmp_path, ck, "orders,returns", out=out,
                              maxMessagesPerTrigger=80, selector="id < 200 OR id >= 1050")
    assert got.columns == ["id", "body", "_seq", "_timestamp", "_address"]
    assert rows_of(got) == [("orders", i) for i in range(200)] + \
        [("returns", i) for i in range(1050, 1100)]
    # admission control holds for the batch as a whole (one extra message per address at most)
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert len(sizes) >= 250 // 82 and max(sizes) <= 82, sizes
    offset = q.recentProgress[-1]["sources"][0]["endOffset"]
    assert json.loads(offset) == {"addresses": {"orders": {"seq": 300}, "returns": {"seq": 100}}}
    assert positions(tmp_path, ["orders", "returns"], "etl") == {"orders": 300, "returns": 100}
    # a restart from the checkpoint reads only what came since, from each address
    send(tmp_path, "returns", range(1100, 1110))
    send(tmp_path, "orders", range(300, 305))
    again, _ = stream_to_memory(spark, tmp_path, ck, "orders,returns", out=out,
                                selector="id < 200 OR id >= 1050")
    assert rows_of(again) == rows_of(got) + [("returns", i) for i in range(1100, 1110)]


def test_one_address_keeps_its_schema_and_offsets(spark, tmp_path):
    send(tmp_path, "orders", range(5))
    got, q = stream_to_memory(spark, tmp_path, tmp_path / "ck", "orders")
    assert got.columns == ["id", "body", "_seq", "_timestamp"]
    assert json.loads(q.recentProgress[-1]["sources"][0]["endOffset"]) == {"seq": 5}


def test_batch_read_of_several_addresses(spark, tmp_path):
    send(tmp_path, "orders", range(0, 50))
    DurableQueue(str(tmp_path)).address("returns").send([{"id": 7, "reason": "late"}])
    df = (spark.read.format("durablequeue").option("address", "returns, orders")
          .load(str(tmp_path)))
    assert df.columns == ["id", "reason", "body", "_seq", "_timestamp", "_address"]
    rows = df.collect()
    assert len(rows) == 51
    assert {(r._address, r.reason, r.body is None) for r in rows if r.id == 7} == {
        ("returns", "late", True), ("orders", None, False)}
    # a where on _address is not pushed to the store as a selector: Spark applies it
    assert df.where("_address = 'orders' AND id >= 45").count() == 5
    assert df.where("id < 8").count() == 9  # pushed as a selector, compiled per address
    every = spark.read.format("durablequeue").option("address", "*").load(str(tmp_path))
    assert every.groupBy("_address").count().orderBy("_address").collect() == [
        ("orders", 50), ("returns", 1)]
    with pytest.raises(Exception, match="_seq in startingPosition means nothing"):
        (spark.read.format("durablequeue").option("address", "orders,returns")
         .option("startingOffsets", "5").load(str(tmp_path)).collect())


def test_a_pattern_picks_up_an_address_created_while_the_query_runs(spark, tmp_path):
    send(tmp_path, "orders", range(0, 5))
    send(tmp_path, "orders.eu", range(100, 103))
    send(tmp_path, "ordersx", range(900, 901))  # not a word match
    send(tmp_path, "returns.eu", range(800, 801))  # another word
    name = f"t_{uuid.uuid4().hex[:10]}"
    df = (spark.readStream.format("durablequeue").option("address", "orders.#")
          .option("consumer", "all-orders").load(str(tmp_path)))
    q = (df.writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="500 milliseconds").start())
    try:
        expected = [("orders", i) for i in range(5)] + [("orders.eu", i) for i in range(100, 103)]
        wait_for(lambda: rows_of(spark.table(name)) == expected, q)
        # created after the query started, with messages before the next micro-batch looks:
        # read from its earliest message, as Kafka's subscribePattern does
        send(tmp_path, "orders.us.west", range(200, 204))
        send(tmp_path, "orders.eu", range(103, 105))
        expected += [("orders.eu", 103), ("orders.eu", 104)] + \
            [("orders.us.west", i) for i in range(200, 204)]
        wait_for(lambda: rows_of(spark.table(name)) == sorted(expected), q)
        offset = {"addresses": {"orders": {"seq": 5}, "orders.eu": {"seq": 5},
                                "orders.us.west": {"seq": 4}}}
        wait_for(lambda: any(json.loads(p["sources"][0]["endOffset"] or "{}") == offset
                             for p in q.recentProgress), q)
        # Spark commits a batch's end to the source when it plans the next batch: until then
        # the consumer's watermark stays where it was (on a slow cluster, past the wait above)
        wait_for(lambda: DurableQueue(str(tmp_path)).address("orders.us.west").consumers()
                 .get("all-orders", {}).get("position") == 4, q)
    finally:
        q.stop()
    assert q.exception() is None
    consumers = DurableQueue(str(tmp_path)).address("orders.us.west").consumers()
    assert consumers["all-orders"]["position"] == 4
    assert "all-orders" not in DurableQueue(str(tmp_path)).address("ordersx").consumers()


def wait_for(condition, q, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert q.exception() is None, q.exception()
        if condition():
            return
        time.sleep(0.3)
    raise AssertionError(f"not reached within {timeout} s")


# -- routing on write ---------------------------------------------------------------------------
ROUTED = T.StructType([T.StructField("id", T.LongType()),
                       T.StructField("_address", T.StringType())])


def routed_batch(ids, names) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(list(ids), pa.int64()),
                            "_address": pa.array(list(names))})


def ids_in(root, name: str) -> list[int]:
    address = DurableQueue(str(root)).address(name, create=False)
    consumer = address.consumer("check", start="earliest")
    table = consumer.receive(100_000)
    consumer.delete()
    assert "_address" not in table.column_names  # routing, not stored
    return sorted(table.column("id").to_pylist())


def page_exists(root, name: str, page: str) -> bool:
    address = DurableQueue(str(root)).address(name, create=False)
    return address.storage.exists(f"{address.layout.pages}/{page}")


def test_a_rerun_batch_completes_the_addresses_it_missed_and_repeats_none(root, tmp_path):
    """Without a JVM: a driver that died between two addresses' commits of batch 7; Spark
    re-runs the batch (new tasks, new pages) and commits it again under the same key. On every
    backend (the checkpoint, Spark's, stays on the local disk)."""
    options = {"path": str(root), "checkpointlocation": str(tmp_path / "ck")}

    def task_output():
        writer = pickle.loads(pickle.dumps(DurableQueueStreamWriter(options, ROUTED, False)))
        message = writer.write(iter([routed_batch(range(6), ["a", "b", "c"] * 2)]))
        message.query_id, message.batch_id = "q-1", 7  # as a task of query q-1 reports them
        return pickle.loads(pickle.dumps(message))

    first = task_output()
    driver = DurableQueueStreamWriter(options, ROUTED, False)
    # the crash: only address "a" got its commit
    driver._publish_to(driver._target_of("a"), first.routed["a"],
                       streaming_txn(7, query_id="q-1", checkpoint=None))
    rerun = task_output()
    DurableQueueStreamWriter(options, ROUTED, False).commit([rerun], 7)
    assert {n: ids_in(root, n) for n in "abc"} == {"a": [0, 3], "b": [1, 4], "c": [2, 5]}
    # once more (a second restart): nothing anywhere, and the re-run's pages are gone
    third = task_output()
    written = {n: [p.name for p in pages] for n, pages in third.routed.items()}
    assert all(page_exists(root, n, p) for n in written for p in written[n])
    DurableQueueStreamWriter(options, ROUTED, False).commit([third], 7)
    assert {n: ids_in(root, n) for n in "abc"} == {"a": [0, 3], "b": [1, 4], "c": [2, 5]}
    # the duplicate's pages are deleted (the crashed run's b and c pages are orphans, which
    # cleanup removes after orphanGraceMs)
    assert not any(page_exists(root, n, p) for n in written for p in written[n])


def test_routing_refuses_a_null_address_and_needs_a_column_or_the_option(tmp_path):
    writer = DurableQueueBatchWriter({"path": str(tmp_path)}, ROUTED, False)
    with pytest.raises(InvalidOptionError, match="1 rows have a null _address"):
        writer.write(iter([routed_batch([1, 2], ["a", None])]))
    assert DurableQueue(str(tmp_path)).addresses() in ([], ["a"])
    plain = T.StructType([T.StructField("id", T.LongType())])
    with pytest.raises(InvalidOptionError, match="or an _address column"):
        DurableQueueBatchWriter({"path": str(tmp_path)}, plain, False)
    with pytest.raises(InvalidNameError, match="'a,b'"):
        writer.write(iter([routed_batch([1], ["a,b"])]))


def test_a_stream_fans_out_by_its_address_column_exactly_once(spark, tmp_path):
    DurableQueue(str(tmp_path)).address("orders").send(
        [{"id": i, "region": ["eu", "us"][i % 2]} for i in range(40)])
    ck = tmp_path / "ck"

    def run():
        q = (spark.readStream.format("durablequeue").option("address", "orders")
             .option("consumer", "router").option("maxMessagesPerTrigger", 15)
             .load(str(tmp_path))
             .select("id", F.concat(F.lit("orders."), "region").alias("_address"))
             .writeStream.format("durablequeue").option("checkpointLocation", str(ck))
             .trigger(availableNow=True).start(str(tmp_path)))
        finish(q)

    run()
    assert ids_in(tmp_path, "orders.eu") == list(range(0, 40, 2))
    assert ids_in(tmp_path, "orders.us") == list(range(1, 40, 2))
    DurableQueue(str(tmp_path)).address("orders").send([{"id": 40, "region": "eu"}])
    run()  # restart from the checkpoint: only the new row, in its address
    assert ids_in(tmp_path, "orders.eu") == list(range(0, 41, 2))
    assert ids_in(tmp_path, "orders.us") == list(range(1, 40, 2))
    # a batch write: the address option wins over the column, which is not stored
    (spark.createDataFrame([(100, "orders.us")], "id long, _address string").write
     .format("durablequeue").option("address", "audit").mode("append").save(str(tmp_path)))
    assert ids_in(tmp_path, "audit") == [100]
    assert ids_in(tmp_path, "orders.us") == list(range(1, 40, 2))


def test_a_pattern_query_goes_on_when_one_of_its_addresses_is_deleted(root, caplog):
    """Without a JVM: an address a pattern matched is deleted between micro-batches: the
    next plan warns, keeps its entry in the offset unread, and the others go on."""
    import logging

    send(root, "orders.a", range(10))
    send(root, "orders.b", range(100, 110))
    source = DurableQueueDataSource({"path": str(root), "address": "orders.*",
                                     "consumer": "c"})
    reader = source.streamReader(source.schema())
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        assert end == {"addresses": {"orders.a": {"seq": 10}, "orders.b": {"seq": 10}}}
        reader.commit(end)
        DurableQueue(str(root)).delete_address("orders.b")
        send(root, "orders.a", range(10, 15))
        with caplog.at_level(logging.WARNING):
            later = reader.latestOffset(end, reader.getDefaultReadLimit())
        assert "were deleted while query of consumer 'c' read them" in caplog.text
        assert later == {"addresses": {"orders.a": {"seq": 15}, "orders.b": {"seq": 10}}}
        got = sorted(b.column("id")[i].as_py() for p in reader.partitions(end, later)
                     for b in reader.read(p) for i in range(b.num_rows))
        assert got == list(range(10, 15))
        reader.commit(later)
        assert positions(root, ["orders.a"], "c") == {"orders.a": 15}
        assert "orders.b" not in DurableQueue(str(root)).addresses()  # not recreated
    finally:
        reader.stop()
