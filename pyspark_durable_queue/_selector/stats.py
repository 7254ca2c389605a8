"""Abstract interpretation of a selector AST over page statistics, for ``may_match``.

Private to the package; used by :mod:`.compiled` (``__all__``). :class:`StatsInterpreter` walks the
AST of :mod:`.parse` against the statistics of one page (see
:mod:`pyspark_durable_queue._format.stats`): each boolean node maps to the set of truth values it
may take on some row of the page (True, False, None = UNKNOWN); each value node to an :class:`_Abs`
describing every value it may take. Rows are treated independently per operand, which
over-approximates and so stays sound: the page is skipped only when TRUE is impossible.

Column kinds come from :func:`.arrow.column_value`, so a page is judged with the same
type mapping that the Arrow compiler uses to filter its rows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .arrow import column_value
from .parse import (
    ARITHMETIC,
    COMPARISONS,
    INT64_MAX,
    INT64_MIN,
    Between,
    Binary,
    Ident,
    In,
    IsNull,
    Like,
    Lit,
    Unary,
    Wildcard,
    between_as_logic,
    like_body,
)

__all__ = ["StatsInterpreter"]

_ALL = frozenset({True, False, None})
_UNKNOWN = frozenset({None})


@dataclass(frozen=True)
class _Abs:
    kind: str  # "num", "str", "bool", "null" (always NULL), "other", "any" (nothing known)
    may_null: bool = True
    has_value: bool = True
    lo: Any = None  # None: unbounded
    hi: Any = None
    nan: bool = False
    flt: bool = False  # approximate numeric: compare as float64
    values: frozenset | None = None  # every possible non-null string


_ABS_ANY = _Abs("any", nan=True)
_ABS_NULL = _Abs("null", may_null=True, has_value=False)


def _schema_kind(t: pa.DataType) -> tuple[str, bool]:
    v = column_value("x", t)
    return {"int": "num", "float": "num"}.get(v.kind, v.kind), v.kind == "float"


def _not(s: frozenset) -> frozenset:
    return frozenset(None if x is None else not x for x in s)


def _kleene_and(a: Any, b: Any) -> Any:
    if a is False or b is False:
        return False
    if a is None or b is None:
        return None
    return True


def _kleene_or(a: Any, b: Any) -> Any:
    if a is True or b is True:
        return True
    if a is None or b is None:
        return None
    return False


class StatsInterpreter:
    def __init__(self, stats: dict, schema: pa.Schema | None) -> None:
        self.rows = int(stats.get("rows", 0))
        self.columns = stats.get("columns", {}) or {}
        self.schema = schema

    def truth(self, node: Any) -> frozenset:
        if isinstance(node, Binary) and node.op in ("AND", "OR"):
            left, right = self.truth(node.left), self.truth(node.right)
            fn = _kleene_and if node.op == "AND" else _kleene_or
            return frozenset(fn(a, b) for a in left for b in right)
        if isinstance(node, Unary) and node.op == "NOT":
            return _not(self.truth(node.operand))
        if isinstance(node, Binary) and node.op in COMPARISONS:
            return self._compare(node.op, self.value(node.left), self.value(node.right))
        if isinstance(node, Between):
            return self.truth(between_as_logic(node))
        if isinstance(node, IsNull):
            v = self.value(node.expr)
            out: set[bool | None] = set()
            if v.may_null:
                out.add(True)
            if v.has_value:
                out.add(False)
            s = frozenset(out)
            return _not(s) if node.negated else s
        if isinstance(node, In):
            return self._in(node)
        if isinstance(node, Like):
            return self._like(node)
        v = self.value(node)  # a lone identifier or literal used as a condition
        if v.kind == "any":
            return _ALL
        if v.kind != "bool" or not v.has_value:
            return _UNKNOWN
        out = {None} if v.may_null else set()  # same set type as above
        if v.hi is None or v.hi:
            out.add(True)
        if v.lo is None or not v.lo:
            out.add(False)
        return frozenset(out)

    # -- values
    def value(self, node: Any) -> _Abs:
        if isinstance(node, Lit):
            v = node.value
            if isinstance(v, bool):
                kind = "bool"
            elif isinstance(v, str):
                return _Abs("str", False, True, v, v, values=frozenset([v]))
            else:
                kind = "num"
            return _Abs(kind, False, True, v, v, flt=isinstance(v, float))
        if isinstance(node, Ident):
            return self._column(node.name)
        if isinstance(node, Unary) and node.op != "NOT":
            v = self.value(node.operand)
            if v.kind in ("any", "null") or node.op == "+":
                return v if v.kind in ("any", "null", "num") else _ABS_NULL
            if v.kind != "num":
                return _ABS_NULL
            lo = None if v.hi is None else -v.hi
            hi = None if v.lo is None else -v.lo
            return self._bounded(v, lo, hi, v.flt, v.nan)
        if isinstance(node, Binary) and node.op in ARITHMETIC:
            return self._arith(node.op, self.value(node.left), self.value(node.right))
        # A condition used as a value (``(a > 1) = TRUE``): a boolean with the truth set.
        truth = self.truth(node)
        known = truth - {None}
        return _Abs(
            "bool",
            may_null=None in truth,
            has_value=bool(known),
            lo=min(known) if known else None,
            hi=max(known) if known else None,
        )

    def _column(self, name: str) -> _Abs:
        kind, flt = None, False
        if self.schema is not None:
            idx = self.schema.get_field_index(name)
            if idx < 0:
                return _ABS_NULL
            kind, flt = _schema_kind(self.schema.field(idx).type)
            if kind == "null":
                return _ABS_NULL
        col = self.columns.get(name)
        if col is None:
            return _Abs(kind or "any", nan=True, flt=flt) if kind != "other" else _Abs("other")
        null_count = col.get("null_count")
        may_null = null_count is None or int(null_count) > 0
        has_value = null_count is None or int(null_count) < self.rows
        lo, hi = col.get("min"), col.get("max")
        values = col.get("values")
        if kind is None:  # no schema: infer from what the writer stored
            sample = lo if lo is not None else hi
            if values is not None or isinstance(sample, str):
                kind = "str"
            elif isinstance(sample, bool):
                kind = "bool"
            elif isinstance(sample, (int, float)):
                kind, flt = "num", isinstance(sample, float) or "nan" in col
            else:
                kind = "any"
        if kind == "other":
            return _Abs("other", may_null, has_value)
        if kind == "any":
            return _Abs("any", may_null, has_value, nan=True)
        nan = bool(col.get("nan", True)) if kind == "num" and flt else False
        if kind == "str" and values is not None:
            values = frozenset(values)
        else:
            values = None
        return _Abs(kind, may_null, has_value, lo, hi, nan, flt, values)

    @staticmethod
    def _bounded(proto: _Abs, lo: Any, hi: Any, flt: bool, nan: bool) -> _Abs:
        def ok(x: Any) -> Any:
            if x is None:
                return None
            if flt:
                x = float(x)
                return None if math.isinf(x) or math.isnan(x) else x
            return x if INT64_MIN <= x <= INT64_MAX else None  # wrapped: anything goes

        lo, hi = ok(lo), ok(hi)
        if lo is None or hi is None:
            lo = hi = None
            nan = nan or flt  # unbounded floats may be infinite, and inf - inf is NaN
        return _Abs("num", proto.may_null, proto.has_value, lo, hi, nan, flt)

    def _arith(self, op: str, a: _Abs, b: _Abs) -> _Abs:
        if "null" in (a.kind, b.kind) or not (a.has_value and b.has_value):
            return _ABS_NULL
        if a.kind == "any" or b.kind == "any":
            return _ABS_ANY
        if a.kind != "num" or b.kind != "num":
            return _ABS_NULL
        flt = a.flt or b.flt
        proto = _Abs("num", a.may_null or b.may_null or op == "/", True)
        nan = a.nan or b.nan
        bounds = (a.lo, a.hi, b.lo, b.hi)
        if op == "/" or any(x is None for x in bounds):
            return self._bounded(proto, None, None, flt, nan or flt)
        alo, ahi, blo, bhi = (float(x) for x in bounds) if flt else bounds
        if op == "+":
            lo, hi = alo + blo, ahi + bhi
        elif op == "-":
            lo, hi = alo - bhi, ahi - blo
        else:
            products = [alo * blo, alo * bhi, ahi * blo, ahi * bhi]
            lo, hi = min(products), max(products)
        return self._bounded(proto, lo, hi, flt, nan)

    # -- predicates
    @staticmethod
    def _compare(op: str, a: _Abs, b: _Abs) -> frozenset:
        if "null" in (a.kind, b.kind) or not (a.has_value and b.has_value):
            return _UNKNOWN
        if "any" in (a.kind, b.kind):
            return _ALL
        if a.kind != b.kind or a.kind == "other":
            return _UNKNOWN
        if a.kind in ("str", "bool") and op not in ("=", "<>"):
            return _UNKNOWN
        out: set = {None} if (a.may_null or b.may_null) else set()
        if a.nan or b.nan:
            out.add(op == "<>")  # NaN is unequal to everything and unordered
        alo, ahi, blo, bhi = a.lo, a.hi, b.lo, b.hi
        if a.flt or b.flt:
            alo, ahi, blo, bhi = (None if x is None else float(x) for x in (alo, ahi, blo, bhi))
        point = alo is not None and alo == ahi == blo == bhi
        if op in ("=", "<>"):
            if a.values is not None and b.values is not None:
                can_equal = bool(a.values & b.values)
                point = len(a.values) == 1 and a.values == b.values
            else:
                can_equal = _overlaps(alo, ahi, blo, bhi)
                for vals, lo, hi in ((a.values, blo, bhi), (b.values, alo, ahi)):
                    if vals is not None:
                        can_equal = can_equal and any(_within(v, lo, hi) for v in vals)
            can_differ = not point
            if can_equal:
                out.add(op == "=")
            if can_differ:
                out.add(op == "<>")
            return frozenset(out)

        # Ordered numeric comparison a OP b; None bounds are unbounded.
        def lt(x: Any, y: Any) -> bool:  # may some a-value x be < some b-value y
            return x is None or y is None or x < y

        def le(x: Any, y: Any) -> bool:
            return x is None or y is None or x <= y

        if op == "<":
            can_true, can_false = lt(alo, bhi), le(blo, ahi)
        elif op == "<=":
            can_true, can_false = le(alo, bhi), lt(blo, ahi)
        elif op == ">":
            can_true, can_false = lt(blo, ahi), le(alo, bhi)
        else:
            can_true, can_false = le(blo, ahi), lt(alo, bhi)
        if can_true:
            out.add(True)
        if can_false:
            out.add(False)
        return frozenset(out)

    def _in(self, node: In) -> frozenset:
        v = self.value(node.expr)
        if v.kind in ("any",) and v.has_value:
            return _ALL
        strings = isinstance(node.values[0], str)
        want = "str" if strings else "num"
        if v.kind != want or not v.has_value:
            return _UNKNOWN
        out: set = {None} if v.may_null else set()
        found: set = set()
        for item in node.values:
            lit = _Abs(
                want,
                False,
                True,
                item,
                item,
                flt=isinstance(item, float),
                values=frozenset([item]) if strings else None,
            )
            found |= self._compare("=", v, lit) - {None}
        if True in found:
            out.add(True)
        # All values inside the list can only be proved for a known value set or a point.
        if v.values is not None:
            if not v.values <= set(node.values):
                out.add(False)
        elif not (v.lo is not None and v.lo == v.hi and v.lo in node.values and not v.nan):
            out.add(False)
        s = frozenset(out)
        return _not(s) if node.negated else s

    def _like(self, node: Like) -> frozenset:
        v = self.value(node.expr)
        if v.kind == "any" and v.has_value:
            return _ALL
        if v.kind != "str" or not v.has_value:
            return _UNKNOWN
        out: set = {None} if v.may_null else set()
        if v.values is not None:
            rx = re.compile(like_body(node.parts), re.DOTALL)
            for s in v.values:
                out.add(rx.fullmatch(s) is not None)
        else:
            out.add(False)
            prefix = node.parts[0] if node.parts and not isinstance(node.parts[0], Wildcard) else ""
            if _prefix_possible(prefix, v.lo, v.hi):
                out.add(True)
        s = frozenset(out)
        return _not(s) if node.negated else s


def _within(v: Any, lo: Any, hi: Any) -> bool:
    try:
        return (lo is None or lo <= v) and (hi is None or v <= hi)
    except TypeError:
        return True


def _overlaps(alo: Any, ahi: Any, blo: Any, bhi: Any) -> bool:
    try:
        return (alo is None or bhi is None or alo <= bhi) and (
            blo is None or ahi is None or blo <= ahi
        )
    except TypeError:  # bounds of different kinds: not provable
        return True


def _prefix_possible(prefix: str, lo: Any, hi: Any) -> bool:
    """May some string in [lo, hi] start with ``prefix``?"""
    if not prefix:
        return True
    if not isinstance(lo, str) or not isinstance(hi, str):
        return True
    # Strings starting with prefix sort at or after it, and before anything greater than it
    # that does not share it.
    return hi >= prefix and (lo <= prefix or lo.startswith(prefix))
