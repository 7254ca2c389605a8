"""The quickstart notebook: the Databricks source runs end to end as a plain script (its %pip
cell is a comment outside Databricks), on a temporary store, and its install line leaves
pyspark to the Databricks runtime; the Jupyter notebook generated from it is up to date and
runs cell by cell in a Jupyter kernel (nbclient), plots included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyspark_durable_queue import DurableQueue

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
NOTEBOOK = NOTEBOOKS / "durablequeue_quickstart.py"
JUPYTER = NOTEBOOKS / "durablequeue_quickstart.ipynb"
#: How long the notebook's producer runs. It produces until at least one micro-batch with rows
#: is in the address however short this is, and the consumers, the plot and the stats need no
#: more than that, so the runs here produce for as little as the notebook allows.
PRODUCE_SECONDS = "0"


def _make_ipynb():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_ipynb", NOTEBOOKS / "make_ipynb.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
               DQ_PRODUCE_SECONDS=PRODUCE_SECONDS, PYSPARK_PYTHON=sys.executable)
    env["MPLBACKEND"] = "Agg"  # plt.show() without a display
    proc = subprocess.run([sys.executable, str(NOTEBOOK)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = DurableQueue(str(root)).address("orders").stats()
    assert stats["next_seq"] > 0
    assert set(stats["consumers"]) == {"billing", "apac"}
    assert "billing" in proc.stdout and "region" in proc.stdout


def test_jupyter_notebook_is_generated_from_the_databricks_source():
    import nbformat

    make = _make_ipynb()
    assert JUPYTER.read_text() == make.render(NOTEBOOK.read_text()), (
        "notebooks/durablequeue_quickstart.ipynb is out of date: run "
        ".venv/bin/python notebooks/make_ipynb.py")
    notebook = nbformat.reads(JUPYTER.read_text(), as_version=4)
    nbformat.validate(notebook)
    code = "".join(c.source for c in notebook.cells if c.cell_type == "code")
    assert "%pip" not in code  # Jupyter users install in the kernel's environment
    assert "spark.dataSource.register(" in code and "plt.show()" in code


@pytest.mark.spark
@pytest.mark.slow
def test_jupyter_notebook_runs_in_a_kernel(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    root = tmp_path / "dq"
    for key, value in {"DQ_ROOT": str(root), "DQ_CHECKPOINTS": str(tmp_path / "chk"),
                       "DQ_PRODUCE_SECONDS": PRODUCE_SECONDS,
                       "PYSPARK_PYTHON": sys.executable}.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    notebook = nbformat.reads(JUPYTER.read_text(), as_version=4)
    # a cell that raises fails the run (CellExecutionError), naming the cell
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was drawn"
    text = "".join(o.get("text", "") for o in outputs)
    assert "billing" in text and "apac" in text
    stats = DurableQueue(str(root)).address("orders").stats()
    assert set(stats["consumers"]) == {"billing", "apac"}
