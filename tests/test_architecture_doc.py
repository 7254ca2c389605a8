"""docs/architecture.md's code map names every module of the package, and only modules that exist.

A module is named by its path under ``pyspark_durable_queue/`` in backticks (`` `queue.py` ``,
`` `_storage/local.py` ``, `` `spark/_sink.py` ``). The document may also name files outside
the package by their path from the repository root (`` `benchmarks/bench_memory.py` ``); a bare
file name (`` `_source.py` ``) counts when exactly one module of a subpackage has it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyspark_durable_queue

PACKAGE = Path(pyspark_durable_queue.__file__).parent
REPO = PACKAGE.parent
DOC = REPO / "docs" / "architecture.md"
NAMED = re.compile(r"`([A-Za-z0-9_./-]+\.py)`")


def modules() -> set[str]:
    """Every module file of the package, by its path under the package."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts}


def not_named(text: str, mods: set[str]) -> list[str]:
    """Modules that ``text`` does not name."""
    return sorted(mods - set(NAMED.findall(text)))


def not_existing(text: str, mods: set[str]) -> list[str]:
    """Files that ``text`` names and that do not exist."""
    basenames: dict[str, int] = {}
    for m in mods:
        base = m.rsplit("/", 1)[-1]
        basenames[base] = basenames.get(base, 0) + 1

    def exists(name: str) -> bool:
        if name in mods or (REPO / name).is_file():
            return True
        return "/" not in name and basenames.get(name) == 1

    return sorted(n for n in set(NAMED.findall(text)) if not exists(n))


def test_the_package_has_modules_in_subpackages():
    # what the checks below walk is the real tree, not the document
    assert {"__init__.py", "address.py", "cli/__init__.py", "_storage/base.py",
            "spark/__init__.py"} <= modules()


def test_every_module_is_named_in_the_code_map():
    missing = not_named(DOC.read_text(), modules())
    assert not missing, (f"docs/architecture.md does not name {missing}: add a row to its code "
                         "map (by the path under pyspark_durable_queue/)")


def test_every_module_the_document_names_exists():
    gone = not_existing(DOC.read_text(), modules())
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"


def test_the_checks_catch_a_missing_row_and_a_module_that_is_gone():
    text = DOC.read_text()
    assert "`_storage/memory.py`" in text
    assert not_named(text.replace("`_storage/memory.py`", "memory"), modules()) == [
        "_storage/memory.py"]
    assert not_existing(text + "\n| gone | `_compactor.py` |\n", modules()) == ["_compactor.py"]
    assert not_existing(text.replace("`spark/_sink.py`", "`_storage.py`"), modules()) == [
        "_storage.py"]
