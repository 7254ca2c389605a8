"""Memory stays flat whatever the backlog (issue 6): peak RSS for 1M vs 10M messages of ~1 KB.

Run::

    .venv/bin/python benchmarks/bench_memory.py [--small 1000000] [--large 10000000]
        [--root /tmp/dq-mem] [--only client|spark] [--keep]

For each backlog size it builds an address with the Python client (default settings: 10 MiB
pages, ``pageMaxCacheSize`` 5), then measures, each in a fresh subprocess:

* client: a ``receive`` + ``ack`` loop over the whole backlog; peak RSS from the kernel
  (``ru_maxrss``).
* spark: ``readStream.format("durablequeue")`` with ``Trigger.AvailableNow`` into the noop sink,
  default options, ``local[2]``; the process tree is sampled every 50 ms and the peak RSS is
  reported for the driver (its Python process plus the JVM) and for each Python worker.

Then it runs two consumers on one address concurrently in one process and prints the shared page
cache's counters. The ratio large/small of each peak is the figure of merit (target <= 1.15),
and each Python worker must stay under ``pageMaxCacheSize * pageSizeBytes + 150 MB``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

MESSAGE_BYTES = 1000
BATCH = 10_000


def body_column(rng: np.random.Generator, n: int) -> pa.Array:
    """``n`` random printable strings of MESSAGE_BYTES bytes, built without Python per row."""
    data = rng.integers(33, 127, size=n * MESSAGE_BYTES, dtype=np.uint8)
    offsets = np.arange(0, (n + 1) * MESSAGE_BYTES, MESSAGE_BYTES, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))


def build(root: str, n: int) -> None:
    from pyspark_durable_queue import DurableQueue

    a = DurableQueue(root).address("backlog")
    # a consumer that never acknowledges: cleanup after the measured runs must not shrink the
    # backlog the next run measures
    a.consumer("retainer", start="earliest")
    if a.stats()["next_seq"] >= n:
        return
    rng = np.random.default_rng(1)
    t = time.perf_counter()
    for start in range(a.stats()["next_seq"], n, BATCH):
        k = min(BATCH, n - start)
        a.send(pa.table({
            "id": pa.array(np.arange(start, start + k, dtype=np.int64)),
            "region": pa.array(np.array(["EU", "US", "APAC"])[rng.integers(0, 3, k)]),
            "body": body_column(rng, k),
        }))
    s = a.stats()
    print(f"  built {n:,} messages, {s['bytes'] / 1e9:.2f} GB in {s['pages']} pages "
          f"({time.perf_counter() - t:.0f} s)", flush=True)


# -- measured in a subprocess ------------------------------------------------------------------
def client_run(root: str) -> None:
    from pyspark_durable_queue import DurableQueue

    a = DurableQueue(root).address("backlog")
    c = a.consumer(f"client-{os.getpid()}")
    t = time.perf_counter()
    n = 0
    while (batch := c.receive(max_messages=10_000)).num_rows:
        n += batch.num_rows
        c.ack(batch)
    dt = time.perf_counter() - t
    c.delete()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"messages": n, "seconds": dt, "peak_rss": peak}))


def spark_run(root: str, checkpoint: str, driver_memory: str = "1g") -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", driver_memory).getOrCreate())
    t = time.perf_counter()
    df = (spark.readStream.format("durablequeue").option("address", "backlog")
          .option("consumer", f"spark-{os.getpid()}").load(root))
    q = (df.writeStream.format("noop").option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    dt = time.perf_counter() - t
    assert q.exception() is None, q.exception()
    batches = len(q.recentProgress)
    rows = sum(p["numInputRows"] for p in q.recentProgress)
    spark.stop()
    print(json.dumps({"messages": rows, "seconds": dt, "batches": batches}))


def two_consumers(root: str) -> None:
    from pyspark_durable_queue import DurableQueue
    from pyspark_durable_queue._read.cache import page_cache

    a = DurableQueue(root).address("backlog")
    names = [f"pair-{i}-{os.getpid()}" for i in range(2)]
    counts = {}

    def consume(name: str) -> None:
        c = a.consumer(name)
        n = 0
        while (batch := c.receive(max_messages=10_000)).num_rows:
            n += batch.num_rows
            c.ack(batch)
        counts[name] = n
        c.delete()

    page_cache().clear()
    threads = [threading.Thread(target=consume, args=(n,)) for n in names]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stats = page_cache().stats()
    stats["messages_per_consumer"] = list(counts.values())
    stats["stored_bytes"] = a.stats()["bytes"]
    print(json.dumps(stats))


# -- orchestration -------------------------------------------------------------------------------
def sample_tree(pid: int, stop: threading.Event, out: dict[int, dict]) -> None:
    import psutil

    root = psutil.Process(pid)
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                rss = p.memory_info().rss
                info = out.setdefault(p.pid, {"peak": 0, "parent": p.ppid(), "name": "",
                                              "cmd": ""})
                # spark-submit is a bash script that exec()s the JVM: names change
                info["name"] = p.name()
                cmd = " ".join(p.cmdline())[:200]
                if cmd:  # an exiting process reports an empty command line
                    info["cmd"] = cmd
                info["peak"] = max(info["peak"], rss)
            except psutil.Error:
                continue
        stop.wait(0.05)


def run_measured(args: list[str]) -> tuple[dict, dict[int, dict], int]:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            text=True)
    stop = threading.Event()
    tree: dict[int, dict] = {}
    th = threading.Thread(target=sample_tree, args=(proc.pid, stop, tree))
    th.start()
    out, _ = proc.communicate()
    stop.set()
    th.join()
    if proc.returncode:
        raise SystemExit(f"measured run failed: {args}")
    return json.loads(out.strip().splitlines()[-1]), tree, proc.pid


def classify(tree: dict[int, dict], driver_pid: int) -> dict[str, object]:
    """Driver: its Python process, the JVM (the launcher JVM that runs first is not counted)
    and the driver-side Python process holding the stream reader. Executors: the forked
    ``pyspark.worker`` processes (not their daemon)."""
    jvm = max((i["peak"] for i in tree.values() if i["name"] == "java"
               and "launcher.Main" not in i["cmd"]), default=0)
    runner = max((i["peak"] for i in tree.values()
                  if "python_streaming_source_runner" in i["cmd"]), default=0)
    daemons = {p for p, i in tree.items() if i["cmd"].endswith("pyspark.daemon pyspark.worker")
               and tree.get(i["parent"], {}).get("name") == "java"}
    workers = [i["peak"] for p, i in tree.items()
               if i["parent"] in daemons and "pyspark.worker" in i["cmd"]]
    driver_py = tree.get(driver_pid, {"peak": 0})["peak"]
    return {"driver_python": driver_py, "jvm": jvm, "source_runner": runner,
            "driver_total": driver_py + jvm + runner,
            "python_workers": sorted(workers, reverse=True)}


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=1_000_000)
    ap.add_argument("--large", type=int, default=10_000_000)
    ap.add_argument("--root", default=None)
    ap.add_argument("--only", choices=["client", "spark"], default=None)
    ap.add_argument("--keep", action="store_true", help="keep the built stores")
    ap.add_argument("--driver-memory", default="1g", help="spark.driver.memory (JVM heap)")
    ap.add_argument("--json", default=None, help="also write the peak RSS figures here")
    ap.add_argument("mode", nargs="?", default="main")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    if args.mode == "client-run":
        return client_run(args.extra[0])
    if args.mode == "spark-run":
        return spark_run(*args.extra)
    if args.mode == "two-consumers":
        return two_consumers(args.extra[0])

    base = args.root or tempfile.mkdtemp(prefix="dq-mem-")
    limit = 5 * 10 * 1024 * 1024 + 150_000_000
    results = {}
    for n in (args.small, args.large):
        root = os.path.join(base, f"n{n}")
        print(f"backlog of {n:,} messages of ~{MESSAGE_BYTES} bytes:", flush=True)
        build(root, n)
        r: dict[str, object] = {}
        if args.only in (None, "client"):
            res, _, _ = run_measured(["client-run", root])
            assert res["messages"] == n, res
            r["client"] = res["peak_rss"]
            print(f"  client receive+ack: peak RSS {mb(res['peak_rss'])}, "
                  f"{n / res['seconds'] / 1e6:.2f} M msg/s", flush=True)
        if args.only in (None, "spark"):
            ckpt = tempfile.mkdtemp(prefix="dq-mem-ckpt-")
            proc_res, tree, driver_pid = run_measured(["spark-run", root, ckpt,
                                                       args.driver_memory])
            shutil.rmtree(ckpt, ignore_errors=True)
            c = classify(tree, driver_pid)
            r["spark"] = c
            workers = c["python_workers"]
            print(f"  spark AvailableNow -> noop: {proc_res['messages']:,} messages in "
                  f"{proc_res['batches']} batches, {proc_res['seconds']:.0f} s; peak RSS "
                  f"driver python {mb(c['driver_python'])} + JVM {mb(c['jvm'])} + stream "
                  f"reader {mb(c['source_runner'])} = {mb(c['driver_total'])}; python workers "
                  f"{', '.join(mb(w) for w in workers[:4])} (limit {mb(limit)})", flush=True)
        results[n] = r
    small, large = results[args.small], results[args.large]
    print("ratios large/small (target <= 1.15):")
    if "client" in small:
        print(f"  client peak RSS: {large['client'] / small['client']:.3f}")
    if "spark" in small:
        s, l_ = small["spark"], large["spark"]
        print(f"  spark driver (python + JVM) peak RSS: "
              f"{l_['driver_total'] / s['driver_total']:.3f}")
        print(f"  spark largest python worker peak RSS: "
              f"{max(l_['python_workers']) / max(s['python_workers']):.3f}; every worker under "
              f"{mb(limit)}: {max(l_['python_workers'] + s['python_workers']) < limit}")
    res, _, _ = run_measured(["two-consumers", os.path.join(base, f"n{args.small}")])
    print(f"two consumers reading {args.small:,} messages concurrently in one process: "
          f"page cache hits {res['hits']}, misses {res['misses']}, read-ahead loads "
          f"{res['prefetched']}, evictions {res['evictions']}, bytes read "
          f"{mb(res['bytes_read'])} for {mb(res['stored_bytes'])} stored "
          f"({res['bytes_read'] / res['stored_bytes']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"message_bytes": MESSAGE_BYTES,
                       "backlogs": {str(n): r for n, r in results.items()}}, f, indent=1)
    if not args.keep and not args.root:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
