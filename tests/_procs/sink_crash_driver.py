"""Driver of the sink crash test: stream numbered JSON files into an address, AvailableNow.

Usage: python sink_crash_driver.py SRC ROOT CHECKPOINT [drain]

Run (and SIGKILLed) repeatedly by ``tests/test_spark_sink_crash.py`` with the same checkpoint.
One input file per micro-batch so that a kill usually lands between batches' phases: tasks
writing pages, the sink's commit, Spark's checkpoint commit. ``drain`` (the test's last run,
never killed): the batch the last kill left planned is replayed as planned, then the rest of the
input goes in one micro-batch (a batch per file cost a second or two each on the 2-core CI
machine and covers nothing the killed runs did not).

The JVM runs with C1 only and the serial collector: a short-lived driver spends less of a
2-core machine compiling and collecting; nothing the test checks depends on the JIT.
"""

from __future__ import annotations

import os
import sys

os.environ["PYSPARK_PYTHON"] = sys.executable

from pyspark.sql import SparkSession

#: The crash drivers' JVM: C1 only (no C2 compiler threads), one GC thread.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def main() -> None:
    src, root, ckpt = sys.argv[1:4]
    drain = sys.argv[4:] == ["drain"]
    spark = (SparkSession.builder.master("local[2]").appName("sink-crash")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    files_per_batch = 100_000 if drain else 1
    df = (spark.readStream.schema("id long, body string")
          .option("maxFilesPerTrigger", files_per_batch)
          .json(src).repartition(2))
    q = (df.writeStream.format("durablequeue").option("address", "numbers")
         .option("pageSizeBytes", "64KiB").option("checkpointLocation", ckpt)
         .trigger(availableNow=True).start(root))
    if not q.awaitTermination(240):  # a deadlock fails this run instead of hanging the test
        raise SystemExit("query did not terminate in 240 s")
    if q.exception() is not None:
        raise SystemExit(f"query failed: {q.exception()}")
    print("DONE", flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
