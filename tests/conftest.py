"""Shared fixtures. Spark tests share one session-scoped SparkSession (``local[2]``)."""

from __future__ import annotations

import os
import sys
import uuid

import pytest

# Spark's Python workers must run this interpreter (the venv's), not the system python3.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def pytest_collection_modifyitems(items):
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)


@pytest.fixture(params=["file", "memory"], ids=["file", "memory"])
def root(request, tmp_path):
    """A fresh store root on the local disk and in fsspec's memory filesystem."""
    if request.param == "file":
        yield str(tmp_path / "dq")
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
