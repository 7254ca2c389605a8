"""Tests of page statistics (``_format.stats``): exactness, soundness of merges, JSON safety."""

from __future__ import annotations

import datetime
import decimal
import json
import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_durable_queue._format.stats import (
    MAX_STRING_STAT_LEN,
    MAX_VALUE_SET,
    batch_stats,
    merge_stats,
    system_stats,
)


def col_stats(values, type_=None):
    return batch_stats(pa.table({"c": pa.array(values, type_)}))["columns"]["c"]


@pytest.mark.parametrize(
    ("values", "type_", "expected"),
    [
        pytest.param([3, 1, None, 2], pa.int64(), {"null_count": 1, "min": 1, "max": 3}, id="int"),
        pytest.param([3, 1], pa.uint8(), {"null_count": 0, "min": 1, "max": 3}, id="uint8"),
        pytest.param(
            [1.5, math.nan, -2.0],
            pa.float64(),
            {"null_count": 0, "min": -2.0, "max": 1.5, "nan": True},
            id="float-nan-ignored",
        ),
        pytest.param(
            [math.nan, None], pa.float64(), {"null_count": 1, "nan": True}, id="float-only-nan"
        ),
        pytest.param(
            [-math.inf, 1.0],
            pa.float32(),
            {"null_count": 0, "max": 1.0, "nan": False},
            id="float-infinite-bound-dropped",
        ),
        pytest.param(
            [True, None], pa.bool_(), {"null_count": 1, "min": True, "max": True}, id="bool"
        ),
        pytest.param(
            ["b", "a", None, "b"],
            pa.string(),
            {"null_count": 1, "min": "a", "max": "b", "values": ["a", "b"]},
            id="string-value-set",
        ),
        pytest.param(
            ["x" * (MAX_STRING_STAT_LEN + 1), "a"],
            pa.string(),
            {"null_count": 0},
            id="string-too-long",
        ),
        pytest.param(
            [None, None], pa.string(), {"null_count": 2, "values": []}, id="string-all-null"
        ),
        pytest.param([None, None], pa.int64(), {"null_count": 2}, id="int-all-null"),
        pytest.param(
            [1_500, -1_500],
            pa.timestamp("us", tz="UTC"),
            {"null_count": 0, "min": -1, "max": 1, "unit": "ms"},
            id="timestamp-us-truncated-to-ms",
        ),
        pytest.param(
            [2, 1],
            pa.timestamp("s"),
            {"null_count": 0, "min": 1000, "max": 2000, "unit": "ms"},
            id="timestamp-s",
        ),
        pytest.param(
            [datetime.date(1970, 1, 3)],
            pa.date32(),
            {"null_count": 0, "min": 2, "max": 2, "unit": "days"},
            id="date32",
        ),
        pytest.param(
            [decimal.Decimal("1.25"), decimal.Decimal("-3.50")],
            pa.decimal128(5, 2),
            {"null_count": 0, "min": -3.5, "max": 1.25},
            id="decimal-as-float",
        ),
        pytest.param([b"x", None], pa.binary(), {"null_count": 1}, id="binary"),
        pytest.param([[1], None], pa.list_(pa.int64()), {"null_count": 1}, id="nested"),
    ],
)
def test_column_stats(values, type_, expected):
    assert col_stats(values, type_) == expected


def test_dictionary_and_view_strings_like_plain_strings():
    plain = col_stats(["b", "a", None])
    assert col_stats(["b", "a", None], pa.string_view()) == plain
    dict_col = pa.array(["b", "a", None]).dictionary_encode()
    assert batch_stats(pa.table({"c": dict_col}))["columns"]["c"] == plain


def test_value_set_limit_and_bounds_from_min_max():
    many = [f"v{i:02d}" for i in range(MAX_VALUE_SET + 1)] * 100
    s = col_stats(many)
    assert "values" not in s
    assert (s["min"], s["max"]) == ("v00", f"v{MAX_VALUE_SET:02d}")
    # Low-cardinality head, high-cardinality tail: the probe must not be trusted alone.
    tricky = ["a"] * 2000 + [f"z{i}" for i in range(100)]
    assert "values" not in col_stats(tricky)
    assert col_stats(["a"] * 5000 + ["b"])["values"] == ["a", "b"]
    # A null first seen after the head is not a value; a value first seen in a later chunk is.
    assert col_stats(["a"] * 500 + [None]) == {"null_count": 1, "values": ["a"],
                                                "min": "a", "max": "a"}
    chunked = pa.chunked_array([["a"] * 300, ["a", "c"], [None, "b"]])
    assert batch_stats(pa.table({"c": chunked}))["columns"]["c"]["values"] == ["a", "b", "c"]


def test_table_with_chunks_and_record_batch_agree():
    t = pa.concat_tables(
        [
            pa.table({"a": [1, 5], "f": [0.5, None]}),
            pa.table({"a": [-2, None], "f": [math.nan, 7.0]}),
        ]
    )
    assert t.column("a").num_chunks == 2
    assert batch_stats(t) == batch_stats(t.combine_chunks().to_batches()[0])
    assert batch_stats(t)["columns"]["f"] == {"null_count": 1, "min": 0.5, "max": 7.0, "nan": True}


def test_only_top_level_columns():
    t = pa.table({"s": pa.array([{"x": 1}]), "n": [1]})
    assert set(batch_stats(t)["columns"]) == {"s", "n"}


def test_system_stats():
    assert system_stats(10, 13, 99) == {
        "rows": 3,
        "columns": {
            "_seq": {"null_count": 0, "min": 10, "max": 12},
            "_timestamp": {"null_count": 0, "min": 99, "max": 99, "unit": "ms"},
        },
    }


def test_merge_side_by_side_with_system_stats():
    user = batch_stats(pa.table({"a": [1, 2, None]}))
    merged = merge_stats([user, system_stats(10, 13, 99)])
    assert merged["rows"] == 3
    assert set(merged["columns"]) == {"a", "_seq", "_timestamp"}


def test_merge_row_wise():
    p1 = merge_stats(
        [batch_stats(pa.table({"a": [1, 2], "s": ["x", None]})), system_stats(0, 2, 5)]
    )
    p2 = merge_stats(
        [batch_stats(pa.table({"a": [None, 9], "s": ["y", "x"]})), system_stats(2, 4, 6)]
    )
    m = merge_stats([p1, p2])
    assert m["rows"] == 4
    assert m["columns"]["a"] == {"null_count": 1, "min": 1, "max": 9}
    assert m["columns"]["s"] == {"null_count": 1, "min": "x", "max": "y", "values": ["x", "y"]}
    assert m["columns"]["_seq"] == {"null_count": 0, "min": 0, "max": 3}
    assert m["columns"]["_timestamp"]["min"] == 5
    assert m["columns"]["_timestamp"]["max"] == 6


def test_merge_drops_what_one_part_cannot_vouch_for():
    long = "x" * (MAX_STRING_STAT_LEN + 1)
    parts = [
        batch_stats(pa.table({"s": ["a", "b"], "n": [1, 2]})),
        batch_stats(pa.table({"s": [long, "c"], "n": [None, None]})),
    ]
    m = merge_stats(parts)
    assert m["columns"]["s"] == {"null_count": 0}  # second part has no bounds and no values
    assert m["columns"]["n"] == {"null_count": 2, "min": 1, "max": 2}  # all-null part is neutral
    # A column missing from a non-empty part is dropped entirely.
    m2 = merge_stats([batch_stats(pa.table({"n": [1]})), batch_stats(pa.table({"o": [1, 2]}))])
    assert m2 == {"rows": 3, "columns": {}}


def test_merge_value_set_overflow():
    parts = [col_stats([f"a{i}" for i in range(10)]), col_stats([f"b{i}" for i in range(10)])]
    m = merge_stats([{"rows": 10, "columns": {"c": p}} for p in parts])
    assert "values" not in m["columns"]["c"]
    assert m["columns"]["c"]["min"] == "a0"


def test_empty_parts():
    assert merge_stats([]) == {"rows": 0, "columns": {}}
    empty = batch_stats(pa.table({"a": pa.array([], pa.int64())}))
    assert empty == {"rows": 0, "columns": {"a": {"null_count": 0}}}
    full = batch_stats(pa.table({"a": [4]}))
    assert merge_stats([empty, full])["columns"]["a"] == {"null_count": 0, "min": 4, "max": 4}


values_strategy = st.lists(st.one_of(st.none(), st.integers(-50, 50)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(st.lists(values_strategy, min_size=1, max_size=4), st.data())
def test_merge_equals_stats_of_concatenation(chunks, data):
    strings = [[None if v is None else f"s{v % 20}" for v in c] for c in chunks]
    floats = [[None if v is None else (math.nan if v == 0 else v / 3) for v in c] for c in chunks]
    tables = [
        pa.table(
            {
                "i": pa.array(c, pa.int64()),
                "s": pa.array(s, pa.string()),
                "f": pa.array(f, pa.float64()),
            }
        )
        for c, s, f in zip(chunks, strings, floats, strict=True)
    ]
    merged = merge_stats([batch_stats(t) for t in tables])
    whole = batch_stats(pa.concat_tables(tables))
    assert merged["rows"] == whole["rows"]
    for name, w in whole["columns"].items():
        m = merged["columns"][name]
        assert m["null_count"] == w["null_count"]
        assert m.get("nan") == w.get("nan")
        # A merged bound may be missing (an all-NaN part has none to give), never wrong.
        for key in ("min", "max"):
            if key in m:
                assert m[key] == w[key]
        # A merged value set may be missing (a part overflowed), never wrong.
        if "values" in m:
            assert m["values"] == w["values"]
    assert json.loads(json.dumps(merged, allow_nan=False)) == merged


def test_json_safe_and_fast_enough():
    import time

    n = 400_000
    t = pa.table(
        {
            "i": pa.array(range(n), pa.int64()),
            "f": pa.array([i / 7 for i in range(n)], pa.float64()),
            "color": pa.array(["red", "blue", "green", "red"] * (n // 4)),
        }
    )
    start = time.perf_counter()
    s = batch_stats(t)
    elapsed = time.perf_counter() - start
    json.dumps(s, allow_nan=False)
    assert s["columns"]["color"]["values"] == ["blue", "green", "red"]
    assert elapsed < 1.0  # generous: a regression to per-row Python would take seconds
