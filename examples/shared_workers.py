"""A pool of worker processes on one shared consumer: leases, renewals, retries, dead letters.

Run::

    python examples/shared_workers.py [ROOT] [WORKERS] [JOBS]

It sends JOBS jobs (default 30) to the address ``jobs``, starts WORKERS processes (default 3)
that each open the shared consumer ``pool`` and take jobs until none is left, and prints what
each worker did. Every 7th job is "long": its worker renews the job's lease while it works.
Every 10th job fails each time: it is nacked, delivered again (to any worker) after a short
delay, and after ``max_delivery_attempts`` (3) deliveries moved to the dead-letter address
``jobs-DLQ``. Every other job is acknowledged once. ROOT defaults to a scratch folder that is
deleted at the end.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import time

from pyspark_durable_queue import DurableQueue, LeaseExpiredError

LEASE_MS = 2_000  # short for the example; the default is 30 s (SQS's visibility timeout)


def worker(root: str, number: int, results: multiprocessing.Queue) -> None:
    """One worker process: its own handle of the shared consumer ``pool``."""
    jobs = DurableQueue(root).address("jobs")
    done, failed, renewed = [], 0, 0
    with jobs.consumer("pool", shared=True, lease_ms=LEASE_MS, prefetch=2) as pool:
        for msg in pool.messages(timeout_ms=500):  # stops after 0.5 s without a job
            job = msg["job"]
            try:
                if job % 10 == 0:
                    raise RuntimeError(f"job {job} fails every time")
                if job % 7 == 0:  # a long job: keep its lease while working
                    for _ in range(2):
                        time.sleep(0.3)
                        pool.renew(msg["_seq"])  # the lease runs LEASE_MS from now again
                        renewed += 1
            except RuntimeError:
                pool.nack(msg["_seq"], delay_ms=100)  # again in 0.1 s, to any worker
                failed += 1
                continue
            try:
                pool.ack(msg["_seq"])  # settles exactly this job (never cumulative)
            except LeaseExpiredError:
                continue  # held past its lease: another worker has the job now
            done.append(job)
    results.put((number, os.getpid(), done, failed, renewed))


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dq-shared-")
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    scratch = len(sys.argv) <= 1
    try:
        jobs = DurableQueue(root).address("jobs", max_delivery_attempts=3,
                                          dead_letter_address="jobs-DLQ")
        jobs.send([{"job": i, "payload": f"job {i}"} for i in range(count)])
        # "spawn": each worker opens its own handles (nothing is inherited through fork)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        procs = [context.Process(target=worker, args=(root, n, results))
                 for n in range(workers)]
        for p in procs:
            p.start()
        reports = sorted(results.get(timeout=300) for _ in procs)
        for p in procs:
            p.join()
        acked = sorted(j for _, _, done, _, _ in reports for j in done)
        for number, pid, done, failed, renewed in reports:
            print(f"worker {number} (pid {pid}): {len(done)} jobs done, {failed} failures "
                  f"nacked, {renewed} lease renewals")
        stats = jobs.stats()["consumers"]["pool"]
        dlq = DurableQueue(root).address("jobs-DLQ", create=False).stats()["messages"]
        print(f"{len(acked)} jobs acknowledged ({len(set(acked))} distinct), {dlq} in "
              f"jobs-DLQ, {stats['leased']} still leased, watermark {stats['position']}")
    finally:
        if scratch:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
