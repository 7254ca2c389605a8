"""Jakarta Messaging message selectors, evaluated column-wise on Arrow data.

A selector (JMS 2.0 section 3.8) such as ``color = 'red' AND amount > 100`` is parsed once into
a small AST, then

- compiled per schema into Arrow compute calls: a :class:`pyarrow.compute.Expression` for
  dataset scans and :meth:`pyarrow.Table.filter`, and the same calls run eagerly on a batch by
  :meth:`Selector.mask` (no ``eval``, no Python per row);
- interpreted abstractly over page statistics (see :mod:`pyspark_durable_queue._stats`) by
  :meth:`Selector.may_match`, which lets a consumer skip pages that cannot match instead of
  reading them. This is what avoids the stall Artemis documents for a restrictive selector
  behind a long run of non-matching messages.

Semantics
---------
Three-valued logic as in SQL-92: comparisons involving NULL are UNKNOWN, ``AND``/``OR``/``NOT``
follow Kleene's tables, and a row is selected only when the selector is TRUE.

- An identifier names a top-level column (``_seq`` and ``_timestamp`` included); identifiers are
  case-sensitive, keywords are not. An identifier that is not a column is NULL, as an absent
  message property is in JMS (:meth:`Selector.unknown_identifiers` lists them for a warning).
- Column values: integers (any width) are exact numerics, floats and decimals are approximate
  numerics (``float64``), timestamps are epoch milliseconds and dates epoch days (both exact),
  strings and booleans are themselves. Other types (binary, nested, time...) can only be tested
  with ``IS [NOT] NULL``; any other use is UNKNOWN.
- Comparing values of different kinds (string with number, boolean with string...) is UNKNOWN,
  not an error. Exact and approximate numerics compare as ``float64``.
- Strings and booleans support only ``=`` and ``<>``, as JMS requires; ``<``, ``>`` etc. on them
  are UNKNOWN (so never selected), which matches Artemis rather than inventing an ordering.
- Arithmetic: exact op exact is exact ``int64`` (wrapping on overflow, as Java ``long``;
  ``/`` truncates toward zero); any approximate operand makes it ``float64``. Division by zero
  is NULL rather than an error or an infinity. Arithmetic on non-numbers is NULL.
- ``x [NOT] BETWEEN a AND b`` means ``x >= a AND x <= b`` (``x < a OR x > b``), as the
  specification defines it; NaN is therefore in neither.
- ``x [NOT] IN (...)`` takes string literals as in JMS or, as an extension, numeric literals (not
  both). NULL ``x`` gives UNKNOWN.
- ``LIKE``: ``_`` is one character, ``%`` any sequence. With ``ESCAPE 'c'``, ``c`` followed by
  ``_``, ``%`` or ``c`` stands for that character literally; anywhere else (the end of the
  pattern included) ``c`` is an ordinary pattern character, a wildcard if it is ``_`` or ``%``.
  So ``'_D__' ESCAPE '_'`` matches ``xD_`` and ``'a!b!' ESCAPE '!'`` matches ``a!b!``, as in
  ActiveMQ and Artemis.
- An identifier on its own is a condition only when it is a boolean column; otherwise UNKNOWN.

Not supported (syntax errors): hexadecimal/octal literals and ``L``/``F``/``D`` suffixes, which
are Artemis extensions rather than JMS.

Implementation
--------------
This module holds only the public :class:`Selector` and :func:`parse`. The work is split along
the three stages above so each can be read and tested alone: :mod:`._selector_parse` (tokens,
AST, syntax errors), :mod:`._selector_arrow` (AST to Arrow compute calls) and
:mod:`._selector_stats` (``may_match`` over page statistics). None of them imports pyspark.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from pyspark_durable_queue._bounded import BoundedLRU
from pyspark_durable_queue._selector_arrow import _Compiler, _evaluate, _to_expression

# The AST node classes stay importable from here, where they lived before the split, for callers
# that inspect what parse() returns (the tests' reference interpreter). The redundant aliases
# mark them as deliberate re-exports; they remain outside __all__ as before.
from pyspark_durable_queue._selector_parse import Between as Between
from pyspark_durable_queue._selector_parse import Binary as Binary
from pyspark_durable_queue._selector_parse import Ident as Ident
from pyspark_durable_queue._selector_parse import In as In
from pyspark_durable_queue._selector_parse import IsNull as IsNull
from pyspark_durable_queue._selector_parse import Like as Like
from pyspark_durable_queue._selector_parse import Lit as Lit
from pyspark_durable_queue._selector_parse import Unary as Unary
from pyspark_durable_queue._selector_parse import _identifiers, parse
from pyspark_durable_queue._selector_stats import _StatsInterpreter

__all__ = ["Selector", "parse"]


# --------------------------------------------------------------------------------------------
# Public API


class Selector:
    """A compiled Jakarta Messaging message selector.

    Parsing happens in the constructor, so a bad selector fails where it is given (the driver),
    not later on an executor. Compilation to Arrow is per schema and cached (the last
    ``_CACHE_SIZE`` schemas per instance).

    Picklable and small: only the text and the optional schema cross process boundaries; the
    AST and compiled forms are rebuilt lazily after unpickling.

    Parameters
    ----------
    text : str
        The selector, e.g. ``"color = 'red' AND amount > 100"``.
    schema : pyarrow.Schema, optional
        The address schema including system columns. When given, :meth:`may_match` knows which
        identifiers are not columns (always NULL) and the exact kind of each column.

    Raises
    ------
    SelectorSyntaxError
        If ``text`` is not a valid selector; the message points at the offending token.
    """

    _CACHE_SIZE = 8

    def __init__(self, text: str, schema: pa.Schema | None = None) -> None:
        self.text = text
        self.schema = schema
        self._ast = parse(text)
        self.identifiers: frozenset[str] = frozenset(_identifiers(self._ast, set()))
        self._compiled: BoundedLRU[pa.Schema, tuple] = BoundedLRU(
            "compiled selector forms", self._CACHE_SIZE, listed=False)

    # -- pickling: text and schema only
    def __getstate__(self) -> dict:
        return {"text": self.text, "schema": self.schema}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["text"], state["schema"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Selector({self.text!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Selector):
            return NotImplemented
        return self.text == other.text and self.schema == other.schema

    def __hash__(self) -> int:
        return hash(self.text)

    # -- compilation
    def _ir(self, schema: pa.Schema) -> tuple:
        return self._compiled.get_or_load(schema, lambda: _Compiler(schema).condition(self._ast))

    def unknown_identifiers(self, schema: pa.Schema) -> set[str]:
        """Identifiers of the selector that are not columns of ``schema`` (they are NULL).

        Called by the consumer on the driver when it opens, to log a warning naming them.
        """
        return {name for name in self.identifiers if schema.get_field_index(name) < 0}

    def expression(self, schema: pa.Schema) -> pc.Expression:
        """The selector as a boolean Arrow expression over ``schema``.

        UNKNOWN is folded to false, so the expression can be negated or combined safely; use
        it with :meth:`pyarrow.Table.filter` or a dataset scanner.
        """
        return pc.Expression._call("coalesce", [_to_expression(self._ir(schema)), pc.scalar(False)])

    def mask(self, data: pa.Table | pa.RecordBatch) -> pa.BooleanArray | pa.ChunkedArray:
        """Evaluate the selector on every row, vectorized.

        Returns
        -------
        pyarrow.BooleanArray or pyarrow.ChunkedArray
            True where the selector is TRUE; false for FALSE and UNKNOWN. No nulls. A chunked
            array for a table, an array for a record batch.
        """
        out = _evaluate(self._ir(data.schema), data, {})
        n = data.num_rows
        if isinstance(out, pa.Scalar):  # the selector does not depend on any column
            value = bool(out.is_valid and out.as_py())
            arr = pa.repeat(pa.scalar(value), n)
            return pa.chunked_array([arr], pa.bool_()) if isinstance(data, pa.Table) else arr
        if out.null_count:
            out = pc.fill_null(out, False)
        if isinstance(data, pa.Table) and isinstance(out, pa.Array):
            out = pa.chunked_array([out])
        return out

    def filter(self, data: pa.Table | pa.RecordBatch) -> pa.Table | pa.RecordBatch:
        """The rows of ``data`` the selector selects, in their order, as the same type."""
        return data.filter(self.mask(data))

    def may_match(self, stats: dict) -> bool:
        """Whether some row described by ``stats`` may satisfy the selector.

        Called by the consumer (driver or executor) for each page before reading it.

        Parameters
        ----------
        stats : dict
            Page statistics, as built by :mod:`pyspark_durable_queue._stats` (user columns
            merged with the system ones).

        Returns
        -------
        bool
            False only when the statistics prove no row can be selected; True when unsure.
            A column absent from ``stats`` is unknown, unless the selector was given a schema
            that lacks it (then it is NULL, like every unknown identifier).
        """
        if int(stats.get("rows", 1)) == 0:
            return False
        return True in _StatsInterpreter(stats, self.schema).truth(self._ast)
