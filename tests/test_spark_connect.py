"""Spark Connect (what Databricks serverless and shared clusters run): the format works through
a Connect session, with no ``register`` call, in a fresh interpreter (a local Connect server
brings its own SparkContext, which cannot share a process with the suite's session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pyspark_durable_queue import DurableQueue

pytest.importorskip("pyspark")
pytest.importorskip("grpc")  # pyspark[connect]

pytestmark = [pytest.mark.spark, pytest.mark.slow]  # a Spark Connect server of its own

SCRIPT = r"""
import json, os, sys
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession
from pyspark.sql.connect.session import SparkSession as ConnectSession

root, ck = sys.argv[1], sys.argv[2]
spark = SparkSession.builder.remote("local[2]").getOrCreate()
assert isinstance(spark, ConnectSession), type(spark)
(spark.range(0, 1000).selectExpr("id", "IF(id % 4 = 0, 'EU', 'US') AS region")
 .write.format("durablequeue").option("address", "orders").mode("append").save(root))
browsed = (spark.read.format("durablequeue").option("address", "orders").load(root)
           .where("region = 'EU'").count())
q = (spark.readStream.format("durablequeue").option("address", "orders")
     .option("consumer", "eu").option("selector", "region = 'EU'")
     .option("maxMessagesPerTrigger", 300).load(root)
     .writeStream.format("memory").queryName("eu").option("checkpointLocation", ck)
     .trigger(availableNow=True).start())
ended = q.awaitTermination(180)
q.stop()
ids = sorted(r.id for r in spark.table("eu").select("id").collect())
print(json.dumps({"browsed": browsed, "ids": ids, "batches": len(q.recentProgress),
                  "ended": ended,
                  "exception": str(q.exception()) if q.exception() else None}))
spark.stop()
"""


def test_format_through_spark_connect(tmp_path):
    script = tmp_path / "connect.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    root = tmp_path / "dq"
    proc = subprocess.run([sys.executable, str(script), str(root), str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ended"] is True and out["exception"] is None
    assert out["browsed"] == 250
    assert out["ids"] == list(range(0, 1000, 4))
    assert out["batches"] >= 2  # admission control holds through Connect too
    assert DurableQueue(str(root)).address("orders").consumers()["eu"]["position"] == 1000
