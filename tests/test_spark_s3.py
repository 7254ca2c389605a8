"""Spark end to end on S3: ``format("durablequeue")`` writing to and reading from an ``s3://``
root, with the credentials and endpoint given as ``storageOptions`` (the way users pass them;
Spark's Python workers do not see environment variables set after the JVM started).

The endpoint is the session's S3 server (``conftest.s3_endpoint``): moto's S3 implementation
over real HTTP, reached through s3fs in the driver, the planner process and every task.
"""

from __future__ import annotations

import json
import uuid

import pytest

from pyspark_durable_queue import DurableQueue

pytest.importorskip("pyspark")

pytestmark = pytest.mark.spark


@pytest.fixture
def s3(s3_endpoint):
    from conftest import new_s3_root

    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-east-1"}}
    return new_s3_root(s3_endpoint), options


def test_sink_and_source_on_s3(spark, tmp_path, s3):
    root, storage = s3
    opts = {"address": "orders", "storageOptions": json.dumps(storage), "cleanupIntervalMs": "0"}
    write = {**opts, "pageSizeBytes": "4096"}
    # a batch write (all-or-nothing) ...
    (spark.range(0, 3000).selectExpr("id", "IF(id % 10 = 0, 'EU', 'US') AS region")
     .write.format("durablequeue").options(**write).mode("append").save(root))
    # ... then a streaming write of more rows, exactly once per micro-batch
    src = tmp_path / "in"
    src.mkdir()
    for f in range(3):
        lines = [json.dumps({"id": i, "region": "EU" if i % 10 == 0 else "US"})
                 for i in range(3000 + f * 500, 3500 + f * 500)]
        (src / f"part-{f}.json").write_text("\n".join(lines) + "\n")
    q = (spark.readStream.schema("id long, region string").option("maxFilesPerTrigger", 1)
         .json(str(src)).writeStream.format("durablequeue").options(**write)
         .option("checkpointLocation", str(tmp_path / "ck-sink")).trigger(availableNow=True)
         .start(root))
    try:
        assert q.awaitTermination(180), "the query did not finish in 180 s"
    finally:
        q.stop()
    assert q.exception() is None

    address = DurableQueue(root, storage_options=storage).address("orders")
    assert address.stats()["messages"] == 4500
    pages = address.stats()["pages"]
    assert pages > 10

    # a selective durable consumer, in several bounded micro-batches
    name = f"t_{uuid.uuid4().hex[:10]}"
    reader = (spark.readStream.format("durablequeue").options(**opts)
              .option("consumer", "eu").option("selector", "region = 'EU'")
              .option("maxMessagesPerTrigger", 1000).load(root))
    q = (reader.writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck-src"))
         .trigger(availableNow=True).start())
    try:
        assert q.awaitTermination(180), "the query did not finish in 180 s"
    finally:
        q.stop()
    assert q.exception() is None
    got = sorted(r.id for r in spark.table(name).select("id").collect())
    assert got == list(range(0, 4500, 10))
    assert len(q.recentProgress) >= 2  # bounded batches, not one

    # the only consumer committed past every page: cleanup removed them from the bucket
    address = DurableQueue(root, storage_options=storage).address("orders")
    assert address.consumers()["eu"]["position"] == 4500
    assert address.stats()["pages"] == 0
    assert not [n for n in address.storage.list(address.pages_folder) if n.endswith(".page")]

    # browsing what is retained finds nothing left; new sends are browsable with where()
    address.send([{"id": 9000, "region": "EU"}])
    browse = (spark.read.format("durablequeue").options(**opts).load(root)
              .where("region = 'EU'").collect())
    assert [r.id for r in browse] == [9000]
