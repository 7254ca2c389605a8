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

__all__ = ["QueuePartition", "read_partition", "read_schema", "spark_schema"]

log = logging.getLogger(__name__)


# -- options and schema -------------------------------------------------------------------------
def open_address(opts: ReadSettings) -> Address:
    """The address (never created by a read).

    ``pageMaxCacheSize`` is an address setting like the sink's: given on a read, it is
    persisted, so that the client, the driver and every executor use one value (executors get
    it with their partitions). ``cleanupIntervalMs`` on a read applies to this query's
    acknowledgements only.
    """
    given = {} if opts.page_max_cache_size is None else {
        "page_max_cache_size": opts.page_max_cache_size}
    address = DurableQueue(opts.path, opts.storage_options).address(opts.address, create=False,
                                                                    **given)
    if opts.cleanup_interval_ms is not None:
        address.settings = address.settings.replace(cleanup_interval_ms=opts.cleanup_interval_ms)
    return address


_WIDER = {pa.uint8(): pa.int16(), pa.uint16(): pa.int32(), pa.uint32(): pa.int64(),
          pa.uint64(): pa.decimal128(20, 0)}


def spark_schema(schema: pa.Schema) -> StructType:
    """The Spark schema of an address: its columns (unsigned integers widened, since Spark has
    none), then ``_seq`` and ``_timestamp`` (``timestamp[us, UTC]`` -> ``TimestampType``)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    fields = [f.with_type(_WIDER.get(f.type, f.type)) for f in with_system_schema(schema)]
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
    """``DataSource.schema()``: called on the driver when a read is planned (``load()``)."""
    opts = ReadSettings.parse(options, streaming=None)
    address = open_address(opts)
    schema = address.schema
    if schema is None:
        raise SchemaMismatchError(
            f"address {opts.address!r} has no schema yet: nothing was ever sent to it. Send a "
            "first message, or give the schema with spark.readStream.schema(...)")
    return spark_schema(schema)


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
    schema = open_address(opts).schema
    return tuple(f for f in schema if f.name in missing) if schema is not None else ()


def output_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects from ``read`` for the read schema ``schema``."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


# -- partitions ---------------------------------------------------------------------------------
class QueuePartition(InputPartition):
    """The page slices one task reads (pickled to an executor: a few dozen bytes per page),
    the address's ``pageMaxCacheSize``, which bounds its pages in the executor's cache, and the
    ``_timestamp`` before which messages have expired as of the plan (``expiry_delay_ms``), and
    the plan's time that ``ttl_ms`` deadlines are judged at (``None``: the address has none)."""

    def __init__(self, slices: Sequence[PageRef], cache_pages: int = 5,
                 expire_before: int | None = None, ttl_now: int | None = None) -> None:
        super().__init__(None)
        self.slices = list(slices)
        self.cache_pages = cache_pages
        self.expire_before = expire_before
        self.ttl_now = ttl_now

    def __repr__(self) -> str:
        rows = sum(s.hi - s.lo for s in self.slices)
        return f"QueuePartition({len(self.slices)} slices, {rows} messages)"


def partitions(tasks: list[list[PageRef]], address: Address,
               expire_before: int | None = None,
               ttl_now: int | None = None) -> list[QueuePartition]:
    """Driver: one partition per planned task, carrying the address's ``pageMaxCacheSize`` and
    the plan's expiry cutoff and TTL time."""
    return [QueuePartition(t, address.settings.page_max_cache_size, expire_before, ttl_now)
            for t in tasks]


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
    """Executor: the messages of one partition, as Arrow record batches of ``output``."""
    assert isinstance(partition, QueuePartition)
    return read_task(opts.path, opts.storage_options, opts.address, partition.slices, output,
                     selector=selector, fail_on_data_loss=opts.fail_on_data_loss,
                     page_max_cache_size=partition.cache_pages,
                     open_address=functools.partial(Address.open, create=False), extra=extra,
                     skip_removed=skip_removed,
                     expire_before=getattr(partition, "expire_before", None),
                     ttl_now=getattr(partition, "ttl_now", None))
