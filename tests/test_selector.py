"""Tests of the JMS selector: syntax, three-valued semantics, Arrow compilation, page skipping.

The vectorized evaluation is checked against ``reference``, a deliberately plain row-by-row
interpreter of the AST written from the specification (it lives here, never in the package).
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
import pickle
import re

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspark_durable_queue._format.stats import batch_stats, merge_stats, system_stats
from pyspark_durable_queue.errors import DurableQueueError, SelectorSyntaxError
from pyspark_durable_queue.selector import (
    Between,
    Binary,
    Ident,
    In,
    IsNull,
    Like,
    Lit,
    Selector,
    Unary,
    parse,
)

# --------------------------------------------------------------------------------------------
# Reference interpreter: one row at a time, Python values, straight from JMS 2.0 section 3.8.

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def _wrap(v: int) -> int:
    return ((v + 2**63) % 2**64) - 2**63


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def ref_value(node, row, schema):
    """(kind, value) with kind in int/float/str/bool/null/other and value None for NULL."""
    if isinstance(node, Lit):
        v = node.value
        kind = (
            "bool"
            if isinstance(v, bool)
            else "int"
            if isinstance(v, int)
            else "float"
            if isinstance(v, float)
            else "str"
        )
        return kind, v
    if isinstance(node, Ident):
        if schema.get_field_index(node.name) < 0:
            return "null", None
        t = schema.field(node.name).type
        v = row.get(node.name)
        if pa.types.is_dictionary(t):
            t = t.value_type
        if pa.types.is_boolean(t):
            return "bool", v
        if pa.types.is_uint64(t):
            return "float", None if v is None else float(v)
        if pa.types.is_integer(t):
            return "int", v
        if pa.types.is_floating(t) or pa.types.is_decimal(t):
            return "float", None if v is None else float(v)
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
            return "str", v
        if pa.types.is_timestamp(t):
            if v is None:
                return "int", None
            if v.tzinfo is None:
                v = v.replace(tzinfo=datetime.timezone.utc)
            delta = v - _EPOCH
            micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
            return "int", _trunc_div(micros, 1000)
        if pa.types.is_date32(t):
            return "int", None if v is None else (v - datetime.date(1970, 1, 1)).days
        return "other", v
    if isinstance(node, Unary) and node.op in "+-":
        kind, v = ref_value(node.operand, row, schema)
        if kind not in ("int", "float"):
            return "null", None
        if v is None or node.op == "+":
            return kind, v
        return kind, _wrap(-v) if kind == "int" else -v
    if isinstance(node, Binary) and node.op in "+-*/":
        (ka, a), (kb, b) = ref_value(node.left, row, schema), ref_value(node.right, row, schema)
        if ka not in ("int", "float") or kb not in ("int", "float"):
            return "null", None
        kind = "float" if "float" in (ka, kb) else "int"
        if a is None or b is None:
            return kind, None
        if kind == "float":
            a, b = float(a), float(b)
        if node.op == "/":
            if b == 0:
                return kind, None
            r = a / b if kind == "float" else _trunc_div(a, b)
        else:
            r = {"+": a + b, "-": a - b, "*": a * b}[node.op]
        return kind, _wrap(r) if kind == "int" else r
    return "bool", ref_truth(node, row, schema)  # a condition used as a value


def _compare(op, a, b):
    if op == "=":
        return a == b
    if op == "<>":
        return a != b
    return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]


def ref_truth(node, row, schema):
    """True, False or None (UNKNOWN)."""
    if isinstance(node, Binary) and node.op in ("AND", "OR"):
        a, b = ref_truth(node.left, row, schema), ref_truth(node.right, row, schema)
        if node.op == "AND":
            return False if False in (a, b) else None if None in (a, b) else True
        return True if True in (a, b) else None if None in (a, b) else False
    if isinstance(node, Unary) and node.op == "NOT":
        v = ref_truth(node.operand, row, schema)
        return None if v is None else not v
    if isinstance(node, Binary):  # comparison
        (ka, a), (kb, b) = ref_value(node.left, row, schema), ref_value(node.right, row, schema)
        if a is None or b is None:
            return None
        if ka in ("int", "float") and kb in ("int", "float"):
            if "float" in (ka, kb):
                a, b = float(a), float(b)
            return _compare(node.op, a, b)
        if ka == kb and ka in ("str", "bool") and node.op in ("=", "<>"):
            return _compare(node.op, a, b)
        return None
    if isinstance(node, Between):
        lo = Binary(">=", node.expr, node.low, 0)
        hi = Binary("<=", node.expr, node.high, 0)
        if node.negated:
            lo, hi = Binary("<", node.expr, node.low, 0), Binary(">", node.expr, node.high, 0)
        return ref_truth(Binary("OR" if node.negated else "AND", lo, hi, 0), row, schema)
    if isinstance(node, In):
        kind, v = ref_value(node.expr, row, schema)
        strings = isinstance(node.values[0], str)
        if v is None or (kind == "str") != strings or kind not in ("str", "int", "float"):
            return None
        found = any(v == x for x in node.values)
        return not found if node.negated else found
    if isinstance(node, Like):
        kind, v = ref_value(node.expr, row, schema)
        if kind != "str" or v is None:
            return None
        # Artemis's LikeExpression: the escape character escapes only a following '_', '%' or
        # itself; anywhere else it is read as an ordinary pattern character.
        rx, i, p, esc = [], 0, node.pattern, node.escape
        while i < len(p):
            if p[i] == esc and p[i + 1 : i + 2] in ("_", "%", esc):
                rx.append(re.escape(p[i + 1]))
                i += 2
                continue
            rx.append("." if p[i] == "_" else ".*" if p[i] == "%" else re.escape(p[i]))
            i += 1
        found = re.fullmatch("".join(rx), v, re.DOTALL) is not None
        return not found if node.negated else found
    if isinstance(node, IsNull):
        _, v = ref_value(node.expr, row, schema)
        return (v is not None) if node.negated else (v is None)
    kind, v = ref_value(node, row, schema)
    return v if kind == "bool" else None


def reference_mask(text, table):
    ast = parse(text)
    return [ref_truth(ast, row, table.schema) is True for row in table.to_pylist()]


# --------------------------------------------------------------------------------------------
# Table-driven semantics

SCHEMA = pa.schema(
    [
        ("i", pa.int64()),
        ("j", pa.int64()),
        ("i8", pa.int8()),
        ("u", pa.uint32()),
        ("f", pa.float64()),
        ("f32", pa.float32()),
        ("s", pa.string()),
        ("t", pa.string()),
        ("ls", pa.large_string()),
        ("ds", pa.dictionary(pa.int32(), pa.string())),
        ("b", pa.bool_()),
        ("c", pa.bool_()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("d", pa.date32()),
        ("dec", pa.decimal128(10, 2)),
        ("bin", pa.binary()),
        ("dotted.name", pa.int64()),
        ("_seq", pa.int64()),
        ("_timestamp", pa.timestamp("ms")),
    ]
)
T0 = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
T0_MS = 1_704_067_200_000
NAN = math.nan

# (selector, row, expected) with expected the three-valued result: True, False or None.
CASES = [
    # literals and boolean columns
    ("TRUE", {}, True),
    ("FALSE", {}, False),
    ("true", {}, True),
    ("b", {"b": True}, True),
    ("b", {"b": False}, False),
    ("b", {}, None),
    ("b = TRUE", {"b": True}, True),
    ("b = FALSE", {"b": True}, False),
    ("b <> c", {"b": True, "c": False}, True),
    ("b < c", {"b": False, "c": True}, None),
    ("s", {"s": "x"}, None),
    ("i", {"i": 1}, None),
    # numeric comparisons across types
    ("i = 5", {"i": 5}, True),
    ("i <> 5", {"i": 5}, False),
    ("i < 5", {"i": 4}, True),
    ("i <= 5", {"i": 5}, True),
    ("i > 5", {"i": 5}, False),
    ("i >= 5", {"i": 5}, True),
    ("i > 4.5", {"i": 5}, True),
    ("i = 5.0", {"i": 5}, True),
    ("i = 5.", {"i": 5}, True),
    ("f = .5", {"f": 0.5}, True),
    ("f = 5E-1", {"f": 0.5}, True),
    ("f < 1E10", {"f": 0.5}, True),
    ("f > 4E-10", {"f": 0.5}, True),
    ("f = 2", {"f": 2.0}, True),
    ("f32 > 0.5", {"f32": 1.5}, True),
    ("i8 > 1000", {"i8": 100}, False),
    ("i8 > -1000", {"i8": -100}, True),
    ("u > -1", {"u": 0}, True),
    ("dec > 1.2", {"dec": decimal.Decimal("1.25")}, True),
    ("i = j", {"i": 3, "j": 3}, True),
    ("i < f", {"i": 3, "f": 3.5}, True),
    ("i = 5", {}, None),
    ("5 = i", {}, None),
    ("i = -9223372036854775808", {"i": -(2**63)}, True),
    # NaN is not NULL: comparisons are false (unequal), IS NULL is false
    ("f = f", {"f": NAN}, False),
    ("f <> 1", {"f": NAN}, True),
    ("f < 1", {"f": NAN}, False),
    ("f IS NULL", {"f": NAN}, False),
    ("f BETWEEN 0 AND 1", {"f": NAN}, False),
    ("f NOT BETWEEN 0 AND 1", {"f": NAN}, False),
    # strings
    ("s = 'red'", {"s": "red"}, True),
    ("s = 'red'", {"s": "blue"}, False),
    ("s <> 'red'", {"s": "blue"}, True),
    ("s = 'RED'", {"s": "red"}, False),
    ("s = 'it''s'", {"s": "it's"}, True),
    ("s = ''", {"s": ""}, True),
    ("s = t", {"s": "x", "t": "x"}, True),
    ("s < 'z'", {"s": "a"}, None),
    ("s >= 'a'", {"s": "a"}, None),
    ("ls = 'x'", {"ls": "x"}, True),
    ("ds = 'x'", {"ds": "x"}, True),
    ("ds <> 'x'", {"ds": "y"}, True),
    ("s = 'red'", {}, None),
    # type mismatch is UNKNOWN, not an error
    ("s = 1", {"s": "1"}, None),
    ("i = '1'", {"i": 1}, None),
    ("b = 1", {"b": True}, None),
    ("s + 1 > 0", {"s": "1"}, None),
    ("bin = 'x'", {"bin": b"x"}, None),
    ("'a' = 1", {}, None),
    # arithmetic
    ("i + 1 = 6", {"i": 5}, True),
    ("i - 1 = 4", {"i": 5}, True),
    ("i * 2 = 10", {"i": 5}, True),
    ("i / 2 = 2", {"i": 5}, True),
    ("i / 2 = 2.5", {"i": 5}, False),
    ("i / 2.0 = 2.5", {"i": 5}, True),
    ("-i / 2 = -2", {"i": 5}, True),
    ("i / 0 IS NULL", {"i": 5}, True),
    ("f / 0 IS NULL", {"f": 5.0}, True),
    ("i / j IS NULL", {"i": 5, "j": 0}, True),
    ("i / j = 2", {"i": 5, "j": 2}, True),
    ("f = i / 0", {"f": 1.0, "i": 1}, None),
    ("f = 1 / 0 + 0.5", {"f": 1.0}, None),
    ("1 / 0 IS NULL", {}, True),
    ("i + j = 1", {"i": 1}, None),
    ("-i = -5", {"i": 5}, True),
    ("- -i = 5", {"i": 5}, True),
    ("+i = 5", {"i": 5}, True),
    ("1 + 2 * 3 = 7", {}, True),
    ("(1 + 2) * 3 = 9", {}, True),
    ("10 - 2 - 3 = 5", {}, True),
    ("12 / 2 / 3 = 2", {}, True),
    ("i8 * 100 = 10000", {"i8": 100}, True),  # exact arithmetic is long, not int8
    ("i * 2 = -2", {"i": 2**63 - 1}, True),  # wraps like Java long
    ("f * 2 > 1E308", {"f": 1e308}, True),
    # logic: Kleene three-valued tables
    ("TRUE AND i = 1", {}, None),
    ("FALSE AND i = 1", {}, False),
    ("TRUE OR i = 1", {}, True),
    ("FALSE OR i = 1", {}, None),
    ("NOT i = 1", {}, None),
    ("NOT i = 1", {"i": 2}, True),
    ("NOT NOT i = 1", {"i": 1}, True),
    ("i = 1 OR i = 2 AND FALSE", {"i": 1}, True),  # AND binds tighter than OR
    ("(i = 1 OR i = 2) AND FALSE", {"i": 1}, False),
    ("NOT i = 1 AND i = 2", {"i": 2}, True),  # NOT binds tighter than AND
    ("(i > 1) = TRUE", {"i": 2}, True),
    ("(i > 1) = (j > 1)", {"i": 2, "j": 0}, False),
    ("(i > 1) = (j > 1)", {"i": 2}, None),
    # BETWEEN
    ("i BETWEEN 1 AND 5", {"i": 1}, True),
    ("i BETWEEN 1 AND 5", {"i": 5}, True),
    ("i BETWEEN 1 AND 5", {"i": 6}, False),
    ("i NOT BETWEEN 1 AND 5", {"i": 6}, True),
    ("i NOT BETWEEN 1 AND 5", {"i": 3}, False),
    ("i BETWEEN 1 AND 5", {}, None),
    ("i NOT BETWEEN 1 AND 5", {}, None),
    ("i BETWEEN j AND 5", {"i": 3}, None),
    ("i BETWEEN j AND 5", {"i": 9}, False),  # FALSE AND UNKNOWN
    ("i + 1 BETWEEN 2 * 1 AND 2.5", {"i": 1}, True),
    ("i between 1 and 5 and i = 3", {"i": 3}, True),
    ("s BETWEEN 'a' AND 'z'", {"s": "m"}, None),
    # IN
    ("s IN ('a', 'b')", {"s": "b"}, True),
    ("s IN ('a', 'b')", {"s": "c"}, False),
    ("s NOT IN ('a', 'b')", {"s": "c"}, True),
    ("s NOT IN ('a', 'b')", {"s": "a"}, False),
    ("s IN ('a')", {}, None),
    ("s NOT IN ('a')", {}, None),
    ("s IN ('it''s')", {"s": "it's"}, True),
    ("ds IN ('x', 'y')", {"ds": "y"}, True),
    ("ls IN ('x')", {"ls": "x"}, True),
    ("i IN (1, 2, 3)", {"i": 2}, True),
    ("i IN (1, -2)", {"i": -2}, True),
    ("i IN (1.5, 2)", {"i": 2}, True),
    ("f IN (1, 2)", {"f": 2.0}, True),
    ("f IN (0)", {"f": -0.0}, True),
    ("f IN (-0.0)", {"f": 0.0}, True),
    ("f NOT IN (0)", {"f": NAN}, True),
    ("f = 0", {"f": -0.0}, True),
    ("i IN ('1')", {"i": 1}, None),
    ("s IN (1)", {"s": "1"}, None),
    ("missing IN ('a')", {}, None),
    # LIKE with wildcards and escapes
    ("s LIKE 'ab%'", {"s": "abc"}, True),
    ("s LIKE 'ab%'", {"s": "xabc"}, False),
    ("s LIKE '%bc'", {"s": "abc"}, True),
    ("s LIKE '%b%'", {"s": "abc"}, True),
    ("s LIKE '%'", {"s": ""}, True),
    ("s LIKE ''", {"s": ""}, True),
    ("s LIKE ''", {"s": "a"}, False),
    ("s LIKE 'abc'", {"s": "abc"}, True),
    ("s LIKE 'a_c'", {"s": "abc"}, True),
    ("s LIKE 'a_c'", {"s": "ac"}, False),
    ("s LIKE '_'", {"s": "é"}, True),  # one character, not one byte
    ("s LIKE 'a%c'", {"s": "a\nb\nc"}, True),
    ("s LIKE 'ab'", {"s": "ab\n"}, False),
    ("s LIKE 'a.c'", {"s": "abc"}, False),  # regex metacharacters are literal
    ("s LIKE '[a]*'", {"s": "[a]*"}, True),
    ("s LIKE 'a\\%'", {"s": "a\\bc"}, True),  # backslash is not an escape by default
    ("s LIKE 'a\\_'", {"s": "a_"}, False),
    ("s LIKE 'a!%' ESCAPE '!'", {"s": "a%"}, True),
    ("s LIKE 'a!%' ESCAPE '!'", {"s": "ab"}, False),
    ("s LIKE 'a!_c' ESCAPE '!'", {"s": "a_c"}, True),
    ("s LIKE 'a!_c' ESCAPE '!'", {"s": "abc"}, False),
    ("s LIKE 'a!!' ESCAPE '!'", {"s": "a!"}, True),
    ("s LIKE '\\%%' ESCAPE '\\'", {"s": "%x"}, True),
    ("s LIKE '\\%%' ESCAPE '\\'", {"s": "x%"}, False),
    ("s LIKE 'a%%b'", {"s": "ab"}, True),
    ("s LIKE 'a''b'", {"s": "a'b"}, True),
    ("s LIKE 'x_%' ESCAPE 'x'", {"s": "_a"}, True),
    # The escape character escapes only '_', '%' or itself (ActiveMQ/Artemis); elsewhere it is
    # an ordinary pattern character.
    ("s LIKE 'a!b' ESCAPE '!'", {"s": "a!b"}, True),  # before an ordinary char: literal
    ("s LIKE 'a!b' ESCAPE '!'", {"s": "ab"}, False),
    ("s LIKE 'xa' ESCAPE 'x'", {"s": "xa"}, True),
    ("s LIKE 'a!' ESCAPE '!'", {"s": "a!"}, True),  # trailing: literal
    ("s LIKE 'a!' ESCAPE '!'", {"s": "a"}, False),
    ("s LIKE 'a!!b' ESCAPE '!'", {"s": "a!b"}, True),  # followed by itself
    ("s LIKE 'a!!b' ESCAPE '!'", {"s": "a!!b"}, False),
    ("s LIKE '!!!%' ESCAPE '!'", {"s": "!%"}, True),
    ("s LIKE '!!!%' ESCAPE '!'", {"s": "!%x"}, False),
    ("s LIKE '%%' ESCAPE '%'", {"s": "%"}, True),  # escape = '%'
    ("s LIKE '%%' ESCAPE '%'", {"s": "ab"}, False),
    ("s LIKE '%' ESCAPE '%'", {"s": "anything"}, True),  # trailing: still a wildcard
    ("s LIKE '%a' ESCAPE '%'", {"s": "xya"}, True),  # before an ordinary char: wildcard
    ("s LIKE '%%%' ESCAPE '%'", {"s": "%tail"}, True),  # literal '%', then wildcard
    ("s LIKE '%%%' ESCAPE '%'", {"s": "tail"}, False),
    ("s LIKE '%_' ESCAPE '%'", {"s": "_"}, True),
    ("s LIKE '%_' ESCAPE '%'", {"s": "a"}, False),
    ("s LIKE '__' ESCAPE '_'", {"s": "_"}, True),  # escape = '_'
    ("s LIKE '__' ESCAPE '_'", {"s": "a"}, False),
    ("s LIKE '_' ESCAPE '_'", {"s": "a"}, True),  # trailing: still a wildcard
    ("s LIKE '___' ESCAPE '_'", {"s": "_x"}, True),  # literal '_', then one character
    ("s LIKE '___' ESCAPE '_'", {"s": "xx"}, False),
    ("s LIKE '_%a' ESCAPE '_'", {"s": "%a"}, True),
    ("s LIKE '_%a' ESCAPE '_'", {"s": "xa"}, False),
    ("s LIKE '_a' ESCAPE '_'", {"s": "ba"}, True),  # before an ordinary char: wildcard
    # Artemis's SelectorTest.testSpecialEscapeLiteral, verbatim in meaning
    ("s LIKE '%_%' ESCAPE '%'", {"s": "_foo"}, True),
    ("s LIKE '_D7xlJIQn$_' ESCAPE '$'", {"s": "XD7xlJIQn_"}, True),
    ("s LIKE '_D7xlJIQn__' ESCAPE '_'", {"s": "XD7xlJIQn_"}, True),
    ("s LIKE '_D7xlJIQn__' ESCAPE '_'", {"s": "D7xlJIQn_"}, False),
    ("s LIKE '%D7xlJIQn%_' ESCAPE '%'", {"s": "XD7xlJIQn_"}, True),
    ("s LIKE '%D7xlJIQn%' ESCAPE '%'", {"s": "XD7xlJIQn_"}, True),
    ("s LIKE '%D7xlJIQn%%' ESCAPE '%'", {"s": "XD7xlJIQn_"}, False),
    ("s LIKE '_D7xlJIQn\\_' ESCAPE '\\'", {"s": "XD7xlJIQn_"}, True),
    ("s LIKE '%D7xlJIQn\\_' ESCAPE '\\'", {"s": "XD7xlJIQn_"}, True),
    ("s NOT LIKE 'a%'", {"s": "abc"}, False),
    ("s NOT LIKE 'a%'", {"s": "bc"}, True),
    ("s LIKE 'a%'", {}, None),
    ("s NOT LIKE 'a%'", {}, None),
    ("ds LIKE 'x%'", {"ds": "xy"}, True),
    ("ls LIKE '_y'", {"ls": "xy"}, True),
    ("i LIKE '1'", {"i": 1}, None),
    # IS NULL, unknown identifiers, system and quoted columns
    ("i IS NULL", {}, True),
    ("i IS NULL", {"i": 1}, False),
    ("i IS NOT NULL", {"i": 1}, True),
    ("bin IS NOT NULL", {"bin": b""}, True),
    ("i + 1 IS NULL", {}, True),
    ("missing IS NULL", {}, True),
    ("missing IS NOT NULL", {}, False),
    ("missing = 1", {}, None),
    ("missing <> 1", {}, None),
    ("NOT missing = 1", {}, None),
    ("missing", {}, None),
    ('"dotted.name" = 7', {"dotted.name": 7}, True),
    ("_seq >= 10", {"_seq": 10}, True),
    ("_timestamp = 1704067200000", {"_timestamp": T0}, True),
    ("ts = 1704067200000", {"ts": T0}, True),
    ("ts > 1704067200000", {"ts": T0 + datetime.timedelta(microseconds=999)}, False),
    ("ts > 1704067200000", {"ts": T0 + datetime.timedelta(milliseconds=1)}, True),
    ("ts BETWEEN 1704067200000 - 1000 AND 1704067200000", {"ts": T0}, True),
    ("d = 19723", {"d": datetime.date(2024, 1, 1)}, True),
    # keywords are case-insensitive, identifiers are not
    ("i Between 1 aNd 2 oR NoT s iS nUlL", {"i": 5}, False),
    ("I = 1", {"i": 1}, None),
    ("s like 'a%' escape '!'", {"s": "ab"}, True),
    ("s not in ('a')", {"s": "b"}, True),
]


def _row_table(row):
    return pa.Table.from_pylist([row], schema=SCHEMA)


def _case_id(case):
    text, row, expected = case
    return f"{text} | {row} -> {expected}"


@pytest.mark.parametrize(("text", "row", "expected"), CASES, ids=[_case_id(c) for c in CASES])
def test_semantics(text, row, expected):
    table = _row_table(row)
    batch = table.to_batches()[0]
    want = expected is True
    sel = Selector(text)
    assert sel.mask(table).to_pylist() == [want]
    assert sel.mask(batch).to_pylist() == [want]
    assert table.filter(sel.expression(table.schema)).num_rows == int(want)
    assert sel.filter(batch).num_rows == int(want)
    # NOT tells FALSE from UNKNOWN: only a FALSE selector becomes TRUE under NOT.
    assert Selector(f"NOT ({text})").mask(table).to_pylist() == [expected is False]
    # The reference interpreter agrees, so the property tests below compare like with like.
    assert ref_truth(parse(text), table.to_pylist()[0], table.schema) == expected
    # A selected row is never skipped by its own page statistics.
    stats = merge_stats([batch_stats(table), system_stats(0, 1, T0_MS)])
    if want:
        assert sel.may_match(stats)
        assert Selector(text, SCHEMA).may_match(stats)


# --------------------------------------------------------------------------------------------
# Syntax errors

BAD = [
    ("3+5", 0),
    ("a = 1 AMD b = 2", 6),
    ("=x 'y'", 0),
    ("", 0),
    ("   ", 3),
    ("a = 1 b", 6),
    ("a = 1)", 5),
    ("(a = 1", 6),
    ("a =", 3),
    ("'abc'", 0),
    ("1", 0),
    ("-a", 0),
    ("a + 1", 0),
    ("NOT 3", 0),
    ("a AND 3", 6),
    ("'x' OR a", 0),
    ("'a' * 2 = 1", 0),
    ("TRUE + 1 = 2", 0),
    ("a = NULL", 4),
    ("NULL IS NULL", 0),
    ("a != 1", 2),
    ("a == 1", 3),
    ("a = 'x", 4),
    ('"a = 1', 0),
    ("a = 1.2.3", 4),
    ("a = 12abc", 4),
    ("a = 0x1F", 4),
    ("a = 1 = 2", 6),
    ("a BETWEEN 1", 11),
    ("a BETWEEN 1 OR 2", 12),
    ("a IN ()", 6),
    ("a IN ('x',)", 10),
    ("a IN ('x', 1)", 2),
    ("a IN (b)", 6),
    ("a IN 'x'", 5),
    ("1 IN ('x')", 2),
    ("a LIKE b", 7),
    ("a LIKE 'x' ESCAPE 'ab'", 18),
    ("a LIKE 'x' ESCAPE ''", 18),
    ("'a' LIKE 'a'", 4),
    ("a IS 1", 5),
    ("a IS NOT", 8),
    ("a NOT = 1", 2),
    ("a = 9223372036854775808", 4),
    ("a = 1E999", 4),
    ("AND = 1", 0),
    ("a = 1 AND", 9),
    ("a @ b", 2),
    ("a.b = 1", 1),
]


@pytest.mark.parametrize(("text", "position"), BAD, ids=[t or "<empty>" for t, _ in BAD])
def test_syntax_errors(text, position):
    with pytest.raises(SelectorSyntaxError) as info:
        Selector(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert isinstance(err, DurableQueueError)
    assert err.selector == text
    assert err.position == position
    lines = str(err).splitlines()
    assert lines[-2] == f"  {text}"
    assert lines[-1] == "  " + " " * position + "^"


def test_syntax_error_pickles():
    with pytest.raises(SelectorSyntaxError) as info:
        Selector("a = 1 AMD b = 2")
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.selector, again.position, str(again)) == (
        info.value.selector,
        info.value.position,
        str(info.value),
    )


def test_non_str_selector_is_a_type_error():
    with pytest.raises(TypeError):
        Selector(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        "a",
        "(a)",
        "NOT a",
        "a = b",
        "'a' = 'b'",
        "1 = 1",
        "x = -9223372036854775808",
        "$x_1 = 1 AND _y = 2 AND ü = 3",
        '"with space" = 1',
        '"quote""d" = 1',
        "a\t=\n1",
        "((a = 1))",
        "a = 1 OR (b = 2 AND NOT c IS NULL)",
        "a = 7E3 OR a = -57.9E2 OR a = .5 OR a = 1. OR a = +62",
    ],
)
def test_valid_syntax(text):
    Selector(text)


# --------------------------------------------------------------------------------------------
# API


def test_identifiers_and_unknown_identifiers():
    sel = Selector("color = 'red' AND \"a.b\" > 1 OR missing IS NULL OR _seq BETWEEN x AND 2")
    assert sel.identifiers == frozenset({"color", "a.b", "missing", "_seq", "x"})
    schema = pa.schema([("color", pa.string()), ("a.b", pa.int64()), ("_seq", pa.int64())])
    assert sel.unknown_identifiers(schema) == {"missing", "x"}


def test_pickle_round_trip_compiles_lazily():
    sel = Selector("amount > 500 AND color = 'red'", SCHEMA)
    data = pa.table({"amount": [600, 700], "color": ["red", "blue"]})
    sel.mask(data)  # populate the compile cache, which must not be pickled
    blob = pickle.dumps(sel)
    assert len(blob) < 4096
    again = pickle.loads(blob)
    assert again == sel
    assert again.text == sel.text and again.schema == SCHEMA
    assert again.identifiers == sel.identifiers
    assert again.mask(data).to_pylist() == [True, False]


def test_mask_and_filter_types():
    table = pa.concat_tables([pa.table({"i": [1, 2]}), pa.table({"i": [3, None]})])
    sel = Selector("i >= 2")
    mask = sel.mask(table)
    assert isinstance(mask, pa.ChunkedArray) and mask.null_count == 0
    assert mask.to_pylist() == [False, True, True, False]
    assert isinstance(sel.filter(table), pa.Table)
    assert sel.filter(table).column("i").to_pylist() == [2, 3]
    batch = table.combine_chunks().to_batches()[0]
    assert isinstance(sel.mask(batch), pa.BooleanArray)
    assert isinstance(sel.filter(batch), pa.RecordBatch)
    # A selector that does not read any column still returns one value per row.
    for text, value in (("TRUE", True), ("missing IS NULL", True), ("missing = 1", False)):
        assert Selector(text).mask(table).to_pylist() == [value] * 4
        assert Selector(text).mask(batch).to_pylist() == [value] * 4
    empty = table.slice(0, 0)
    assert Selector("i > 1").mask(empty).to_pylist() == []


def test_expression_is_two_valued_and_usable_with_datasets():
    import pyarrow.dataset as ds

    table = pa.table({"i": [1, None, 3]})
    expr = Selector("i > 1").expression(table.schema)
    assert table.filter(~expr).column("i").to_pylist() == [1, None]
    assert ds.dataset(table).to_table(filter=expr).column("i").to_pylist() == [3]


def test_one_selector_many_schemas():
    sel = Selector("x = 1")
    assert sel.mask(pa.table({"x": [1, 2]})).to_pylist() == [True, False]
    assert sel.mask(pa.table({"x": ["1", "2"]})).to_pylist() == [False, False]
    assert sel.mask(pa.table({"y": [1, 2]})).to_pylist() == [False, False]


# --------------------------------------------------------------------------------------------
# Page statistics (may_match)


def _stats(**columns):
    table = pa.table(columns)
    return merge_stats([batch_stats(table), system_stats(100, 100 + table.num_rows, T0_MS)])


@pytest.mark.parametrize(
    ("text", "columns", "expected"),
    [
        pytest.param("color = 'red'", {"color": ["blue", "blue"]}, False, id="value-set-miss"),
        pytest.param("color = 'red'", {"color": ["blue", "red"]}, True, id="value-set-hit"),
        pytest.param("color <> 'blue'", {"color": ["blue", None]}, False, id="ne-single-value"),
        pytest.param("color IN ('red', 'green')", {"color": ["blue"]}, False, id="in-miss"),
        pytest.param("color NOT IN ('blue')", {"color": ["blue"]}, False, id="not-in-all"),
        pytest.param("color LIKE 'r%'", {"color": ["blue", "green"]}, False, id="like-values"),
        pytest.param(
            "id LIKE 'k-1%'",
            {"id": [f"k-{i:05d}" for i in range(50_000, 50_100)]},
            False,
            id="like-prefix-by-bounds",
        ),
        pytest.param(
            "id LIKE 'k-5%'",
            {"id": [f"k-{i:05d}" for i in range(50_000, 50_100)]},
            True,
            id="like-prefix-inside",
        ),
        pytest.param("amount > 100", {"amount": [10, 50]}, False, id="gt-above-max"),
        pytest.param("amount > 100", {"amount": [10, 500]}, True, id="gt-overlap"),
        pytest.param("amount >= 50", {"amount": [10, 50]}, True, id="ge-at-max"),
        pytest.param("amount < 10", {"amount": [10, 50]}, False, id="lt-below-min"),
        pytest.param("amount = 30", {"amount": [10, 20]}, False, id="eq-outside"),
        pytest.param("amount > 100.5", {"amount": [10, 100]}, False, id="int-vs-float"),
        pytest.param("amount * 2 > 200", {"amount": [10, 100]}, False, id="arithmetic-bounds"),
        pytest.param("-amount > -5", {"amount": [10, 100]}, False, id="negation-bounds"),
        pytest.param("amount BETWEEN 200 AND 300", {"amount": [10, 100]}, False, id="between"),
        pytest.param("amount NOT BETWEEN 0 AND 100", {"amount": [10, 100]}, False, id="not-btw"),
        pytest.param("amount IN (1, 2)", {"amount": [10, 100]}, False, id="in-numbers"),
        pytest.param("x IS NULL", {"x": [1, 2]}, False, id="is-null-none"),
        pytest.param(
            "x IS NOT NULL",
            {"x": pa.array([None, None], pa.int64())},
            False,
            id="is-not-null-all-null",
        ),
        pytest.param("x = 1", {"x": pa.array([None, None], pa.int64())}, False, id="all-null"),
        pytest.param("x IS NULL", {"x": [1, None]}, True, id="is-null-some"),
        pytest.param("price <> 1", {"price": [1.0, 1.0]}, False, id="float-ne-point"),
        pytest.param("price <> 1", {"price": [1.0, NAN]}, True, id="nan-is-unequal"),
        pytest.param("NOT price > 5", {"price": [1.0, 2.0]}, True, id="not-gt"),
        pytest.param("NOT price < 5", {"price": [1.0, 2.0]}, False, id="not-lt"),
        pytest.param("NOT price < 5", {"price": [1.0, NAN]}, True, id="not-lt-nan"),
        pytest.param("NOT amount = 1", {"amount": [1, None]}, False, id="not-with-null"),
        pytest.param("flag", {"flag": [False, False]}, False, id="bool-false"),
        pytest.param("NOT flag", {"flag": [True, None]}, False, id="not-bool-true"),
        pytest.param("flag = TRUE", {"flag": [True, False]}, True, id="bool-eq"),
        pytest.param(
            "amount > 100 OR color = 'red'",
            {"amount": [1], "color": ["red"]},
            True,
            id="or-one-side",
        ),
        pytest.param(
            "amount > 100 OR color = 'red'",
            {"amount": [1], "color": ["blue"]},
            False,
            id="or-both-fail",
        ),
        pytest.param(
            "amount > 100 AND color = 'red'",
            {"amount": [500], "color": ["blue"]},
            False,
            id="and-one-fails",
        ),
        pytest.param(
            "NOT (amount > 100 OR color = 'red')",
            {"amount": [500], "color": ["x"]},
            False,
            id="not-or",
        ),
        pytest.param("color < 'z'", {"color": ["a"]}, False, id="string-order-unknown"),
        pytest.param("color = 1", {"color": ["a"]}, False, id="type-mismatch"),
        pytest.param("_seq >= 200", {"a": [1, 2]}, False, id="seq-range"),
        pytest.param("_seq >= 101", {"a": [1, 2]}, True, id="seq-range-hit"),
        pytest.param(f"_timestamp < {T0_MS}", {"a": [1]}, False, id="timestamp"),
        pytest.param(
            "ts > 1704067200000",
            {"ts": pa.array([T0], pa.timestamp("us", tz="UTC"))},
            False,
            id="timestamp-column",
        ),
        pytest.param("unknown_col = 1", {"a": [1]}, True, id="no-stats-unsure"),
        pytest.param("blob IS NULL", {"blob": [b"x"]}, False, id="binary-null-count"),
        pytest.param("TRUE", {"a": [1]}, True, id="true"),
        pytest.param("FALSE", {"a": [1]}, False, id="false"),
    ],
)
def test_may_match(text, columns, expected):
    stats = json.loads(json.dumps(_stats(**columns)))  # as read back from the JSON file
    assert Selector(text).may_match(stats) is expected


def test_may_match_uses_schema_for_identifiers_that_are_not_columns():
    stats = _stats(a=[1, 2])
    schema = pa.schema(
        [("a", pa.int64()), ("_seq", pa.int64()), ("_timestamp", pa.timestamp("ms"))]
    )
    assert Selector("missing = 1").may_match(stats)  # no schema: unsure
    assert not Selector("missing = 1", schema).may_match(stats)  # NULL = 1 is UNKNOWN
    assert Selector("missing IS NULL", schema).may_match(stats)
    assert not Selector("missing IS NOT NULL", schema).may_match(stats)
    # A binary column can only be NULL or not: comparing it is UNKNOWN.
    blob_stats = _stats(blob=[b"x"])
    blob_schema = pa.schema([("blob", pa.binary())])
    assert Selector("blob = 'x'").may_match(blob_stats)  # no schema: kind unknown
    assert not Selector("blob = 'x'", blob_schema).may_match(blob_stats)
    assert not Selector("blob IS NULL", blob_schema).may_match(blob_stats)
    # A column of the schema without statistics stays unsure.
    schema2 = schema.append(pa.field("b", pa.int64()))
    assert Selector("b = 1", schema2).may_match(stats)


def test_may_match_empty_and_partial_stats():
    assert not Selector("TRUE").may_match({"rows": 0, "columns": {}})
    assert Selector("a > 1").may_match({"rows": 5, "columns": {}})
    assert Selector("a > 1").may_match({"rows": 5, "columns": {"a": {"null_count": 0}}})
    assert Selector("a > 1").may_match({"rows": 5, "columns": {"a": {"min": 0, "max": 9}}})
    assert not Selector("a > 9").may_match({"rows": 5, "columns": {"a": {"min": 0, "max": 9}}})


# LIKE patterns whose ESCAPE character is itself a wildcard (or whose escape is trailing or
# before an ordinary character), each with a value it must select.
SPECIAL_ESCAPE_LIKES = [
    ("s LIKE '_D7xlJIQn__' ESCAPE '_'", "XD7xlJIQn_"),
    ("s LIKE '%D7xlJIQn%' ESCAPE '%'", "XD7xlJIQn_"),
    ("s LIKE '%%%' ESCAPE '%'", "%tail"),
    ("s LIKE '%%k%' ESCAPE '%'", "%kite"),
    ("s LIKE '___' ESCAPE '_'", "_x"),
    ("s LIKE '__%' ESCAPE '_'", "_abc"),
    ("s LIKE 'k!' ESCAPE '!'", "k!"),
    ("s LIKE 'k!x%' ESCAPE '!'", "k!xyz"),
    ("s LIKE 'k!!%' ESCAPE '!'", "k!z"),
]


@pytest.mark.parametrize(
    ("text", "match"), SPECIAL_ESCAPE_LIKES, ids=[t for t, _ in SPECIAL_ESCAPE_LIKES]
)
@pytest.mark.parametrize("distinct", [4, 40], ids=["value-set", "min-max-only"])
def test_like_with_special_escape_never_skips_a_page_holding_a_match(text, match, distinct):
    """The Arrow filter and the page statistics read the same pattern: a page whose values
    include a selected one is never skipped, and (with a value set) a page without is."""
    sel = Selector(text)
    fillers = [f"filler-{k:03d}" for k in range(distinct - 1)]
    for values in ([*fillers, match], [match, *fillers]):
        page = pa.table({"s": values})
        stats = json.loads(json.dumps(_stats(s=values)))
        assert ("values" in stats["columns"]["s"]) is (distinct <= 16)  # the kind of stats meant
        assert sel.mask(page).to_pylist() == [v == match for v in values]
        assert sel.may_match(stats), (text, stats["columns"]["s"])
    no_match = json.loads(json.dumps(_stats(s=fillers)))
    assert not any(sel.mask(pa.table({"s": fillers})).to_pylist())
    if distinct <= 16:
        assert not sel.may_match(no_match)


# --------------------------------------------------------------------------------------------
# Property tests: vectorized == reference on random data and selectors; may_match is sound.

PROP_SCHEMA = pa.schema(
    [
        ("i", pa.int64()),
        ("j", pa.int32()),
        ("f", pa.float64()),
        ("s", pa.string()),
        ("b", pa.bool_()),
        ("ts", pa.timestamp("ms")),
    ]
)
NUM_IDENTS = ["i", "j", "f", "ts", "missing"]
STR_VALUES = ["", "a", "b", "ab", "ba", "a%", "b_c", "a!", "é"]

ints = st.one_of(st.none(), st.integers(-6, 6))
floats = st.one_of(
    st.none(),
    st.sampled_from([0.0, -0.0, 0.5, -1.5, 2.0, 3.25, math.nan, math.inf, -math.inf]),
    st.floats(-10, 10, allow_nan=False),
)


@st.composite
def tables(draw):
    n = draw(st.integers(0, 12))
    cols = {
        "i": draw(st.lists(ints, min_size=n, max_size=n)),
        "j": draw(st.lists(ints, min_size=n, max_size=n)),
        "f": draw(st.lists(floats, min_size=n, max_size=n)),
        "s": draw(
            st.lists(st.one_of(st.none(), st.sampled_from(STR_VALUES)), min_size=n, max_size=n)
        ),
        "b": draw(st.lists(st.one_of(st.none(), st.booleans()), min_size=n, max_size=n)),
        "ts": draw(st.lists(ints, min_size=n, max_size=n)),
    }
    table = pa.table(
        {name: pa.array(cols[name], PROP_SCHEMA.field(name).type) for name in PROP_SCHEMA.names}
    )
    cut = draw(st.integers(0, n))  # two chunks, to exercise ChunkedArray paths
    return pa.concat_tables([table.slice(0, cut), table.slice(cut)])


num_literals = st.one_of(
    st.integers(-6, 6).map(str),
    st.sampled_from(["0.5", "1.", ".5", "2E0", "25E-1", "-1.5", "3.0"]),
)


def num_exprs():
    leaf = st.one_of(st.sampled_from(NUM_IDENTS), num_literals)
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from("+-*/"), inner).map(
                lambda t: f"({t[0]} {t[1]} {t[2]})"
            ),
            inner.map(lambda e: f"-{e}"),
        ),
        max_leaves=4,
    )


str_exprs = st.one_of(
    st.sampled_from(["s", "missing"]),
    st.sampled_from(STR_VALUES).map(lambda v: "'" + v.replace("'", "''") + "'"),
)
str_literal = st.sampled_from(STR_VALUES).map(lambda v: "'" + v + "'")
like_patterns = st.lists(
    st.sampled_from(["a", "b", "%", "_", "!", "!%", "!_", "!!", "%%", "__", "é"]), max_size=4
).map("".join)
CMP = ["=", "<>", "<", "<=", ">", ">="]


def conditions():
    leaf = st.one_of(
        st.tuples(num_exprs(), st.sampled_from(CMP), num_exprs()).map(" ".join),
        st.tuples(str_exprs, st.sampled_from(CMP), str_exprs).map(" ".join),
        st.tuples(str_exprs, st.sampled_from(["=", "<>"]), num_exprs()).map(" ".join),
        st.sampled_from(["b", "b = TRUE", "b <> FALSE", "TRUE", "FALSE", "missing"]),
        st.tuples(
            num_exprs(), st.sampled_from(["BETWEEN", "NOT BETWEEN"]), num_exprs(), num_exprs()
        ).map(lambda t: f"{t[0]} {t[1]} {t[2]} AND {t[3]}"),
        st.tuples(
            st.sampled_from(["s", "missing"]),
            st.sampled_from(["IN", "NOT IN"]),
            st.lists(str_literal, min_size=1, max_size=3),
        ).map(lambda t: f"{t[0]} {t[1]} ({', '.join(t[2])})"),
        st.tuples(
            st.sampled_from(["i", "f", "j"]),
            st.sampled_from(["IN", "NOT IN"]),
            st.lists(num_literals, min_size=1, max_size=3),
        ).map(lambda t: f"{t[0]} {t[1]} ({', '.join(t[2])})"),
        st.tuples(
            st.sampled_from(["s", "i"]),
            st.sampled_from(["LIKE", "NOT LIKE"]),
            like_patterns,
            st.sampled_from(["!", "%", "_"]),
        ).map(lambda t: f"{t[0]} {t[1]} '{t[2]}' ESCAPE '{t[3]}'"),
        st.tuples(
            st.sampled_from(["s", "i", "f", "b", "missing", "(i / j)"]),
            st.sampled_from(["IS NULL", "IS NOT NULL"]),
        ).map(" ".join),
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            inner.map(lambda c: f"NOT ({c})"),
            st.tuples(inner, st.sampled_from(["AND", "OR"]), inner).map(
                lambda t: f"({t[0]}) {t[1]} ({t[2]})"
            ),
        ),
        max_leaves=5,
    )


PROP_SETTINGS = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROP_SETTINGS
@given(tables(), conditions())
def test_vectorized_equals_reference(table, text):
    sel = Selector(text)
    expected = reference_mask(text, table)
    assert sel.mask(table).to_pylist() == expected
    batch = table.combine_chunks().to_batches()
    if batch:
        assert sel.mask(batch[0]).to_pylist() == expected
    assert table.filter(sel.expression(table.schema)).num_rows == sum(expected)


@PROP_SETTINGS
@given(tables(), conditions(), st.integers(1, 4))
def test_may_match_is_sound(table, text, page_rows):
    """Whenever may_match says a page cannot match, no row of it is selected."""
    sel, with_schema = Selector(text), Selector(text, PROP_SCHEMA)
    pages = [table.slice(k, page_rows) for k in range(0, table.num_rows, page_rows)]
    page_stats = []
    for k, page in enumerate(pages):
        stats = merge_stats([batch_stats(page), system_stats(k * 10, k * 10 + page.num_rows, 1)])
        stats = json.loads(json.dumps(stats))
        page_stats.append(stats)
        selected = any(sel.mask(page).to_pylist())
        if selected:
            assert sel.may_match(stats), (text, page.to_pylist(), stats)
            assert with_schema.may_match(stats), (text, page.to_pylist(), stats)
    if page_stats and any(sel.mask(table).to_pylist()):
        assert sel.may_match(merge_stats(page_stats))
