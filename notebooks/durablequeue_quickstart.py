# Databricks notebook source
# MAGIC %md
# MAGIC # pyspark-durable-queue quickstart
# MAGIC
# MAGIC A durable message queue stored as files in a Unity Catalog volume (or any fsspec URL),
# MAGIC written and read by Structured Streaming. Producers write orders into the address
# MAGIC `orders`; two durable consumers read it with different selectors; each page file is
# MAGIC removed once both have committed past it.
# MAGIC
# MAGIC Import this file into a workspace (it is in Databricks' source format) or run its cells
# MAGIC in any PySpark 4.x notebook.
# MAGIC
# MAGIC The install cell below installs the package without the `[spark]` extra: on Databricks
# MAGIC pyspark belongs to the runtime, and a pyspark from PyPI would shadow it. Elsewhere,
# MAGIC `pip install "pyspark-durable-queue[spark]"` brings pyspark too.

# COMMAND ----------

# MAGIC %pip install pyspark-durable-queue

# COMMAND ----------

import os
import sys
import time

# Outside Databricks, Spark's Python workers must use this interpreter.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from pyspark.sql import SparkSession, functions as F  # noqa: E402

from pyspark_durable_queue import DurableQueue  # noqa: E402
from pyspark_durable_queue.spark import DurableQueueDataSource  # noqa: E402

spark = SparkSession.builder.getOrCreate()
if "display" not in globals():  # outside Databricks
    def display(df):  # noqa: D103
        df.show(truncate=False)

# Databricks documents explicit registration of Python data sources; where Spark already
# auto-registered `durablequeue` (any pip install), this is harmless.
spark.dataSource.register(DurableQueueDataSource)

ROOT = os.environ.get("DQ_ROOT", "/Volumes/main/default/queues/dq")  # or s3://..., ./demo-data
CHECKPOINTS = os.environ.get("DQ_CHECKPOINTS", ROOT + "-checkpoints")

# COMMAND ----------

# MAGIC %md ## Produce: a streaming query writes orders into the address `orders`

# COMMAND ----------

orders = (
    spark.readStream.format("rate").option("rowsPerSecond", 2000).load()
    .select(
        F.col("value").alias("order_id"),
        F.element_at(F.array(F.lit("EU"), F.lit("US"), F.lit("APAC")),
                     (F.col("value") % 3 + 1).cast("int")).alias("region"),
        (F.rand(seed=7) * 500).cast("decimal(10,2)").alias("amount"),
        F.col("timestamp").alias("ordered_at"),
    )
)
producer = (
    orders.writeStream.format("durablequeue")
    .option("address", "orders")
    .option("pageSizeBytes", 4 * 1024 * 1024)
    .option("maxSizeBytes", 1024 * 1024 * 1024)   # 1 GiB backlog ...
    .option("addressFullPolicy", "BLOCK")          # ... then producers wait for consumers
    .option("checkpointLocation", f"{CHECKPOINTS}/producer")
    .trigger(processingTime="5 seconds")
    .start(ROOT)
)
# Produce for a while, and at least until one micro-batch is in the address (a cold cluster
# can take longer than that to run its first batch).
deadline = time.monotonic() + float(os.environ.get("DQ_PRODUCE_SECONDS", "30"))
while producer.isActive and (time.monotonic() < deadline or not any(
        p["numInputRows"] for p in producer.recentProgress)):
    producer.awaitTermination(1)
if producer.exception() is not None:
    raise producer.exception()
producer.stop()

# COMMAND ----------

# MAGIC %md ## Consume: two durable consumers with selectors, bounded micro-batches

# COMMAND ----------

def consume(consumer: str, selector: str, table: str):
    return (
        spark.readStream.format("durablequeue")
        .option("address", "orders")
        .option("consumer", consumer)
        .option("selector", selector)
        .option("maxMessagesPerTrigger", 50_000)
        .load(ROOT)
        .writeStream.format("memory").queryName(table)
        .option("checkpointLocation", f"{CHECKPOINTS}/{consumer}")
        .trigger(availableNow=True)
        .start()
    )


consumers = {"billing": consume("billing", "region = 'EU' AND amount > 100", "billing"),
             "apac": consume("apac", "region IN ('APAC')", "apac")}
for q in consumers.values():
    q.awaitTermination()

display(spark.sql("SELECT region, count(*) AS n, max(_seq) FROM billing GROUP BY region"))
display(spark.sql("SELECT region, count(*) AS n FROM apac GROUP BY region"))

# COMMAND ----------

# MAGIC %md ## Backlog and throughput, micro-batch by micro-batch
# MAGIC
# MAGIC Each micro-batch's progress says where the consumer's watermark ended (`{"seq": N}`): the
# MAGIC backlog after the batch is the address's end minus that. `maxMessagesPerTrigger` kept
# MAGIC every batch bounded, so the backlog drains in steps instead of one huge batch.

# COMMAND ----------

import json  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402


def end_seq(progress) -> int:
    offset = progress["sources"][0]["endOffset"]
    return int((json.loads(offset) if isinstance(offset, str) else offset)["seq"])


end_of_address = DurableQueue(ROOT).address("orders").stats()["next_seq"]
fig, (backlog_ax, rate_ax) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, q in consumers.items():
    batches = [p for p in q.recentProgress if p["numInputRows"]]
    backlog_ax.plot([end_of_address - end_seq(p) for p in batches], marker="o", label=name)
    rate_ax.plot([p["processedRowsPerSecond"] for p in batches], marker="o", label=name)
produced = [p for p in producer.recentProgress if p["numInputRows"]]
rate_ax.plot([p["processedRowsPerSecond"] for p in produced], marker="s", label="producer")
backlog_ax.set(title="backlog after each micro-batch", xlabel="micro-batch",
               ylabel="messages (all regions)")
rate_ax.set(title="throughput", xlabel="micro-batch", ylabel="rows / s")
backlog_ax.legend()
rate_ax.legend()
fig.tight_layout()
plt.show()

# COMMAND ----------

# MAGIC %md ## Browse without consuming, and look at the store from Python

# COMMAND ----------

browse = (spark.read.format("durablequeue").option("address", "orders").load(ROOT)
          .where("amount > 490"))
display(browse.limit(10))

stats = DurableQueue(ROOT).address("orders").stats()
print({k: stats[k] for k in ("messages", "bytes", "pages", "first_seq", "next_seq")})
for name, c in stats["consumers"].items():
    print(name, c["position"], c["backlog_messages"], c["selector"])

# COMMAND ----------

# MAGIC %md
# MAGIC The same from a terminal: `durablequeue $ROOT stats orders`, `durablequeue $ROOT verify
# MAGIC orders`, `durablequeue $ROOT cleanup orders --apply`.
