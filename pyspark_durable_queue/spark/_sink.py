"""The Spark sink: ``df.write`` / ``df.writeStream`` ``.format("durablequeue")``.

How a write flows:

1. **Driver, query start.** Spark builds the writer (``DurableQueueDataSource.writer`` or
   ``streamWriter``). The constructor validates every option, opens (or creates) the address with
   the settings given as options, converts the DataFrame's schema to Arrow and checks it against
   the address's schema, so mistakes fail before any task runs.
2. **Executors, one task per partition.** :meth:`write` receives Arrow record batches (no per-row
   Python), writes them into new page files with a
   :class:`~pyspark_durable_queue._format.page.PageWriter` and returns a small
   :class:`DurableQueueCommitMessage` naming the pages. Pages are invisible until committed; a
   task that fails deletes what it wrote, a task that is killed leaves orphans that
   ``Address.cleanup`` removes after ``orphanGraceMs``.
3. **Driver, commit.** All pages of the batch are published by one commit-log entry, so a batch
   is all-or-nothing. The address-full policy is applied here (DROP / FAIL / BLOCK). Streaming
   commits carry the transaction ``(query id, batch id)``: the query id is stable across restarts
   from one checkpoint, so a micro-batch that Spark re-runs after a driver crash is recognised
   and not appended twice (its new pages are deleted). A batch ``df.write`` may carry the
   transaction ``(txnAppId, txnVersion)`` (Delta Lake's option names): a write whose version the
   address already holds for that app id (or a later one) is skipped, which makes a retried
   ``foreachBatch`` idempotent. It is the client's ``send(txn=(app id, version))`` transaction:
   both are keyed ``"app:" + app id`` (see :mod:`.._log.txn`).

Routing: a DataFrame with an ``_address`` column and no ``address`` option writes each row to
the address it names (the option wins when both are given; ``_address`` is never stored). Each
task writes pages per address; the driver commits each address in its own entry under the same
transaction key, so a re-run after a crash between two of them stores the batch once in each.

Spark runs the streaming ``commit`` in a fresh Python process on the driver that builds a new
writer, so everything a commit needs travels in the commit messages or is recomputed from the
options.

Time zones: Spark hands timestamps to Python as ``timestamp[us, tz=<session time zone>]``. Arrow
stores timestamps as UTC instants whatever the zone label says, so the sink stores them as
``timestamp[us, tz=UTC]``: the instant is kept exactly and the stored data does not depend on the
writer's ``spark.sql.session.timeZone``. ``TIMESTAMP_NTZ`` stays ``timestamp[us]`` (no zone).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from .._format.schema import RESERVED_COLUMNS, conform_schema, with_ttl
from .._log.txn import app_id, app_txn, committed, streaming_txn
from ..address import Address, CommitResult
from ..errors import InvalidOptionError, SchemaMismatchError
from ..queue import DurableQueue
from ..settings import WriteSettings, absolute_path
from ._reader import ADDRESS_COLUMN

__all__ = [
    "DurableQueueBatchWriter",
    "DurableQueueCommitMessage",
    "DurableQueueStreamWriter",
    "spark_to_arrow_schema",
]

log = logging.getLogger(__name__)

@dataclass
class DurableQueueCommitMessage(WriterCommitMessage):
    """What one write task reports to the driver: the pages it wrote (not yet visible).

    Small and picklable: page names, counts and statistics, no data.

    Attributes
    ----------
    pages : list
        The pages as the task's page writer described them (``PageWriter.close()``), in write
        order; the driver hands them back to ``Address.commit`` or ``Address.discard``.
    rows : int
        Rows written by the task.
    query_id : str or None
        The streaming query's id (``None`` for a batch ``df.write``).
    batch_id : int or None
        The micro-batch id seen by the task (``None`` for a batch write).
    routed : dict
        A write routed by an ``_address`` column: the pages of each address (``pages`` is then
        empty).
    """

    pages: list[Any] = field(default_factory=list)
    rows: int = 0
    query_id: str | None = None
    batch_id: int | None = None
    #: a write routed by its ``_address`` column: the pages written for each address
    routed: dict[str, list[Any]] = field(default_factory=dict)


def spark_to_arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema the sink stores for a Spark schema.

    Timestamps with a time zone become ``timestamp[us, tz=UTC]`` (see the module docstring);
    strings and binaries use the 32-bit offset types, as the Python client does.

    Raises
    ------
    SchemaMismatchError
        A column's type has no Arrow equivalent, or uses a reserved system column name.
    """
    from pyspark.sql.pandas.types import to_arrow_schema

    reserved = [f.name for f in schema.fields if f.name in RESERVED_COLUMNS]
    if reserved:
        raise SchemaMismatchError(
            f"columns {reserved} are reserved for the store's system columns (_seq, _timestamp "
            "are added to every message); drop or rename them before writing, e.g. "
            "df.drop('_seq', '_timestamp') when forwarding from another address")
    try:
        return to_arrow_schema(schema, error_on_duplicated_field_names_in_struct=True,
                               timezone="UTC", prefers_large_types=False)
    except Exception as exc:  # pyspark raises PySparkTypeError / TypeError for unsupported types
        raise SchemaMismatchError(
            f"the DataFrame schema cannot be stored in a durablequeue address: {exc}") from exc


class _DurableQueueWriterBase:
    """Shared by the batch and the streaming writer: option checks, schema, task-side write.

    Built on the driver; pickled to the executors. It holds the address (URL, name, settings:
    a few hundred bytes) and the target Arrow schema, never a file handle or a cache.
    """

    _streaming = False

    def __init__(self, options: Mapping[str, Any], schema: StructType, overwrite: bool) -> None:
        routing = ADDRESS_COLUMN in schema.fieldNames()
        opts = WriteSettings.parse(options, streaming=self._streaming, overwrite=overwrite,
                                   routed=routing)
        self.merge_schema: bool = opts.merge_schema
        #: ``ttlMs``: every row written expires this long after its commit (None: never)
        self.ttl_ms: int | None = opts.ttl_ms
        #: where ``_address`` is in the rows Spark hands over (-1: none); not stored
        self._route_column = schema.fieldNames().index(ADDRESS_COLUMN) if routing else -1
        if routing:
            schema = StructType([f for f in schema.fields if f.name != ADDRESS_COLUMN])
        arrow = spark_to_arrow_schema(schema)
        self.queue = DurableQueue(opts.path, opts.storage_options)
        self._address_settings = opts.address_settings
        #: rows go to the address their ``_address`` names (no ``address`` option given)
        self.routed = routing and not opts.address
        #: the DataFrame's Arrow schema, without ``_address``
        self.arrow = arrow
        self.checkpoint: str | None = options.get("checkpointlocation")
        #: The user transaction of a batch write (namespaced key, version), or None.
        self.txn = None if opts.txn_app_id is None else app_txn(
            (opts.txn_app_id, opts.txn_version))
        self._targets: dict[str, _Target] = {}  # routed: opened lazily, per process
        self._skip = False
        if self.routed:
            return
        address = self.queue.address(opts.address, **opts.address_settings)
        # Check against the address's schema now (fail fast, naming the columns); the result is
        # the schema pages are written with: the address's own types, grown by new nullable
        # columns when mergeSchema is on.
        self._target = _Target(address, arrow, self.merge_schema, self.ttl_ms)
        self.address = address
        self.schema = self._target.schema
        # Already committed: the tasks need not write pages that commit would only delete.
        self._skip = self.txn is not None and committed(self.address.state.txns, self.txn)

    def _target_of(self, name: str) -> _Target:
        """Routed writes: the address ``name`` (created with the write's settings if new) and
        the schema its pages are written with, opened once per process."""
        target = self._targets.get(name)
        if target is None:
            address = self.queue.address(name, **self._address_settings)
            target = self._targets[name] = _Target(address, self.arrow, self.merge_schema,
                                                   self.ttl_ms)
        return target

    # -- executors ------------------------------------------------------------------------------
    def write(self, iterator: Iterator[pa.RecordBatch]) -> DurableQueueCommitMessage:
        """Called by Spark on an executor, once per task: write the task's rows into new pages
        (of the address each row's ``_address`` names, when routed).

        Returns the pages in a commit message; nothing is visible until the driver commits.
        On any error the pages written so far are deleted before the error propagates.
        """
        query_id, batch_id = _task_ids() if self._streaming else (None, None)
        if self._skip:
            for _ in iterator:  # Spark expects the task's input to be consumed
                pass
            return DurableQueueCommitMessage([], 0, query_id, batch_id)
        open_: dict[str, _Pending] = {}
        rows = 0
        try:
            for batch in iterator:
                if batch.num_rows == 0:
                    continue
                rows += batch.num_rows
                if self._route_column < 0:
                    self._pending(open_, "").add(batch)
                    continue
                route = batch.column(self._route_column)
                batch = batch.remove_column(self._route_column)  # _address is not stored
                if not self.routed:
                    self._pending(open_, "").add(batch)  # the address option wins
                    continue
                for name, part in _split(batch, route):
                    self._pending(open_, name).add(part)
            written = {name: p.close() for name, p in open_.items()}
        except BaseException:
            for p in open_.values():
                p.abort()
            raise
        if self.routed:
            return DurableQueueCommitMessage([], rows, query_id, batch_id, written)
        return DurableQueueCommitMessage(written.get("", []), rows, query_id, batch_id)

    def _pending(self, open_: dict[str, _Pending], name: str) -> _Pending:
        pending = open_.get(name)
        if pending is None:
            target = self._target if not name else self._target_of(name)
            pending = open_[name] = _Pending(target)
        return pending

    # -- driver ---------------------------------------------------------------------------------
    def _publish(self, messages: Sequence[WriterCommitMessage | None],
                 txn: tuple[str, int] | None) -> None:
        if not self.routed:
            pages = [p for m in _ours(messages) for p in m.pages]
            self._publish_to(self._target, pages, txn)
            return
        # Each address touched gets its own commit under the same key: a batch that Spark
        # re-runs after a driver crash between two of them finds the first done (its pages are
        # deleted) and completes the others; exactly once in every address.
        routed: dict[str, list[Any]] = {}
        for m in _ours(messages):
            for name, pages in m.routed.items():
                routed.setdefault(name, []).extend(pages)
        for name in sorted(routed):
            self._publish_to(self._target_of(name), routed[name], txn)

    def _publish_to(self, target: _Target, pages: list[Any],
                    txn: tuple[str, int] | None) -> CommitResult:
        address = target.address
        result = address.commit(pages, target.schema, txn=txn, merge_schema=self.merge_schema,
                                ttl=target.ttl_ms is not None)
        if result.dropped:
            log.warning("durablequeue: address %r is full, addressFullPolicy=DROP dropped %d "
                        "messages (counted in the address stats)", address.name,
                        sum(p.rows for p in pages))
        elif result.duplicate and txn is not None and app_id(txn[0]) is not None:
            log.warning("durablequeue: txnAppId=%r txnVersion=%d (or a later version) was "
                        "already committed to address %r; this write is skipped, not "
                        "appended again", app_id(txn[0]), txn[1], address.name)
        elif result.duplicate:
            log.warning("durablequeue: batch %s was already committed to address %r before "
                        "(Spark re-ran it after a restart); not appended again",
                        txn, address.name)
        # Orphans of killed tasks (and pages consumers have passed) go here too, at most every
        # cleanupIntervalMs across all processes.
        address.maybe_cleanup()
        return result

    def _discard(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        # Failed tasks report None and deleted their own pages; tasks that were killed leave
        # orphans for Address.cleanup (older than orphanGraceMs).
        for m in _ours(messages):
            if m.pages:
                self._target.address.discard(m.pages)
            for name, pages in m.routed.items():
                self._target_of(name).address.discard(pages)


class _Target:
    """One address a write goes to and the schema its pages are written with: the address's
    own types, grown by new nullable columns when ``mergeSchema`` is on (checked when built:
    a mismatch raises :class:`SchemaMismatchError` naming the columns). With ``ttl_ms``
    (``ttlMs``) the frames store it as the hidden TTL column, as ``send(rows, ttl_ms=N)``
    does."""

    def __init__(self, address: Address, arrow: pa.Schema, merge_schema: bool,
                 ttl_ms: int | None = None) -> None:
        self.address = address
        self.ttl_ms = ttl_ms
        _, self.schema = conform_schema(arrow.empty_table(), address.schema, merge_schema)
        self._types = [f.type for f in self.schema]
        self._not_null = [i for i, f in enumerate(self.schema) if not f.nullable]

    def stored(self, batches: list[pa.RecordBatch]) -> pa.RecordBatch | pa.Table:
        """``batches`` as one frame's rows, as they are stored (with the TTL column)."""
        data = self.gather(batches)
        if self.ttl_ms is None:
            return data
        table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
        return with_ttl(table, self.ttl_ms)

    def gather(self, batches: list[pa.RecordBatch]) -> pa.RecordBatch | pa.Table:
        if len(batches) == 1:
            return self.conform(batches[0])
        first = batches[0].schema
        if all(b.schema.equals(first) for b in batches):  # always so for Spark's batches
            return self.conform(pa.concat_batches(batches))
        parts = [self.conform(b) for b in batches]
        return pa.concat_tables([p if isinstance(p, pa.Table) else pa.Table.from_batches([p])
                                 for p in parts]).combine_chunks()

    def conform(self, batch: pa.RecordBatch) -> pa.RecordBatch | pa.Table:
        if batch.schema.equals(self.schema):
            return batch
        if self._types == [f.type for f in batch.schema] and batch.schema.names == \
                self.schema.names and not any(batch.column(i).null_count
                                              for i in self._not_null):
            # Spark's Arrow batches mark every field nullable; relabel without copying.
            return pa.RecordBatch.from_arrays(batch.columns, schema=self.schema)
        # Time zone relabel (metadata only), large -> small offsets, numeric widening, nulls
        # for address columns the DataFrame lacks; a value that does not fit raises
        # SchemaMismatchError naming the column.
        table, _ = conform_schema(pa.Table.from_batches([batch]), self.schema, True)
        return table


class _Pending:
    """The rows one task writes to one address: Spark's Arrow batches are often small
    (``spark.sql.execution.arrow.maxRecordsPerBatch``, 10,000 rows by default), so they are
    gathered into frames of the page writer's size first (bounded: one frame's worth of
    memory per address the task writes to)."""

    def __init__(self, target: _Target) -> None:
        self.target = target
        self.writer = target.address.page_writer()
        self.batches: list[pa.RecordBatch] = []
        self.bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self.batches.append(batch)
        self.bytes += batch.nbytes
        if self.bytes >= self.writer.frame_bytes:
            self.writer.write(self.target.stored(self.batches))
            self.batches, self.bytes = [], 0

    def close(self) -> list[Any]:
        if self.batches:
            self.writer.write(self.target.stored(self.batches))
            self.batches = []
        return list(self.writer.close())

    def abort(self) -> None:
        self.writer.abort()


def _split(batch: pa.RecordBatch, route: pa.Array) -> Iterator[tuple[str, pa.RecordBatch]]:
    """The rows of ``batch`` by the address ``route`` names for each."""
    if route.null_count:
        raise InvalidOptionError(
            f"{route.null_count} rows have a null {ADDRESS_COLUMN}: each row routed by the "
            f"{ADDRESS_COLUMN} column must name its address (or give the option 'address')")
    names = pc.unique(route).to_pylist()
    if len(names) == 1:
        yield str(names[0]), batch
        return
    for name in names:
        yield str(name), batch.filter(pc.equal(route, name))


def _ours(messages: Sequence[WriterCommitMessage | None]) -> list[DurableQueueCommitMessage]:
    return [m for m in messages if isinstance(m, DurableQueueCommitMessage)]


def _task_ids() -> tuple[str | None, int | None]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return None, None
    query_id = ctx.getLocalProperty("sql.streaming.queryId")
    batch = ctx.getLocalProperty("streaming.sql.batchId")
    return query_id, (int(batch) if batch is not None else None)


class DurableQueueBatchWriter(_DurableQueueWriterBase, DataSourceArrowWriter):
    """Writer of ``df.write.format("durablequeue").mode("append").save(root)``.

    All-or-nothing: the driver publishes every task's pages in one commit-log entry, or none.
    With ``txnAppId`` and ``txnVersion``, at most once per (app id, version).
    """

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:  # type: ignore[override]
        """Called by Spark on the driver once every task succeeded: publish all pages at once.

        Raises :class:`AddressFullError` (FAIL, or BLOCK after ``blockTimeoutMs``); nothing is
        stored then. A transaction (``txnAppId``/``txnVersion``) already committed stores
        nothing and logs a warning.
        """
        self._publish(messages, self.txn)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:  # type: ignore[override]
        """Called by Spark on the driver when a task failed: delete the pages written."""
        self._discard(messages)


class DurableQueueStreamWriter(_DurableQueueWriterBase, DataSourceStreamArrowWriter):
    """Writer of ``df.writeStream.format("durablequeue").start(root)``: exactly-once per
    micro-batch, keyed by ``(query id, batch id)``."""

    _streaming = True

    def commit(self, messages: list[WriterCommitMessage | None],  # type: ignore[override]
               batchId: int) -> None:
        """Called by Spark on the driver (in a fresh Python process) when every task of
        micro-batch ``batchId`` succeeded: publish its pages in one entry, exactly once."""
        ours = _ours(messages)
        query_ids = {m.query_id for m in ours if m.query_id}
        if len(query_ids) > 1:
            self._discard(messages)
            raise RuntimeError(f"commit messages of batch {batchId} come from several queries "
                               f"{sorted(query_ids)}; refusing to commit")
        # No task reported a query id (none ran with rows): keyed by the checkpoint instead.
        txn = streaming_txn(batchId, query_id=query_ids.pop() if query_ids else None,
                            checkpoint=absolute_path(self.checkpoint) if self.checkpoint
                            else None)
        stale = [m.batch_id for m in ours if m.batch_id is not None and m.batch_id != batchId]
        if stale:
            self._discard(messages)
            raise RuntimeError(f"commit of batch {batchId} received task results of batches "
                               f"{sorted(set(stale))}; refusing to commit")
        self._publish(messages, txn)

    def abort(self, messages: list[WriterCommitMessage | None],  # type: ignore[override]
              batchId: int) -> None:
        """Called by Spark on the driver when a task of ``batchId`` failed: delete the pages
        written; nothing becomes visible."""
        self._discard(messages)
