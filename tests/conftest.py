"""Shared fixtures. Spark tests share one session-scoped SparkSession (``local[2]``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

# Spark's Python workers must run this interpreter (the venv's), not the system python3.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def pytest_collection_modifyitems(items):
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3 endpoint for the whole session: moto's S3 implementation in a subprocess
    (``_procs/s3_server.py``), reached over real HTTP by the real s3fs client (conditional
    PUTs, listings, ranged GETs, multipart uploads).

    Configured the way users configure S3, through the standard AWS environment variables, so
    ``DurableQueue("s3://bucket/dq")`` needs no storage options and child processes (crash
    tests, Spark workers) reach the same server.
    """
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    pytest.importorskip("waitress")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = os.path.join(os.path.dirname(__file__), "_procs", "s3_server.py")
    proc = subprocess.Popen([sys.executable, server, str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto's S3 server did not start on {endpoint}") from None
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(10)


_S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "AWS_DEFAULT_REGION")


def new_s3_root(endpoint: str) -> str:
    """A fresh bucket on the session's S3 server; returns the store root URL in it."""
    import boto3

    bucket = f"dq-{uuid.uuid4().hex[:20]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/dq"


@pytest.fixture(params=["file", "s3"])
def shared_root(request, tmp_path):
    """A root that several processes can share: a local folder, or a bucket on the session's
    S3 server (exclusive publishing there is a conditional PUT, not ``link``)."""
    if request.param == "s3":
        return new_s3_root(request.getfixturevalue("s3_endpoint"))
    return str(tmp_path / "dq")


@pytest.fixture(params=["file", "memory", "s3"], ids=["file", "memory", "s3"])
def root(request, tmp_path):
    """A fresh store root on the local disk, in fsspec's memory filesystem and on S3."""
    if request.param == "file":
        yield str(tmp_path / "dq")
    elif request.param == "s3":
        yield new_s3_root(request.getfixturevalue("s3_endpoint"))
    else:
        import fsspec

        url = f"memory://dq-{uuid.uuid4().hex}"
        yield url
        fs = fsspec.filesystem("memory")
        path = url.replace("memory://", "/")
        if fs.exists(path):
            fs.rm(path, recursive=True)


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("pyspark-durable-queue-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.python.filterPushdown.enabled", "true")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
