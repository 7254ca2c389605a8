"""``spark.readStream.format("durablequeue")``: a streaming source with durable consumers (the
batch reader is in ``_batch``; both share the options, schema and partitions of ``_reader``).

Offsets are consumer watermarks: ``{"seq": N}`` means every ``_seq < N`` is done. Who calls what,
and where (Spark 4.2+ Python Data Source API):

- Driver, one long-lived Python process per query (the "stream reader" process): ``initialOffset``
  (new query: the consumer's watermark, or ``startingOffsets`` for a new consumer),
  ``prepareForTriggerAvailableNow``, ``getDefaultReadLimit``, ``latestOffset(start, limit)``,
  ``reportLatestOffset``, ``partitions(start, end)`` and ``commit(end)``. This process holds the
  consumer's lease (one running query per consumer, :mod:`.._ops.lease`) and moves its watermark.
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

from .._format.schema import compile_selector
from .._read import Limits, admit, batch_budget, plan_tasks, seq_ranges_text
from ..consumer import Consumer
from ..settings import ReadSettings
from ._reader import (
    data_loss,
    offset_expiry,
    offset_seq,
    offset_ttl_now,
    open_address,
    output_schema,
    partitions,
    read_partition,
    selector_fields,
)

__all__ = ["DurableQueueStreamReader"]


# -- streaming ----------------------------------------------------------------------------------
class _Driver:
    """Driver-side state of a streaming read: address, lease, consumer (never pickled)."""

    def __init__(self, opts: ReadSettings) -> None:
        assert opts.consumer is not None
        self.address = open_address(opts)
        self.lease = self.address.consumer_lease(opts.consumer, opts.consumer_lease_ms)
        #: the end of the last batch ``latestOffset`` planned: until Spark commits it, its
        #: messages are in flight (what the lease claims say, for ``stats()``)
        self.planned = -1
        self.lease.report = self._status
        self.lease.acquire()
        self.lease.start_heartbeat()
        # The query's options define the consumer: an absent selector clears a stored one, so
        # cleanup keeps every page this query reads.
        self.consumer = Consumer.open(self.address, opts.consumer, selector=opts.selector or "",
                                      start=opts.start)
        self.consumer.adopt_lease(self.lease)  # the query owns the consumer through its lease
        schema = self.address.schema
        self.selector = None
        if opts.selector and schema is not None:
            self.selector = compile_selector(opts.selector, schema)

    def _status(self) -> dict[str, Any]:
        """What the lease claims say of the query (``ConsumerLease.report``, heartbeat thread):
        the planned batch not committed yet."""
        consumer = getattr(self, "consumer", None)
        if consumer is None:
            return {}
        position = consumer.position
        end = max(self.planned, position)
        return {"cursor": end, "in_flight": end - position}

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
        self.output = output_schema(schema)
        self._extra = selector_fields(self.opts, self.output, self.opts.selector)
        self._driver_state: _Driver | None = None
        self._target: int | None = None
        self._last_trigger = 0.0  # minOffsetsPerTrigger: when a batch last went ahead
        #: the log's end as the last latestOffset saw it, for the reportLatestOffset after it
        self._seen_end: int | None = None

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
                position = max(position, drv.address.state.first_seq)
        return {"seq": position}

    def prepareForTriggerAvailableNow(self) -> None:
        """Driver, once, before an ``AvailableNow`` run: fix the target at the log's end."""
        self._target = self._driver.address.state.next_seq

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
        begin = offset_seq(start)
        drv.ack(begin)
        drv.address.release_due()  # scheduled messages that are due join this batch
        state = drv.address.state
        if begin >= state.next_seq:
            # everything before damage to the journal was read: fail the query, naming it
            drv.address.log.check_damage()
        self._seen_end = state.next_seq
        target = state.next_seq if self._target is None else min(self._target, state.next_seq)
        limits = self._limits(limit)
        if self._target is not None and limits.min_rows is not None:
            limits = Limits(limits.rows, limits.bytes, limits.pages)  # never wait in AvailableNow
        # nothing new: the offset Spark already has (an expiry cutoff in it included), or Spark
        # would take a changed offset for new data and run empty batches
        unchanged = {k: start[k] for k in ("seq", "expire_before", "ttl_now") if k in start}
        if self._delay(target - begin):
            return unchanged
        end = admit(state.pages, begin, target, limits, drv.selector)
        if end <= begin:
            return unchanged
        drv.planned = end
        now = time.time()
        expire_before = drv.address.settings.expire_before(now)
        # the batch's expiry as of its plan, in its offset: a replayed batch reads the same rows
        offset: dict[str, int] = {"seq": end}
        if expire_before is not None:
            offset["expire_before"] = expire_before
        if state.ttl:  # some messages were sent with ttl_ms: the time they are judged at
            offset["ttl_now"] = int(now * 1e6)
        return offset

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
        """Driver, right after ``latestOffset``: the log's end, for the query's progress
        reports; the end that ``latestOffset`` just saw (an idle query calls both every 10 ms:
        a second look at the log would double its reads, a request each on object stores)."""
        end, self._seen_end = self._seen_end, None
        return {"seq": self._driver.address.state.next_seq if end is None else end}

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        """Driver: cut ``[start, end)`` into tasks (also when a restart re-plans a batch)."""
        drv = self._driver
        begin, stop = offset_seq(start), offset_seq(end)
        if stop <= begin:
            return []
        state = drv.address.state
        # With a selector, cleanup drops pages it cannot match, so only what repair or
        # retention recorded as lost counts; without one, every hole does (it covers theirs).
        gaps = (state.pages.gaps(begin, stop) if drv.selector is None
                else state.lost_in(begin, stop))
        changed = [(a, b) for a, b, _ in drv.consumer.lost_in(begin, stop)]
        if gaps:
            data_loss(self.opts, (
                f"messages _seq {seq_ranges_text(gaps)} of address {self.opts.address!r} are "
                f"gone although consumer {self.opts.consumer!r} had not acknowledged them "
                "(removed by retention, retentionMs / retentionBytes; pages deleted by hand; "
                "damaged pages removed by repair; or the query restarted from an old "
                "checkpoint)"))
        if changed:
            why = drv.consumer.lost_in(begin, stop)[0][2]
            data_loss(self.opts, (
                f"messages _seq {seq_ranges_text(changed)} of address {self.opts.address!r} "
                f"are lost to consumer {self.opts.consumer!r}: its {why}, and cleanup had "
                "removed them because the old selector could not match them. Use a new "
                "consumer name to read the address with the new selector from the start"))
        return partitions(plan_tasks(state.pages, begin, stop, selector=drv.selector,
                                     slots=self.opts.task_slots,
                                     min_tasks=self.opts.min_partitions), drv.address,
                          offset_expiry(end), offset_ttl_now(end))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Executor: the messages of one task, as Arrow record batches."""
        return read_partition(self.opts, self.output, self.opts.selector, self._extra,
                              partition)

    def commit(self, end: dict) -> None:
        """Driver, after Spark committed the batch ending at ``end``: acknowledge it (the
        consumer's durable watermark moves; cleanup may remove pages every consumer passed)."""
        self._driver.ack(offset_seq(end))

    def stop(self) -> None:
        """Driver, when the query ends (not always called: a killed query's lease expires)."""
        if self._driver_state is not None:
            self._driver_state.lease.release()
