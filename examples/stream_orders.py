"""Stream generated orders into the address ``orders`` with Spark Structured Streaming.

Usage::

    python examples/stream_orders.py [ROOT] [SECONDS]

ROOT defaults to ``./demo-data``; the query runs for SECONDS (default 20) once its first orders
are stored (starting Spark can take longer than that on a busy machine), then stops. Run it
again: it resumes from its checkpoint (``ROOT/_checkpoints/stream_orders``) and appends only
new orders (each micro-batch lands exactly once). Then read them back without Spark::

    from pyspark_durable_queue import DurableQueue
    orders = DurableQueue("./demo-data").address("orders")
    eu = orders.consumer("eu-billing", selector="region = 'EU' AND amount > 100")
    batch = eu.receive(); print(batch.num_rows); eu.ack(batch)

No ``spark.dataSource.register`` call is needed: once the package is installed, Spark finds
``format("durablequeue")`` by itself (on Databricks, register it explicitly:
``spark.dataSource.register(pyspark_durable_queue.DefaultSource)``).
"""

from __future__ import annotations

import os
import sys
import time

# Spark's Python workers must run this interpreter (where pyarrow and this package live).
os.environ["PYSPARK_PYTHON"] = sys.executable

from pyspark.sql import SparkSession
from pyspark.sql import functions as F


def main() -> None:
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "./demo-data")
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    spark = (SparkSession.builder.master("local[2]").appName("stream-orders")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .getOrCreate())
    spark.sparkContext.setLogLevel("WARN")

    regions = F.array(*(F.lit(r) for r in ("EU", "US", "APAC", "LATAM")))
    orders = (spark.readStream.format("rate").option("rowsPerSecond", 500).load()
              .select(F.col("value").alias("order_id"),
                      F.element_at(regions, (F.col("value") % 4 + 1).cast("int")).alias("region"),
                      F.round(F.rand(seed=42) * 500, 2).cast("decimal(10,2)").alias("amount"),
                      F.col("timestamp").alias("ts")))

    query = (orders.writeStream.format("durablequeue")
             .option("address", "orders")
             # Address settings: persisted when the address is created.
             .option("pageSizeBytes", "1MiB")
             .option("maxSizeBytes", "1GiB")
             .option("addressFullPolicy", "BLOCK")
             .option("blockTimeoutMs", 60000)
             .option("checkpointLocation", os.path.join(root, "_checkpoints", "stream_orders"))
             .trigger(processingTime="2 seconds")
             .start(root))
    # Count SECONDS from the first stored batch: stopping the query while its first batch is
    # still being written (a slow start) would store nothing.
    started = time.monotonic()
    while (query.isActive and time.monotonic() - started < 300
           and not any(p["numInputRows"] for p in query.recentProgress)):
        time.sleep(0.5)
    deadline = time.monotonic() + seconds
    while query.isActive and time.monotonic() < deadline:
        time.sleep(1)
    query.stop()
    if query.exception() is not None:
        raise SystemExit(f"query failed: {query.exception()}")

    from pyspark_durable_queue import DurableQueue

    stats = DurableQueue(root).address("orders").stats()
    print(f"address 'orders' under {root}: {stats['messages']} messages in {stats['pages']} "
          f"pages, {stats['commits']} commits")
    spark.stop()


if __name__ == "__main__":
    main()
