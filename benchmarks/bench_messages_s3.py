"""Single-message sends on an object store: the S3 test endpoint, 1 thread against N threads.

Group commit is what makes single sends usable on object stores, where one commit is several
HTTP round trips: concurrent senders share them. This starts the S3 endpoint the tests use
(moto's S3 implementation under waitress, ``tests/_procs/s3_server.py``, reached over HTTP by
s3fs) and prints sends per second with 1 thread and with ``--threads`` threads (one shared
``Address``, and a handle per thread), each as a ratio against the 1-thread rate of the same
run. Run::

    .venv/bin/python benchmarks/bench_messages_s3.py [--seconds 5] [--threads 8]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pyspark_durable_queue import DurableQueue

SERVER = os.path.join(os.path.dirname(__file__), "..", "tests", "_procs", "s3_server.py")
ROW = {"id": 0, "body": "x" * 90}


def start_endpoint() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, SERVER, str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the S3 test endpoint did not start") from None
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    return proc, endpoint


def new_root(endpoint: str) -> str:
    import boto3

    bucket = f"bench-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/dq"


def run(root: str, threads: int, seconds: float, *, own_handles: bool) -> tuple[float, float]:
    """Sends per second and the p99 latency of one send (ms)."""
    shared = DurableQueue(root).address("bench")
    shared.send([ROW])  # creates the address and fixes the schema
    latencies: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop = [0.0]

    def work(k: int) -> None:
        a = DurableQueue(root).address("bench") if own_handles else shared
        a.send([ROW])  # warm the handle's connection
        start.wait()
        while time.perf_counter() < stop[0]:
            t = time.perf_counter()
            a.send([ROW])
            latencies[k].append(time.perf_counter() - t)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    stop[0] = time.perf_counter() + seconds + 0.5  # after every worker is at the barrier
    start.wait()
    began = time.perf_counter()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - began
    every = sorted(x for per in latencies for x in per)
    p99 = every[int(0.99 * (len(every) - 1))] * 1000 if every else float("nan")
    return len(every) / elapsed, p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    proc, endpoint = start_endpoint()
    try:
        one, p99_one = run(new_root(endpoint), 1, args.seconds, own_handles=False)
        rows = [("send([row]), 1 thread", 1, one, p99_one)]
        for own in (False, True):
            rate, p99 = run(new_root(endpoint), args.threads, args.seconds, own_handles=own)
            what = "a handle per thread" if own else "one shared Address"
            rows.append((f"send([row]), {what}", args.threads, rate, p99))
    finally:
        proc.terminate()
        proc.wait()
    print(f"S3 test endpoint (moto + waitress over HTTP), {args.seconds:g} s per scenario")
    print(f"{'scenario':38s} {'threads':>7s} {'msg/s':>9s} {'vs 1 thread':>11s} {'p99 ms':>8s}")
    for name, threads, rate, p99 in rows:
        print(f"{name:38s} {threads:7d} {rate:9,.0f} {rate / one:10.2f}x {p99:8.1f}")


if __name__ == "__main__":
    main()
