"""``spark.read.format("durablequeue")``: browse retained messages without acknowledging them.

Created by Spark from ``DurableQueueDataSource.reader`` in a driver-side planner process
(``partitions``, ``pushFilters``); ``read`` runs on executors. Shares planning, partitions and
options with the streaming source (both use ``_reader``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from .._format.schema import compile_selector, user_fields, with_system_schema
from .._read import EARLIEST, parallelism, plan_tasks, seq_ranges_text
from ..settings import ReadSettings
from ._reader import (
    ADDRESS_COLUMN,
    QueuePartition,
    data_loss,
    open_address,
    output_schema,
    partitions,
    read_names,
    read_partition,
    selector_fields,
)

__all__ = ["DurableQueueBatchReader"]

log = logging.getLogger(__name__)


def _pushdown_enabled() -> bool:
    """Whether ``spark.sql.python.filterPushdown.enabled`` is on for the read being planned.

    Spark fails the read when a reader implements ``pushFilters`` and the setting is off, and it
    tells the planner process only (``plan_data_source_read``, local ``enable_pushdown``). Its
    frame is looked up so that reads work either way; if it cannot be found (another Spark
    version), filters are pushed and Spark's own message explains the setting.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if "enable_pushdown" in frame.f_locals and "is_streaming" in frame.f_locals:
            return bool(frame.f_locals["enable_pushdown"])
        frame = frame.f_back  # type: ignore[assignment]
    return True


class DurableQueueBatchReader(DataSourceReader):
    """``spark.read.format("durablequeue")``: browse retained messages without acknowledging,
    from ``startingPosition`` or, with ``consumer``, from that consumer's watermark. The
    ``selector`` option filters them.

    Created by Spark from :meth:`DurableQueueDataSource.reader` in a driver-side planner
    process; when ``spark.sql.python.filterPushdown.enabled`` is on, the instance is a
    subclass that also implements ``pushFilters``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is DurableQueueBatchReader and args and _pushdown_enabled():  # not unpickling
            cls = _PushdownReader
        return super().__new__(cls)

    def __init__(self, options: Mapping[str, Any], schema: StructType) -> None:
        self.opts = ReadSettings.parse(options, streaming=False)
        self.schema = schema
        self.output = output_schema(schema)
        self._extra = selector_fields(self.opts, self.output, self.opts.selector)
        self.pushed: str | None = None

    def _selector_text(self) -> str | None:
        parts = [f"({t})" for t in (self.opts.selector, self.pushed) if t]
        return " AND ".join(parts) if parts else None

    def partitions(self) -> Sequence[InputPartition]:
        """Driver, once: the retained messages (from the consumer's watermark, if given) of
        each address read."""
        names = read_names(self.opts)
        planned: list[QueuePartition] = []
        for name in names:
            planned += self._address_partitions(name, len(names))
        return planned or [QueuePartition([])]

    def _address_partitions(self, name: str, count: int) -> list[QueuePartition]:
        o = self.opts
        address = open_address(o, name)
        state = address.snapshot()  # positions in time are found in journal rows too
        if o.consumer:
            start = address.consumer(o.consumer, create=False).position
        else:
            start = (o.start or EARLIEST).resolve(state)
        end = state.next_seq if o.end is None else o.end.resolve(state)
        if state.damage is not None and end >= state.next_seq:
            # it reads to the end, where the journal is damaged: not a silently short read
            raise state.damage
        if o.end is not None and end > state.next_seq:
            log.warning("endingOffsets=%s is past the end of address %r (_seq %d): reading to "
                        "the end; a later read with the same options may return more", o.end,
                        name, state.next_seq)
            end = state.next_seq
        if o.end is not None and o.end.kind == "time" and o.end.value > time.time() * 1e6:
            log.warning("endingTimestamp=%s is in the future: a later read with the same "
                        "options may return more", o.end)
        if (o.start is not None and o.start.kind == "seq") or o.end is not None:
            # an explicit range promises the same rows on every run: say when some are gone
            gaps = state.gaps(start, end)  # pages of expired messages are not gone
            if gaps:
                data_loss(o, f"messages _seq {seq_ranges_text(gaps)} of the requested range of "
                              f"address {name!r} are no longer retained (removed by "
                              "cleanup once every consumer had passed them, or by repair)")
        text = self._selector_text()
        selector = (compile_selector(text, state.schema) if text and state.schema is not None
                    else None)
        slots = o.task_slots
        if count > 1:  # the addresses share the task slots
            slots = max(1, (slots or parallelism()) // count)
        tasks = plan_tasks(state.pages, start, end, selector=selector, slots=slots,
                           min_tasks=o.min_partitions)
        # expiry and TTLs as of the plan: every task drops the same messages
        now = time.time()
        return partitions(tasks, address, address.settings.expire_before(now),
                          name=name if o.selection.several else None, ttl_now=int(now * 1e6))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Executor: the messages of one task; pages removed by cleanup meanwhile are skipped."""
        return read_partition(self.opts, self.output, self._selector_text(), self._extra,
                              partition, skip_removed=True)


class _PushdownReader(DurableQueueBatchReader):
    """A batch reader that also takes Spark's ``where`` conditions."""

    def pushFilters(self, filters: list[Any]) -> Any:
        """Driver, once, while planning: filters become part of the selector (pages and rows
        are pruned); all of them are returned, so Spark still checks them on what is read."""
        from ._filters import filters_to_selector

        arrow = with_system_schema(user_fields(self.output.remove(
            self.output.get_field_index(ADDRESS_COLUMN)) if ADDRESS_COLUMN in self.output.names
            and self.opts.selection.several else self.output))
        self.pushed, _ = filters_to_selector(list(filters), arrow)
        return filters
