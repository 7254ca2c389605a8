"""What the streaming reader (``_source``) and the batch reader (``_batch``) share: opening the
address, the Spark schema of a read, the partitions they plan and the executor's ``read``.

Neither reader imports the other; both import this module. Driver-side functions run in the
planner or stream-reader process; :func:`read_partition` runs on executors.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import StructType

from .._format.schema import with_system_schema
from .._read import PageRef, read_task
from ..address import Address
from ..errors import DataLossError, InvalidOptionError, SchemaMismatchError
from ..queue import DurableQueue
from ..settings import ReadSettings

__all__ = ["ADDRESS_COLUMN", "QueuePartition", "read_partition", "read_schema", "spark_schema"]

log = logging.getLogger(__name__)

#: The column naming each row's address in a read of several addresses (after the system
#: columns), and the routing column of a write.
ADDRESS_COLUMN = "_address"
ADDRESS_FIELD = pa.field(ADDRESS_COLUMN, pa.string(), nullable=False)


# -- options and schema -------------------------------------------------------------------------
def open_address(opts: ReadSettings, name: str | None = None) -> Address:
    """The address ``name`` (default: the one the option ``address`` names), never created by
    a read.

    ``pageMaxCacheSize`` is an address setting like the sink's: given on a read, it is
    persisted, so that the client, the driver and every executor use one value (executors get
    it with their partitions). ``cleanupIntervalMs`` on a read applies to this query's
    acknowledgements only.
    """
    given = {} if opts.page_max_cache_size is None else {
        "page_max_cache_size": opts.page_max_cache_size}
    name = opts.selection.single if name is None else name
    assert name is not None, "a read of several addresses names the one to open"
    address = DurableQueue(opts.path, opts.storage_options).address(name, create=False,
                                                                    **given)
    if opts.cleanup_interval_ms is not None:
        address.settings = address.settings.replace(cleanup_interval_ms=opts.cleanup_interval_ms)
    return address


_WIDER = {pa.uint8(): pa.int16(), pa.uint16(): pa.int32(), pa.uint32(): pa.int64(),
          pa.uint64(): pa.decimal128(20, 0)}


def spark_schema(schema: pa.Schema, *, address_column: bool = False) -> StructType:
    """The Spark schema of an address: its columns (unsigned integers widened, since Spark has
    none), then ``_seq`` and ``_timestamp`` (``timestamp[us, UTC]`` -> ``TimestampType``), and
    with ``address_column`` the ``_address`` string of a read of several addresses."""
    from pyspark.sql.pandas.types import from_arrow_schema

    fields = [f.with_type(_WIDER.get(f.type, f.type)) for f in with_system_schema(schema)]
    if address_column:
        fields.append(ADDRESS_FIELD)
    problems = []
    for f in fields:
        try:
            from_arrow_schema(pa.schema([f]))
        except Exception as exc:  # pyspark raises assorted types here
            problems.append(f"column {f.name!r} has type {f.type}, which Spark cannot read "
                            f"({type(exc).__name__})")
    if problems:
        raise SchemaMismatchError("; ".join(problems))
    return from_arrow_schema(pa.schema(fields))


def read_schema(options: Mapping[str, Any]) -> StructType:
    """``DataSource.schema()``: called on the driver when a read is planned (``load()``).

    One address: its columns, ``_seq``, ``_timestamp``. Several: the columns of all of them
    (by name, in the order first seen; a column missing from some is null there), then
    ``_seq``, ``_timestamp`` and ``_address``.
    """
    opts = ReadSettings.parse(options, streaming=None)
    if not opts.selection.several:
        address = open_address(opts)
        schema = address.schema
        if schema is None:
            raise SchemaMismatchError(
                f"address {opts.address!r} has no schema yet: nothing was ever sent to it. Send "
                "a first message, or give the schema with spark.readStream.schema(...)")
        return spark_schema(schema)
    names = read_names(opts)
    merged = user_schema(opts, names)
    if merged is None:
        raise SchemaMismatchError(
            f"no address that option address={opts.address!r} names has a schema yet "
            f"({', '.join(names) or 'none exists'}): send a first message to one, or give the "
            "schema with spark.readStream.schema(...) (with an _address string column to get "
            "each row's address)")
    return spark_schema(merged, address_column=True)


def read_names(opts: ReadSettings) -> list[str]:
    """The addresses a read covers now: the names given, then those a pattern matches."""
    selection = opts.selection
    if not selection.patterns:
        return list(selection.names)
    return selection.resolve(DurableQueue(opts.path, opts.storage_options).addresses())


def user_schema(opts: ReadSettings, names: Sequence[str] | None = None) -> pa.Schema | None:
    """The user columns of the read: of its address, or of its addresses together
    (:func:`merge_schemas`); ``None`` before anything was sent."""
    if not opts.selection.several:
        return open_address(opts).schema
    schemas = {n: open_address(opts, n).schema for n in (read_names(opts) if names is None
                                                          else names)}
    return merge_schemas({n: s for n, s in schemas.items() if s is not None})


def merge_schemas(schemas: Mapping[str, pa.Schema]) -> pa.Schema | None:
    """The user columns of several addresses together: every column by name, in the order first
    seen; one that some address lacks becomes nullable. ``None`` when ``schemas`` is empty.

    Raises
    ------
    SchemaMismatchError
        Two addresses give a column different types, or one has a column named ``_address``.
    """
    fields: dict[str, pa.Field] = {}
    owner: dict[str, str] = {}
    problems = []
    for name, schema in schemas.items():
        if ADDRESS_COLUMN in schema.names:
            problems.append(f"address {name!r} has a column {ADDRESS_COLUMN!r}, the column a "
                            "read of several addresses adds; read it alone")
        for f in schema:
            seen = fields.get(f.name)
            if seen is None:
                fields[f.name], owner[f.name] = f, name
            elif not seen.type.equals(f.type):
                problems.append(f"column {f.name!r} is {seen.type} in address "
                                f"{owner[f.name]!r} but {f.type} in {name!r}")
            elif f.nullable and not seen.nullable:
                fields[f.name] = seen.with_nullable(True)
    if problems:
        raise SchemaMismatchError("the addresses of one read must agree on their columns: " +
                                  "; ".join(problems))
    if not schemas:
        return None
    for column in fields:
        if any(column not in s.names for s in schemas.values()):
            fields[column] = fields[column].with_nullable(True)
    return pa.schema(list(fields.values()))


def selector_fields(opts: ReadSettings, output: pa.Schema,
                    selector: str | None) -> tuple[pa.Field, ...]:
    """Address columns the selector names that the read schema lacks (a schema given with
    ``.schema(...)``): they are read for the selector and dropped before Spark sees them."""
    if not selector:
        return ()
    from ..selector import Selector

    missing = Selector(selector).identifiers - set(output.names)
    if not missing:
        return ()
    schema = user_schema(opts)
    return tuple(f for f in schema if f.name in missing) if schema is not None else ()


def output_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects from ``read`` for the read schema ``schema``."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


# -- partitions ---------------------------------------------------------------------------------
class QueuePartition(InputPartition):
    """The page slices one task reads (pickled to an executor: a few dozen bytes per page),
    the address's ``pageMaxCacheSize``, which bounds its pages in the executor's cache, the
    ``_timestamp`` before which messages have expired as of the plan (``expiry_delay_ms``), in
    a read of several addresses the name of the one it reads (``None``: the only one), and the
    plan's time that ``ttl_ms`` deadlines are judged at (``None``: the address has none)."""

    def __init__(self, slices: Sequence[PageRef], cache_pages: int = 5,
                 expire_before: int | None = None, address: str | None = None,
                 ttl_now: int | None = None) -> None:
        super().__init__(None)
        self.slices = list(slices)
        self.cache_pages = cache_pages
        self.expire_before = expire_before
        self.address = address
        self.ttl_now = ttl_now

    def __repr__(self) -> str:
        rows = sum(s.hi - s.lo for s in self.slices)
        return f"QueuePartition({len(self.slices)} slices, {rows} messages)"


def partitions(tasks: list[list[PageRef]], address: Address,
               expire_before: int | None = None, *,
               name: str | None = None, ttl_now: int | None = None) -> list[QueuePartition]:
    """Driver: one partition per planned task, carrying the address's ``pageMaxCacheSize``, the
    plan's expiry cutoff and TTL time and, in a read of several addresses, the address's
    ``name``."""
    return [QueuePartition(t, address.settings.page_max_cache_size, expire_before, name,
                           ttl_now) for t in tasks]


def address_entries(offset: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The entries of the offset of a read of several addresses,
    ``{"addresses": {name: {"seq": N, ...}, ...}}``."""
    entries = offset.get("addresses") if isinstance(offset, Mapping) else None
    if not isinstance(entries, Mapping) or not all(isinstance(e, Mapping)
                                                   for e in entries.values()):
        raise InvalidOptionError(
            f"offset {offset!r} is not the offset of a durablequeue read of several addresses "
            "({'addresses': {name: {'seq': N}}}); was the checkpoint written by a query of one "
            "address, or by another source? A query's addresses option cannot change between "
            "one address and several: use a new checkpoint")
    return {str(n): dict(e) for n, e in entries.items()}


def offset_expiry(offset: Mapping[str, Any] | None) -> int | None:
    """The expiry cutoff an end offset records (``{"seq": N, "expire_before": T}``), ``None``
    for an offset without one (no ``expiry_delay_ms`` when it was planned)."""
    value = None if offset is None else offset.get("expire_before")
    return None if value is None else int(value)


def offset_ttl_now(offset: Mapping[str, Any] | None) -> int | None:
    """The time an end offset records for ``ttl_ms`` deadlines (``"ttl_now"``, epoch
    microseconds), ``None`` for an offset without one (no message of the address had a TTL
    when it was planned, or planned by a release before TTLs)."""
    value = None if offset is None else offset.get("ttl_now")
    return None if value is None else int(value)


def offset_seq(offset: Mapping[str, Any] | None) -> int:
    """The ``_seq`` of a durablequeue offset ``{"seq": N}``."""
    try:
        return int(offset["seq"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as exc:
        raise InvalidOptionError(f"offset {offset!r} is not a durablequeue offset "
                                 "({'seq': N}); was the checkpoint written by another "
                                 "source?") from exc


def data_loss(opts: ReadSettings, message: str) -> None:
    """Driver: fail with ``message`` or, with ``failOnDataLoss=false``, log it and go on."""
    if opts.fail_on_data_loss:
        raise DataLossError(message + "; set failOnDataLoss=false to skip them")
    log.warning("%s; skipped (failOnDataLoss=false)", message)


# -- executors ----------------------------------------------------------------------------------
def read_partition(opts: ReadSettings, output: pa.Schema, selector: str | None,
                   extra: tuple[pa.Field, ...], partition: InputPartition, *,
                   skip_removed: bool = False) -> Iterator[pa.RecordBatch]:
    """Executor: the messages of one partition, as Arrow record batches of ``output`` (its
    ``_address`` column, if any, is the partition's address)."""
    assert isinstance(partition, QueuePartition)
    name = getattr(partition, "address", None) or opts.selection.single
    assert name is not None, "a partition of a read of several addresses names its address"
    where = output.get_field_index(ADDRESS_COLUMN) if opts.selection.several else -1
    stored = output.remove(where) if where >= 0 else output
    batches = read_task(opts.path, opts.storage_options, name, partition.slices, stored,
                        selector=selector, fail_on_data_loss=opts.fail_on_data_loss,
                        page_max_cache_size=partition.cache_pages,
                        open_address=functools.partial(Address.open, create=False),
                        extra=extra, skip_removed=skip_removed,
                        expire_before=getattr(partition, "expire_before", None),
                        ttl_now=getattr(partition, "ttl_now", None))
    if where < 0:
        return batches
    return _with_address(batches, output, where, name)


def _with_address(batches: Iterator[pa.RecordBatch], output: pa.Schema, where: int,
                  name: str) -> Iterator[pa.RecordBatch]:
    value = pa.scalar(name, pa.string())
    for batch in batches:
        columns = list(batch.columns)
        columns.insert(where, pa.repeat(value, batch.num_rows))
        yield pa.RecordBatch.from_arrays(columns, schema=output)
