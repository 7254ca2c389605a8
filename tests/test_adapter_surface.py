"""The Spark adapter's reach into the engine, checked from the source (``ast``, no pyspark).

The adapter (``spark/``) stays thin: it uses the public ``Address``, ``Consumer``,
``DurableQueue``, ``settings``, ``selector`` and ``errors``, and at most three private engine
modules (the read surface ``_read``, schema conformance ``_format.schema``, transaction keys
``_log.txn``), counted by module: each module of an engine package counts on its own.
Readers share code through ``spark/_reader.py``, never through each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pyspark_durable_queue

PACKAGE = Path(pyspark_durable_queue.__file__).parent
SPARK = PACKAGE / "spark"
MAX_PRIVATE_ENGINE_MODULES = 3


def _trees() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(SPARK.glob("*.py"))}


def _imports(tree: ast.Module) -> set[str]:
    """Modules ``tree`` imports (anywhere, function bodies included), as dotted names relative
    to the package: ``_read.plan``, ``address``, ``spark._source``..."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            else:
                base = ("spark." if node.level == 1 else "") + (node.module or "")
                # ``from . import x`` / ``from .. import x``: x may be a module
                names = [base] if node.module else [base + a.name for a in node.names]
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    prefix = "pyspark_durable_queue."
    return {n[len(prefix):] if n.startswith(prefix) else n for n in found}


def _engine_private(name: str) -> bool:
    """Whether ``name`` (from :func:`_imports`) is a private module or package of the engine."""
    top = name.split(".")[0]
    return top.startswith("_") and ((PACKAGE / top).with_suffix(".py").exists()
                                     or (PACKAGE / top).is_dir())


def test_the_import_parser_sees_relative_absolute_and_nested_imports():
    tree = ast.parse("from .._read.plan import admit\n"
                     "import pyspark_durable_queue._log.commit_log\n"
                     "def f():\n    from ._source import x\n    from ..address import A\n")
    assert _imports(tree) == {"_read.plan", "_log.commit_log", "spark._source", "address"}
    assert _engine_private("_read.plan") and _engine_private("_storage")
    assert not _engine_private("address") and not _engine_private("spark._reader")


def test_the_spark_adapter_imports_at_most_three_private_engine_modules():
    used: dict[str, set[str]] = {}
    for module, tree in _trees().items():
        for name in _imports(tree):
            if _engine_private(name):
                used.setdefault(name, set()).add(module)  # a module, not its package
    assert used, "the parser found no engine import at all: it is broken"
    assert len(used) <= MAX_PRIVATE_ENGINE_MODULES, (
        f"spark/ imports {len(used)} private engine modules {sorted(used)} (by module: {used}); "
        f"at most {MAX_PRIVATE_ENGINE_MODULES}: reach the engine through Address, Consumer and "
        "the read surface _read")


def _reader_modules(trees: dict[str, ast.Module]) -> set[str]:
    """spark modules that define a Spark reader class (a base named ``...Reader``)."""
    readers = set()
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    (b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")).endswith(
                        "Reader") for b in node.bases):
                readers.add(module)
    return readers


def test_no_reader_module_imports_another_reader_module():
    trees = _trees()
    readers = _reader_modules(trees)
    assert {"_source", "_batch"} <= readers  # the detection works
    for module, tree in trees.items():
        if module == "__init__":
            continue  # the DataSource creates the readers
        crossing = {n for n in _imports(tree) if n.startswith("spark.")
                    and n.split(".")[1] in readers - {module}}
        assert not crossing, (f"spark/{module}.py imports from reader modules {crossing}; move "
                              "shared code into spark/_reader.py")


def test_the_adapter_builds_no_storage_and_spells_no_transaction_key_or_frame_size():
    names = {"Storage", "AddressLayout", "CommitLog", "FRAME_TARGET_BYTES", "APP_PREFIX",
             "SPARK_QUERY_PREFIX", "SPARK_CHECKPOINT_PREFIX"}
    keys = ("app:", "spark-query:", "spark-checkpoint:")
    for module, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Name | ast.alias | ast.Attribute):
                name = getattr(node, "id", None) or getattr(node, "name", None) or \
                    getattr(node, "attr", None)
                assert name not in names, f"spark/{module}.py uses {name}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith(keys), \
                    f"spark/{module}.py spells a transaction key ({node.value!r}): ask _log.txn"


def test_the_sinks_keys_are_the_ones_earlier_releases_wrote():
    # Keys are persisted in the commit log: a restarted query must find its earlier batches.
    from pyspark_durable_queue._log.txn import app_id, app_txn, streaming_txn

    assert streaming_txn(7, query_id="q1", checkpoint="/ck") == ("spark-query:q1", 7)
    assert streaming_txn(7, query_id=None, checkpoint="/ck") == ("spark-checkpoint:/ck", 7)
    assert streaming_txn(7, query_id=None, checkpoint=None) is None
    assert app_txn(("loader", 3)) == ("app:loader", 3)
    assert app_id("app:loader") == "loader"
    assert app_id("spark-query:q1") is None
