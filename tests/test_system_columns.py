"""The system columns (``_seq``, ``_timestamp``) and compiling a selector against an address.

Both are defined once (``_format.schema``); the consumer, cleanup, the CLI, Spark tasks and the
Spark readers all compile a selector with :func:`compile_selector`.
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.schema import (
    RESERVED_COLUMNS,
    SYSTEM_FIELDS,
    compile_selector,
    user_fields,
    with_system_schema,
)
from pyspark_durable_queue.errors import SchemaMismatchError, SelectorSyntaxError

ADDRESS = pa.schema([("id", pa.int64()), ("color", pa.string())])


def test_system_columns_are_seq_then_timestamp_and_reserved():
    assert [f.name for f in SYSTEM_FIELDS] == ["_seq", "_timestamp"]
    assert RESERVED_COLUMNS == {"_seq", "_timestamp", "_delivery_count", "_ttl_ms"}
    full = with_system_schema(ADDRESS)
    assert full.names == ["id", "color", "_seq", "_timestamp"]
    assert full.field("_timestamp").type == pa.timestamp("us", tz="UTC")
    assert not full.field("_seq").nullable
    assert user_fields(full) == ADDRESS


def test_a_user_column_named_like_a_system_column_is_refused(tmp_path):
    a = DurableQueue(str(tmp_path)).address("q")
    with pytest.raises(SchemaMismatchError, match="reserved"):
        a.send(pa.table({"_seq": [1]}))


def test_compiled_selector_sees_system_columns():
    sel = compile_selector("_seq >= 2 AND _timestamp > 0 AND color = 'red'", ADDRESS)
    assert sel.schema == with_system_schema(ADDRESS)
    assert sel.unknown_identifiers(sel.schema) == set()
    rows = pa.table({"id": [1, 2, 3], "color": ["red", "red", "blue"], "_seq": [1, 2, 3],
                     "_timestamp": pa.array([5000] * 3, pa.timestamp("us", tz="UTC"))})
    assert sel.mask(rows).to_pylist() == [False, True, False]
    # _seq is a column, not NULL: a page holding _seq 2..3 may match, one of 0..1 cannot
    sel = compile_selector("_seq >= 2", ADDRESS)
    assert sel.may_match({"rows": 2, "columns": {"_seq": {"min": 2, "max": 3, "nulls": 0}}})
    assert not sel.may_match({"rows": 2, "columns": {"_seq": {"min": 0, "max": 1, "nulls": 0}}})


def test_unknown_column_is_null_not_an_error():
    sel = compile_selector("missing = 1 OR id = 1", ADDRESS)
    assert sel.unknown_identifiers(with_system_schema(ADDRESS)) == {"missing"}
    rows = pa.table({"id": [1, 2], "color": ["a", "b"]})
    assert sel.mask(rows).to_pylist() == [True, False]
    # a schema that lacks the column makes it NULL for the statistics too
    assert not compile_selector("missing = 1", ADDRESS).may_match({"rows": 5, "columns": {}})


def test_before_the_address_has_a_schema_columns_are_not_known():
    sel = compile_selector("flag = TRUE", None)
    assert sel.schema is None
    assert sel.may_match({"rows": 5, "columns": {}})  # unknown, not NULL: may match


def test_syntax_errors_are_unchanged():
    with pytest.raises(SelectorSyntaxError, match="position"):
        compile_selector("color = ", ADDRESS)


def test_consumer_selector_on_seq_and_unknown_column_warning(tmp_path, caplog):
    a = DurableQueue(str(tmp_path)).address("q")
    a.send(pa.table({"id": [1, 2, 3], "color": ["red", "blue", "red"]}))
    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        c = a.consumer("c", selector="_seq >= 1 AND (color = 'red' OR nope = 1)")
    assert "uses nope, which is not a column of the address" in caplog.text
    assert "_seq" not in caplog.text.split("uses", 1)[1]
    got = c.receive()
    assert got.column("id").to_pylist() == [3]
    assert got.schema.names == ["id", "color", "_seq", "_timestamp", "_delivery_count"]
