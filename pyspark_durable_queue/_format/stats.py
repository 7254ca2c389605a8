"""Page statistics: per-column null counts, min/max and small value sets.

The page writer stores one stats dict per page (in a JSON file), and
:meth:`pyspark_durable_queue.selector.Selector.may_match` reads it to skip pages that cannot
match a consumer's selector without opening them.

A stats dict is JSON-safe::

    {"rows": int,
     "columns": {name: {"null_count": int,
                        "min": v, "max": v,      # only when provable, see below
                        "values": [str, ...],    # string columns with <= 16 distinct values
                        "nan": bool,             # floating columns only
                        "unit": "ms" | "days"}}} # timestamp / date columns only

Soundness is the only rule that matters here: a key that is present must be true for every row
of the page, so a missing key always means "unknown" and never "none". That is why ``min`` and
``max`` are omitted (rather than approximated) for long strings, non-finite floats and all-null
columns, and why :func:`merge_stats` drops anything not known for every part.

Value conventions, shared with the selector so that both see the same numbers:

- timestamps are epoch milliseconds (truncated toward zero), whatever their unit or time zone;
- dates are epoch days (``date64`` truncated toward zero);
- decimals and ``uint64`` are Python floats (rounding to nearest is monotonic, so
  ``float(min(x))`` equals ``min(float(x))`` and the selector, which compares them as
  ``float64``, agrees);
- booleans are ``bool``, integers ``int``, floats ``float``.

Only top-level columns are described; nested fields get ``null_count`` only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .schema import SEQ, TIMESTAMP

__all__ = ["MAX_STRING_STAT_LEN", "MAX_VALUE_SET", "batch_stats", "merge_stats", "system_stats"]

#: Strings longer than this are not stored as ``min``/``max`` (they would bloat the JSON file).
MAX_STRING_STAT_LEN = 256
#: String columns keep their distinct values when there are at most this many.
MAX_VALUE_SET = 16
# How many leading values are hashed first: a page with more than MAX_VALUE_SET distinct values
# in its head needs no full pass, which keeps high-cardinality columns (ids, payloads) cheap.
_VALUE_SET_PROBE = 64

_TS_TO_MS_DIVISOR = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _normalize(col: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Return ``col`` in a type the compute kernels support for min/max."""
    t = col.type
    if pa.types.is_dictionary(t):
        # Dictionary pages arise from Parquet-style producers; decoding is cheap compared to
        # getting the value set wrong.
        col = col.cast(t.value_type)
        t = col.type
    if pa.types.is_string_view(t):
        col = col.cast(pa.large_string())
    elif pa.types.is_float16(t):
        col = col.cast(pa.float32())
    return col


def _timestamp_ms(value: int, unit: str) -> int:
    div = _TS_TO_MS_DIVISOR[unit]
    if div is None:
        return value * 1000
    return _trunc_div(value, div)


def _trunc_div(value: int, div: int) -> int:
    # Truncation toward zero, as Arrow's integer ``divide`` (which the selector uses to turn
    # timestamps into milliseconds) does; any monotonic rounding keeps min/max exact, but it
    # has to be the same one on both sides.
    q = abs(value) // div
    return q if value >= 0 else -q


def _has_nan(col: pa.Array | pa.ChunkedArray) -> bool:
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    for chunk in chunks:
        if chunk.null_count == 0:
            # Zero-copy numpy is several times faster than pc.is_nan + pc.any.
            if np.isnan(chunk.to_numpy(zero_copy_only=True)).any():
                return True
        elif pc.any(pc.is_nan(chunk)).as_py():
            return True
    return False


def _float_min_max(col: pa.Array | pa.ChunkedArray) -> tuple[float, float] | None:
    """NaN-ignoring min and max of a float column, None when there is no number at all."""
    lows: list[float] = []
    highs: list[float] = []
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    for chunk in chunks:
        if len(chunk) == chunk.null_count:
            continue
        if chunk.null_count == 0:
            # numpy is much faster here than Arrow's NaN-aware float min_max kernel.
            arr = chunk.to_numpy(zero_copy_only=True)
            nan = np.isnan(arr)
            if nan.any():
                arr = arr[~nan]
                if arr.size == 0:
                    continue
            lows.append(float(arr.min()))
            highs.append(float(arr.max()))
        else:
            mm = pc.min_max(chunk)
            if mm["min"].is_valid:
                lows.append(float(mm["min"].as_py()))
                highs.append(float(mm["max"].as_py()))
    if not lows:
        return None
    lo, hi = min(lows), max(highs)
    if math.isnan(lo) or math.isnan(hi):
        return None
    return lo, hi


def _min_max(col: pa.Array | pa.ChunkedArray, t: pa.DataType) -> tuple[Any, Any] | None:
    """Min and max of a non-float column in the JSON conventions of the module docstring."""
    mm = pc.min_max(col)
    lo_s, hi_s = mm["min"], mm["max"]
    if not lo_s.is_valid or not hi_s.is_valid:
        return None
    if pa.types.is_timestamp(t):
        return (
            _timestamp_ms(lo_s.cast(pa.int64()).as_py(), t.unit),
            _timestamp_ms(hi_s.cast(pa.int64()).as_py(), t.unit),
        )
    if pa.types.is_date32(t):
        return lo_s.cast(pa.int32()).as_py(), hi_s.cast(pa.int32()).as_py()
    if pa.types.is_date64(t):
        day = 86_400_000
        return (
            _trunc_div(lo_s.cast(pa.int64()).as_py(), day),
            _trunc_div(hi_s.cast(pa.int64()).as_py(), day),
        )
    if pa.types.is_decimal(t) or pa.types.is_uint64(t):
        # The selector compares these as float64 (uint64 may not fit int64); store the bounds
        # the way it sees them so both round the same way.
        return float(lo_s.as_py()), float(hi_s.as_py())
    return lo_s.as_py(), hi_s.as_py()


def _value_set(col: pa.Array | pa.ChunkedArray) -> list[str] | None:
    """Sorted distinct non-null strings of ``col``, or None when there are too many."""
    head = col.slice(0, _VALUE_SET_PROBE)
    probe = pc.unique(head)
    if len(probe) - probe.null_count > MAX_VALUE_SET:
        return None  # the head alone has too many: no pass over the whole column
    if len(col) > _VALUE_SET_PROBE:
        # Usually every value already showed up in the head: a membership pass is cheaper
        # than hashing the column into a new set.
        if pc.all(pc.is_in(col, value_set=probe, skip_nulls=False)).as_py():
            uniq = probe
        else:
            uniq = pc.unique(col)
            if len(uniq) - uniq.null_count > MAX_VALUE_SET:
                return None
    else:
        uniq = probe
    values = sorted(v for v in uniq.to_pylist() if v is not None)
    if any(len(v) > MAX_STRING_STAT_LEN for v in values):
        return None  # same bound as min/max: keep the stats file small
    return values


def _column_stats(col: pa.Array | pa.ChunkedArray) -> dict[str, Any]:
    out: dict[str, Any] = {"null_count": int(col.null_count)}
    t = col.type
    if pa.types.is_dictionary(t):
        t = t.value_type
    orderable = (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or _is_string(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_date(t)
        or pa.types.is_decimal(t)
    )
    if not orderable:
        return out
    col = _normalize(col)
    if pa.types.is_floating(t):
        out["nan"] = _has_nan(col)
    elif pa.types.is_timestamp(t):
        out["unit"] = "ms"
    elif pa.types.is_date(t):
        out["unit"] = "days"
    non_null = len(col) - col.null_count
    if _is_string(t):
        values = _value_set(col) if non_null else []
        if values is not None:
            out["values"] = values
            # The sorted value set already holds the bounds; a string min_max pass costs as
            # much as the hashing did. Python orders str by code point, as Arrow orders UTF-8.
            if values and max(len(values[0]), len(values[-1])) <= MAX_STRING_STAT_LEN:
                out["min"], out["max"] = values[0], values[-1]
            return out
    if non_null == 0:
        return out
    bounds = _float_min_max(col) if pa.types.is_floating(t) else _min_max(col, t)
    if bounds is None:
        return out
    lo, hi = bounds
    if isinstance(lo, float) and (math.isnan(lo) or math.isnan(hi)):
        return out
    if isinstance(lo, str) and isinstance(hi, str) and \
            max(len(lo), len(hi)) > MAX_STRING_STAT_LEN:
        return out
    # Non-finite bounds are not valid JSON; dropping one side only loosens the bound.
    if not (isinstance(lo, float) and math.isinf(lo)):
        out["min"] = lo
    if not (isinstance(hi, float) and math.isinf(hi)):
        out["max"] = hi
    return out


def batch_stats(batch: pa.RecordBatch | pa.Table) -> dict:
    """Compute the statistics of one batch or table.

    Called by the page writer for every page it writes (on whichever process writes: the Spark
    executor for a streaming sink, the driver for a local producer).

    Parameters
    ----------
    batch : pyarrow.RecordBatch or pyarrow.Table
        The rows of the page. Only top-level columns are described.

    Returns
    -------
    dict
        A JSON-safe stats dict, see the module docstring.

    Notes
    -----
    Vectorized throughout (``min_max``, ``is_nan``, ``unique`` on string columns whose first
    values look low-cardinality).
    """
    columns = {name: _column_stats(batch.column(i)) for i, name in enumerate(batch.schema.names)}
    return {"rows": int(batch.num_rows), "columns": columns}


def _merge_column(parts: list[tuple[int, dict]]) -> dict[str, Any]:
    """Merge the stats of one column; ``parts`` holds (rows, column_stats) pairs."""
    out: dict[str, Any] = {"null_count": sum(int(c.get("null_count", rows)) for rows, c in parts)}
    # Parts whose values are all null say nothing about min/max/values and must not veto them.
    informative = [c for rows, c in parts if int(c.get("null_count", rows)) < rows]
    for key in ("unit",):
        units = {c[key] for _, c in parts if key in c}
        if len(units) == 1:
            out[key] = units.pop()
    if any("nan" in c for _, c in parts):
        out["nan"] = any(c.get("nan", False) for _, c in parts)
    if informative and all("min" in c and "max" in c for c in informative):
        try:
            out["min"] = min(c["min"] for c in informative)
            out["max"] = max(c["max"] for c in informative)
        except TypeError:  # mixed kinds after a schema change: no usable bound
            out.pop("min", None)
            out.pop("max", None)
    has_values = [c for _, c in parts if "values" in c]
    if has_values and all("values" in c for c in informative):
        union = set()
        for c in has_values:
            union.update(c["values"])
        if len(union) <= MAX_VALUE_SET:
            out["values"] = sorted(union)
    return out


def _side_by_side(parts: list[dict]) -> bool:
    if len(parts) < 2 or len({int(p.get("rows", 0)) for p in parts}) != 1:
        return False
    seen: set[str] = set()
    for p in parts:
        names = set(p.get("columns", {}))
        if not names or names & seen:
            return False
        seen |= names
    return True


def merge_stats(parts: list[dict]) -> dict:
    """Merge the stats of consecutive batches into the stats of their concatenation.

    Parameters
    ----------
    parts : list of dict
        Stats dicts as returned by :func:`batch_stats` or :func:`system_stats`.

    Returns
    -------
    dict
        Stats valid for all rows of all parts. A column absent from a non-empty part is
        dropped (nothing is known about it there), as is any bound or value set that one part
        cannot vouch for.

    Notes
    -----
    Parts describing *different columns of the same rows* are combined side by side instead:
    when every part has the same ``rows`` and no column name appears in two parts, as in
    ``merge_stats([batch_stats(batch), system_stats(start, end, ts)])``. Pages of one address
    always share their columns, so a row-wise merge never looks like that.
    """
    if _side_by_side(parts):
        columns: dict[str, Any] = {}
        for p in parts:
            columns.update(p.get("columns", {}))
        return {"rows": int(parts[0]["rows"]), "columns": columns}
    rows = sum(int(p.get("rows", 0)) for p in parts)
    nonempty = [p for p in parts if int(p.get("rows", 0)) > 0]
    names: list[str] = []
    seen: set[str] = set()
    for p in nonempty:
        for name in p.get("columns", {}):
            if name not in seen:
                seen.add(name)
                names.append(name)
    columns = {}
    for name in names:
        if not all(name in p.get("columns", {}) for p in nonempty):
            continue
        columns[name] = _merge_column([(int(p["rows"]), p["columns"][name]) for p in nonempty])
    return {"rows": rows, "columns": columns}


def system_stats(seq_start: int, seq_end: int, timestamp_ms: int) -> dict:
    """Stats of the system columns of a page written in one send.

    Parameters
    ----------
    seq_start, seq_end : int
        Sequence numbers of the page, ``seq_end`` exclusive.
    timestamp_ms : int
        The send time shared by every row, epoch milliseconds.

    Returns
    -------
    dict
        Stats for ``_seq`` and ``_timestamp``, to be combined with :func:`batch_stats` of the
        user columns (``{**user["columns"], **system["columns"]}``) or with :func:`merge_stats`
        across sends.
    """
    n = int(seq_end) - int(seq_start)
    if n <= 0:
        return {"rows": 0, "columns": {}}
    ts = int(timestamp_ms)
    return {
        "rows": n,
        "columns": {
            SEQ: {"null_count": 0, "min": int(seq_start), "max": int(seq_end) - 1},
            TIMESTAMP: {"null_count": 0, "min": ts, "max": ts, "unit": "ms"},
        },
    }
