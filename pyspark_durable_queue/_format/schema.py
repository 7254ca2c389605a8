"""Messages and the address schema: what users send becomes Arrow, checked against the schema.

An address has one Arrow schema, fixed by its first write. Data that does not fit fails with
:class:`SchemaMismatchError` naming the columns; values are cast only safely and within a kind
(an int column takes ``5`` but refuses ``7.5`` and ``"7"``); ``merge`` adds new columns as
nullable. Used by ``Address.send`` (the client) and by the Spark sink (its tasks conform Spark's
batches; its driver checks pages at commit).
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa

from .._bounded import BoundedLRU
from ..errors import InvalidMessageError, SchemaMismatchError
from .ipc import KINDS, BatchEncoder

if TYPE_CHECKING:
    from .._selector import Selector

__all__ = ["ARROW_ERRORS", "DELIVERY_COUNT", "DELIVERY_COUNT_FIELD", "RESERVED_COLUMNS", "SEQ",
           "SYSTEM_FIELDS", "TIMESTAMP", "TTL", "TTL_FIELD",
           "TIMESTAMP_TYPE", "arrow_table",
           "as_rows", "check_page_schema", "compile_selector", "conform_schema",
           "nullable", "rows_to_table", "ttl_alive", "typed_stream", "typed_table", "unexpired",
           "user_fields", "with_system_schema", "with_ttl"]

#: The system columns' names: a message's place in the address, and its commit time (which
#: a compacted page's frames also store, as a column of this name).
SEQ = "_seq"
TIMESTAMP = "_timestamp"
TIMESTAMP_TYPE = pa.timestamp("us", tz="UTC")
#: The system columns every read returns after the address's own: the one definition.
SYSTEM_FIELDS = (pa.field(SEQ, pa.int64(), nullable=False),
                 pa.field(TIMESTAMP, TIMESTAMP_TYPE, nullable=False))
#: How many times a consumer delivered a message, 1 the first time (JMSXDeliveryCount): a
#: column of the Python consumer's reads only (``receive``, ``messages``), never stored and
#: never in Spark's schema.
DELIVERY_COUNT = "_delivery_count"
DELIVERY_COUNT_FIELD = pa.field(DELIVERY_COUNT, pa.int32(), nullable=False)
#: A message's time to live in milliseconds (``send(rows, ttl_ms=N)``): a hidden column stored
#: only in the frames of sends that had one (null for the other rows of a frame that mixes
#: them), never returned to readers; the message expires at ``_timestamp + N``.
TTL = "_ttl_ms"
TTL_FIELD = pa.field(TTL, pa.int64())
#: Column names users may not send (the system columns', the delivery count, the TTL).
RESERVED_COLUMNS = frozenset([*(f.name for f in SYSTEM_FIELDS), DELIVERY_COUNT, TTL])


def with_system_schema(schema: pa.Schema | None) -> pa.Schema:
    """The schema readers return: user columns, then ``_seq`` and ``_timestamp``."""
    fields = list(schema) if schema is not None else []
    return pa.schema([*fields, *SYSTEM_FIELDS])


_Rows = TypeVar("_Rows", pa.Table, pa.RecordBatch)


def unexpired(data: _Rows, expire_before: int | None) -> _Rows:
    """``data`` without the messages that expired: those whose ``_timestamp`` is before
    ``expire_before`` (epoch microseconds; ``None``: nothing expires). ``data`` itself when
    none did (no copy)."""
    if expire_before is None or data.num_rows == 0:
        return data
    import pyarrow.compute as pc

    keep = pc.greater_equal(data.column(TIMESTAMP), pa.scalar(expire_before, TIMESTAMP_TYPE))
    if pc.all(keep).as_py():
        return data
    return data.filter(keep)


def with_ttl(table: pa.Table, ttl_ms: int | None) -> pa.Table:
    """``table`` (conformed to the address schema) with the hidden :data:`TTL` column that a
    send's frames store: ``ttl_ms`` for every row, or nulls (``None``: a send without one
    that shares a frame with one that has it)."""
    n = table.num_rows
    values = pa.nulls(n, pa.int64()) if ttl_ms is None else \
        pa.array(np.full(n, ttl_ms, dtype=np.int64))
    return table.append_column(TTL_FIELD, values)


def ttl_alive(data: _Rows, ttl: pa.Array, ts_us: int | pa.Array, now_us: int) -> _Rows:
    """``data`` without the rows of a stored frame that expired by ``now_us`` (epoch
    microseconds) by their :data:`TTL` (``ttl``: milliseconds, null for none, one per row of
    ``data``) and commit time ``ts_us`` (one for the frame, or one per row as a compacted
    frame stores it): a row expires at ``_timestamp + ttl``, as a message past
    ``expiry_delay_ms`` does at ``_timestamp + delay``. ``data`` itself when none did: the
    frame's shortest TTL from its earliest time tells, without a mask, in the usual case."""
    import pyarrow.compute as pc

    shortest = pc.min(ttl).as_py()
    if shortest is None:
        return data
    first = ts_us if isinstance(ts_us, int) else pc.min(ts_us.cast(pa.int64())).as_py()
    if first + shortest * 1000 >= now_us:
        return data
    times = pa.scalar(ts_us, pa.int64()) if isinstance(ts_us, int) else ts_us.cast(pa.int64())
    deadline = pc.add(times, pc.multiply(ttl, 1000))
    return data.filter(pc.fill_null(pc.greater_equal(deadline, now_us), True))


def ttl_horizon(ttl: pa.Array, ts_us: int | pa.Array, now_us: int) -> int | None:
    """The earliest deadline (epoch microseconds) at or after ``now_us`` among rows with a
    :data:`TTL` (the arguments as for :func:`ttl_alive`): until then, rows that
    :func:`ttl_alive` kept stay alive. ``None``: no row has a TTL that has not ended."""
    import pyarrow.compute as pc

    if ttl.null_count == len(ttl):
        return None
    times = pa.scalar(ts_us, pa.int64()) if isinstance(ts_us, int) else ts_us.cast(pa.int64())
    deadline = pc.add(times, pc.multiply(ttl, 1000))
    first = pc.min(pc.filter(deadline, pc.fill_null(pc.greater_equal(deadline, now_us),
                                                    False))).as_py()
    return None if first is None else int(first)


def user_fields(schema: pa.Schema) -> pa.Schema:
    """``schema`` without the system columns (a read schema as Spark gives it back)."""
    return pa.schema([f for f in schema if f.name not in RESERVED_COLUMNS])


def compile_selector(text: str, schema: pa.Schema | None) -> Selector:
    """A selector for messages of an address whose user columns are ``schema``.

    The selector sees the system columns too, so ``_seq`` and ``_timestamp`` are columns (not
    NULL) for it; an identifier that is neither is NULL, as in JMS. ``schema=None`` (nothing
    sent yet) gives a selector that knows no columns: every identifier is unknown rather than
    NULL until the address has a schema. Raises ``SelectorSyntaxError`` for bad text.
    """
    from .._selector import Selector  # only when needed: it is a heavy import

    return Selector(text, None if schema is None else with_system_schema(schema))


#: What Arrow raises on Python values it cannot convert (a str in an int column, mixed kinds,
#: an int past int64).
ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError,
                ValueError, OverflowError)


def arrow_table(data: Any) -> pa.Table:
    """A ``pyarrow.Table``, ``RecordBatch`` or ``pandas.DataFrame`` as a table."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    return pa.Table.from_pandas(data, preserve_index=False).replace_schema_metadata(None)


def as_rows(data: Any) -> list[dict[str, Any]] | None:
    """The messages of ``data`` as a list of dicts, checked (each a dict, every column name a
    string); ``None`` for Arrow and pandas data. Raises ``InvalidMessageError`` for anything
    else, naming the first message that is wrong."""
    if type(data) is list:  # the usual case, plain dicts with str keys, checked first
        for row in data:
            if type(row) is not dict:
                break
            for k in row:
                if type(k) is not str:
                    break
            else:
                continue
            break
        else:
            return data
    if isinstance(data, pa.Table | pa.RecordBatch) or (
            type(data).__module__.startswith("pandas") and hasattr(data, "columns")):
        return None
    if isinstance(data, dict):
        return [data]
    if not isinstance(data, list | tuple):
        raise InvalidMessageError(
            f"cannot send a {type(data).__name__}; send a pyarrow.Table, a pandas.DataFrame, "
            "a list of dicts or one dict")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise InvalidMessageError(
                f"message {i} is a {type(row).__name__}, expected a dict of column -> value")
        for k in row:
            if not isinstance(k, str):
                raise InvalidMessageError(f"message {i} has a non-string column name {k!r}")
    return data if isinstance(data, list) else list(data)


def _table(names: list[str], columns: list[list[Any]]) -> pa.Table:
    # pa.array per column is the inference pa.table(dict) does, without its fixed overhead a
    # call, which was most of a single send's conversion
    return pa.Table.from_arrays([pa.array(values) for values in columns], names=names)


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """One Arrow table of ``rows`` (dicts with string keys), each column's type inferred from
    its values.

    Infer, never coerce: ``from_pylist(schema=...)`` would truncate 7.5 into an int64 column
    silently; :func:`conform_schema` casts afterwards, safely. The usual case, every row with
    the same keys, is converted column by column (faster than ``from_pylist``); rows with
    differing keys get the union of the columns, missing values as nulls (``from_pylist``
    would take the first row's keys and silently lose the others).
    """
    if not rows:
        return pa.table({})
    try:
        keys = list(rows[0])
        if keys and len(set(map(len, rows))) == 1 and all(isinstance(k, str) for k in keys):
            try:
                columns = [list(map(itemgetter(k), rows)) for k in keys]
            except KeyError:  # same number of keys, not the same keys
                pass
            else:
                return _table(keys, columns)
        names = list(dict.fromkeys(k for row in rows for k in row))
        bad = [k for k in names if not isinstance(k, str)]
        if bad:  # (send checks its rows first; a producer's rows are checked here)
            raise InvalidMessageError(f"a message has a non-string column name {bad[0]!r}")
        if not names:
            raise InvalidMessageError("a message has no columns")
        return _table(names, [[row.get(k) for row in rows] for k in names])
    except ARROW_ERRORS as exc:
        raise InvalidMessageError(f"cannot convert messages to Arrow: {exc}") from exc


#: Column types that inference gives exactly one Python type: a column of values of that type
#: (or None) converted with the column's type is what inferring it would give, and conforming
#: it to the address schema changes nothing.
_EXACT_TYPES: dict[pa.DataType, type] = {t: kind[1] for t, kind in KINDS.items()}


class _SchemaPlan:
    """What a send needs to know of an address schema, worked out once per schema object."""

    __slots__ = ("_encoder", "columns", "nullable", "schema", "struct")

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        fields = list(schema)
        self.nullable = all(f.nullable for f in fields)
        typed = [(f.name, _EXACT_TYPES.get(f.type)) for f in fields]
        #: (name, Python type) of every column, or None when a column's type is not one of
        #: ``_EXACT_TYPES`` (or a column forbids nulls)
        self.columns = typed if self.nullable and all(t[1] for t in typed) else None
        #: the rows' type as one struct (one conversion call for all columns)
        self.struct = pa.struct(fields)
        self._encoder: BatchEncoder | None = None

    @property
    def encoder(self) -> BatchEncoder | None:
        """What writes rows of this schema as Arrow IPC without Arrow, made on first use;
        ``None`` where :func:`typed_table` would not convert."""
        if self.columns is None:
            return None
        if self._encoder is None:
            # by the schema message it writes: addresses of one schema share an encoder
            key = pa.schema(list(self.struct)).serialize().to_pybytes()
            self._encoder = _ENCODERS.get_or_load(key, lambda: BatchEncoder(self.struct))
        return self._encoder if self._encoder.ok else None


#: Encoders of address schemas, by the IPC schema message they write (making one is
#: costly: Arrow converts, serialises and checks two batches). A plan (below) is made again
#: whenever its schema object is new, or after more than 16 schemas: its encoder is not.
_ENCODERS: BoundedLRU[bytes, BatchEncoder] = BoundedLRU("IPC encoders of address schemas", 64)

#: Plans by the id of their schema object (which the plan keeps alive, so the id is not
#: reused while it is here): an address's view keeps one schema object until it changes. At
#: most 16, cleared when full.
_PLANS: dict[int, _SchemaPlan] = {}


def _plan(schema: pa.Schema) -> _SchemaPlan:
    plan = _PLANS.get(id(schema))
    if plan is None or plan.schema is not schema:
        if len(_PLANS) >= 16:
            _PLANS.clear()
        plan = _PLANS[id(schema)] = _SchemaPlan(schema)
    return plan


def nullable(schema: pa.Schema) -> bool:
    """Whether every column of ``schema`` takes nulls (then a table with this very schema needs
    no conforming)."""
    return _plan(schema).nullable


def typed_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table | None:
    """``rows`` as a table with the address ``schema``, converted with its column types; or
    ``None`` when that would not be what :func:`rows_to_table` and :func:`conform_schema` give
    (a column type other than int64, double, string, binary or bool, a row whose columns are
    not the schema's, a value that is not exactly its column's Python type, a non-nullable
    column; or a value Arrow refuses): then the caller converts as usual, and gets the usual
    error. (Converting with the types skips Arrow's inference.)
    """
    plan = _plan(schema)
    columns = plan.columns
    if columns is None:
        return None
    width = len(columns)
    try:
        for row in rows:
            # a dict subclass may answer row[name] for a column it does not hold
            # (defaultdict, Counter): those go the usual way
            if type(row) is not dict or len(row) != width:
                return None
            for name, kind in columns:
                v = row[name]
                if type(v) is not kind and v is not None:
                    return None
        # the rows (dicts with exactly the schema's columns) as one struct array: one call
        # into Arrow for all columns instead of one a column
        return pa.Table.from_struct_array(pa.array(rows, type=plan.struct))
    except (KeyError, *ARROW_ERRORS):
        return None


def typed_stream(rows: list[dict[str, Any]], schema: pa.Schema) -> bytes | None:
    """``rows`` as one record batch in a complete Arrow IPC stream, byte for byte what writing
    ``typed_table(rows, schema)`` with ``new_stream`` gives, written without Arrow (see
    ``_format.ipc``); ``None`` when :func:`typed_table` would give ``None``, or the encoder is
    off."""
    encoder = _plan(schema).encoder
    if encoder is None:
        return None
    return encoder.encode_one(rows[0]) if len(rows) == 1 else encoder.encode(rows)


def _schema_text(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def as_schema(batch: pa.RecordBatch, schema: pa.Schema, *, exact: bool = False) -> pa.RecordBatch:
    """A stored frame (written under the address schema then, maybe older) in ``schema``:
    added columns are null. What readers do; writers conform with :func:`conform_schema`,
    which validates.

    ``exact`` also replaces a schema that differs only in metadata (Spark checks it)."""
    if batch.schema.equals(schema, check_metadata=exact):
        return batch
    names = batch.schema.names
    arrays = []
    for f in schema:
        if f.name in names:
            col = batch.column(f.name)
            arrays.append(col if col.type == f.type else col.cast(f.type))
        else:
            arrays.append(pa.nulls(batch.num_rows, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def conform_schema(table: pa.Table, schema: pa.Schema | None,
                   merge: bool) -> tuple[pa.Table, pa.Schema]:
    """Cast ``table`` to the address schema (adding nulls for missing nullable columns).

    Returns the table and the schema it now has (the address schema, grown by new nullable
    columns when ``merge``).
    """
    reserved = [n for n in table.schema.names if n in RESERVED_COLUMNS]
    if reserved:
        raise SchemaMismatchError(
            f"columns {reserved} are reserved for the store's system columns; rename them")
    if len(set(table.schema.names)) != len(table.schema.names):
        raise SchemaMismatchError(f"duplicate column names in {table.schema.names}")
    if schema is None:
        return table, table.schema
    extra = [f for f in table.schema if f.name not in schema.names]
    if extra and not merge:
        raise SchemaMismatchError(
            f"columns {[f.name for f in extra]} are not in the schema of the address "
            f"({_schema_text(schema)}); send with merge_schema=True (Spark: mergeSchema) to "
            "add them as nullable columns")
    target = pa.schema([*schema, *(f.with_nullable(True) for f in extra)])
    arrays = []
    problems = []
    for f in target:
        if f.name in table.schema.names:
            col = table.column(f.name)
            if col.type != f.type:
                if not _castable(col.type, f.type):
                    problems.append(f"column {f.name!r} is {col.type}, the address has {f.type}")
                    continue
                try:
                    col = col.cast(f.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                    problems.append(f"column {f.name!r} is {col.type}, the address has "
                                    f"{f.type} ({e})")
                    continue
            if not f.nullable and col.null_count:
                problems.append(f"column {f.name!r} is not nullable but has nulls")
            arrays.append(col)
        elif f.nullable:
            arrays.append(pa.nulls(table.num_rows, f.type))
        else:
            problems.append(f"column {f.name!r} is missing and is not nullable")
    if problems:
        raise SchemaMismatchError("; ".join(problems))
    return pa.Table.from_arrays(arrays, schema=target), target


def _kind(t: pa.DataType) -> str:
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_temporal(t):
        return "time"
    return "nested"


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Casts allowed when data meets the address schema: all-null columns, and within one kind
    (numbers, strings, ...); never parsing strings into numbers or the other way round."""
    a, b = _kind(src), _kind(dst)
    return a == "null" or a == b


def check_page_schema(page_schema: pa.Schema, current: pa.Schema | None,
                      merge: bool) -> pa.Schema | None:
    """Check pages written with ``page_schema`` against the address's ``current`` schema.

    Returns the new address schema to record, or ``None`` when it does not change.
    Raises :class:`SchemaMismatchError` naming the columns that do not fit.
    """
    if current is not None and page_schema.equals(current):
        return None  # the common case: what the address already has
    page_schema = pa.schema([f for f in page_schema]).remove_metadata()
    reserved = [n for n in page_schema.names if n in RESERVED_COLUMNS]
    if reserved:  # pages written outside send() (Spark tasks) are checked here
        raise SchemaMismatchError(
            f"columns {reserved} are reserved for the store's system columns; rename them")
    if current is None:
        return page_schema
    problems = []
    extra = []
    for f in page_schema:
        if f.name not in current.names:
            extra.append(f)
            continue
        cf = current.field(f.name)
        if cf.type != f.type:
            problems.append(f"column {f.name!r} is {f.type}, the address has {cf.type}")
    for cf in current:
        if cf.name not in page_schema.names and not cf.nullable:
            problems.append(f"column {cf.name!r} is missing and is not nullable")
    if extra and not merge:
        problems.append(f"columns {[f.name for f in extra]} are not in the address schema "
                        f"({_schema_text(current)}); use mergeSchema to add them")
    if problems:
        raise SchemaMismatchError("schema mismatch: " + "; ".join(problems))
    if extra:
        return pa.schema([*current, *(f.with_nullable(True) for f in extra)])
    return None
