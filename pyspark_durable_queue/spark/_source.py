"""``spark.readStream.format("durablequeue")``: a streaming source with durable consumers (the
batch reader is in ``_batch``; both share the options, schema and partitions of ``_reader``).

Offsets are consumer watermarks: ``{"seq": N}`` means every ``_seq < N`` is done. A read of
several addresses (a list or patterns in the option ``address``) has one such entry per address,
``{"addresses": {name: {"seq": N}}}``, and a consumer of the query's consumer name in each; an
address without an entry (found by a pattern since) starts at its consumer's watermark. Who
calls what, and where (Spark 4.2+ Python Data Source API):

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

What an acknowledgement settles: every row below ``end``, whatever the consumer's delivery window
(``_ops/window.py``) holds there. A Python client of the same consumer name may have left rows in
it: nacked and waiting for redelivery (they hold its watermark), or a dead-letter move a crash
stopped. A query starts at the watermark and reads every row of its range that the window does
not hold as settled, so it delivered them: its commit settles them (and finishes the move first,
as the client's next ``receive`` would). Redelivery delays, delivery counts,
``max_delivery_attempts`` and dead letters are the Python client's (a query reads a nacked row
when its range comes, once). ``partitions`` leaves out the rows the client settled above the
watermark (acknowledged between nacked rows, settled one by one, or in a dead-letter move:
``DeliveryWindow.unsettled``); while the query runs, the window a batch is planned from is the
one its replay is planned from (only the query's lease holder changes it, and ``commit`` only
below the batch).

Sharing a consumer name between a query and Python clients in turn (not at once: the lease) has
these limits (a review's findings, issue 43; not yet changed):

* A driver that died after logging a batch's offsets and before committing it lets its lease go;
  a Python client that takes the consumer then and acknowledges rows of that range makes the
  replay read fewer rows than the first attempt did (never a row twice, none lost: the client
  got them). A replay reads the same rows only if no client used the consumer in between.
* A client that seeks the consumer below a query's checkpoint and nacks rows there: the query's
  next ``latestOffset`` acknowledges its ``begin`` and settles them (no redelivery, no dead
  letter), although that run of the query did not read them again.
* ``failOnDataLoss`` judges the whole range, rows the batch skips as settled included; a query
  restarted from an old checkpoint skips the rows the consumer acknowledged since, where it used
  to read them again.
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

from .._format.schema import compile_selector
from .._read import (
    EARLIEST,
    Limits,
    ReadPosition,
    admit,
    batch_budget,
    parallelism,
    plan_tasks,
    seq_ranges_text,
    share_limits,
)
from ..consumer import Consumer
from ..settings import AddressSettings, ReadSettings
from ._reader import (
    QueuePartition,
    address_entries,
    data_loss,
    group_partitions,
    offset_expiry,
    offset_seq,
    offset_ttl_now,
    open_address,
    output_schema,
    partitions,
    read_names,
    read_partition,
    selector_fields,
)

__all__ = ["DurableQueueStreamReader"]

log = logging.getLogger(__name__)


# -- streaming ----------------------------------------------------------------------------------
class _Driver:
    """Driver-side state of one address of a streaming read: address, lease, consumer (never
    pickled)."""

    def __init__(self, opts: ReadSettings, name: str, start: ReadPosition | None) -> None:
        assert opts.consumer is not None
        self.name = name
        self.start = start
        self.address = open_address(opts, name)
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
                                      start=start)
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

    def initial(self) -> int:
        """Where this query starts in the address when no offset says: the consumer's
        watermark (a new consumer: ``start``, the first retained message by default)."""
        position = self.consumer.position
        if self.start is None or self.start.kind == "earliest":
            state = self.address.consumers().get(self.consumer.name, {})
            if state.get("created") == state.get("updated"):
                # never acknowledged: "earliest" means the first retained message, even if
                # another consumer's cleanup removed pages since the consumer was created
                position = max(position, self.address.state.first_seq)
        return position

    def ack(self, position: int) -> None:
        """Settle every row below ``position``: the query read them all (see the module
        docstring), the rows a Python client of the consumer left waiting for redelivery
        included."""
        if position > self.consumer.position:
            self.lease.check()
            self.consumer._settle_below(position)


class DurableQueueStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Streaming reads of one address, or of several (a list or wildcard patterns in the
    option ``address``), for one durable consumer (of that name in each address).

    Created by Spark from :meth:`DurableQueueDataSource.streamReader` in the driver-side stream
    reader process (and, pickled, on executors for :meth:`read`). Nothing touches the store
    until Spark calls the first method, so constructing it has no side effects.
    """

    def __init__(self, options: Mapping[str, Any], schema: StructType) -> None:
        self.opts = ReadSettings.parse(options, streaming=True)
        self.schema = schema
        self.output = output_schema(schema)
        self._extra = selector_fields(self.opts, self.output, self.opts.selector)
        self._drivers: dict[str, _Driver] = {}
        #: AvailableNow: each address's end when the run began (one found later: when found)
        self._target: dict[str, int] | None = None
        self._last_trigger = 0.0  # minOffsetsPerTrigger: when a batch last went ahead
        #: the log's ends as the last latestOffset saw them, for the reportLatestOffset after it
        self._seen_end: dict[str, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_drivers"] = {}  # leases, consumers, caches stay in the driver process
        return state

    # -- addresses and offsets --------------------------------------------------------------------
    def _names(self) -> list[str]:
        """The addresses read now: the names given, then those a pattern matches today."""
        return read_names(self.opts)

    def _driver(self, name: str, start: ReadPosition | None = EARLIEST) -> _Driver:
        """The driver state of address ``name``, opened on first use. ``start`` places a new
        consumer: the query's start option for the addresses of its first offset; an address
        that a pattern finds later is read from its earliest message (Kafka's
        ``subscribePattern``)."""
        drv = self._drivers.get(name)
        if drv is None:
            drv = self._drivers[name] = _Driver(self.opts, name, start)
        drv.lease.renew()
        return drv

    def _entries(self, offset: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
        """The per-address entries of an offset (``{"seq": N, ...}`` each)."""
        if offset is None:
            return {}
        if not self.opts.selection.several:
            return {self.opts.selection.names[0]: dict(offset)}
        return address_entries(offset)

    def _offset(self, entries: Mapping[str, Mapping[str, Any]]) -> dict:
        """An offset of ``entries``: one address keeps today's ``{"seq": N}``; several are
        ``{"addresses": {name: {"seq": N}, ...}}``."""
        if not self.opts.selection.several:
            return dict(next(iter(entries.values())))
        return {"addresses": {n: dict(e) for n, e in sorted(entries.items())}}

    def _begin(self, name: str, entries: Mapping[str, Mapping[str, Any]]) -> int:
        """Where address ``name`` starts after ``entries``: its entry, or (an address the
        offset does not hold yet: nothing of it was read by this query) its consumer's
        watermark."""
        entry = entries.get(name)
        return offset_seq(entry) if entry is not None else self._driver(name).initial()

    # -- Spark's calls ----------------------------------------------------------------------------
    def initialOffset(self) -> dict:
        """Driver, when a query starts without a checkpoint: each consumer's watermark (a new
        consumer starts at ``startingOffsets`` / ``startingTimestamp``)."""
        return self._offset({n: {"seq": self._driver(n, self.opts.start).initial()}
                             for n in self._names()})

    def prepareForTriggerAvailableNow(self) -> None:
        """Driver, once, before an ``AvailableNow`` run: fix the targets at the logs' ends."""
        self._target = {n: self._driver(n, self.opts.start).address.state.next_seq
                        for n in self._names()}

    def getDefaultReadLimit(self) -> ReadLimit:
        """Driver, once per query: the first of ``maxMessagesPerTrigger``,
        ``maxBytesPerTrigger``, ``maxPagesPerTrigger``, else the memory budget in bytes (of
        the first address's settings)."""
        o = self.opts
        if o.max_messages_per_trigger is not None:
            return ReadMaxRows(o.max_messages_per_trigger)
        if o.max_bytes_per_trigger is not None:
            return ReadMaxBytes(o.max_bytes_per_trigger)
        if o.max_pages_per_trigger is not None:
            return ReadMaxFiles(o.max_pages_per_trigger)
        names = self._names()
        settings = (self._driver(names[0], self.opts.start).address.settings if names
                    else AddressSettings())
        return ReadMaxBytes(batch_budget(settings, o.task_slots))

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
        """Driver, before every micro-batch: how far the next batch goes from ``start`` in each
        address; the read limits hold for the batch as a whole, shared among the addresses in
        proportion to their backlogs.

        Also acknowledges ``start`` (see the module docstring) and renews the leases.
        """
        entries = self._entries(start)
        names = self._names()
        gone = [n for n in entries if n not in names]
        if gone:  # deleted since (a pattern's): their entries stay in the offset, unread
            log.warning("addresses %s were deleted while query of consumer %r read them",
                        gone, self.opts.consumer)
            for name in gone:  # their consumer's lease went with them: nothing to write
                drv = self._drivers.pop(name, None)
                if drv is not None:
                    drv.lease.abandon()
        begins: dict[str, int] = {}
        targets: dict[str, int] = {}
        seen: dict[str, int] = {}
        for name in names:
            drv = self._driver(name)
            begin = self._begin(name, entries)
            drv.ack(begin)
            drv.address.release_due()  # scheduled messages that are due join this batch
            state = drv.address.state
            if begin >= state.next_seq:
                # everything before damage to the journal was read: fail the query, naming it
                drv.address.log.check_damage()
            seen[name] = state.next_seq
            target = state.next_seq
            if self._target is not None:
                target = min(self._target.setdefault(name, state.next_seq), target)
            begins[name], targets[name] = begin, target
        self._seen_end = seen
        limits = self._limits(limit)
        if self._target is not None and limits.min_rows is not None:
            limits = Limits(limits.rows, limits.bytes, limits.pages)  # never wait in AvailableNow
        # nothing new: the offset Spark already has (an expiry cutoff in it included), or Spark
        # would take a changed offset for new data and run empty batches
        if self._delay(sum(max(0, targets[n] - begins[n]) for n in targets)):
            return start
        backlog = {n: max(0, targets[n] - begins[n]) for n in targets}
        if len(backlog) > 1 and limits.min_rows is not None and \
                sum(backlog.values()) < limits.min_rows:
            return start  # Spark's ReadMinRows, for the addresses together
        shares = share_limits(limits, backlog)
        ends = dict(entries)
        moved = False
        for name, begin in begins.items():
            drv = self._drivers[name]
            end = admit(drv.address.state.pages, begin, targets[name], shares[name],
                        drv.selector)
            if end <= begin:
                continue
            moved = True
            drv.planned = end
            entry: dict[str, Any] = {"seq": end}
            now = time.time()
            expire_before = drv.address.settings.expire_before(now)
            if expire_before is not None:
                # the batch's expiry as of its plan, in its offset: a replay reads the same rows
                entry["expire_before"] = expire_before
            if drv.address.state.ttl:  # messages sent with ttl_ms: the time they are judged at
                entry["ttl_now"] = int(now * 1e6)
            ends[name] = entry
        return self._offset(ends) if moved else start

    def _delay(self, available: int) -> bool:
        """``minOffsetsPerTrigger`` with Kafka's semantics: hold the next micro-batch back
        while fewer messages are available (in all addresses together), but never longer than
        ``maxTriggerDelay`` since the last batch went ahead. ``Trigger.AvailableNow`` never
        waits."""
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
        """Driver, right after ``latestOffset``: the logs' ends, for the query's progress
        reports; the ends that ``latestOffset`` just saw (an idle query calls both every 10 ms:
        a second look at the logs would double their reads, a request each on object stores)."""
        seen, self._seen_end = self._seen_end, None
        if seen is None:
            seen = {n: self._driver(n).address.state.next_seq for n in self._names()}
        if not seen and not self.opts.selection.several:
            return None
        return self._offset({n: {"seq": end} for n, end in seen.items()})

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        """Driver: cut ``[start, end)`` of each address into tasks (also when a restart
        re-plans a batch)."""
        begins = self._entries(start)
        ends = self._entries(end)
        total = {}
        for name, entry in ends.items():
            if name in begins and offset_seq(begins[name]) >= offset_seq(entry):
                continue
            total[name] = (self._begin(name, begins), offset_seq(entry))
        messages = sum(e - b for b, e in total.values())
        planned: list[QueuePartition] = []
        for name, (begin, stop) in total.items():
            # several addresses share the task slots by their messages
            weight = (stop - begin) / messages if len(total) > 1 else 1.0
            planned += self._address_partitions(name, begin, stop, ends[name], weight)
        if not self.opts.selection.several or self.opts.min_partitions is not None:
            return planned
        return group_partitions(planned, self.opts.task_slots)

    def _address_partitions(self, name: str, begin: int, stop: int, end: Mapping[str, Any],
                            weight: float) -> list[QueuePartition]:
        drv = self._driver(name)
        state = drv.address.state
        # With a selector, cleanup drops pages it cannot match, so only what repair or
        # retention recorded as lost counts; without one, every hole does (it covers theirs).
        gaps = (drv.address.snapshot().gaps(begin, stop) if drv.selector is None
                else state.lost_in(begin, stop))
        changed = [(a, b) for a, b, _ in drv.consumer.lost_in(begin, stop)]
        if gaps:
            data_loss(self.opts, (
                f"messages _seq {seq_ranges_text(gaps)} of address {name!r} are "
                f"gone although consumer {self.opts.consumer!r} had not acknowledged them "
                "(removed by retention, retentionMs / retentionBytes; pages deleted by hand; "
                "damaged pages removed by repair; or the query restarted from an old "
                "checkpoint)"))
        if changed:
            why = drv.consumer.lost_in(begin, stop)[0][2]
            data_loss(self.opts, (
                f"messages _seq {seq_ranges_text(changed)} of address {name!r} "
                f"are lost to consumer {self.opts.consumer!r}: its {why}, and cleanup had "
                "removed them because the old selector could not match them. Use a new "
                "consumer name to read with the new selector from the start"))
        slots = self.opts.task_slots
        if weight < 1.0:
            slots = max(1, round((slots or parallelism()) * weight))
        # rows a Python client of the consumer acknowledged above its watermark are not read
        runs = drv.consumer._unsettled_in(begin, stop)
        tasks = plan_tasks(state.pages, begin, stop, selector=drv.selector, slots=slots,
                           min_tasks=self.opts.min_partitions,
                           runs=None if runs == [(begin, stop)] else runs)
        return partitions(tasks, drv.address, offset_expiry(end), ttl_now=offset_ttl_now(end),
                          name=name if self.opts.selection.several else None)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Executor: the messages of one task, as Arrow record batches."""
        return read_partition(self.opts, self.output, self.opts.selector, self._extra,
                              partition)

    def commit(self, end: dict) -> None:
        """Driver, after Spark committed the batch ending at ``end``: acknowledge it in each
        address (the consumers' durable watermarks move; cleanup may remove pages every
        consumer passed)."""
        entries = self._entries(end)
        present = set(self._names()) if self.opts.selection.patterns else set(entries)
        for name, entry in entries.items():
            if name in present:
                self._driver(name).ack(offset_seq(entry))

    def stop(self) -> None:
        """Driver, when the query ends (not always called: a killed query's lease expires)."""
        for drv in self._drivers.values():
            drv.lease.release()
