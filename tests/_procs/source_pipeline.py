"""Driver of the source crash test: address ``in`` -> streaming query -> address ``out``, and
beside it a second query over several addresses (``m1,m2,e``, one offset each) routed by an
``_address`` column to ``mout.m1`` / ``mout.m2`` / ``mout.e`` (each address committed under the
batch's key). Address ``e`` holds messages sent with ``ttl_ms``: its offsets record the plan's
time (``ttl_now``), at which a replay reads it.

Usage: python source_pipeline.py ROOT CHECKPOINT [drain]

Run (and SIGKILLed) repeatedly by ``tests/test_spark_pipeline_crash.py`` with the same
checkpoint. Small micro-batches (``maxMessagesPerTrigger``) so that a kill lands in any phase:
planning, tasks reading pages, the sink's commit, Spark's checkpoint commit, the source's ack and
cleanup. ``Trigger.AvailableNow``: a run that is not killed drains the backlog and exits 0.
``drain`` (the test's last run, never killed): the batches the last kill left planned are
replayed as planned, then the rest of the backlog goes in one micro-batch per query (small ones
cost a second or two each on the 2-core CI machine and cover nothing the killed runs did not).
The JVM runs with C1 only and the serial collector: a short-lived driver spends less of a
2-core machine compiling and collecting; nothing the test checks depends on the JIT.

Prints ``STARTING <epoch seconds>`` before it starts the queries: no batch of this run (a
replay included) reads before that time.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["PYSPARK_PYTHON"] = sys.executable

from pyspark.sql import SparkSession

#: The crash drivers' JVM: C1 only (no C2 compiler threads), one GC thread.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def main() -> None:
    root, ckpt = sys.argv[1:3]
    drain = sys.argv[3:] == ["drain"]
    spark = (SparkSession.builder.master("local[2]").appName("source-crash")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    print(f"STARTING {time.time()!r}", flush=True)
    in_limit, multi_limit = (10_000_000, 10_000_000) if drain else (700, 500)
    df = (spark.readStream.format("durablequeue").option("address", "in")
          .option("consumer", "pipe").option("maxMessagesPerTrigger", in_limit)
          .option("consumerLeaseMs", 4000).option("cleanupIntervalMs", 0).load(root))
    out = df.selectExpr("id", "body", "_seq AS src_seq")
    q = (out.writeStream.format("durablequeue").option("address", "out")
         .option("pageSizeBytes", "64KiB").option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start(root))
    many = (spark.readStream.format("durablequeue").option("address", "m1,m2,e")
            .option("consumer", "multi").option("maxMessagesPerTrigger", multi_limit)
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
