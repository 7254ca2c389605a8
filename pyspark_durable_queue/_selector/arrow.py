"""Compilation of a selector AST to Arrow compute calls.

Private to the package; used by :mod:`.compiled` and :mod:`.stats` (``__all__``). A
:class:`Compiler` built for one schema turns the AST of :mod:`.parse` into a tiny IR of ``("field",
name)`` / ``("lit", scalar)`` / ``("call", fn, args, opts)`` tuples. The IR is materialized either
as a :class:`pyarrow.compute.Expression` (:func:`to_expression`, for dataset scans and
:meth:`pyarrow.Table.filter`) or by calling the kernels eagerly on a batch (:func:`evaluate`, for
:meth:`Selector.mask`), so that the two evaluation paths cannot drift apart.

Column types are mapped to selector kinds here (:func:`column_value`); the statistics
reasoning in :mod:`.stats` reuses that mapping so both agree on what a column is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .parse import (
    ANY_CHARS,
    ARITHMETIC,
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
    like_regex,
)

__all__ = ["Compiler", "Value", "column_value", "evaluate", "to_expression"]

_NULL_BOOL = ("lit", pa.scalar(None, pa.bool_()))
_TRUE = ("lit", pa.scalar(True))
_FALSE = ("lit", pa.scalar(False))
_TO_F64 = pc.CastOptions.unsafe(pa.float64())  # int64 -> float64 may round, as in Java
_TO_I64 = pc.CastOptions.unsafe(pa.int64())
_CMP_FN = {
    "=": "equal",
    "<>": "not_equal",
    "<": "less",
    "<=": "less_equal",
    ">": "greater",
    ">=": "greater_equal",
}
_ARITH_FN = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}
_MS_PER = {"s": None, "ms": 1, "us": 1_000, "ns": 1_000_000}


def _call(fn: str, *args: Any, options: Any = None) -> tuple:
    return ("call", fn, args, options)


def _lit(value: Any, type_: pa.DataType | None = None) -> tuple:
    return ("lit", pa.scalar(value, type_))


@dataclass(frozen=True)
class Value:
    """A compiled value: IR, kind ("bool", "int", "float", "str", "null", "other") and type."""

    ir: tuple
    kind: str
    type: pa.DataType | None = None


def column_value(name: str, type_: pa.DataType) -> Value:
    f = ("field", name)
    if pa.types.is_dictionary(type_):
        inner = column_value(name, type_.value_type)
        if inner.kind in ("other", "null"):
            return Value(f, inner.kind, type_)
        decoded = _call("cast", f, options=pc.CastOptions.safe(type_.value_type))
        return _column_value_from(decoded, type_.value_type)
    return _column_value_from(f, type_)


def _column_value_from(f: tuple, t: pa.DataType) -> Value:
    if pa.types.is_boolean(t):
        return Value(f, "bool", t)
    if pa.types.is_integer(t):
        if pa.types.is_uint64(t):  # would not fit int64; compare approximately, as stats do
            return Value(_call("cast", f, options=_TO_F64), "float", pa.float64())
        return Value(f, "int", t)
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        if pa.types.is_float64(t):
            return Value(f, "float", t)
        return Value(_call("cast", f, options=_TO_F64), "float", pa.float64())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return Value(f, "str", t)
    if pa.types.is_string_view(t):
        cast = _call("cast", f, options=pc.CastOptions.safe(pa.large_string()))
        return Value(cast, "str", pa.large_string())
    if pa.types.is_timestamp(t):
        raw = _call("cast", f, options=_TO_I64)
        div = _MS_PER[t.unit]
        if div is None:
            return Value(_call("multiply", raw, _lit(1000)), "int", pa.int64())
        if div == 1:
            return Value(raw, "int", pa.int64())
        return Value(_call("divide", raw, _lit(div)), "int", pa.int64())
    if pa.types.is_date32(t):
        days = _call("cast", f, options=pc.CastOptions.unsafe(pa.int32()))
        return Value(_call("cast", days, options=_TO_I64), "int", pa.int64())
    if pa.types.is_date64(t):
        raw = _call("cast", f, options=_TO_I64)
        return Value(_call("divide", raw, _lit(86_400_000)), "int", pa.int64())
    if pa.types.is_null(t):
        return Value(_NULL_BOOL, "null")
    return Value(f, "other", t)


def _as_int64(v: Value) -> tuple:
    if v.ir[0] == "lit":
        return _lit(v.ir[1].as_py(), pa.int64())  # None (x / 0 folded) stays a typed null
    if v.type == pa.int64():
        return v.ir
    return _call("cast", v.ir, options=_TO_I64)


def _as_float64(v: Value) -> tuple:
    if v.ir[0] == "lit":
        value = v.ir[1].as_py()
        return _lit(None if value is None else float(value), pa.float64())
    if v.kind == "float":
        return v.ir
    return _call("cast", v.ir, options=_TO_F64)


def _numeric_pair(a: Value, b: Value) -> tuple[tuple, tuple, str]:
    """Bring two numeric values to a common type; ints keep their width when a literal fits."""
    if a.kind == "float" or b.kind == "float":
        return _as_float64(a), _as_float64(b), "float"
    # Comparing a narrow int column with a literal: type the literal like the column so Arrow
    # does not widen (copy) the whole column first.
    for col, other in ((a, b), (b, a)):
        if col.ir[0] != "lit" and other.ir[0] == "lit" and col.type is not None:
            try:
                typed = _lit(other.ir[1].as_py(), col.type)
            except (pa.ArrowException, OverflowError, ValueError):
                break  # the literal does not fit the column type: compare as int64
            return (col.ir, typed, "int") if col is a else (typed, col.ir, "int")
    return _as_int64(a), _as_int64(b), "int"


class Compiler:
    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema

    def condition(self, node: Any) -> tuple:
        """IR of a boolean node (values true/false/null)."""
        v = self.value(node)
        if v.kind == "bool":
            return v.ir
        return _NULL_BOOL  # a non-boolean used as a condition is UNKNOWN

    def value(self, node: Any) -> Value:
        if isinstance(node, Lit):
            v = node.value
            if isinstance(v, bool):
                return Value(_lit(v), "bool", pa.bool_())
            if isinstance(v, int):
                return Value(_lit(v, pa.int64()), "int", pa.int64())
            if isinstance(v, float):
                return Value(_lit(v, pa.float64()), "float", pa.float64())
            return Value(_lit(v, pa.string()), "str", pa.string())
        if isinstance(node, Ident):
            idx = self.schema.get_field_index(node.name)
            if idx < 0:
                return Value(_NULL_BOOL, "null")
            return column_value(node.name, self.schema.field(idx).type)
        if isinstance(node, Unary):
            if node.op == "NOT":
                return Value(_call("invert", self.condition(node.operand)), "bool", pa.bool_())
            v = self.value(node.operand)
            if v.kind not in ("int", "float"):
                return Value(_NULL_BOOL, "null")
            if node.op == "+":
                return v
            if v.kind == "int":
                return Value(_call("negate", _as_int64(v)), "int", pa.int64())
            return Value(_call("negate", v.ir), "float", pa.float64())
        if isinstance(node, Binary):
            if node.op in ("AND", "OR"):
                fn = "and_kleene" if node.op == "AND" else "or_kleene"
                ir = _call(fn, self.condition(node.left), self.condition(node.right))
                return Value(ir, "bool", pa.bool_())
            left, right = self.value(node.left), self.value(node.right)
            if node.op in ARITHMETIC:
                return self._arith(node.op, left, right)
            return Value(self._compare(node.op, left, right), "bool", pa.bool_())
        if isinstance(node, Between):
            return self.value(between_as_logic(node))
        if isinstance(node, IsNull):
            v = self.value(node.expr)
            if v.kind == "null":
                return Value(_FALSE if node.negated else _TRUE, "bool", pa.bool_())
            return Value(_call("is_valid" if node.negated else "is_null", v.ir), "bool")
        if isinstance(node, In):
            return Value(self._in(node), "bool", pa.bool_())
        if isinstance(node, Like):
            return Value(self._like(node), "bool", pa.bool_())
        raise TypeError(f"unknown selector node {node!r}")  # pragma: no cover

    def _arith(self, op: str, a: Value, b: Value) -> Value:
        if a.kind not in ("int", "float") or b.kind not in ("int", "float"):
            return Value(_NULL_BOOL, "null")
        if a.kind == "float" or b.kind == "float":
            x, y, kind, t = _as_float64(a), _as_float64(b), "float", pa.float64()
        else:
            x, y, kind, t = _as_int64(a), _as_int64(b), "int", pa.int64()
        if op == "/":
            # Division by zero is NULL: null the zero divisors so the kernel skips those slots.
            if y[0] == "lit":
                if y[1].as_py() == 0:
                    return Value(("lit", pa.scalar(None, t)), kind, t)
            else:
                is_zero = _call("equal", y, ("lit", pa.scalar(0, t)))
                y = _call("if_else", is_zero, ("lit", pa.scalar(None, t)), y)
        return Value(_call(_ARITH_FN[op], x, y), kind, t)

    @staticmethod
    def _compare(op: str, a: Value, b: Value) -> tuple:
        kinds = {a.kind, b.kind}
        if kinds <= {"int", "float"}:
            x, y, _ = _numeric_pair(a, b)
            return _call(_CMP_FN[op], x, y)
        if len(kinds) == 1 and kinds <= {"str", "bool"} and op in ("=", "<>"):
            return _call(_CMP_FN[op], a.ir, b.ir)
        return _NULL_BOOL

    def _in(self, node: In) -> tuple:
        v = self.value(node.expr)
        strings = isinstance(node.values[0], str)
        if strings and v.kind == "str":
            x, value_set = v.ir, pa.array(node.values, v.type or pa.string())
        elif not strings and v.kind in ("int", "float"):
            if v.kind == "float" or any(isinstance(x, float) for x in node.values):
                # is_in hashes bits, so -0.0 would miss 0.0; adding +0.0 maps -0.0 to 0.0 and
                # keeps everything else (NaN included) as it is.
                x = _call("add", _as_float64(v), _lit(0.0, pa.float64()))
                value_set = pa.array([float(n) + 0.0 for n in node.values], pa.float64())
            else:
                x, value_set = _as_int64(v), pa.array(node.values, pa.int64())
        else:
            return _NULL_BOOL
        found = _call("is_in", x, options=pc.SetLookupOptions(value_set))
        if node.negated:
            found = _call("invert", found)
        # is_in answers false for a null input; JMS wants UNKNOWN.
        return _call("if_else", _call("is_null", x), _NULL_BOOL, found)

    def _like(self, node: Like) -> tuple:
        v = self.value(node.expr)
        if v.kind != "str":
            return _NULL_BOOL
        parts = node.parts
        literal_only = all(not isinstance(p, Wildcard) or p is ANY_CHARS for p in parts)
        inner = [p for p in parts if p is not ANY_CHARS]
        if not parts:
            ir = _call("equal", v.ir, _lit("", pa.string()))
        elif literal_only and len(inner) <= 1:
            # The shapes selectors use most get Arrow's dedicated kernels, not a regex.
            text = inner[0] if inner else ""
            opts = pc.MatchSubstringOptions(text)
            starts, ends = parts[0] is not ANY_CHARS, parts[-1] is not ANY_CHARS
            if starts and ends:
                ir = _call("equal", v.ir, _lit(text, pa.string()))
            elif starts:
                ir = _call("starts_with", v.ir, options=opts)
            elif ends:
                ir = _call("ends_with", v.ir, options=opts)
            else:
                ir = _call("match_substring", v.ir, options=opts)
        else:
            opts = pc.MatchSubstringOptions(like_regex(parts))
            ir = _call("match_substring_regex", v.ir, options=opts)
        return _call("invert", ir) if node.negated else ir


def to_expression(ir: tuple) -> pc.Expression:
    tag = ir[0]
    if tag == "field":
        return pc.field(ir[1])
    if tag == "lit":
        return pc.scalar(ir[1])
    args = [to_expression(a) for a in ir[2]]
    return pc.Expression._call(ir[1], args, ir[3])


def evaluate(ir: tuple, data: pa.Table | pa.RecordBatch, memo: dict[int, Any]) -> Any:
    key = id(ir)
    if key in memo:  # BETWEEN shares its operand between two comparisons
        return memo[key]
    tag = ir[0]
    if tag == "field":
        out = data.column(ir[1])
    elif tag == "lit":
        out = ir[1]
    else:
        args = [evaluate(a, data, memo) for a in ir[2]]
        out = pc.call_function(ir[1], args, ir[3])
    memo[key] = out
    return out
