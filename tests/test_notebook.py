"""The Databricks quickstart notebook runs end to end as a plain script (its %pip cell is a
comment outside Databricks), on a temporary store, and its install line leaves pyspark to the
Databricks runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyspark_durable_queue import DurableQueue

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "durablequeue_quickstart.py"


def test_install_line_leaves_pyspark_to_the_runtime():
    # On Databricks pyspark comes with the runtime; a %pip line that pulls pyspark from PyPI
    # (directly or through the [spark] extra) would shadow it.
    text = NOTEBOOK.read_text()
    pip = [line.split() for line in text.splitlines() if line.startswith("# MAGIC %pip")]
    assert len(pip) == 1 and pip[0][3] == "install"
    requirements = [word for word in pip[0][4:] if not word.startswith("-")]
    assert requirements and all(r.startswith("pyspark-durable-queue") and "[" not in r
                                for r in requirements), pip[0]
    assert "spark.dataSource.register(" in text


@pytest.mark.spark
@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    root = tmp_path / "dq"
    env = dict(os.environ, DQ_ROOT=str(root), DQ_CHECKPOINTS=str(tmp_path / "chk"),
               DQ_PRODUCE_SECONDS="8", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run([sys.executable, str(NOTEBOOK)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = DurableQueue(str(root)).address("orders").stats()
    assert stats["next_seq"] > 0
    assert set(stats["consumers"]) == {"billing", "apac"}
    assert "billing" in proc.stdout and "region" in proc.stdout
