"""The Spark sink: ``df.write`` / ``df.writeStream`` ``.format("durablequeue")``.

Writer construction and pickling are checked without a JVM; everything else goes through Spark
(the session-scoped ``spark`` fixture) and is checked with the Python client.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import json_input_files

pytest.importorskip("pyspark")

from pyspark.sql import types as T

from pyspark_durable_queue import (
    DurableQueue,
    InvalidOptionError,
    SchemaMismatchError,
)
from pyspark_durable_queue._format.page import PageInfo
from pyspark_durable_queue.spark._sink import (
    DurableQueueBatchWriter,
    DurableQueueCommitMessage,
    DurableQueueStreamWriter,
)

SCHEMA = T.StructType([T.StructField("id", T.LongType()), T.StructField("body", T.StringType())])


def read_all(root, name: str) -> pa.Table:
    """Every message of an address, through the Python client (a throwaway consumer)."""
    address = DurableQueue(str(root)).address(name, create=False)
    consumer = address.consumer("test-read-all", start="earliest")
    parts = list(consumer.batches(max_messages=1_000_000, max_bytes=1 << 30))
    consumer.delete()
    if not parts:
        return pa.table({})
    return pa.concat_tables(parts)


def page_files(root, name: str) -> list[str]:
    return sorted(p.name for p in (Path(root) / name / "pages").glob("*.page"))


def live_page_files(address) -> list[str]:
    """The page files the log names (a local address created by a client send keeps that
    send's messages in a journal segment, which is no page file)."""
    return sorted(n for n in address.state.pages.names if n.endswith(".page"))


def finish(q, timeout: float = 180) -> None:
    """Wait for a query that should end by itself (``availableNow``), stop it whatever
    happens, and check that it ended in time and without an error."""
    try:
        ended = q.awaitTermination(timeout)
    finally:
        q.stop()
    assert ended, f"the query did not finish in {timeout} s"
    assert q.exception() is None


def fail(q, timeout: float = 120) -> str:
    """Wait for a query that should fail, stop it whatever happens; returns the error text."""
    try:
        with pytest.raises(Exception) as info:
            q.awaitTermination(timeout)  # returns False (no error: the test fails) on time-out
    finally:
        q.stop()
    assert q.exception() is not None
    return error_text(info.value)


def error_text(exc: BaseException) -> str:
    """Spark wraps Python errors; the class name and message are in the text somewhere."""
    parts = []
    while exc is not None:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


# -- without a JVM ----------------------------------------------------------------------------
def test_writer_and_commit_message_pickle_small(tmp_path):
    opts = {"path": str(tmp_path / "dq"), "address": "orders", "pageSizeBytes": "1MiB",
            "addressFullPolicy": "block", "checkpointlocation": str(tmp_path / "ckpt")}
    for cls in (DurableQueueBatchWriter, DurableQueueStreamWriter):
        writer = cls(opts, SCHEMA, False)
        blob = pickle.dumps(writer)
        assert len(blob) < 4096
        copy = pickle.loads(blob)
        assert copy.schema == writer.schema
        assert copy.address.settings.page_size_bytes == 1 << 20
        assert copy.address.settings.address_full_policy == "BLOCK"
    page = PageInfo("0123456789abcdef0123456789abcdef.page", 3, 10, {"rows": 3, "columns": {}})
    message = DurableQueueCommitMessage([page], 3, "query-id", 7)
    assert pickle.loads(pickle.dumps(message)) == message
    assert len(pickle.dumps(message)) < 600


def test_task_write_then_commit_without_spark(tmp_path):
    """The task side and the driver side meet only through the (pickled) commit message."""
    opts = {"path": str(tmp_path / "dq"), "address": "a"}
    writer = pickle.loads(pickle.dumps(DurableQueueStreamWriter(opts, SCHEMA, False)))
    batch = pa.record_batch({"id": pa.array([1, 2, 3]), "body": ["a", "é", None]})
    message = pickle.loads(pickle.dumps(writer.write(iter([batch]))))
    assert message.rows == 3 and len(message.pages) == 1
    assert read_all(tmp_path / "dq", "a").num_rows == 0  # invisible until committed
    committer = DurableQueueStreamWriter(opts, SCHEMA, False)  # as Spark's fresh process does
    message.query_id = "q1"
    committer.commit([message], 0)
    committer.commit([message], 0)  # a re-run of batch 0: deduplicated
    table = read_all(tmp_path / "dq", "a")
    assert table.column("body").to_pylist() == ["a", "é", None]


def test_storage_options_reach_the_store_and_travel_to_tasks(tmp_path):
    opts = {"path": str(tmp_path / "dq"), "address": "a", "storage.anon": "true",
            "storage.endpoint_url": "http://127.0.0.1:9", "storageOptions": '{"key": "k"}'}
    writer = pickle.loads(pickle.dumps(DurableQueueBatchWriter(opts, SCHEMA, False)))
    assert writer.address.storage.storage_options == {
        "key": "k", "anon": True, "endpoint_url": "http://127.0.0.1:9"}
    with pytest.raises(InvalidOptionError, match="storageOptions"):
        DurableQueueBatchWriter(dict(opts, storageOptions="[1]"), SCHEMA, False)


def test_options_validated_together(tmp_path):
    opts = {"path": str(tmp_path / "dq"), "address": "a", "pageSizeByte": "1",
            "addressFullPolicy": "SOMETIMES", "maxSizeBytes": "lots"}
    with pytest.raises(InvalidOptionError) as info:
        DurableQueueBatchWriter(opts, SCHEMA, False)
    text = str(info.value)
    assert "pageSizeByte" in text and "accepted options" in text
    assert "addressFullPolicy='SOMETIMES'" in text and "PAGE, DROP, FAIL, BLOCK" in text
    assert "maxSizeBytes='lots'" in text
    assert not (tmp_path / "dq").exists()  # nothing created on bad options


def test_missing_address_and_overwrite_refused(tmp_path):
    with pytest.raises(InvalidOptionError, match="'address'"):
        DurableQueueBatchWriter({"path": str(tmp_path)}, SCHEMA, False)
    with pytest.raises(InvalidOptionError, match="append-only"):
        DurableQueueStreamWriter({"path": str(tmp_path), "address": "a"}, SCHEMA, True)


def test_reserved_columns_refused(tmp_path):
    schema = T.StructType([T.StructField("_seq", T.LongType()), T.StructField("x", T.LongType())])
    with pytest.raises(SchemaMismatchError, match="_seq"):
        DurableQueueBatchWriter({"path": str(tmp_path), "address": "a"}, schema, False)


@pytest.mark.parametrize(
    ("options", "needles"),
    [
        pytest.param({"txnAppId": "etl"}, ["txnAppId", "txnVersion", "without"], id="id-only"),
        pytest.param({"txnVersion": "3"}, ["txnAppId", "txnVersion", "without"], id="ver-only"),
        pytest.param({"txnAppId": "etl", "txnVersion": "-1"}, ["txnVersion='-1'"], id="neg"),
        pytest.param({"txnAppId": "etl", "txnVersion": "1.5"}, ["txnVersion='1.5'"], id="frac"),
        pytest.param({"txnAppId": "etl", "txnVersion": "1k"}, ["txnVersion='1k'"], id="suffix"),
        pytest.param({"txnAppId": "", "txnVersion": "1"}, ["txnAppId=''"], id="empty-id"),
    ],
)
def test_txn_options_validated(tmp_path, options, needles):
    opts = {"path": str(tmp_path / "dq"), "address": "a", **options}
    with pytest.raises(InvalidOptionError) as info:
        DurableQueueBatchWriter(opts, SCHEMA, False)
    for needle in needles:
        assert needle in str(info.value)
    assert not (tmp_path / "dq").exists()


def test_txn_options_refused_on_a_streaming_write(tmp_path):
    opts = {"path": str(tmp_path / "dq"), "address": "a", "txnAppId": "etl", "txnVersion": "0"}
    with pytest.raises(InvalidOptionError, match="for batch writes"):
        DurableQueueStreamWriter(opts, SCHEMA, False)


def test_batch_txn_without_spark(tmp_path, caplog):
    """Driver and tasks as Spark runs them, twice with one (txnAppId, txnVersion): the second
    write's tasks write no page and its commit stores nothing; the client's send(txn=) is the
    same transaction."""
    root = tmp_path / "dq"
    opts = {"path": str(root), "address": "a", "txnAppId": "etl", "TXNVERSION": "7"}
    batch = pa.record_batch({"id": pa.array([1, 2, 3]), "body": ["a", "b", "c"]})
    for attempt in range(2):
        writer = DurableQueueBatchWriter(opts, SCHEMA, False)
        task = pickle.loads(pickle.dumps(writer))
        message = pickle.loads(pickle.dumps(task.write(iter([batch]))))
        assert len(message.pages) == (1 if attempt == 0 else 0)
        with caplog.at_level("WARNING", logger="pyspark_durable_queue.spark._sink"):
            writer.commit([message])
    assert "txnAppId='etl' txnVersion=7" in caplog.text and "skipped" in caplog.text
    assert read_all(root, "a").column("id").to_pylist() == [1, 2, 3]
    address = DurableQueue(str(root)).address("a")
    assert address.state.txns == {"app:etl": 7}
    assert page_files(root, "a") == sorted(address.state.pages.names)
    assert address.send([{"id": 9, "body": "x"}], txn=("etl", 7)).duplicate
    assert address.send([{"id": 9, "body": "x"}], txn=("etl", 8)).count == 1
    # and a Spark write of a version the client already committed is skipped too
    writer = DurableQueueBatchWriter(dict(opts, TXNVERSION="8"), SCHEMA, False)
    writer.commit([writer.write(iter([batch]))])
    assert read_all(root, "a").column("id").to_pylist() == [1, 2, 3, 9]


# -- through Spark ----------------------------------------------------------------------------
ALL_TYPES = T.StructType([
    T.StructField("id", T.LongType(), False),
    T.StructField("b", T.BooleanType()),
    T.StructField("i8", T.ByteType()),
    T.StructField("i16", T.ShortType()),
    T.StructField("i32", T.IntegerType()),
    T.StructField("f32", T.FloatType()),
    T.StructField("f64", T.DoubleType()),
    T.StructField("dec", T.DecimalType(38, 10)),
    T.StructField("s", T.StringType()),
    T.StructField("bin", T.BinaryType()),
    T.StructField("d", T.DateType()),
    T.StructField("ts", T.TimestampType()),
    T.StructField("ntz", T.TimestampNTZType()),
    T.StructField("arr", T.ArrayType(T.StringType())),
    T.StructField("m", T.MapType(T.StringType(), T.ArrayType(T.LongType()))),
    T.StructField("st", T.StructType([
        T.StructField("x", T.DoubleType()),
        T.StructField("inner", T.StructType([T.StructField("tags", T.ArrayType(T.StringType())),
                                             T.StructField("when", T.TimestampType())])),
    ])),
])

UTC = dt.timezone.utc
ROWS = [
    (1, True, 1, 2, 3, 1.5, 2.25, decimal.Decimal("12345678901234567890.0123456789"),
     "plain", b"\x00\xff", dt.date(2024, 2, 29), dt.datetime(2024, 3, 1, 12, 0, tzinfo=UTC),
     dt.datetime(2024, 3, 1, 12, 0), ["a", None], {"k": [1, None]},
     {"x": 1.0, "inner": {"tags": ["t"], "when": dt.datetime(1969, 12, 31, 23, 59, tzinfo=UTC)}}),
    (2, None, None, None, None, None, None, None, None, None, None, None, None, None, None, None),
    (3, False, -128, -32768, -(2 ** 31), float("inf"), float("nan"),
     decimal.Decimal("-0.0000000001"),
     "ünïcødé 日本語 🚀 \u0000 \U0010ffff", b"", dt.date(1, 1, 1),
     dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), dt.datetime(1, 1, 1), [],
     {}, {"x": None, "inner": None}),
    (4, True, 127, 32767, 2 ** 31 - 1, -0.0, 1e308, decimal.Decimal("0"), "", b"x" * 1000,
     dt.date(1970, 1, 1), dt.datetime(1900, 1, 1, tzinfo=UTC), None, [None], {"n": None},
     {"x": 3.0, "inner": {"tags": None, "when": None}}),
]


def _normalize(value):
    """Values as collect() returns them, comparable to what the client returns."""
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalize(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(UTC).replace(tzinfo=None)
    if isinstance(value, bytearray):
        return bytes(value)
    return value


@pytest.mark.spark
def test_batch_write_round_trips_all_arrow_types(spark, tmp_path):
    root = tmp_path / "dq"
    previous = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "Asia/Kolkata")  # the sink stores UTC
    try:
        df = spark.createDataFrame(ROWS, ALL_TYPES).repartition(2)
        df.write.format("durablequeue").option("address", "types").mode("append").save(str(root))
        expected = {r["id"]: r.asDict(recursive=True) for r in df.collect()}
    finally:
        spark.conf.set("spark.sql.session.timeZone", previous)
    table = read_all(root, "types")
    assert table.schema.field("ts").type == pa.timestamp("us", tz="UTC")
    assert table.schema.field("ntz").type == pa.timestamp("us")
    assert table.schema.field("dec").type == pa.decimal128(38, 10)
    got = {}
    for row in table.to_pylist():
        seq = row.pop("_seq")
        assert seq in range(4) and row.pop("_timestamp") is not None
        assert row.pop("_delivery_count") == 1  # read by a consumer: its first delivery
        if row["m"] is not None:
            row["m"] = dict(row["m"])
        got[row["id"]] = row
    assert got.keys() == expected.keys()
    for key in expected:
        assert _normalize(got[key]) == _normalize(expected[key]), key
    assert got[3]["s"] == "ünïcødé 日本語 🚀 \u0000 \U0010ffff"
    # one commit entry for the whole write
    assert DurableQueue(str(root)).address("types").state.version == 1


@pytest.mark.spark
def test_settings_given_as_options_persist(spark, tmp_path):
    root = str(tmp_path / "dq")
    spark.range(10).write.format("durablequeue").option("address", "cfg") \
        .option("pageSizeBytes", "64KiB").option("max-size-messages", 1000) \
        .option("addressFullPolicy", "drop").option("FSYNC", "false").mode("append").save(root)
    settings = DurableQueue(root).address("cfg").settings
    assert settings.page_size_bytes == 64 * 1024
    assert settings.max_size_messages == 1000
    assert settings.address_full_policy == "DROP"
    assert settings.fsync == "always"  # the write's own choice, not persisted for others
    persisted = json.loads((tmp_path / "dq" / "cfg" / "address.json").read_text())["settings"]
    assert persisted["address_full_policy"] == "DROP" and "fsync" not in persisted


@pytest.mark.spark
def test_bad_options_and_overwrite_fail_through_spark(spark, tmp_path):
    root = str(tmp_path / "dq")
    df = spark.range(3)
    with pytest.raises(Exception) as info:
        df.write.format("durablequeue").option("address", "a").option("colour", "red") \
            .option("blockTimeoutMs", "-5").mode("append").save(root)
    text = error_text(info.value)
    assert "InvalidOptionError" in text and "colour" in text and "blockTimeoutMs" in text
    with pytest.raises(Exception) as info:
        df.write.format("durablequeue").option("address", "a").mode("overwrite").save(root)
    assert "append-only" in error_text(info.value)
    # A streaming writer is built when the first micro-batch is planned: the query fails then,
    # before any task runs.
    q = spark.readStream.format("rate").load().writeStream.format("durablequeue") \
        .option("address", "a").option("checkpointLocation", str(tmp_path / "ck")) \
        .option("pageSizeBytes", "tiny").start(root)
    text = fail(q)
    assert "InvalidOptionError" in text
    assert "pageSizeBytes" in text


@pytest.mark.spark
def test_schema_mismatch_fails_fast_and_merge_schema_adds_columns(spark, tmp_path):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("s").send([{"id": 1, "body": "x"}])
    with pytest.raises(Exception) as info:
        spark.createDataFrame([("a", 2)], "id string, body long").write \
            .format("durablequeue").option("address", "s").mode("append").save(root)
    text = error_text(info.value)
    assert "SchemaMismatchError" in text and "'id'" in text
    with pytest.raises(Exception) as info:
        spark.createDataFrame([(2, "y", 1.5)], "id long, body string, extra double").write \
            .format("durablequeue").option("address", "s").mode("append").save(root)
    assert "mergeSchema" in error_text(info.value)
    spark.createDataFrame([(2, "y", 1.5)], "id int, body string, extra double").write \
        .format("durablequeue").option("address", "s").option("mergeSchema", "true") \
        .mode("append").save(root)
    table = read_all(root, "s")
    assert table.column("id").to_pylist() == [1, 2]  # int widened to the address's int64
    assert table.column("extra").to_pylist() == [None, 1.5]


@pytest.mark.spark
def test_failed_task_leaves_nothing(spark, tmp_path):
    """A task failing half-way (a value that does not fit the address's int32 column) deletes
    its pages; the job's abort deletes the other tasks' pages; nothing becomes visible."""
    root = str(tmp_path / "dq")
    address = DurableQueue(root).address("f")
    address.send(pa.table({"id": pa.array([0], pa.int32())}))
    previous = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    try:
        df = spark.range(0, 2000, 1, 2).selectExpr(
            "CASE WHEN id = 1900 THEN 9999999999 ELSE id END AS id")
        with pytest.raises(Exception) as info:
            df.write.format("durablequeue").option("address", "f").mode("append").save(root)
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", previous)
    assert "SchemaMismatchError" in error_text(info.value)
    assert read_all(root, "f").column("id").to_pylist() == [0]
    later = time.time() + 10 * 24 * 3600
    address.cleanup(dry_run=False, now=later)  # orphans of tasks Spark killed, if any
    assert page_files(root, "f") == live_page_files(address)


def _stream(spark, src: Path, root: str, ckpt: Path, **options):
    reader = spark.readStream.schema("id long, body string").option("maxFilesPerTrigger", 1)
    writer = reader.json(str(src)).writeStream.format("durablequeue") \
        .option("address", "s").option("checkpointLocation", str(ckpt))
    for k, v in options.items():
        writer = writer.option(k, v)
    return writer.trigger(availableNow=True).start(root)


@pytest.mark.spark
def test_stream_rerun_after_crash_is_not_appended_twice(spark, tmp_path):
    """Spark re-runs a micro-batch whose sink commit happened but whose checkpoint commit did
    not (a driver crash in between): the re-run must not append again."""
    src, root, ckpt = tmp_path / "in", str(tmp_path / "dq"), tmp_path / "ckpt"
    total = json_input_files(src, 3, 50)
    q = _stream(spark, src, root, ckpt)
    finish(q)
    assert read_all(root, "s").num_rows == total
    versions = DurableQueue(root).address("s").state.version
    # Forget that the last two batches were committed, as a crash before the checkpoint's
    # commit file would.
    for batch in ("1", "2"):
        (ckpt / "commits" / batch).unlink()
        (ckpt / "commits" / f".{batch}.crc").unlink(missing_ok=True)
    q = _stream(spark, src, root, ckpt)
    finish(q)
    assert (ckpt / "commits" / "2").exists()  # Spark did run batches 1 and 2 again
    table = read_all(root, "s")
    assert sorted(table.column("id").to_pylist()) == list(range(total))
    assert table.column("_seq").to_pylist() == list(range(total))
    assert DurableQueue(root).address("s").state.version == versions
    assert len(page_files(root, "s")) == len(DurableQueue(root).address("s").state.pages.names)


@pytest.mark.spark
def test_stream_fail_policy_stops_query_and_stores_nothing(spark, tmp_path):
    src, root, ckpt = tmp_path / "in", str(tmp_path / "dq"), tmp_path / "ckpt"
    json_input_files(src, 1, 20)
    DurableQueue(root).address("s", max_size_messages=10, address_full_policy="FAIL").send(
        [{"id": -i, "body": "old"} for i in range(1, 11)])
    q = _stream(spark, src, root, ckpt)
    text = fail(q)
    assert "AddressFullError" in text and "addressFullPolicy=FAIL" in text
    assert read_all(root, "s").num_rows == 10
    stored = DurableQueue(root).address("s")
    assert len(stored.state.pages) == 1 and page_files(root, "s") == live_page_files(stored)


@pytest.mark.spark
def test_drop_and_block_policies(spark, tmp_path):
    root = str(tmp_path / "dq")
    address = DurableQueue(root).address("p")
    address.send([{"id": 1}] * 5)
    df = spark.range(100, 103, 1, 1)
    # DROP: the write succeeds, nothing is stored, the drop is counted.
    df.write.format("durablequeue").option("address", "p").option("maxSizeMessages", 5) \
        .option("addressFullPolicy", "DROP").mode("append").save(root)
    stats = DurableQueue(root).address("p").stats()
    assert stats["messages"] == 5 and stats["dropped_messages"] == 3
    # BLOCK with nobody acking: fails after blockTimeoutMs, stores nothing.
    with pytest.raises(Exception) as info:
        df.write.format("durablequeue").option("address", "p") \
            .option("addressFullPolicy", "BLOCK").option("blockTimeoutMs", 300) \
            .mode("append").save(root)
    assert "AddressFullError" in error_text(info.value)
    assert "blockTimeoutMs=300" in error_text(info.value)
    # BLOCK with a consumer acking meanwhile: the write goes through.
    consumer = DurableQueue(root).address("p").consumer("c")

    def ack_later():
        time.sleep(2)
        consumer.ack(consumer.receive(max_messages=100))

    acker = threading.Thread(target=ack_later)
    acker.start()
    df.write.format("durablequeue").option("address", "p") \
        .option("blockTimeoutMs", 120000).mode("append").save(root)
    acker.join(60)
    assert not acker.is_alive()
    stats = DurableQueue(root).address("p").stats()
    assert stats["consumers"]["c"]["backlog_messages"] == 3
    assert page_files(root, "p") == live_page_files(DurableQueue(root).address("p"))


@pytest.mark.spark
def test_batch_write_with_txn_is_stored_once(spark, tmp_path):
    root = str(tmp_path / "dq")

    def write(df, version):
        df.write.format("durablequeue").option("address", "t").option("txnAppId", "etl") \
            .option("txnVersion", version).mode("append").save(root)

    df = spark.range(0, 10, 1, 2).selectExpr("id", "'first' AS body")
    write(df, 4)
    write(df, 4)  # the same write retried
    write(spark.range(100, 105).selectExpr("id", "'old' AS body"), 3)  # an older version
    table = read_all(root, "t")
    assert sorted(table.column("id").to_pylist()) == list(range(10))
    write(spark.range(10, 12).selectExpr("id", "'next' AS body"), 5)
    address = DurableQueue(root).address("t")
    assert sorted(read_all(root, "t").column("id").to_pylist()) == list(range(12))
    assert address.state.txns == {"app:etl": 5}
    assert page_files(root, "t") == sorted(address.state.pages.names)
    assert address.send([{"id": 99, "body": "client"}], txn=("etl", 5)).duplicate


@pytest.mark.spark
def test_foreach_batch_retried_with_txn_version_stores_each_row_once(spark, tmp_path):
    """foreachBatch writes each micro-batch with txnVersion=batch_id; writing the same batch a
    second time (a retry of the function) stores nothing more."""
    src, root, ckpt = tmp_path / "in", str(tmp_path / "dq"), tmp_path / "ckpt"
    total = json_input_files(src, 3, 20)
    calls: list[int] = []

    def write_twice(df, batch_id):
        for _ in range(2):
            df.write.format("durablequeue").option("address", "fb") \
                .option("txnAppId", "fb-loader").option("txnVersion", batch_id) \
                .mode("append").save(root)
        calls.append(batch_id)

    q = (spark.readStream.schema("id long, body string").option("maxFilesPerTrigger", 1)
         .json(str(src)).writeStream.foreachBatch(write_twice)
         .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
    assert q.awaitTermination(300)
    q.stop()
    assert q.exception() is None
    assert calls == [0, 1, 2]  # three micro-batches, each written twice
    table = read_all(root, "fb")
    assert sorted(table.column("id").to_pylist()) == list(range(total))
    address = DurableQueue(root).address("fb")
    assert address.state.txns == {"app:fb-loader": 2}
    assert address.state.version == 3  # one entry per micro-batch, none for the retries
    assert page_files(root, "fb") == sorted(address.state.pages.names)


FRESH_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    root, src, ckpt = sys.argv[1:4]
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .getOrCreate())
    spark.range(0, 5).selectExpr("id", "'batch' AS kind").write.format("durablequeue") \\
        .option("address", "orders").mode("append").save(root)
    q = (spark.readStream.schema("id long, kind string").json(src)
         .writeStream.format("durablequeue").option("address", "orders")
         .option("checkpointLocation", ckpt).trigger(availableNow=True).start(root))
    ended = q.awaitTermination(180)
    q.stop()
    print(json.dumps({"ended": ended,
                      "exception": str(q.exception()) if q.exception() else None}))
    spark.stop()
""")


@pytest.mark.spark
@pytest.mark.slow  # a driver (JVM) of its own
def test_fresh_interpreter_finds_format_without_register(tmp_path):
    """The package is only installed: Spark registers ``durablequeue`` by itself."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text("".join(
        json.dumps({"id": i, "kind": "stream"}) + "\n" for i in range(5, 12)))
    script = tmp_path / "fresh.py"
    script.write_text(FRESH_SCRIPT)
    assert "register" not in FRESH_SCRIPT
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "dq"), str(src), str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"ended": True, "exception": None}
    table = read_all(tmp_path / "dq", "orders")
    assert sorted(table.column("id").to_pylist()) == list(range(12))
    assert table.column("kind").to_pylist().count("batch") == 5
