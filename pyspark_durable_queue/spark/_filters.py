"""Spark's pushed filters (``pyspark.sql.datasource.Filter``) as a selector.

A batch read turns the ``where`` conditions Spark pushes into selector text, AND-ed with the
``selector`` option: page and frame statistics then skip what cannot match, and the remaining
rows are filtered in Arrow before they reach the JVM.

Rule: the selector may keep *more* rows than Spark's condition, never fewer. Every filter is
also handed back to Spark, which evaluates it again on what the source returns, so a translation
only has to be a sound superset. Where selector and Spark semantics differ, the filter is left to
Spark alone:

- ``NaN``: Spark orders NaN above every number (``x > 1`` is true for NaN), Arrow says false;
  so ``>``/``>=`` on floating columns and NaN literals are not pushed;
- ``float32`` and decimal columns compare differently after widening; not pushed;
- strings only support ``=``, ``IN`` and ``LIKE`` in selectors (no ordering);
- timestamps are compared in milliseconds by selectors: bounds are widened by one millisecond;
- nested columns, ``<=>`` and anything else are not pushed.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import pyarrow as pa

__all__ = ["filters_to_selector"]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_MS = dt.timedelta(milliseconds=1)
_MAX_OFFSET_MS = 14 * 3600 * 1000


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _kind(t: pa.DataType) -> str:
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) and not pa.types.is_uint64(t):
        return "int"
    if pa.types.is_float64(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str"
    if pa.types.is_timestamp(t) and t.tz is not None:
        return "ts"
    return "other"


def _number(value: Any, kind: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        text = repr(value)
        return text if any(c in text for c in ".e") else text + ".0"
    if kind == "int" and not -(2**63) <= value < 2**63:
        return None
    return str(value)


def _millis(value: Any) -> tuple[float, int] | None:
    """Epoch milliseconds of a datetime literal and how uncertain they are."""
    if not isinstance(value, dt.datetime):
        return None
    if value.tzinfo is None:
        # a naive datetime is in some session time zone: widen by the largest UTC offset
        return (value.replace(tzinfo=dt.timezone.utc) - _EPOCH) / _MS, _MAX_OFFSET_MS + 1
    return (value - _EPOCH) / _MS, 1


def _like(value: Any, pattern: str) -> str | None:
    if not isinstance(value, str):
        return None
    body = value.replace("!", "!!").replace("%", "!%").replace("_", "!_")
    return _string(pattern.replace("*", body)) + " ESCAPE '!'"


def _translate(f: Any, schema: pa.Schema) -> tuple[str, bool] | None:
    """``(selector text, exact)`` for one filter, or ``None`` when it is not pushed.

    ``exact`` means the text selects exactly Spark's rows (needed under ``NOT``); otherwise it
    selects a superset.
    """
    from pyspark.sql import datasource as ds

    if isinstance(f, ds.Not):
        inner = _translate(f.child, schema)
        if inner is None or not inner[1]:
            return None
        return f"NOT ({inner[0]})", True
    attr = getattr(f, "attribute", None)
    if not isinstance(attr, tuple) or len(attr) != 1 or attr[0] not in schema.names:
        return None
    name = attr[0]
    col = _ident(name)
    kind = _kind(schema.field(name).type)
    if isinstance(f, ds.IsNull):
        return f"{col} IS NULL", True
    if isinstance(f, ds.IsNotNull):
        return f"{col} IS NOT NULL", True
    value = getattr(f, "value", None)
    ops = {ds.EqualTo: "=", ds.GreaterThan: ">", ds.GreaterThanOrEqual: ">=",
           ds.LessThan: "<", ds.LessThanOrEqual: "<="}
    op = ops.get(type(f))
    if op is not None:
        if kind in ("int", "float"):
            if kind == "float" and op in (">", ">="):
                return None
            num = _number(value, kind)
            return None if num is None else (f"{col} {op} {num}", True)
        if kind == "str" and op == "=" and isinstance(value, str):
            return f"{col} = {_string(value)}", True
        if kind == "bool" and op == "=" and isinstance(value, bool):
            return f"{col} = {'TRUE' if value else 'FALSE'}", True
        if kind == "ts":
            got = _millis(value)
            if got is None:
                return None
            lo, hi = math.floor(got[0]) - got[1], math.ceil(got[0]) + got[1]
            text = {"=": f"{col} BETWEEN {lo} AND {hi}", ">": f"{col} >= {lo}",
                    ">=": f"{col} >= {lo}", "<": f"{col} <= {hi}", "<=": f"{col} <= {hi}"}[op]
            return text, False
        return None
    if isinstance(f, ds.In):
        values = tuple(value or ())
        if not values:
            return None
        if kind == "str" and all(isinstance(v, str) for v in values):
            return f"{col} IN ({', '.join(_string(v) for v in values)})", True
        if kind == "int":
            nums = [_number(v, kind) for v in values]
            if all(n is not None and "." not in n and "e" not in n for n in nums):
                return f"{col} IN ({', '.join(n for n in nums if n)})", True
        return None
    if kind == "str":
        if isinstance(f, ds.StringStartsWith):
            pat = _like(value, "*%")
        elif isinstance(f, ds.StringEndsWith):
            pat = _like(value, "%*")
        elif isinstance(f, ds.StringContains):
            pat = _like(value, "%*%")
        else:
            return None
        return None if pat is None else (f"{col} LIKE {pat}", True)
    return None


def filters_to_selector(filters: list[Any], schema: pa.Schema) -> tuple[str | None, list[Any]]:
    """Translate the filters that can be pushed; returns the AND of their selector texts (or
    ``None``) and the filters used. Each text is checked by the selector parser; a filter whose
    text the parser refuses is simply not pushed."""
    from ..errors import SelectorSyntaxError
    from ..selector import Selector

    parts = []
    used = []
    for f in filters:
        got = _translate(f, schema)
        if got is None:
            continue
        try:
            Selector(got[0])
        except SelectorSyntaxError:
            continue
        parts.append(f"({got[0]})")
        used.append(f)
    return (" AND ".join(parts) if parts else None), used
