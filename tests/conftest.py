"""Shared fixtures. Spark tests share one session-scoped SparkSession (``local[2]``)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import uuid
from types import ModuleType
from typing import NoReturn

import pytest

# Spark's Python workers must run this interpreter (the venv's), not the system python3.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


#: ``DQ_REQUIRE_BACKENDS=1`` (``.ci/run`` sets it): a missing test backend (Azurite, the S3
#: test server's packages) fails the tests that need it instead of skipping them, so a run
#: cannot pass while the S3 or Azure cases quietly did not run.
REQUIRE_BACKENDS = os.environ.get("DQ_REQUIRE_BACKENDS") == "1"


def backend_missing(reason: str) -> NoReturn:
    """Skip, or fail under ``DQ_REQUIRE_BACKENDS=1``, because a test backend is missing."""
    if REQUIRE_BACKENDS:
        pytest.fail(f"{reason}. DQ_REQUIRE_BACKENDS=1 (as in CI): the S3 and Azure cases must "
                    "run, not be skipped", pytrace=False)
    pytest.skip(reason)


def require_backend_module(name: str) -> ModuleType:
    """``pytest.importorskip`` for a test backend's package, failing under
    ``DQ_REQUIRE_BACKENDS=1``."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        backend_missing(f"{name} is not importable ({exc}; pip install -e '.[test]')")


def load_file(name: str, path) -> ModuleType:
    """A Python file that is not an importable module (a child script, another test file)
    loaded as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finish_query(q, timeout: float = 180) -> None:
    """Wait for a streaming query that ends by itself (``availableNow``), stop it, and check
    it finished without an exception."""
    try:
        ended = q.awaitTermination(timeout)
    finally:
        q.stop()
    assert ended, f"the query did not finish in {timeout} s"
    assert q.exception() is None


def json_input_files(folder, files: int, rows: int, body: str = "row-") -> int:
    """``files`` JSON-lines files of ``rows`` rows ``{"id", "body"}`` each (a file source's
    micro-batches); returns the rows written."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for f in range(files):
        lines = [json.dumps({"id": n + i, "body": f"{body}{n + i}"}) for i in range(rows)]
        (folder / f"part-{f:04d}.json").write_text("\n".join(lines) + "\n")
        n += rows
    return n


def older_format(root, name: str, number: int) -> None:
    """Make the new address ``name`` under the local folder ``root`` one of on-disk format
    ``number`` (1-4; 4 is the journal's), as an earlier release created it: ``address.json``
    without its checksum. Call it before anything else is written to the address, and open
    the address again afterwards (a handle keeps the format it opened)."""
    assert 1 <= number <= 4, number
    path = os.path.join(str(root), name, "address.json")
    with open(path) as f:
        meta = json.load(f)
    if number == 4:
        assert meta.pop("journal"), "format 4 is the journal's: create the address with it"
    meta.pop("journal", None)
    del meta["crc32c"]
    meta["format"] = number
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)


def taken_in_time(setup, first_ms: int = 300):
    """For a test that makes messages old by waiting: ``setup(ttl_ms)`` sends with that TTL
    (on a fresh address each time) and takes what it must take before the TTL ends, returning
    ``(handle, taken)``. Tried with ``first_ms``, then four and sixteen times it, until the
    take came within half the TTL of the call (a loaded machine may be slower than a short
    TTL: the test must not judge rows that expired early); a slower attempt's handle is closed.
    Returns ``(ttl_ms, handle, taken)`` of the attempt kept (the last one, at worst)."""
    import time

    for ttl in (first_ms, first_ms * 4):
        since = time.monotonic()
        handle, taken = setup(ttl)
        if (time.monotonic() - since) * 1000 < ttl / 2:
            return ttl, handle, taken
        handle.close()
    handle, taken = setup(first_ms * 16)
    return first_ms * 16, handle, taken


def run_cli(capsys, *argv):
    """``durablequeue ARGV`` in this process: ``(exit code, stdout, stderr)``."""
    from pyspark_durable_queue.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def pytest_collection_modifyitems(items):
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # In pytest-xdist's workers (`make test`: --dist loadfile --no-loadscope-reorder, a
        # file's tests on one worker, the files handed out in this order) the files with the
        # longest tests go out first: handed out last, one of them would run on alone while
        # the other workers have nothing left to do. No test depends on another having run.
        items.sort(key=lambda item: not (item.get_closest_marker("slow")
                                         or item.get_closest_marker("crash")))


class ScratchRoot:
    """A store root for tests that cannot take a fixture (Hypothesis state machines, which make
    one per example): a fresh folder on the local disk (``kind`` ``"file"``) or a fresh URL in
    fsspec's memory filesystem (``"memory"``); :meth:`remove` deletes it."""

    def __init__(self, kind: str, prefix: str) -> None:
        import tempfile

        self.tmp: str | None = None
        if kind == "file":
            self.tmp = tempfile.mkdtemp(prefix=prefix)
            self.url = f"{self.tmp}/dq"
        else:
            self.url = f"memory://{prefix}{uuid.uuid4().hex}"

    def remove(self) -> None:
        if self.tmp is not None:
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        import fsspec

        fs = fsspec.filesystem("memory")
        path = self.url.replace("memory://", "/")
        if fs.exists(path):
            fs.rm(path, recursive=True)


@contextlib.contextmanager
def _serving(args: list[str], listening: str, what: str, host: str = "127.0.0.1"):
    """Run a test server in a subprocess until the block ends; yields its port.

    The server picks a free port itself (port 0) and prints it: ``listening`` is a regular
    expression whose group 1 is the port in the line it prints once it listens. A port picked
    here and handed to the server could be taken in between, by another pytest-xdist worker's
    server among others (and a worker would then have talked to another worker's server)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    found: queue.Queue[int | None] = queue.Queue()

    def read() -> None:  # and go on reading, so that the server never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(listening, line)
            if match:
                found.put(int(match.group(1)))
        found.put(None)  # the server ended (or closed its standard output) without a port

    threading.Thread(target=read, daemon=True).start()
    try:
        try:
            port = found.get(timeout=60)
        except queue.Empty:
            port = None
        if port is None:
            raise RuntimeError(f"{what} did not start (exit status {proc.poll()})")
        socket.create_connection((host, port), timeout=5).close()
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(3)  # Azurite takes its time over a graceful stop; nothing to keep
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3 endpoint for the whole session: moto's S3 implementation in a subprocess
    (``_procs/s3_server.py``), reached over real HTTP by the real s3fs client (conditional
    PUTs, listings, ranged GETs, multipart uploads).

    Configured the way users configure S3, through the standard AWS environment variables, so
    ``DurableQueue("s3://bucket/dq")`` needs no storage options and child processes (crash
    tests, Spark workers) reach the same server.
    """
    for name in ("s3fs", "moto.server", "waitress", "boto3"):
        require_backend_module(name)
    server = os.path.join(os.path.dirname(__file__), "_procs", "s3_server.py")
    with _serving([sys.executable, server, "0"], r"^listening on (\d+)$",
                  "moto's S3 server") as port:
        endpoint = f"http://127.0.0.1:{port}"
        with _environ({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}):
            yield endpoint


def new_s3_root(endpoint: str) -> str:
    """A fresh bucket on the session's S3 server; returns the store root URL in it."""
    import boto3

    bucket = f"dq-{uuid.uuid4().hex[:20]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/dq"


#: Where ``make test`` installs Azurite (npm), Microsoft's Azure Storage emulator.
AZURITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv",
                       "azurite", "node_modules", ".bin", "azurite-blob")
# Azurite's well-known development account (public, documented by Microsoft).
_AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
                "KBHBeksoGMGw==")


@pytest.fixture(scope="session")
def azure_connection(tmp_path_factory):
    """An Azure Blob endpoint for the whole session: Azurite in a subprocess, reached over
    HTTP by adlfs (``abfs://``), whose exclusive create is ``overwrite=False``
    (``If-None-Match: *``). Configured through ``AZURE_STORAGE_CONNECTION_STRING``, as users
    do, so child processes reach it too. Skipped where Azurite is not installed (``make test``
    installs it with npm when npm is there), failed instead under ``DQ_REQUIRE_BACKENDS=1``."""
    require_backend_module("adlfs")
    require_backend_module("azure.storage.blob")
    binary = os.environ.get("DQ_AZURITE", AZURITE)
    if not os.path.exists(binary):
        backend_missing(f"Azurite, the Azure Storage emulator, is not installed at {binary} "
                        "(`make test` installs it with npm; DQ_AZURITE names another binary)")
    data = tmp_path_factory.mktemp("azurite")
    args = [binary, "--silent", "--location", str(data), "--blobHost", "127.0.0.1",
            "--blobPort", "0", "--skipApiVersionCheck", "--loose"]
    # "Azurite Blob service successfully listens on http://127.0.0.1:PORT"
    with _serving(args, r"listens on http://127\.0\.0\.1:(\d+)\s*$", "Azurite") as port:
        connection = ("DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
                      f"AccountKey={_AZURITE_KEY};"
                      f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;")
        with _environ({"AZURE_STORAGE_CONNECTION_STRING": connection}):
            yield connection


def new_azure_root(connection: str) -> str:
    """A fresh container on the session's Azurite; returns the store root URL in it."""
    from azure.storage.blob import BlobServiceClient

    container = f"dq-{uuid.uuid4().hex[:20]}"
    BlobServiceClient.from_connection_string(connection).create_container(container)
    return f"abfs://{container}/dq"


def object_store_root(request, kind: str) -> str:
    if kind == "s3":
        return new_s3_root(request.getfixturevalue("s3_endpoint"))
    return new_azure_root(request.getfixturevalue("azure_connection"))


def _local_root(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def raw_fs(url: str, storage_options: dict | None = None):
    """The fsspec filesystem of a non-local store root, made apart from the store's own
    ``Storage``, so that tests can read and damage files behind the store's back."""
    import fsspec

    return fsspec.core.url_to_fs(url, **(storage_options or {}), use_listings_cache=False)[0]


def raw_read(storage, path: str) -> bytes:
    """The bytes of ``path`` (a full path, as ``storage.join`` makes it), read bypassing
    ``storage``: ``open()`` on a local root, fsspec elsewhere."""
    if _local_root(storage.url):
        with open(path, "rb") as f:
            return f.read()
    return raw_fs(storage.url, storage.storage_options).cat_file(path)


def raw_write(storage, path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` bypassing ``storage`` (to damage a store on purpose)."""
    if _local_root(storage.url):
        with open(path, "wb") as f:
            f.write(data)
    else:
        raw_fs(storage.url, storage.storage_options).pipe_file(path, data)


@pytest.fixture(params=["file", "s3", "abfs"])
def shared_root(request, tmp_path):
    """A root that several processes can share: a local folder, a bucket on the session's S3
    server or a container on its Azurite (exclusive publishing there is a conditional PUT, not
    ``link``)."""
    if request.param == "file":
        return str(tmp_path / "dq")
    return object_store_root(request, request.param)


@pytest.fixture(params=["file", "memory", "s3", "abfs"])
def root(request, tmp_path):
    """A fresh store root on the local disk, in fsspec's memory filesystem, on S3 and on Azure
    Blob storage."""
    if request.param == "file":
        yield str(tmp_path / "dq")
    elif request.param in ("s3", "abfs"):
        yield object_store_root(request, request.param)
    else:
        import fsspec

        url = f"memory://dq-{uuid.uuid4().hex}"
        yield url
        fs = fsspec.filesystem("memory")
        path = url.replace("memory://", "/")
        if fs.exists(path):
            fs.rm(path, recursive=True)


#: ``DQ_SPARK_CLUSTER=1`` (``make test-cluster``): the ``spark`` fixture's session runs on a
#: Spark standalone cluster (a master and two workers of one core each, started from the pyspark
#: package on 127.0.0.1: ``tests/spark_cluster.py``) instead of ``local[2]``, so executors are
#: JVMs and Python workers of their own, sharing only the store's local root with the driver.
SPARK_CLUSTER = os.environ.get("DQ_SPARK_CLUSTER") == "1"
CLUSTER_SKIP = ("runs only on a Spark standalone cluster: `make test-cluster` "
                "(DQ_SPARK_CLUSTER=1) starts one")


def _wait_for_executors(session, count: int, timeout_s: float = 120) -> None:
    """Wait until ``count`` executors registered with the driver (they come up after the
    session does), so that every cluster test runs with all of them."""
    import time

    tracker = session.sparkContext._jsc.sc().statusTracker()
    deadline = time.monotonic() + timeout_s
    while len(tracker.getExecutorInfos()) < count + 1:  # the driver is listed too
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} executors did not register within {timeout_s:.0f} s "
                               f"(got {len(tracker.getExecutorInfos()) - 1}); the workers' "
                               "logs are in the session's spark-cluster temporary folder")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def spark_master(tmp_path_factory):
    """The master the ``spark`` fixture's session uses: ``local[2]``, or with
    ``DQ_SPARK_CLUSTER=1`` a standalone cluster's ``spark://127.0.0.1:PORT``, stopped at the
    end of the session."""
    if not SPARK_CLUSTER:
        yield "local[2]"
        return
    from spark_cluster import standalone_cluster

    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2) as url:
        yield url


@pytest.fixture(scope="session")
def spark_cluster(spark_master):
    """The standalone cluster's master URL; skips (saying how to run it) without
    ``DQ_SPARK_CLUSTER=1``."""
    if not SPARK_CLUSTER:
        pytest.skip(CLUSTER_SKIP)
    return spark_master


@pytest.fixture(scope="session")
def spark(spark_master):
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(spark_master)
    if SPARK_CLUSTER:
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # the driver's JVM, started just below
        # one executor per worker (1 core, 768 MiB of the worker's 1 GiB), both in use; the
        # driver on the loopback interface only, as the daemons are
        builder = (builder.config("spark.executor.cores", "1")
                   .config("spark.executor.memory", "768m")
                   .config("spark.cores.max", "2")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1"))
    session = (
        builder
        .appName("pyspark-durable-queue-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.python.filterPushdown.enabled", "true")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    if SPARK_CLUSTER:
        _wait_for_executors(session, 2)
    yield session
    session.stop()
