"""The Python client without Spark: send, consume with a selector, acknowledge, clean up.

    python examples/client_quickstart.py [ROOT]      (default ./demo-data)
"""

from __future__ import annotations

import random
import sys

from pyspark_durable_queue import DurableQueue


def main(root: str = "demo-data") -> None:
    q = DurableQueue(root)
    orders = q.address("client-orders", page_size_bytes=256 * 1024)
    rng = random.Random(7)
    for batch in range(5):
        orders.send([{"order_id": batch * 1000 + i,
                      "region": rng.choice(["EU", "US", "APAC"]),
                      "amount": round(rng.uniform(1, 500), 2)} for i in range(1000)])

    billing = orders.consumer("billing", selector="region = 'EU' AND amount > 100")
    audit = orders.consumer("audit")
    eu = 0
    while (batch := billing.receive(max_messages=500)).num_rows:
        eu += batch.num_rows
        billing.ack(batch)
    print(f"billing received {eu} EU orders over 100 (selector), watermark {billing.position}")

    first = audit.receive(max_messages=10)
    print("audit sees the first orders:", first.select(["_seq", "order_id", "region"])
          .to_pylist()[:3])
    audit.ack(first)

    report = orders.cleanup(dry_run=True)
    print(f"cleanup would remove {len(report.pages)} pages: audit still needs the rest")
    stats = orders.stats()
    print(f"address {stats['address']}: {stats['messages']} messages in {stats['pages']} pages; "
          + ", ".join(f"{n} backlog {c['backlog_messages']}"
                      for n, c in stats["consumers"].items()))


if __name__ == "__main__":
    main(*sys.argv[1:])
