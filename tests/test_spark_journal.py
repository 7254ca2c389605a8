"""Spark reads and writes a journal address (format 4) through ``format("durablequeue")``."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest
from conftest import finish_query

pytest.importorskip("pyspark")

from pyspark_durable_queue import DurableQueue

pytestmark = pytest.mark.spark


def _singles(root, n: int, start: int = 0) -> None:
    address = DurableQueue(str(root)).address("orders", journal=True, page_size_bytes=8192,
                                              fsync="never")
    for i in range(start, start + n):
        address.send([{"id": i, "region": "EU" if i % 2 else "US"}])


def test_batch_and_streaming_reads_of_single_sends_in_rolled_segments(spark, tmp_path):
    _singles(tmp_path, 400)
    segments = [p for p in (tmp_path / "orders" / "pages").iterdir() if p.suffix == ".dqj"]
    assert len(segments) > 3  # the data spans several rolled segments
    df = spark.read.format("durablequeue").option("address", "orders").load(str(tmp_path))
    rows = df.select("id", "_seq").collect()
    assert sorted((r._seq, r.id) for r in rows) == [(i, i) for i in range(400)]
    eu = (spark.read.format("durablequeue").option("address", "orders")
          .load(str(tmp_path)).where("region = 'EU' AND id >= 390"))
    assert sorted(r.id for r in eu.select("id").collect()) == [391, 393, 395, 397, 399]

    name = f"t_{uuid.uuid4().hex[:10]}"
    stream = (spark.readStream.format("durablequeue").option("address", "orders")
              .option("consumer", "etl").option("maxMessagesPerTrigger", 150)
              .load(str(tmp_path)))
    q = (stream.writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    finish_query(q)
    assert sorted(r.id for r in spark.table(name).select("id").collect()) == list(range(400))
    assert DurableQueue(str(tmp_path)).address("orders").consumers()["etl"]["position"] == 400


def test_the_sink_writes_into_a_journal_address_exactly_once(spark, tmp_path):
    _singles(tmp_path, 50)
    DurableQueue(str(tmp_path)).address("copy", journal=True)  # created with a journal
    stream = (spark.readStream.format("durablequeue").option("address", "orders")
              .option("consumer", "copier").load(str(tmp_path))).select("id", "region")
    q = (stream.writeStream.format("durablequeue").option("address", "copy")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True)
         .start(str(tmp_path)))
    finish_query(q)
    copy = DurableQueue(str(tmp_path)).address("copy")
    assert copy.format.journal
    copy.send([{"id": 50, "region": "EU"}])  # a single send after the sink's pages
    got = copy.consumer("audit", start="earliest").receive(max_messages=1000)
    assert got.column("id").to_pylist() == [*range(50), 50] or \
        sorted(got.column("id").to_pylist()) == list(range(51))
    assert got.column("_seq").to_pylist() == list(range(51))
    assert got.num_rows == 51 and got.column("region").type == pa.string()


def test_a_write_that_creates_an_address_may_ask_for_the_journal(spark, tmp_path):
    df = spark.createDataFrame([(i, "EU") for i in range(20)], "id long, region string")
    (df.write.format("durablequeue").option("address", "made").option("journal", "true")
     .mode("append").save(str(tmp_path)))
    made = DurableQueue(str(tmp_path)).address("made")
    assert made.format.journal
    made.send([{"id": 20, "region": "US"}])  # a single send: a unit of the journal
    assert [p.suffix for p in (tmp_path / "made" / "pages").iterdir()].count(".dqj") == 1
    back = spark.read.format("durablequeue").option("address", "made").load(str(tmp_path))
    assert sorted(r.id for r in back.select("id").collect()) == list(range(21))



def test_the_source_does_not_read_journal_units_a_selector_cannot_match(spark, tmp_path):
    """The frames of every unit but the last are damaged on disk after a checkpoint covered
    them (so the log never reads them again): a query whose selector the units' statistics
    rule out succeeds, which it could not if it read them; a full read fails on them."""
    import numpy as np

    from pyspark_durable_queue._log.journal import _UNIT_HEAD, HEAD, STATS_MIN_BYTES

    rows, sends = 40_000, 4  # units of ~4.4 MB: each carries its statistics
    address = DurableQueue(str(tmp_path)).address("big", journal=True, fsync="never",
                                                  page_size_bytes=4 << 20)
    address.consumer("keep", start="earliest")
    for k in range(sends):
        ids = np.arange(k * rows, (k + 1) * rows, dtype=np.int64)
        address.send(pa.table({"id": ids, "body": pa.array([b"x" * 100] * rows)}))
    index = address.state.pages
    assert len(index) == sends and index.bytes[0] >= STATS_MIN_BYTES
    address.log.write_checkpoint(address.log.refresh())
    for i in range(sends - 1):  # each unit in a segment of its own: zero its frames
        path = tmp_path / "big" / "pages" / index.names[i]
        with open(path, "r+b") as f:
            head = f.read(HEAD + _UNIT_HEAD.size)
            entry_len, frames_len = _UNIT_HEAD.unpack_from(head, HEAD)[4:6]
            f.seek(HEAD + _UNIT_HEAD.size + entry_len)
            f.write(bytes(frames_len))
    n = rows * sends

    def stream(selector: str | None):
        reader = (spark.readStream.format("durablequeue").option("address", "big")
                  .option("consumer", f"c{uuid.uuid4().hex[:8]}"))
        if selector is not None:
            reader = reader.option("selector", selector)
        name = f"t_{uuid.uuid4().hex[:10]}"
        q = (reader.load(str(tmp_path)).select("id").writeStream.format("memory")
             .queryName(name).option("checkpointLocation", str(tmp_path / name))
             .trigger(availableNow=True).start())
        return q, name

    for selector, expected in (("id < 0", []), (f"id >= {n - 50}", list(range(n - 50, n))),
                               (f"id >= {n - rows} AND id < {n - rows + 5}",
                                list(range(n - rows, n - rows + 5)))):
        q, name = stream(selector)
        finish_query(q)
        assert sorted(r.id for r in spark.table(name).collect()) == expected

    q, _name = stream(None)  # what reading the damaged units does
    try:
        with pytest.raises(Exception, match="corrupt page"):
            q.awaitTermination(180)
    finally:
        q.stop()


def test_reads_of_a_damaged_journal_get_what_is_before_it_then_fail_naming_it(spark, tmp_path):
    # issue 38: a flipped byte in the last unit, after its send returned
    a = DurableQueue(str(tmp_path)).address("orders", journal=True)
    for k in range(3):
        a.send([{"id": k * 10 + i, "region": "EU"} for i in range(10)])
    path = tmp_path / "orders" / "pages" / a.state.pages.names[0]
    data = bytearray(path.read_bytes())
    at = data.rindex(b"DQJU")
    data[at + 200] ^= 0x01
    path.write_bytes(bytes(data))
    where = f"{path.name}@{at}"
    with pytest.raises(Exception, match=where):  # a batch read to the end: not 20 rows
        spark.read.format("durablequeue").option("address", "orders").load(
            str(tmp_path)).collect()
    ok = (spark.read.format("durablequeue").option("address", "orders")
          .option("endingOffsets", '{"seq": 15}').load(str(tmp_path)))
    assert sorted(r.id for r in ok.select("id").collect()) == list(range(15))

    name = f"t_{uuid.uuid4().hex[:10]}"
    stream = (spark.readStream.format("durablequeue").option("address", "orders")
              .option("consumer", "etl").load(str(tmp_path)))
    q = (stream.writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    with pytest.raises(Exception, match=where):  # the query fails, naming the damage
        q.awaitTermination(300)
    assert q.exception() is not None and where in str(q.exception())
    assert sorted(r.id for r in spark.table(name).select("id").collect()) == list(range(20))
