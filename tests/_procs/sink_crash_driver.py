"""Driver of the sink crash test: stream numbered JSON files into an address, AvailableNow.

Usage: python sink_crash_driver.py SRC ROOT CHECKPOINT

Run (and SIGKILLed) repeatedly by ``tests/test_spark_sink_crash.py`` with the same checkpoint.
One input file per micro-batch so that a kill usually lands between batches' phases: tasks
writing pages, the sink's commit, Spark's checkpoint commit.
"""

from __future__ import annotations

import os
import sys

os.environ["PYSPARK_PYTHON"] = sys.executable

from pyspark.sql import SparkSession


def main() -> None:
    src, root, ckpt = sys.argv[1:4]
    spark = (SparkSession.builder.master("local[2]").appName("sink-crash")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = (spark.readStream.schema("id long, body string").option("maxFilesPerTrigger", 1)
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
