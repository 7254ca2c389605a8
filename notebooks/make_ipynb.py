"""Generate the Jupyter notebook from the Databricks one: one source, two formats.

``notebooks/durablequeue_quickstart.py`` (Databricks' source format: cells separated by
``# COMMAND ----------``, markdown and magics behind ``# MAGIC``) is the source;
``durablequeue_quickstart.ipynb`` is made from it by this script, and a test checks that it is
up to date. Run after editing the source::

    .venv/bin/python notebooks/make_ipynb.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "durablequeue_quickstart.py"
TARGET = HERE / "durablequeue_quickstart.ipynb"

_HEADER = "# Databricks notebook source"
_SEPARATOR = "# COMMAND ----------"
_MAGIC = "# MAGIC"
#: What Jupyter users read instead of the Databricks install cell.
_INSTALL = ("Install first, in the environment of the notebook's kernel: "
            '`pip install "pyspark-durable-queue[spark]"` (on Databricks the `%pip` cell of '
            "the source installs it without pyspark, which the runtime brings).")


def _cell(kind: str, text: str, index: int) -> dict:
    lines = text.splitlines(keepends=True)
    cell = {"cell_type": kind, "id": f"cell-{index}", "metadata": {}, "source": lines}
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def convert(source: str) -> dict:
    """The notebook (nbformat 4 JSON) of a Databricks source notebook."""
    body = source.removeprefix(_HEADER).strip("\n")
    cells = []
    for chunk in body.split(_SEPARATOR):
        chunk = chunk.strip("\n")
        if not chunk:
            continue
        lines = chunk.splitlines()
        if all(line.startswith(_MAGIC) for line in lines):
            text = "\n".join(line[len(_MAGIC):].removeprefix(" ") for line in lines)
            if text.startswith("%pip"):
                cells.append(_cell("markdown", _INSTALL, len(cells)))
                continue
            cells.append(_cell("markdown", text.removeprefix("%md").lstrip(" \n"), len(cells)))
        else:
            cells.append(_cell("code", chunk, len(cells)))
    return {
        "cells": cells,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def render(source: str) -> str:
    return json.dumps(convert(source), indent=1, ensure_ascii=False) + "\n"


def main() -> int:
    TARGET.write_text(render(SOURCE.read_text()))
    print(f"wrote {TARGET}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
