"""What a Spark job costs an object store: S3 requests per operation, counted at the server.

The cost model behind ``docs/scaling.md``. This starts the S3 endpoint the tests use (moto's S3
implementation, ``tests/_procs/s3_server.py``) in this process, behind a WSGI middleware that
counts every HTTP request by kind (LIST, GET, PUT, HEAD, DELETE, POST) and by what it touched
(a page, a log entry, a checkpoint, a consumer's files, the cleanup marker...), and drives
the store through the real s3fs client over HTTP. Spark's calls are made without a JVM, as
``tests/test_spark_multi.py`` makes them: the sink's writer is pickled to each "task" and its
commit message pickled back to a pickled "driver" writer; the stream reader plans on the
driver and its pickled copy reads each planned partition.

For each size of the address (``--pages``: live pages, built by sink commits of 100 tasks of
one page each) and number of durable consumers (``--consumers``, all holding every page), and
for each number of tasks per micro-batch (``--tasks``: one per executor), it counts:

* ``sink task``: one task's write (average over the batch's tasks), on an executor;
* ``sink commit``: the driver's commit of the batch (a pickled writer, as Spark hands it to
  the Python process that commits: it opens the log itself), cleanup not due;
* ``plan``: the stream reader's ``latestOffset`` and ``partitions`` (driver), planning that
  many tasks of one page each (``maxPagesPerTrigger``, ``minPartitions``);
* ``read task``: one task's read of its partition (average), on an executor;
* ``source commit``: the reader's ``commit(end)`` (the consumer's watermark, driver);
* ``cleanup tick``: ``maybe_cleanup`` when the interval has not passed (every commit and ack
  does it); ``cleanup idle``: a cleanup that finds nothing to remove; ``cleanup remove``: one
  removing 100 pages every consumer acknowledged (after one ``ack`` per consumer: ``ack``);
* ``compact``: compaction of 100 small pages into one;
* ``open``: a fresh handle's first look at the address (what a restarted driver pays);
* ``query start``: the stream reader's first ``latestOffset`` (consumer, lease) and the sink
  writer's construction.

Counts are deterministic for a given layout (no retries: one process, no contention); the
seconds are moto's on this machine, not S3's. Run::

    .venv/bin/python benchmarks/bench_scaling.py                    # 1k and 10k pages
    .venv/bin/python benchmarks/bench_scaling.py --pages 1000 --tasks 1,10 --consumers 1
    .venv/bin/python benchmarks/bench_scaling.py --detail           # and by file kind

The bucket lives in moto's memory, so nothing is left on disk.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, unquote

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "_procs"))

KINDS = ("LIST", "GET", "PUT", "HEAD", "DELETE", "POST")
BYTES_UP, BYTES_DOWN = "bytes sent", "bytes received"  # request and GET response bodies
BUCKET = "bench-scaling"
ROOT_PREFIX = "dq"
ADDRESS = "a"
ROWS = 100  # rows per task (one page each, ~10 KB)
BATCH = 100  # tasks per sink commit while building the address


# -- the counting server ---------------------------------------------------------------------------
class Counter:
    """Requests by (kind, area), counted by a WSGI middleware in front of moto.

    Thread-safe: waitress serves requests on 8 threads; ``lock`` guards ``counts``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def wrap(self, app: Callable[..., Any]) -> Callable[..., Any]:
        def counting(environ: dict[str, Any], start_response: Any) -> Any:
            kind, key = classify(environ)
            sent = int(environ.get("CONTENT_LENGTH") or 0)

            def counted_start(status: str, headers: list[tuple[str, str]], *args: Any) -> Any:
                got = 0
                if environ.get("REQUEST_METHOD") == "GET":
                    got = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
                with self.lock:
                    self.counts[(kind, area(key))] += 1
                    self.counts[(BYTES_UP, "")] += sent
                    self.counts[(BYTES_DOWN, "")] += got
                return start_response(status, headers, *args)

            return app(environ, counted_start)

        return counting

    def snapshot(self) -> collections.Counter[tuple[str, str]]:
        with self.lock:
            return self.counts.copy()


def classify(environ: dict[str, Any]) -> tuple[str, str]:
    """The request's kind as S3 bills it and the key (or listed prefix) it names."""
    method = environ.get("REQUEST_METHOD", "GET")
    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    path = unquote(environ.get("PATH_INFO", "")).lstrip("/")
    _bucket, _, key = path.partition("/")
    if method == "GET" and not key and ("list-type" in query or "prefix" in query):
        return "LIST", query.get("prefix", [""])[0]
    if method == "POST" and "delete" in query:
        return "DELETE", key  # DeleteObjects: one request, up to 1,000 keys
    return method, key


def area(key: str) -> str:
    """What a key is in the store's layout (``_format/layout.py``)."""
    prefix = f"{ROOT_PREFIX}/{ADDRESS}/"
    if not key.startswith(prefix):
        return "root" if key.rstrip("/") in ("", ROOT_PREFIX) else "other"
    rest = key[len(prefix):]
    if rest.startswith("pages"):
        return "page"
    if rest.startswith("log/"):
        name = rest[4:]
        if name == "_last_checkpoint":
            return "checkpoint hint"
        if ".checkpoint" in name:
            return "checkpoint"
        return "log entry" if name else "log listing"
    if rest == "log":
        return "log listing"
    if rest.startswith("consumers/_leases"):
        return "lease"
    if rest.startswith("consumers"):
        return "consumer"
    for name in ("cleanup.json", "address.json", "scheduled", "expiry"):
        if rest.startswith(name):
            return name
    return rest.split("/", 1)[0] or "address listing"


def start_server(counter: Counter) -> str:
    import waitress
    from s3_server import make_app

    server = waitress.create_server(counter.wrap(make_app()), host="127.0.0.1", port=0,
                                    threads=8)
    threading.Thread(target=server.run, name="moto", daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.effective_port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    return f"s3://{BUCKET}/{ROOT_PREFIX}"


# -- measuring -------------------------------------------------------------------------------------
class Results:
    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.rows: list[tuple[str, dict[str, Any], collections.Counter[tuple[str, str]],
                              float]] = []

    def measure(self, op: str, where: dict[str, Any], fn: Callable[[], Any], *,
                per: int = 1) -> Any:
        """Run ``fn`` and record the requests it made (divided by ``per``: an average)."""
        before = self.counter.snapshot()
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        time.sleep(0.05)  # the last responses' counting is done before the response returns
        delta = self.counter.snapshot() - before
        if per > 1:
            delta = collections.Counter({k: v / per for k, v in delta.items()})
        self.rows.append((op, where, delta, seconds / per))
        print_row(op, where, delta, seconds / per)
        return result


def kinds_of(delta: collections.Counter[tuple[str, str]]) -> dict[str, float]:
    out = dict.fromkeys(KINDS, 0.0)
    for (kind, _), n in delta.items():
        if kind not in (BYTES_UP, BYTES_DOWN):
            out[kind] = out.get(kind, 0.0) + n
    return out


def kib(delta: collections.Counter[tuple[str, str]], which: str) -> str:
    return f"{delta.get((which, ''), 0) / 1024:,.0f}"


def fmt(n: float) -> str:
    return f"{n:.0f}" if abs(n - round(n)) < 0.05 else f"{n:.1f}"


HEADER = (f"| {'operation':<14} | {'pages':>6} | {'consumers':>9} | {'tasks':>5} | "
          + " | ".join(f"{k:>6}" for k in KINDS)
          + f" | {'total':>6} | {'KiB up':>7} | {'KiB down':>8} | {'s (moto)':>8} |")


def print_row(op: str, where: dict[str, Any], delta: collections.Counter[tuple[str, str]],
              seconds: float) -> None:
    k = kinds_of(delta)
    cells = " | ".join(f"{fmt(k[name]):>6}" for name in KINDS)
    print(f"| {op:<14} | {where.get('pages', ''):>6} | {where.get('consumers', ''):>9} | "
          f"{where.get('tasks', ''):>5} | {cells} | {fmt(sum(k.values())):>6} | "
          f"{kib(delta, BYTES_UP):>7} | {kib(delta, BYTES_DOWN):>8} | {seconds:>8.3f} |",
          flush=True)
    if DETAIL:
        by_area: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        for (kind, where_), n in delta.items():
            if kind not in (BYTES_UP, BYTES_DOWN):
                by_area[where_][kind] += n
        for name in sorted(by_area):
            parts = ", ".join(f"{kind} {fmt(n)}" for kind, n in sorted(by_area[name].items()))
            print(f"|   {name}: {parts}")


DETAIL = False


# -- Spark's calls, without a JVM ------------------------------------------------------------------
def spark_schema() -> Any:
    from pyspark.sql import types as T

    return T.StructType([T.StructField("id", T.LongType()), T.StructField("body", T.StringType())])


def task_batch(first: int) -> Iterator[Any]:
    import pyarrow as pa

    yield pa.record_batch({"id": pa.array(range(first, first + ROWS), pa.int64()),
                           "body": pa.array([f"message {i} " + "x" * 80
                                             for i in range(first, first + ROWS)])})


class Job:
    """One streaming query writing into the address and one reading it, driven as Spark does."""

    def __init__(self, root: str, checkpoint: str) -> None:
        from pyspark_durable_queue.spark._sink import DurableQueueStreamWriter

        self.root = root
        # cleanup at most hourly and no automatic compaction: each is measured on its own
        self.options = {"path": root, "address": ADDRESS, "checkpointlocation": checkpoint,
                        "cleanupIntervalMs": "3600000", "compactSmallPages": "0"}
        self.writer_class = DurableQueueStreamWriter
        self.writer = DurableQueueStreamWriter(self.options, spark_schema(), False)
        self.batch_id = 0
        self.next_id = 0

    def new_writer(self) -> Any:
        return self.writer_class(self.options, spark_schema(), False)

    def tasks(self, n: int) -> list[Any]:
        """``n`` tasks' writes: the writer pickled to each, its commit message pickled back."""
        shipped = pickle.dumps(self.writer)
        messages = []
        for _ in range(n):
            message = pickle.loads(shipped).write(task_batch(self.next_id))
            self.next_id += ROWS
            message.query_id, message.batch_id = "bench-query", self.batch_id
            messages.append(pickle.loads(pickle.dumps(message)))
        return messages

    def commit(self, messages: list[Any]) -> None:
        pickle.loads(pickle.dumps(self.writer)).commit(messages, self.batch_id)
        self.batch_id += 1


def reader_for(root: str, tasks: int) -> Any:
    from pyspark_durable_queue.spark import DurableQueueDataSource

    source = DurableQueueDataSource({
        "path": root, "address": ADDRESS, "consumer": "etl",
        "maxPagesPerTrigger": str(tasks), "minPartitions": str(tasks),
        "taskSlots": str(tasks), "consumerLeaseMs": "3600000"})
    return source.streamReader(source.schema())


# -- the runs --------------------------------------------------------------------------------------
def grow(job: Job, pages: int) -> None:
    """Sink commits of ``BATCH`` one-page tasks until the address holds ``pages`` live pages."""
    address = job.writer.address
    t0 = time.perf_counter()
    while True:
        live = len(address.state.pages)
        if live >= pages:
            break
        job.commit(job.tasks(min(BATCH, pages - live)))
    checkpoints = [(n, size) for n, size, _ in address.storage.list_detailed(
        address.layout.log) if ".checkpoint" in n]
    print(f"(address at {len(address.state.pages)} pages, {job.batch_id} sink commits, "
          f"{time.perf_counter() - t0:.0f} s; checkpoints: {checkpoints})", flush=True)


def set_consumers(root: str, count: int) -> None:
    """Durable consumers ``c1``.. up to ``count`` in all (with ``etl``, the query's), each at
    the first message, so that every page stays needed; those beyond ``count`` deleted."""
    from pyspark_durable_queue import DurableQueue

    address = DurableQueue(root).address(ADDRESS, create=False)
    wanted = {f"c{i}" for i in range(1, count)}
    for name in address.consumers():
        if name.startswith("c") and name not in wanted:
            address.consumer(name).delete()
    have = set(address.consumers())
    for name in sorted(wanted - have):
        address.consumer(name, start="earliest").close()


def run_level(results: Results, job: Job, pages: int, consumers: int,
              task_counts: list[int], *, first: bool) -> None:
    from pyspark_durable_queue import DurableQueue

    root = job.root
    for n in task_counts:
        where = {"pages": pages, "consumers": consumers, "tasks": n}
        messages = results.measure("sink task", where, lambda n=n: job.tasks(n), per=n)
        results.measure("sink commit", where, lambda m=messages: job.commit(m))
        reader = reader_for(root, n)
        try:
            def first_batch(reader: Any = reader) -> tuple[Any, Any]:
                start = reader.initialOffset()
                return start, reader.latestOffset(start, reader.getDefaultReadLimit())

            # the query's start: its consumer, its lease, its first latestOffset
            start, end = results.measure("query start", where, first_batch)
            reader.commit(end)
            start = end

            def plan(reader: Any = reader, start: Any = start) -> tuple[Any, Any]:
                end = reader.latestOffset(start, reader.getDefaultReadLimit())
                return end, reader.partitions(start, end)

            end, parts = results.measure("plan", where, plan)
            assert len(parts) == n, (len(parts), n)
            shipped = pickle.dumps(reader)

            def read_all(parts: Any = parts, shipped: bytes = shipped) -> None:
                for p in parts:
                    for _ in pickle.loads(shipped).read(pickle.loads(pickle.dumps(p))):
                        pass

            results.measure("read task", where, read_all, per=n)
            results.measure("source commit", where, lambda e=end, r=reader: r.commit(e))
        finally:
            reader.stop()
    where = {"pages": pages, "consumers": consumers}
    address = DurableQueue(root).address(ADDRESS, create=False)
    _ = address.state
    results.measure("cleanup tick", where, address.maybe_cleanup)
    address.cleanup(dry_run=False)  # what the query's consumer passed: "cleanup remove"
    results.measure("cleanup idle", where, lambda: address.cleanup(dry_run=False))
    results.measure("open", where,
                    lambda: (DurableQueue(root).address(ADDRESS, create=False).state,
                             DurableQueue(root).address(ADDRESS, create=False).consumers()))
    if first:
        results.measure("query start", {**where, "tasks": "sink"}, job.new_writer)


def run_removal(results: Results, root: str, pages: int, consumers: int) -> None:
    """Every consumer acknowledges the first 100 live pages; cleanup removes them; then
    compaction of 100 small pages."""
    from pyspark_durable_queue import DurableQueue

    address = DurableQueue(root).address(ADDRESS, create=False)
    index = address.state.pages
    first = address.state.first_seq
    upto = index.ref(min(len(index), 100)).seq if len(index) > 100 else address.state.next_seq
    where = {"pages": pages, "consumers": consumers}
    handles = [address.consumer(name) for name in sorted(address.consumers())]
    try:
        def ack_all() -> None:
            for c in handles:
                if c.position < upto:
                    c.ack(upto - 1)
        results.measure("ack", where, ack_all, per=len(handles))
    finally:
        for c in handles:
            c.close()
    report = results.measure("cleanup remove", where, lambda: address.cleanup(dry_run=False))
    removed = len(report.pages)
    report_c = results.measure(
        "compact", where, lambda: address.compact(max_bytes=100 * page_bytes(address)))
    print(f"(cleanup removed {removed} pages; first seq {first} -> {address.state.first_seq}; "
          f"compaction: {report_c})", flush=True)


def page_bytes(address: Any) -> int:
    index = address.state.pages
    return max(1, int(index.ref(len(index) - 1).bytes)) if len(index) else 10_000


def main() -> None:
    global DETAIL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", default="1000,10000",
                        help="live pages of the address, comma-separated (default 1000,10000)")
    parser.add_argument("--tasks", default="1,10,100",
                        help="tasks per micro-batch, comma-separated (default 1,10,100)")
    parser.add_argument("--consumers", default="1,10,100",
                        help="durable consumers, comma-separated (default 1,10,100)")
    parser.add_argument("--detail", action="store_true", help="break each row down by file")
    args = parser.parse_args()
    DETAIL = args.detail
    logging.basicConfig(level=logging.ERROR)
    pages = sorted(int(x) for x in args.pages.split(","))
    tasks = sorted(int(x) for x in args.tasks.split(","))
    consumers = sorted(int(x) for x in args.consumers.split(","))
    import tempfile

    counter = Counter()
    root = start_server(counter)
    results = Results(counter)
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as checkpoint:
        job = Job(root, checkpoint)
        print(HEADER)
        print("|" + "|".join("-" * (len(c)) for c in HEADER.split("|")[1:-1]) + "|")
        for p in pages:
            grow(job, p)
            for c in consumers:
                set_consumers(root, c)
                run_level(results, job, p, c, tasks, first=c == consumers[0])
            run_removal(results, root, p, consumers[-1])


if __name__ == "__main__":
    main()
