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
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from .._format.schema import RESERVED_COLUMNS, conform_schema
from .._log.txn import app_id, app_txn, committed, streaming_txn
from ..address import CommitResult
from ..errors import SchemaMismatchError
from ..queue import DurableQueue
from ..settings import WriteSettings, absolute_path

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
    """

    pages: list[Any] = field(default_factory=list)
    rows: int = 0
    query_id: str | None = None
    batch_id: int | None = None


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
        opts = WriteSettings.parse(options, streaming=self._streaming, overwrite=overwrite)
        self.merge_schema: bool = opts.merge_schema
        self.address = DurableQueue(opts.path, opts.storage_options).address(
            opts.address, **opts.address_settings)
        arrow = spark_to_arrow_schema(schema)
        # Check against the address's schema now (fail fast, naming the columns); the result is
        # the schema pages are written with: the address's own types, grown by new nullable
        # columns when mergeSchema is on.
        _, self.schema = conform_schema(arrow.empty_table(), self.address.schema,
                                        self.merge_schema)
        self._types = [f.type for f in self.schema]
        self._not_null = [i for i, f in enumerate(self.schema) if not f.nullable]
        self.checkpoint: str | None = options.get("checkpointlocation")
        #: The user transaction of a batch write (namespaced key, version), or None.
        self.txn = None if opts.txn_app_id is None else app_txn(
            (opts.txn_app_id, opts.txn_version))
        # Already committed: the tasks need not write pages that commit would only delete.
        self._skip = self.txn is not None and committed(self.address.state.txns, self.txn)

    # -- executors ------------------------------------------------------------------------------
    def write(self, iterator: Iterator[pa.RecordBatch]) -> DurableQueueCommitMessage:
        """Called by Spark on an executor, once per task: write the task's rows into new pages.

        Returns the pages in a commit message; nothing is visible until the driver commits.
        On any error the pages written so far are deleted before the error propagates.
        """
        query_id, batch_id = _task_ids() if self._streaming else (None, None)
        if self._skip:
            for _ in iterator:  # Spark expects the task's input to be consumed
                pass
            return DurableQueueCommitMessage([], 0, query_id, batch_id)
        writer = self.address.page_writer()
        # Spark's Arrow batches are often small (spark.sql.execution.arrow.maxRecordsPerBatch,
        # 10,000 rows by default): they are gathered into frames of the writer's size first
        # (bounded: one frame's worth of memory).
        target = writer.frame_bytes
        pending: list[pa.RecordBatch] = []
        pending_bytes = 0
        rows = 0
        try:
            for batch in iterator:
                if batch.num_rows == 0:
                    continue
                pending.append(batch)
                pending_bytes += batch.nbytes
                rows += batch.num_rows
                if pending_bytes >= target:
                    writer.write(self._gather(pending))
                    pending, pending_bytes = [], 0
            if pending:
                writer.write(self._gather(pending))
            pages = writer.close()
        except BaseException:
            writer.abort()
            raise
        return DurableQueueCommitMessage(list(pages), rows, query_id, batch_id)

    def _gather(self, batches: list[pa.RecordBatch]) -> pa.RecordBatch | pa.Table:
        if len(batches) == 1:
            return self._in_address_schema(batches[0])
        first = batches[0].schema
        if all(b.schema.equals(first) for b in batches):  # always so for Spark's batches
            return self._in_address_schema(pa.concat_batches(batches))
        parts = [self._in_address_schema(b) for b in batches]
        return pa.concat_tables([p if isinstance(p, pa.Table) else pa.Table.from_batches([p])
                                 for p in parts]).combine_chunks()

    def _in_address_schema(self, batch: pa.RecordBatch) -> pa.RecordBatch | pa.Table:
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

    # -- driver ---------------------------------------------------------------------------------
    def _publish(self, messages: Sequence[WriterCommitMessage | None],
                 txn: tuple[str, int] | None) -> CommitResult:
        pages = [p for m in _ours(messages) for p in m.pages]
        result = self.address.commit(pages, self.schema, txn=txn, merge_schema=self.merge_schema)
        if result.dropped:
            log.warning("durablequeue: address %r is full, addressFullPolicy=DROP dropped %d "
                        "messages (counted in the address stats)", self.address.name,
                        sum(p.rows for p in pages))
        elif result.duplicate and txn is not None and app_id(txn[0]) is not None:
            log.warning("durablequeue: txnAppId=%r txnVersion=%d (or a later version) was "
                        "already committed to address %r; this write is skipped, not "
                        "appended again", app_id(txn[0]), txn[1], self.address.name)
        elif result.duplicate:
            log.warning("durablequeue: batch %s was already committed to address %r before "
                        "(Spark re-ran it after a restart); not appended again",
                        txn, self.address.name)
        # Orphans of killed tasks (and pages consumers have passed) go here too, at most every
        # cleanupIntervalMs across all processes.
        self.address.maybe_cleanup()
        return result

    def _discard(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        # Failed tasks report None and deleted their own pages; tasks that were killed leave
        # orphans for Address.cleanup (older than orphanGraceMs).
        self.address.discard(p for m in _ours(messages) for p in m.pages)


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
