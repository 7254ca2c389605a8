"""The :class:`Selector`: a selector parsed once, compiled per schema, judged against statistics.

The public :mod:`pyspark_durable_queue.selector` re-exports it and documents the language; the
engine (schema conformance, scanning, planning) imports it from here, below itself, so that no
engine module imports a public module.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from .._bounded import BoundedLRU
from .arrow import Compiler, evaluate, to_expression
from .parse import collect_identifiers, parse
from .stats import StatsInterpreter

__all__ = ["Selector"]


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
        self.identifiers: frozenset[str] = frozenset(collect_identifiers(self._ast, set()))
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
        return self._compiled.get_or_load(schema, lambda: Compiler(schema).condition(self._ast))

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
        return pc.Expression._call("coalesce", [to_expression(self._ir(schema)), pc.scalar(False)])

    def mask(self, data: pa.Table | pa.RecordBatch) -> pa.BooleanArray | pa.ChunkedArray:
        """Evaluate the selector on every row, vectorized.

        Returns
        -------
        pyarrow.BooleanArray or pyarrow.ChunkedArray
            True where the selector is TRUE; false for FALSE and UNKNOWN. No nulls. A chunked
            array for a table, an array for a record batch.
        """
        out = evaluate(self._ir(data.schema), data, {})
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
            Page statistics, as built by :mod:`pyspark_durable_queue._format.stats` (user columns
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
        return True in StatsInterpreter(stats, self.schema).truth(self._ast)
