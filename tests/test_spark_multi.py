"""Several addresses in one Spark query: a list or Artemis wildcards in the option ``address``
on reads (streaming and batch), and routing by an ``_address`` column on writes. End to end
through ``format("durablequeue")`` with the session-scoped ``spark`` fixture; data is written
and checked with the Python client.
"""

from __future__ import annotations

import uuid

import pytest
from test_address_names import legacy_comma_address

pytest.importorskip("pyspark")

from pyspark_durable_queue import DurableQueue


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


def stream_to_memory(spark, root, ckpt, address: str, consumer: str = "etl", **options):
    reader = (spark.readStream.format("durablequeue").option("address", address)
              .option("consumer", consumer))
    for k, v in options.items():
        reader = reader.option(k, v)
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (reader.load(str(root)).writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(ckpt)).trigger(availableNow=True).start())
    finish(q)
    return spark.table(name), q


def test_a_quoted_name_reads_an_address_with_a_comma(spark, tmp_path):
    legacy_comma_address(tmp_path)
    df = (spark.read.format("durablequeue").option("address", "`a,b`").load(str(tmp_path)))
    assert sorted(r.id for r in df.collect()) == [1, 2]
    assert df.columns == ["id", "_seq", "_timestamp"]  # one address: no _address column
    got, _ = stream_to_memory(spark, tmp_path, tmp_path / "ck", "`a,b`")
    assert sorted(r.id for r in got.collect()) == [1, 2]
