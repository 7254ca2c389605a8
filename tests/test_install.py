"""A fresh install works as the README says: the wheel built from this repository, installed
into new virtual environments (no system site packages), runs the Python client and the CLI
without pyspark, and with the ``[spark]`` extra Spark finds ``format("durablequeue")`` by itself.

These tests build and install for real (pip reaches the package registry; its cache keeps a
reinstall fast), so they are marked ``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent

# What a source checkout holds besides the sources: environments, build output, caches, data.
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                      "__pycache__", ".*_cache", ".hypothesis", "demo-data",
                                      "spark-warehouse", "metastore_db")


def _run(args: list[str | Path], *, env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, (f"{' '.join(map(str, args))} exited with "
                                      f"{proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                      f"{proc.stderr[-3000:]}")
    return proc


def _clean_env(venv: Path) -> dict[str, str]:
    """The environment of a user who just installed into ``venv``: nothing from this test
    run's interpreter (``PYTHONPATH`` may point at the checkout) leaks in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "SPARK_HOME",
                        "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    python = str(venv / "bin" / "python")
    return env | {"PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                  "PYSPARK_PYTHON": python, "PYSPARK_DRIVER_PYTHON": python,
                  "SPARK_LOCAL_IP": "127.0.0.1"}


def _fresh_venv(path: Path, requirement: str) -> Path:
    _run([sys.executable, "-m", "venv", path])
    assert "include-system-site-packages = false" in (path / "pyvenv.cfg").read_text()
    python = path / "bin" / "python"
    # --no-compile: pip would byte-compile every module it installs (pyspark's thousands among
    # them) up front; the interpreter compiles what it imports anyway, and the install takes
    # about half as long (the [spark] one 17 s -> 9 s, measured on the 2-core machine).
    _run([python, "-m", "pip", "install", "--quiet", "--no-compile", requirement],
         env=_clean_env(path))
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the repository these tests belong to. Built from a copy of its sources:
    setuptools builds in the source tree, and a ``build/`` left there (stale files included)
    would end up in the wheel."""
    src = tmp_path_factory.mktemp("src") / REPO.name
    shutil.copytree(REPO, src, ignore=_NOT_SOURCES)
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, src])
    (built,) = out.glob("pyspark_durable_queue-*.whl")
    return built


CLIENT = """
import json, sys
import pyspark_durable_queue as dq
from pyspark_durable_queue import *  # noqa: F403

orders = DurableQueue(sys.argv[1]).address("orders")
orders.send([{"id": i, "region": "EU" if i % 2 else "US"} for i in range(10)])
billing = orders.consumer("billing", selector="region = 'EU'")
batch = billing.receive(max_messages=3)
billing.ack(batch)
try:
    dq.DefaultSource
    error = None
except ModuleNotFoundError as exc:
    error = str(exc)
print(json.dumps({"file": dq.__file__, "received": batch.column("id").to_pylist(),
                  "all": dq.__all__, "default_source_error": error,
                  "pyspark_loaded": "pyspark" in sys.modules}))
"""


def test_without_extras_the_client_and_cli_run_and_pyspark_is_absent(wheel, tmp_path):
    venv = tmp_path / "venv"
    python = _fresh_venv(venv, str(wheel))
    env = _clean_env(venv)

    proc = _run([python, "-c", "import pyspark"], env=env, cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "No module named 'pyspark'" in proc.stderr

    root = tmp_path / "dq"
    out = json.loads(_run([python, "-c", CLIENT, root], env=env, cwd=tmp_path).stdout)
    assert Path(out["file"]).is_relative_to(venv), out["file"]  # the installed wheel
    assert out["received"] == [1, 3, 5]
    assert "DurableQueue" in out["all"] and "DefaultSource" not in out["all"]
    assert 'pip install "pyspark-durable-queue[spark]"' in out["default_source_error"]
    assert not out["pyspark_loaded"]

    cli = venv / "bin" / "durablequeue"
    addresses = json.loads(_run([cli, root, "--json", "addresses"], env=env, cwd=tmp_path).stdout)
    assert [(a["address"], a["next_seq"], a["consumers"]) for a in addresses] == [
        ("orders", 10, 1)]
    stats = json.loads(_run([cli, root, "--json", "stats", "orders"], env=env,
                            cwd=tmp_path).stdout)
    assert stats["consumers"]["billing"]["position"] == 6  # past _seq 5, the last acked match
    assert stats["consumers"]["billing"]["backlog_messages"] == 4
    browse = _run([cli, root, "--json", "browse", "orders", "--selector", "id >= 7"], env=env,
                  cwd=tmp_path).stdout
    assert [json.loads(line)["id"] for line in browse.splitlines()] == [7, 8, 9]


SPARK = """
import sys
from pyspark.sql import SparkSession

root = sys.argv[1]
spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "1").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
# no spark.dataSource.register(...): Spark registers pyspark_* modules' DefaultSource itself
(spark.range(5).selectExpr("id", "concat('m-', id) AS body")
    .write.format("durablequeue").mode("append").option("address", "events").save(root))
rows = (spark.read.format("durablequeue").option("address", "events").load(root)
        .orderBy("_seq").collect())
print("ROWS", [(r.id, r.body, r._seq) for r in rows])
# and a streaming query from one address into another (the streaming reader, writer and the
# sink's commit on the driver run in their own Python processes)
q = (spark.readStream.format("durablequeue").option("address", "events")
     .option("consumer", "copier").load(root)
     .selectExpr("id * 10 AS x").writeStream.format("durablequeue").option("address", "tens")
     .option("checkpointLocation", sys.argv[2]).trigger(availableNow=True).start(root))
q.awaitTermination(300)
assert not q.isActive and q.exception() is None, q.exception()
spark.stop()
"""


def test_with_the_spark_extra_format_durablequeue_is_found_without_register(wheel, tmp_path):
    venv = tmp_path / "venv"
    python = _fresh_venv(venv, f"{wheel}[spark]")
    env = _clean_env(venv)
    pyspark_file = _run([python, "-c", "import pyspark; print(pyspark.__file__)"], env=env,
                        cwd=tmp_path).stdout.strip()
    assert Path(pyspark_file).is_relative_to(venv), pyspark_file

    root = tmp_path / "dq"
    proc = _run([python, "-c", SPARK, root, tmp_path / "checkpoint"], env=env, cwd=tmp_path,
                timeout=600)
    assert "ROWS [(0, 'm-0', 0), (1, 'm-1', 1), (2, 'm-2', 2), (3, 'm-3', 3), " \
           "(4, 'm-4', 4)]" in proc.stdout, proc.stdout[-2000:]
    # what Spark wrote is the store's: the client in this test's environment reads it
    from pyspark_durable_queue import DurableQueue

    queue = DurableQueue(str(root))
    assert queue.address("events", create=False).stats()["consumers"]["copier"]["position"] == 5
    tens = queue.address("tens", create=False).consumer("check").receive(max_messages=100)
    assert tens.column("x").to_pylist() == [0, 10, 20, 30, 40]
