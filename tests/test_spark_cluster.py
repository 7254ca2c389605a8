"""On a Spark standalone cluster (``make test-cluster``; skipped otherwise): the session really
runs its tasks in executor JVMs of their own, and the sink and the source work end to end
there, the store's root a local folder that the driver and both executors share.

``make test-cluster`` runs this file and the sink's and source's end-to-end tests
(``tests/test_spark_sink.py``, ``test_spark_source.py``, ``test_spark_multi.py``,
``test_spark_journal.py``, ``test_spark_s3.py``) with ``DQ_SPARK_CLUSTER=1``, which makes the
session-scoped ``spark`` fixture use the cluster (``conftest.spark_master``).
"""

from __future__ import annotations

import os
import uuid

import pytest

pytest.importorskip("pyspark")

from conftest import finish_query

from pyspark_durable_queue import DurableQueue

pytestmark = pytest.mark.spark


def executor_jvms(spark) -> set[int]:
    """The JVMs that ran the Python workers of a job of 8 tasks (-1: no JVM above one)."""

    def java_ancestor(_rows):  # nested: pickled by value, executors cannot import tests/
        pid = os.getpid()
        while pid > 1:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if stat[stat.index("(") + 1:stat.rindex(")")] == "java":
                return [pid]
            pid = int(stat[stat.rindex(")") + 2:].split()[1])  # the parent's pid
        return [-1]

    return set(spark.sparkContext.parallelize(range(8), 8).mapPartitions(java_ancestor)
               .collect())


def test_tasks_run_in_executor_jvms_other_than_the_driver(spark, spark_cluster):
    assert spark.sparkContext.master == spark_cluster
    infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    assert len(infos) == 3, "the driver and one executor per worker"
    driver_jvm = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    jvms = executor_jvms(spark)
    assert -1 not in jvms and driver_jvm not in jvms, (driver_jvm, jvms)


def test_sink_then_source_through_executors(spark, spark_cluster, tmp_path):
    """A stream written by executors' tasks (several pages, one commit per micro-batch on the
    driver), then read back by a streaming query whose tasks read the pages on executors."""
    root = str(tmp_path / "store")
    src = tmp_path / "in"
    src.mkdir()
    for f in range(4):
        rows = [f'{{"id": {i}, "body": "m{i}"}}' for i in range(f * 500, (f + 1) * 500)]
        (src / f"part-{f}.json").write_text("\n".join(rows) + "\n")
    q = (spark.readStream.schema("id long, body string").option("maxFilesPerTrigger", 2)
         .json(str(src)).repartition(4).writeStream.format("durablequeue")
         .option("address", "orders").option("pageSizeBytes", "4096")
         .option("checkpointLocation", str(tmp_path / "ck-sink"))
         .trigger(availableNow=True).start(root))
    finish_query(q)
    address = DurableQueue(root).address("orders", create=False)
    assert address.stats()["messages"] == 2000
    assert address.stats()["pages"] >= 4  # written by several tasks

    name = f"t_{uuid.uuid4().hex[:10]}"
    read = (spark.readStream.format("durablequeue").option("address", "orders")
            .option("consumer", "etl").option("maxMessagesPerTrigger", 700)
            .option("minPartitions", 2).load(root)
            .writeStream.format("memory").queryName(name)
            .option("checkpointLocation", str(tmp_path / "ck-source"))
            .trigger(availableNow=True).start())
    finish_query(read)
    got = spark.table(name)
    assert sorted(r.id for r in got.select("id").collect()) == list(range(2000))
    assert address.consumers()["etl"]["position"] == 2000
