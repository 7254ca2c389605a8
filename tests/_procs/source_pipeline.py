"""Driver of the source crash test: address ``in`` -> streaming query -> address ``out``, and
beside it a second query over several addresses (``m1,m2,e``, one offset each) routed by an
``_address`` column to ``mout.m1`` / ``mout.m2`` / ``mout.e`` (each address committed under the
batch's key). Address ``e`` holds messages sent with ``ttl_ms``: its offsets record the plan's
time (``ttl_now``), at which a replay reads it.

Usage: python source_pipeline.py ROOT CHECKPOINT

Run (and SIGKILLed) repeatedly by ``tests/test_spark_pipeline_crash.py`` with the same
checkpoint. Small micro-batches (``maxMessagesPerTrigger``) so that a kill lands in any phase:
planning, tasks reading pages, the sink's commit, Spark's checkpoint commit, the source's ack and
cleanup. ``Trigger.AvailableNow``: a run that is not killed drains the backlog and exits 0.

Prints ``STARTING <epoch seconds>`` before it starts the queries: no batch of this run (a
replay included) reads before that time.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["PYSPARK_PYTHON"] = sys.executable

from pyspark.sql import SparkSession


def main() -> None:
    root, ckpt = sys.argv[1:3]
    spark = (SparkSession.builder.master("local[2]").appName("source-crash")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    print(f"STARTING {time.time()!r}", flush=True)
    df = (spark.readStream.format("durablequeue").option("address", "in")
          .option("consumer", "pipe").option("maxMessagesPerTrigger", 700)
          .option("consumerLeaseMs", 4000).option("cleanupIntervalMs", 0).load(root))
    out = df.selectExpr("id", "body", "_seq AS src_seq")
    q = (out.writeStream.format("durablequeue").option("address", "out")
         .option("pageSizeBytes", "64KiB").option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start(root))
    many = (spark.readStream.format("durablequeue").option("address", "m1,m2,e")
            .option("consumer", "multi").option("maxMessagesPerTrigger", 500)
            .option("consumerLeaseMs", 4000).option("cleanupIntervalMs", 0).load(root)
            .selectExpr("id", "body", "_seq AS src_seq", "concat('mout.', _address) AS _address"))
    routed = (many.writeStream.format("durablequeue").option("pageSizeBytes", "64KiB")
              .option("checkpointLocation", ckpt + "-multi").trigger(availableNow=True)
              .start(root))
    for query in (q, routed):
        if not query.awaitTermination(240):  # a deadlock fails this run, not the test's wait
            raise SystemExit("query did not terminate in 240 s")
        if query.exception() is not None:
            raise SystemExit(f"query failed: {query.exception()}")
    print("DONE", flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
