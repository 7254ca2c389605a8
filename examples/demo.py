"""The main demo (``make demo``): a durable queue between Spark streaming queries.

    python examples/demo.py [ROOT] [SECONDS]        (ROOT defaults to ./demo-data)

1. A producer query streams generated orders into the address ``orders`` (BLOCK policy, 1 GiB
   backlog limit) for SECONDS (default 15), counted from its first stored batch.
2. Two durable consumers read ``orders`` with different selectors, each in bounded micro-batches
   (``Trigger.AvailableNow`` with ``maxMessagesPerTrigger``): ``billing`` takes EU orders over
   100 and writes invoices into a second address, ``apac`` counts APAC orders.
3. Pages both consumers have committed past are removed; the demo prints the address's stats,
   then browses the invoices with the Python client (no Spark).

Run it again: every query resumes from its checkpoint and consumer watermark, so only new orders
are produced and consumed.
"""

from __future__ import annotations

import os
import sys
import time

# Spark's Python workers must run this interpreter (where pyarrow and this package live).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from pyspark_durable_queue import DurableQueue


def produce(spark: SparkSession, root: str, checkpoints: str, seconds: float) -> None:
    regions = F.array(*(F.lit(r) for r in ("EU", "US", "APAC", "LATAM")))
    orders = (spark.readStream.format("rate").option("rowsPerSecond", 2000).load()
              .select(F.col("value").alias("order_id"),
                      F.element_at(regions, (F.col("value") % 4 + 1).cast("int")).alias("region"),
                      (F.rand(seed=42) * 500).cast("decimal(10,2)").alias("amount"),
                      F.col("timestamp").alias("ordered_at")))
    query = (orders.writeStream.format("durablequeue")
             .option("address", "orders")
             .option("pageSizeBytes", "1MiB")
             .option("maxSizeBytes", "1GiB")
             .option("addressFullPolicy", "BLOCK")
             .option("cleanupIntervalMs", 0)
             .option("checkpointLocation", f"{checkpoints}/producer")
             .trigger(processingTime="2 seconds")
             .start(root))
    # Count SECONDS from the first stored batch: stopping the query while its first batch is
    # still being written (a slow start) would store nothing, and the consumers would find an
    # address without a schema.
    started = time.monotonic()
    while (query.isActive and time.monotonic() - started < 300
           and not any(p["numInputRows"] for p in query.recentProgress)):
        time.sleep(0.5)
    deadline = time.monotonic() + seconds
    while query.isActive and time.monotonic() < deadline:
        time.sleep(0.5)
    query.stop()
    if query.exception() is not None:
        raise SystemExit(f"producer failed: {query.exception()}")


def consume(spark: SparkSession, root: str, checkpoints: str) -> dict[str, int]:
    source = (spark.readStream.format("durablequeue").option("address", "orders")
              .option("maxMessagesPerTrigger", 20_000))
    billing = (source.option("consumer", "billing")
               .option("selector", "region = 'EU' AND amount > 100").load(root)
               .select("order_id", "amount", F.col("_seq").alias("order_seq"),
                       (F.col("amount") * F.lit(1.2)).cast("decimal(12,2)").alias("gross")))
    q1 = (billing.writeStream.format("durablequeue").option("address", "invoices")
          .option("checkpointLocation", f"{checkpoints}/billing")
          .trigger(availableNow=True).start(root))
    apac = (source.option("consumer", "apac").option("selector", "region = 'APAC'").load(root))
    q2 = (apac.writeStream.format("noop").option("checkpointLocation", f"{checkpoints}/apac")
          .trigger(availableNow=True).start())
    counts = {}
    for name, q in (("billing", q1), ("apac", q2)):
        q.awaitTermination()
        if q.exception() is not None:
            raise SystemExit(f"consumer {name} failed: {q.exception()}")
        counts[name] = sum(p["numInputRows"] for p in q.recentProgress)
        last = q.lastProgress
        counts[f"{name}_batches"] = last["batchId"] + 1 if last else 0
    return counts


def main() -> None:
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "demo-data")
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
    checkpoints = os.path.join(root, "_checkpoints")
    spark = (SparkSession.builder.master("local[2]").appName("durablequeue-demo")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    print(f"1. producing orders into {root} for {seconds:.0f} s ...", flush=True)
    produce(spark, root, checkpoints, seconds)
    orders = DurableQueue(root).address("orders")
    s = orders.stats()
    print(f"   address 'orders': {s['next_seq']:,} messages so far, {s['messages']:,} retained "
          f"in {s['pages']} pages", flush=True)

    print("2. consuming with two durable consumers and selectors ...", flush=True)
    counts = consume(spark, root, checkpoints)
    print(f"   billing (EU, amount > 100): {counts['billing']:,} orders in "
          f"{counts['billing_batches']} micro-batches -> address 'invoices'")
    print(f"   apac (APAC):                {counts['apac']:,} orders in "
          f"{counts['apac_batches']} micro-batches")
    spark.stop()

    print("3. the store after both consumers committed:")
    orders.cleanup(dry_run=False)
    s = orders.stats()
    print(f"   'orders': {s['messages']:,} messages retained in {s['pages']} pages "
          f"(consumed pages removed); consumers: "
          + ", ".join(f"{n} at _seq {c['position']:,}" for n, c in s["consumers"].items()))
    invoices = DurableQueue(root).address("invoices")
    peek = invoices.consumer("demo-browser", start="earliest")
    first = peek.receive(max_messages=3)
    peek.delete()
    print(f"   'invoices': {invoices.stats()['next_seq']:,} messages; first ones: "
          f"{first.select(['order_id', 'amount', 'gross', '_seq']).to_pylist()}")
    print(f"   try: durablequeue {root} stats orders")


if __name__ == "__main__":
    main()
