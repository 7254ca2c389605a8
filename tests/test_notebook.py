"""The Databricks quickstart notebook runs end to end as a plain script (its %pip cell is a
comment outside Databricks), on a temporary store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyspark_durable_queue import DurableQueue

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "durablequeue_quickstart.py"

pytestmark = [pytest.mark.spark, pytest.mark.slow]


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
