"""Parsing of Jakarta Messaging selectors: tokens, AST and static checks.

Private to the package: :mod:`pyspark_durable_queue.selector` documents the language and its
semantics and re-exports the AST classes. This module turns selector text into an AST of frozen
dataclasses (:class:`Lit`, :class:`Ident`, :class:`Unary`, :class:`Binary`, :class:`Between`,
:class:`In`, :class:`Like`, :class:`IsNull`) and rejects what is not a conditional expression with a
:class:`~pyspark_durable_queue.errors.SelectorSyntaxError` pointing at the offending token.

It also holds the AST helpers that both back ends need (identifier collection, the rewrite of
BETWEEN into comparisons, LIKE patterns as regexes), so that the Arrow compiler
(:mod:`.arrow`) and the statistics reasoning (:mod:`.stats`) read one
definition of the language rather than two that could drift apart.

It needs neither pyarrow nor pyspark: what a selector means does not depend on how its rows are
stored, and a bad selector is rejected before any data is touched.

Surface (``__all__``): :func:`parse`, the AST classes, and for :mod:`.arrow`, :mod:`.stats`
and :mod:`.compiled`: :func:`collect_identifiers`, :func:`between_as_logic`, :func:`like_regex`,
:func:`like_body`, the LIKE wildcards (:class:`Wildcard`, :data:`ONE_CHAR`, :data:`ANY_CHARS`),
the operator sets :data:`ARITHMETIC` and :data:`COMPARISONS`, and the int64 bounds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pyspark_durable_queue.errors import SelectorSyntaxError

__all__ = [
    "ANY_CHARS",
    "ARITHMETIC",
    "COMPARISONS",
    "INT64_MAX",
    "INT64_MIN",
    "ONE_CHAR",
    "Between",
    "Binary",
    "Ident",
    "In",
    "IsNull",
    "Like",
    "Lit",
    "Unary",
    "Wildcard",
    "between_as_logic",
    "collect_identifiers",
    "like_body",
    "like_regex",
    "parse",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# --------------------------------------------------------------------------------------------
# AST


@dataclass(frozen=True)
class Lit:
    """A literal: ``int`` (exact), ``float`` (approximate), ``str`` or ``bool``."""

    value: Any
    pos: int


@dataclass(frozen=True)
class Ident:
    name: str
    pos: int


@dataclass(frozen=True)
class Unary:
    op: str  # "-", "+" or "NOT"
    operand: Any
    pos: int


@dataclass(frozen=True)
class Binary:
    op: str  # "+ - * /", "= <> < <= > >=", "AND", "OR"
    left: Any
    right: Any
    pos: int


@dataclass(frozen=True)
class Between:
    expr: Any
    low: Any
    high: Any
    negated: bool
    pos: int


@dataclass(frozen=True)
class In:
    expr: Ident
    values: tuple
    negated: bool
    pos: int


@dataclass(frozen=True)
class Like:
    expr: Ident
    pattern: str
    escape: str | None
    negated: bool
    pos: int
    # Parsed pattern: tuple of str (literal run), "_" marker ONE_CHAR or "%" marker ANY_CHARS.
    parts: tuple = ()


@dataclass(frozen=True)
class IsNull:
    expr: Any
    negated: bool
    pos: int


ARITHMETIC = frozenset("+-*/")
COMPARISONS = frozenset({"=", "<>", "<", "<=", ">", ">="})
_KEYWORDS = frozenset(
    {"NOT", "AND", "OR", "BETWEEN", "IN", "LIKE", "ESCAPE", "IS", "NULL", "TRUE", "FALSE"}
)


class Wildcard(str):
    """A LIKE wildcard, distinguishable from a literal run of the same text."""


ONE_CHAR = Wildcard("_")
ANY_CHARS = Wildcard("%")

# --------------------------------------------------------------------------------------------
# Lexer

_TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<num>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)
  | (?P<str>'(?:[^']|'')*')
  | (?P<qid>"(?:[^"]|"")*")
  | (?P<id>(?:[^\W\d]|\$)(?:\w|\$)*)
  | (?P<op><>|<=|>=|[=<>+\-*/(),])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Tok:
    kind: str  # "num", "str", "id", "kw", "op", "eof"
    value: Any
    pos: int
    text: str


def _tokenize(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            ch = text[pos]
            if ch == "'":
                raise SelectorSyntaxError("unterminated string literal", text, pos)
            if ch == '"':
                raise SelectorSyntaxError("unterminated quoted identifier", text, pos)
            hint = " (use <> for 'not equal')" if text.startswith("!=", pos) else ""
            raise SelectorSyntaxError(f"unexpected character {ch!r}{hint}", text, pos)
        kind = m.lastgroup
        raw = m.group()
        if kind == "num":
            end = m.end()
            if end < len(text) and (text[end].isalnum() or text[end] in "_$."):
                raise SelectorSyntaxError(f"malformed number {raw + text[end]!r}", text, pos)
            is_exact = not any(c in raw for c in ".eE")
            if is_exact:
                toks.append(_Tok("num", int(raw), pos, raw))
            else:
                try:
                    value = float(raw)
                except OverflowError:  # pragma: no cover - float() returns inf instead
                    value = math.inf
                if math.isinf(value):
                    raise SelectorSyntaxError(f"number {raw} is out of range", text, pos)
                toks.append(_Tok("num", value, pos, raw))
        elif kind == "str":
            toks.append(_Tok("str", raw[1:-1].replace("''", "'"), pos, raw))
        elif kind == "qid":
            toks.append(_Tok("id", raw[1:-1].replace('""', '"'), pos, raw))
        elif kind == "id":
            upper = raw.upper()
            if upper in _KEYWORDS:
                toks.append(_Tok("kw", upper, pos, raw))
            else:
                toks.append(_Tok("id", raw, pos, raw))
        elif kind == "op":
            toks.append(_Tok("op", raw, pos, raw))
        pos = m.end()
    toks.append(_Tok("eof", None, len(text), "end of selector"))
    return toks


# --------------------------------------------------------------------------------------------
# Parser: recursive descent over the JMS grammar, then a static kind check that rejects what the
# grammar's conditional/arithmetic split rejects (``3+5``, ``NOT 'a'``, ``'a' * 2``).


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    # -- helpers
    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def _advance(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def _is(self, kind: str, value: Any = None) -> bool:
        tok = self.tok
        return tok.kind == kind and (value is None or tok.value == value)

    def _error(self, message: str, tok: _Tok | None = None) -> SelectorSyntaxError:
        tok = tok or self.tok
        return SelectorSyntaxError(message, self.text, tok.pos)

    def _expect(self, kind: str, value: Any, what: str) -> _Tok:
        if not self._is(kind, value):
            raise self._error(f"expected {what}, found {self._describe(self.tok)}")
        return self._advance()

    @staticmethod
    def _describe(tok: _Tok) -> str:
        return "end of selector" if tok.kind == "eof" else repr(tok.text)

    # -- grammar
    def parse(self) -> Any:
        if self._is("eof"):
            raise self._error("empty selector")
        node = self._or()
        if not self._is("eof"):
            found = self._describe(self.tok)
            raise self._error(f"unexpected {found}; expected AND, OR or end of selector")
        return node

    def _or(self) -> Any:
        node = self._and()
        while self._is("kw", "OR"):
            tok = self._advance()
            node = Binary("OR", node, self._and(), tok.pos)
        return node

    def _and(self) -> Any:
        node = self._not()
        while self._is("kw", "AND"):
            tok = self._advance()
            node = Binary("AND", node, self._not(), tok.pos)
        return node

    def _not(self) -> Any:
        if self._is("kw", "NOT"):
            tok = self._advance()
            return Unary("NOT", self._not(), tok.pos)
        return self._predicate()

    def _predicate(self) -> Any:
        left = self._arith()
        tok = self.tok
        if tok.kind == "op" and tok.value in COMPARISONS:
            self._advance()
            return Binary(tok.value, left, self._arith(), tok.pos)
        if tok.kind != "kw":
            return left
        if tok.value == "IS":
            self._advance()
            negated = self._is("kw", "NOT")
            if negated:
                self._advance()
            self._expect("kw", "NULL", "NULL after IS [NOT]")
            return IsNull(left, negated, tok.pos)
        negated = False
        if tok.value == "NOT" and self.toks[self.i + 1].kind == "kw":
            if self.toks[self.i + 1].value in ("BETWEEN", "IN", "LIKE"):
                self._advance()
                negated = True
        op = self.tok
        if op.kind == "kw" and op.value == "BETWEEN":
            self._advance()
            low = self._arith()
            self._expect("kw", "AND", "AND in BETWEEN ... AND ...")
            return Between(left, low, self._arith(), negated, tok.pos)
        if op.kind == "kw" and op.value == "IN":
            return self._in(left, negated, tok)
        if op.kind == "kw" and op.value == "LIKE":
            return self._like(left, negated, tok)
        if negated:  # pragma: no cover - guarded by the lookahead above
            raise self._error("expected BETWEEN, IN or LIKE after NOT")
        return left

    def _in(self, left: Any, negated: bool, start: _Tok) -> In:
        if not isinstance(left, Ident):
            raise SelectorSyntaxError("IN needs an identifier on its left", self.text, start.pos)
        self._advance()
        self._expect("op", "(", "'(' after IN")
        values: list[Any] = []
        while True:
            sign = 1
            if self._is("op", "-") or self._is("op", "+"):
                sign = -1 if self._advance().value == "-" else 1
                if not self._is("num"):
                    raise self._error("expected a number after the sign in the IN list")
            tok = self.tok
            if tok.kind == "str" and sign == 1:
                values.append(self._advance().value)
            elif tok.kind == "num":
                values.append(self._check_int(sign * self._advance().value, tok))
            else:
                raise self._error(f"expected a literal in IN list, found {self._describe(tok)}")
            if self._is("op", ","):
                self._advance()
                continue
            self._expect("op", ")", "',' or ')' in IN list")
            break
        kinds = {isinstance(v, str) for v in values}
        if len(kinds) > 1:
            raise SelectorSyntaxError("IN list mixes strings and numbers", self.text, start.pos)
        return In(left, tuple(values), negated, start.pos)

    def _like(self, left: Any, negated: bool, start: _Tok) -> Like:
        if not isinstance(left, Ident):
            raise SelectorSyntaxError("LIKE needs an identifier on its left", self.text, start.pos)
        self._advance()
        pat_tok = self.tok
        if pat_tok.kind != "str":
            raise self._error(
                f"expected a string pattern after LIKE, found {self._describe(pat_tok)}"
            )
        self._advance()
        escape = None
        if self._is("kw", "ESCAPE"):
            self._advance()
            esc_tok = self.tok
            if esc_tok.kind != "str" or len(esc_tok.value) != 1:
                raise self._error("ESCAPE needs a string literal of exactly one character")
            escape = self._advance().value
        parts = _parse_like(pat_tok.value, escape)
        return Like(left, pat_tok.value, escape, negated, start.pos, parts)

    def _arith(self) -> Any:
        node = self._term()
        while self.tok.kind == "op" and self.tok.value in ("+", "-"):
            tok = self._advance()
            node = Binary(tok.value, node, self._term(), tok.pos)
        return node

    def _term(self) -> Any:
        node = self._unary()
        while self.tok.kind == "op" and self.tok.value in ("*", "/"):
            tok = self._advance()
            node = Binary(tok.value, node, self._unary(), tok.pos)
        return node

    def _unary(self) -> Any:
        if self.tok.kind == "op" and self.tok.value in ("+", "-"):
            tok = self._advance()
            if tok.value == "-" and self._is("num", INT64_MAX + 1):
                # The one literal that is only valid negated (Long.MIN_VALUE), as in Java.
                self._advance()
                return Lit(INT64_MIN, tok.pos)
            operand = self._unary()
            if isinstance(operand, Lit) and type(operand.value) in (int, float):
                # Fold so that ``-9223372036854775808`` is a valid long and ``x > -5`` compares
                # against a plain literal.
                value = -operand.value if tok.value == "-" else operand.value
                return Lit(self._check_int(value, tok), tok.pos)
            return Unary(tok.value, operand, tok.pos)
        return self._primary()

    def _check_int(self, value: Any, tok: _Tok) -> Any:
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            raise SelectorSyntaxError(
                f"exact numeric literal {value} is out of the range of a long", self.text, tok.pos
            )
        return value

    def _primary(self) -> Any:
        tok = self.tok
        if tok.kind == "num":
            self._advance()
            return Lit(self._check_int(tok.value, tok), tok.pos)
        if tok.kind == "str":
            self._advance()
            return Lit(tok.value, tok.pos)
        if tok.kind == "id":
            self._advance()
            return Ident(tok.value, tok.pos)
        if tok.kind == "kw" and tok.value in ("TRUE", "FALSE"):
            self._advance()
            return Lit(tok.value == "TRUE", tok.pos)
        if tok.kind == "op" and tok.value == "(":
            self._advance()
            node = self._or()
            self._expect("op", ")", "')'")
            return node
        if tok.kind == "kw" and tok.value == "NULL":
            raise self._error("NULL is only allowed in IS [NOT] NULL")
        raise self._error(f"expected an identifier, a literal or '(', found {self._describe(tok)}")


def _parse_like(pattern: str, escape: str | None) -> tuple:
    """Split a LIKE pattern into literal runs and the wildcard markers ``ONE_CHAR`` / ``ANY_CHARS``.

    The escape character escapes only when the next character is ``_``, ``%`` or the escape
    character itself; anywhere else, the end of the pattern included, it is an ordinary pattern
    character (so an escape of ``%`` or ``_`` keeps its wildcard meaning there). This is what
    ActiveMQ and Artemis do, and it makes every pattern valid.
    """
    parts: list[Any] = []
    buf: list[str] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == escape and i + 1 < len(pattern) and pattern[i + 1] in ("_", "%", escape):
            buf.append(pattern[i + 1])
            i += 2
            continue
        if ch in "_%":
            if buf:
                parts.append("".join(buf))
                buf = []
            wild = ONE_CHAR if ch == "_" else ANY_CHARS
            if not (wild is ANY_CHARS and parts and parts[-1] is ANY_CHARS):  # '%%' == '%'
                parts.append(wild)
        else:
            buf.append(ch)
        i += 1
    if buf:
        parts.append("".join(buf))
    return tuple(parts)


# Static kinds: "bool", "num", "str" or "any" (an identifier, known only once a schema is).
def _start(node: Any) -> int:
    """Position of the first character of ``node``, where a caret reads best."""
    if isinstance(node, Binary):
        return min(node.pos, _start(node.left))
    if isinstance(node, (Between, In, Like, IsNull)):
        return min(node.pos, _start(node.expr))
    return node.pos


def _static_kind(node: Any, text: str) -> str:
    def fail(message: str, at: Any) -> SelectorSyntaxError:
        return SelectorSyntaxError(message, text, _start(at))

    if isinstance(node, Lit):
        v = node.value
        return "bool" if isinstance(v, bool) else "str" if isinstance(v, str) else "num"
    if isinstance(node, Ident):
        return "any"
    if isinstance(node, Unary):
        kind = _static_kind(node.operand, text)
        if node.op == "NOT":
            if kind not in ("bool", "any"):
                raise fail(f"NOT needs a condition, not a {_KIND_NAMES[kind]}", node)
            return "bool"
        if kind not in ("num", "any"):
            raise fail(f"unary {node.op} needs a number, not a {_KIND_NAMES[kind]}", node)
        return "num"
    if isinstance(node, Binary):
        lk, rk = _static_kind(node.left, text), _static_kind(node.right, text)
        if node.op in ("AND", "OR"):
            for k, side in ((lk, node.left), (rk, node.right)):
                if k not in ("bool", "any"):
                    raise fail(f"{node.op} needs conditions, not a {_KIND_NAMES[k]}", side)
            return "bool"
        if node.op in ARITHMETIC:
            for k, side in ((lk, node.left), (rk, node.right)):
                if k not in ("num", "any"):
                    raise fail(f"'{node.op}' needs numbers, not a {_KIND_NAMES[k]}", side)
            return "num"
        return "bool"  # comparison: mismatched kinds are UNKNOWN at run time, not errors
    if isinstance(node, Between):
        for part in (node.expr, node.low, node.high):
            _static_kind(part, text)
        return "bool"
    if isinstance(node, IsNull):
        _static_kind(node.expr, text)
        return "bool"
    return "bool"  # In, Like


_KIND_NAMES = {"bool": "condition", "num": "number", "str": "string", "any": "value"}


def parse(text: str) -> Any:
    """Parse a selector into its AST.

    Parameters
    ----------
    text : str
        The selector.

    Returns
    -------
    object
        The root node (the AST dataclasses of this module, also importable from
        :mod:`pyspark_durable_queue.selector`).

    Raises
    ------
    SelectorSyntaxError
        If ``text`` is not a conditional expression of the JMS selector grammar.
    """
    if not isinstance(text, str):
        raise TypeError(f"selector must be a str, not {type(text).__name__}")
    root = _Parser(text).parse()
    kind = _static_kind(root, text)
    if kind not in ("bool", "any"):
        raise SelectorSyntaxError(
            f"a selector must be a condition, but this is a {_KIND_NAMES[kind]} expression",
            text,
            _start(root),
        )
    return root


def collect_identifiers(node: Any, out: set[str]) -> set[str]:
    """Add the identifiers ``node`` names to ``out`` and return it."""
    if isinstance(node, Ident):
        out.add(node.name)
    elif isinstance(node, Unary):
        collect_identifiers(node.operand, out)
    elif isinstance(node, Binary):
        collect_identifiers(node.left, out)
        collect_identifiers(node.right, out)
    elif isinstance(node, Between):
        for part in (node.expr, node.low, node.high):
            collect_identifiers(part, out)
    elif isinstance(node, (In, Like, IsNull)):
        collect_identifiers(node.expr, out)
    return out


def between_as_logic(node: Between) -> Binary:
    """The specification's definition of (NOT) BETWEEN in terms of comparisons."""
    if node.negated:
        return Binary(
            "OR",
            Binary("<", node.expr, node.low, node.pos),
            Binary(">", node.expr, node.high, node.pos),
            node.pos,
        )
    return Binary(
        "AND",
        Binary(">=", node.expr, node.low, node.pos),
        Binary("<=", node.expr, node.high, node.pos),
        node.pos,
    )


def like_regex(parts: tuple) -> str:
    """Anchored RE2 regex for a parsed LIKE pattern (RE2's ``$`` is end of text only)."""
    return "(?s)^" + like_body(parts) + "$"


def like_body(parts: tuple) -> str:
    """Unanchored regex for a parsed LIKE pattern, valid for both RE2 and Python ``re``."""
    out = []
    for part in parts:
        if part is ONE_CHAR:
            out.append(".")
        elif part is ANY_CHARS:
            out.append(".*")
        else:
            # Own escaping: re.escape also escapes characters (space, '#') that RE2 rejects.
            out.append(re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", part))
    return "".join(out)
