"""``spark.readStream.format("durablequeue")``: a streaming source with durable consumers (the
batch reader is in ``_batch``; both share the options, schema and partitions defined here).

Offsets are consumer watermarks: ``{"seq": N}`` means every ``_seq < N`` is done. Who calls what,
and where (Spark 4.2+ Python Data Source API):

- Driver, one long-lived Python process per query (the "stream reader" process): ``initialOffset``
  (new query: the consumer's watermark, or ``startingOffsets`` for a new consumer),
  ``prepareForTriggerAvailableNow``, ``getDefaultReadLimit``, ``latestOffset(start, limit)``,
  ``reportLatestOffset``, ``partitions(start, end)`` and ``commit(end)``. This process holds the
  consumer's lease (one running query per consumer, :mod:`._lease`) and moves its watermark.
- Executors (Python workers): ``read(partition)``, with a pickled copy of the reader.

Acknowledgement: the watermark moves to ``end`` in ``commit(end)``, and also to ``start`` in
``latestOffset(start, ...)``. Spark calls ``commit`` for batch N only while it plans batch N+1
(``MicroBatchExecution.constructNextBatch``), so without the second rule the last batch of an
``AvailableNow`` run, or the last batch before the stream goes idle, would stay unacknowledged and
its pages would never be cleaned up. Both are safe: Spark asks for ``latestOffset(start)`` only
after the batch ending at ``start`` is in the checkpoint's commit log (a restart re-runs an
uncommitted batch before asking), and ``commit(end)`` comes later still. A page is therefore never
removed before the batch that read it was committed by Spark.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxFiles,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from .._layout import AddressLayout
from .._lease import ConsumerLease
from .._log import seq_ranges_text
from .._plan import Limits, PageRef, admit, batch_budget, plan_tasks
from .._schema import compile_selector, with_system_schema
from .._storage import Storage
from .._tasks import ReadSpec, read_slices
from ..address import Address
from ..consumer import Consumer
from ..errors import DataLossError, InvalidOptionError, SchemaMismatchError
from ..settings import ReadSettings

__all__ = ["DurableQueueStreamReader", "QueuePartition", "read_schema", "spark_schema"]

log = logging.getLogger(__name__)



# -- options and schema -------------------------------------------------------------------------
def _storage(opts: ReadSettings) -> Storage:
    return Storage(opts.path, opts.storage_options)


def _layout(opts: ReadSettings) -> AddressLayout:
    return AddressLayout(_storage(opts).join(opts.address))


def _open_address(opts: ReadSettings) -> Address:
    """The address (never created by a read).

    ``pageMaxCacheSize`` is an address setting like the sink's: given on a read, it is
    persisted, so that the client, the driver and every executor use one value (executors get
    it with their partitions). ``cleanupIntervalMs`` on a read applies to this query's
    acknowledgements only.
    """
    given = {} if opts.page_max_cache_size is None else {
        "page_max_cache_size": opts.page_max_cache_size}
    address = Address.open(_storage(opts), opts.address, create=False, **given)
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
    address = _open_address(opts)
    schema = address.schema
    if schema is None:
        raise SchemaMismatchError(
            f"address {opts.address!r} has no schema yet: nothing was ever sent to it. Send a "
            "first message, or give the schema with spark.readStream.schema(...)")
    return spark_schema(schema)


def _selector_fields(opts: ReadSettings, output: pa.Schema,
                     selector: str | None) -> tuple[pa.Field, ...]:
    """Address columns the selector names that the read schema lacks (a schema given with
    ``.schema(...)``): they are read for the selector and dropped before Spark sees them."""
    if not selector:
        return ()
    from ..selector import Selector

    missing = Selector(selector).identifiers - set(output.names)
    if not missing:
        return ()
    schema = _open_address(opts).schema
    return tuple(f for f in schema if f.name in missing) if schema is not None else ()


def _output_schema(schema: StructType) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


# -- partitions ---------------------------------------------------------------------------------
class QueuePartition(InputPartition):
    """The page slices one task reads (pickled to an executor: a few dozen bytes per page),
    and the address's ``pageMaxCacheSize``, which bounds its pages in the executor's cache."""

    def __init__(self, slices: Sequence[PageRef], cache_pages: int = 5) -> None:
        super().__init__(None)
        self.slices = list(slices)
        self.cache_pages = cache_pages

    def __repr__(self) -> str:
        rows = sum(s.hi - s.lo for s in self.slices)
        return f"QueuePartition({len(self.slices)} slices, {rows} messages)"


def _seq(offset: Mapping[str, Any] | None) -> int:
    try:
        return int(offset["seq"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as exc:
        raise InvalidOptionError(f"offset {offset!r} is not a durablequeue offset "
                                 "({'seq': N}); was the checkpoint written by another "
                                 "source?") from exc


def _partitions(tasks: list[list[PageRef]], address: Address) -> list[QueuePartition]:
    return [QueuePartition(t, address.settings.page_max_cache_size) for t in tasks]


def _data_loss(opts: ReadSettings, message: str) -> None:
    if opts.fail_on_data_loss:
        raise DataLossError(message + "; set failOnDataLoss=false to skip them")
    log.warning("%s; skipped (failOnDataLoss=false)", message)


# -- streaming ----------------------------------------------------------------------------------
class _Driver:
    """Driver-side state of a streaming read: address, lease, consumer (never pickled)."""

    def __init__(self, opts: ReadSettings) -> None:
        assert opts.consumer is not None
        self.address = _open_address(opts)
        self.lease = ConsumerLease(self.address.storage,
                                   self.address.layout.leases(opts.consumer),
                                   opts.consumer, opts.consumer_lease_ms)
        self.lease.acquire()
        self.lease.start_heartbeat()
        # The query's options define the consumer: an absent selector clears a stored one, so
        # cleanup keeps every page this query reads.
        self.consumer = Consumer.open(self.address, opts.consumer, selector=opts.selector or "",
                                      start=opts.start)
        schema = self.address.schema
        self.selector = None
        if opts.selector and schema is not None:
            self.selector = compile_selector(opts.selector, schema)

    def ack(self, position: int) -> None:
        if position > self.consumer.position:
            self.lease.check()
            self.consumer.ack(position - 1)


class DurableQueueStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Streaming reads of one address for one durable consumer.

    Created by Spark from :meth:`DurableQueueDataSource.streamReader` in the driver-side stream
    reader process (and, pickled, on executors for :meth:`read`). Nothing touches the store
    until Spark calls the first method, so constructing it has no side effects.
    """

    def __init__(self, options: Mapping[str, Any], schema: StructType) -> None:
        self.opts = ReadSettings.parse(options, streaming=True)
        self.schema = schema
        self.output = _output_schema(schema)
        self._extra = _selector_fields(self.opts, self.output, self.opts.selector)
        self._driver_state: _Driver | None = None
        self._target: int | None = None
        self._last_trigger = 0.0  # minOffsetsPerTrigger: when a batch last went ahead

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_driver_state"] = None  # lease, consumer, caches stay in the driver process
        return state

    @property
    def _driver(self) -> _Driver:
        if self._driver_state is None:
            self._driver_state = _Driver(self.opts)
        self._driver_state.lease.renew()
        return self._driver_state

    def initialOffset(self) -> dict:
        """Driver, when a query starts without a checkpoint: the consumer's watermark (a new
        consumer starts at ``startingOffsets`` / ``startingTimestamp``)."""
        drv = self._driver
        position = drv.consumer.position
        if self.opts.start is None or self.opts.start.kind == "earliest":
            state = drv.address.consumers().get(drv.consumer.name, {})
            if state.get("created") == state.get("updated"):
                # never acknowledged: "earliest" means the first retained message, even if
                # another consumer's cleanup removed pages since the consumer was created
                position = max(position, drv.address.log.refresh().first_seq)
        return {"seq": position}

    def prepareForTriggerAvailableNow(self) -> None:
        """Driver, once, before an ``AvailableNow`` run: fix the target at the log's end."""
        self._target = self._driver.address.log.refresh().next_seq

    def getDefaultReadLimit(self) -> ReadLimit:
        """Driver, once per query: the first of ``maxMessagesPerTrigger``,
        ``maxBytesPerTrigger``, ``maxPagesPerTrigger``, else the memory budget in bytes."""
        o = self.opts
        if o.max_messages_per_trigger is not None:
            return ReadMaxRows(o.max_messages_per_trigger)
        if o.max_bytes_per_trigger is not None:
            return ReadMaxBytes(o.max_bytes_per_trigger)
        if o.max_pages_per_trigger is not None:
            return ReadMaxFiles(o.max_pages_per_trigger)
        return ReadMaxBytes(batch_budget(self._driver.address.settings, o.task_slots))

    def _limits(self, limit: ReadLimit) -> Limits:
        if isinstance(limit, ReadAllAvailable):
            return Limits()  # Spark's word wins (Trigger.Once, ...): options do not apply
        o = self.opts
        configured = Limits(o.max_messages_per_trigger, o.max_bytes_per_trigger,
                            o.max_pages_per_trigger)
        if isinstance(limit, ReadMaxRows):
            return configured.tighten(Limits(rows=limit.max_rows))
        if isinstance(limit, ReadMaxBytes):
            return configured.tighten(Limits(bytes=limit.max_bytes))
        if isinstance(limit, ReadMaxFiles):
            return configured.tighten(Limits(pages=limit.max_files))
        if isinstance(limit, ReadMinRows):
            return configured.tighten(Limits(min_rows=limit.min_rows))
        return configured

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """Driver, before every micro-batch: how far the next batch goes from ``start``.

        Also acknowledges ``start`` (see the module docstring) and renews the lease.
        """
        drv = self._driver
        begin = _seq(start)
        drv.ack(begin)
        state = drv.address.log.refresh()
        target = state.next_seq if self._target is None else min(self._target, state.next_seq)
        limits = self._limits(limit)
        if self._target is not None and limits.min_rows is not None:
            limits = Limits(limits.rows, limits.bytes, limits.pages)  # never wait in AvailableNow
        if self._delay(target - begin):
            return {"seq": begin}
        end = admit(state.pages, begin, target, limits, drv.selector)
        return {"seq": max(begin, end)}

    def _delay(self, available: int) -> bool:
        """``minOffsetsPerTrigger`` with Kafka's semantics: hold the next micro-batch back
        while fewer messages are available, but never longer than ``maxTriggerDelay`` since
        the last batch went ahead. ``Trigger.AvailableNow`` never waits."""
        o = self.opts
        if o.min_offsets_per_trigger is None or self._target is not None:
            return False
        now = time.time()
        if available < o.min_offsets_per_trigger and (now - self._last_trigger) * 1000 < \
                o.max_trigger_delay:
            return True
        self._last_trigger = now
        return False

    def reportLatestOffset(self) -> dict | None:
        """Driver, after ``latestOffset``: the log's end, for the query's progress reports."""
        return {"seq": self._driver.address.log.refresh().next_seq}

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        """Driver: cut ``[start, end)`` into tasks (also when a restart re-plans a batch)."""
        drv = self._driver
        begin, stop = _seq(start), _seq(end)
        if stop <= begin:
            return []
        state = drv.address.log.refresh()
        # With a selector, cleanup drops pages it cannot match, so only what repair recorded
        # as lost counts; without one, every hole does (it covers repair's too).
        gaps = (state.pages.gaps(begin, stop) if drv.selector is None
                else state.lost_in(begin, stop))
        changed = [(a, b) for a, b, _ in drv.consumer.lost_in(begin, stop)]
        if gaps:
            _data_loss(self.opts, (
                f"messages _seq {seq_ranges_text(gaps)} of address {self.opts.address!r} are "
                f"gone although consumer {self.opts.consumer!r} had not acknowledged them "
                "(pages deleted by hand, damaged pages removed by repair, or the query "
                "restarted from an old checkpoint)"))
        if changed:
            why = drv.consumer.lost_in(begin, stop)[0][2]
            _data_loss(self.opts, (
                f"messages _seq {seq_ranges_text(changed)} of address {self.opts.address!r} "
                f"are lost to consumer {self.opts.consumer!r}: its {why}, and cleanup had "
                "removed them because the old selector could not match them. Use a new "
                "consumer name to read the address with the new selector from the start"))
        return _partitions(plan_tasks(state.pages, begin, stop, selector=drv.selector,
                                      slots=self.opts.task_slots,
                                      min_tasks=self.opts.min_partitions), drv.address)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Executor: the messages of one task, as Arrow record batches."""
        assert isinstance(partition, QueuePartition)
        return read_slices(self._spec(partition), partition.slices)

    def _spec(self, partition: QueuePartition) -> ReadSpec:
        return ReadSpec(_storage(self.opts), _layout(self.opts).pages, self.output,
                        self.opts.selector, self.opts.fail_on_data_loss,
                        partition.cache_pages, extra=self._extra)

    def commit(self, end: dict) -> None:
        """Driver, after Spark committed the batch ending at ``end``: acknowledge it (the
        consumer's durable watermark moves; cleanup may remove pages every consumer passed)."""
        self._driver.ack(_seq(end))

    def stop(self) -> None:
        """Driver, when the query ends (not always called: a killed query's lease expires)."""
        if self._driver_state is not None:
            self._driver_state.lease.release()
