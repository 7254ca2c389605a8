"""Statistics for the runs of small journal units in rolled segments.

A journal unit under ``STATS_MIN_BYTES`` (a single send, a few rows) carries no statistics:
computing them would cost a small send more than its write. The page index keeps a run of
such units as one row per segment (``PageIndex``), which a selector must read. Once the
segment has rolled, the run can no longer grow; maintenance (``Address.maybe_cleanup``, when
compaction is not due: compaction writes pages with statistics itself) then reads the run
once and publishes its statistics (an ``append`` of no pages that carries ``sealed``, see
``_log.state``). From then on selectors, the Spark
planner and cleanup skip the whole run as they skip a page file.

Who calls it: ``Address.maybe_cleanup`` (after commits and acknowledgements, at most every
``cleanupIntervalMs``) and ``Address.seal``. Nothing is rewritten: a ``sealed`` entry only
adds statistics to rows that had none, so a reader that planned without them is still right.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .._format.schema import TIMESTAMP
from .._log.commit_log import LogState
from .._log.index import PageRef
from .._log.journal import HEAD, read_units, segment_number
from .._log.state import append_entry
from .._storage import NotFound, Storage
from ..errors import DurableQueueError
from .cleanup import consumed
from .context import OnAddress

__all__ = ["SealReport", "Sealer", "seal_in_background", "unsealed_rows"]

log = logging.getLogger(__name__)

#: Rows are described a part of at most this many messages at a time (a run of single
#: sends decodes to one-row batches; statistics are computed on their concatenation).
_PART_ROWS = 65_536


@dataclass
class SealReport:
    """What one :meth:`Sealer.seal` did: rows given statistics, their messages and bytes."""

    rows: int = 0
    messages: int = 0
    bytes_read: int = 0


def unsealed_rows(state: LogState) -> list[int]:
    """The index rows of small journal units in rolled segments that have no statistics yet
    (the segment being written is left out: its run may still grow)."""
    if state.journal is None:
        return []
    idx, open_segment = state.pages, state.journal.segment
    return [i for i in range(len(idx))
            if idx.is_run(i) and segment_number(idx.names[i]) < open_segment]


def row_stats(storage: Storage, pages_folder: str, ref: PageRef) -> dict[str, Any]:
    """The statistics of the messages of the journal row ``ref`` (as a page file's footer
    holds them), its units read and decoded once: the user columns, and ``_timestamp`` from
    the first unit's commit time to the last one's (a run's messages were committed over a
    while; the row's ``ts`` is only the first). Runs of frames of one schema are described
    together; frames of an older schema describe their own columns, and merging leaves a
    column unknown unless every part knows it."""
    from .._format.stats import batch_stats, merge_stats

    assert ref.span is not None
    parts: list[dict[str, Any]] = []
    pending: list[pa.RecordBatch] = []
    count = 0

    def describe() -> None:
        parts.append(batch_stats(pa.Table.from_batches(pending).combine_chunks()))
        pending.clear()

    path = f"{pages_folder}/{ref.name}"
    first_ts = last_ts = None
    for unit in read_units(storage, path, ref.span, ref.seq, ref.end):
        first_ts = unit.ts if first_ts is None else first_ts
        last_ts = unit.ts
        for batch in unit.batches:
            if pending and not batch.schema.equals(pending[0].schema):
                describe()
                count = 0
            pending.append(batch)
            count += batch.num_rows
            if count >= _PART_ROWS:
                describe()
                count = 0
    if pending:
        describe()
    stats: dict[str, Any] = merge_stats(parts) if parts else {"rows": 0, "columns": {}}
    if first_ts is not None and last_ts is not None:
        # epoch milliseconds, truncated as the selector truncates (times are never negative)
        stats["columns"][TIMESTAMP] = {"null_count": 0, "min": first_ts // 1000,
                                       "max": last_ts // 1000, "unit": "ms"}
    return stats


class Sealer(OnAddress):
    """Publishes statistics for an address's sealed runs of small journal units.

    Concurrency: any process may seal; the entry is built on the freshest log
    under the publish lock and names each row by segment and first ``_seq``, so a row that
    another process sealed, compaction replaced or cleanup removed meanwhile is left out
    (two sealers at worst both read a run; one entry gives it statistics).
    """

    def seal(self, *, max_bytes: int | None = None, for_selectors: bool = False) -> SealReport:
        """Give the sealed runs that a consumer may still read (all of them without
        consumers: a new one may start at the earliest) statistics, oldest first, up to about
        ``max_bytes`` of them read (at least one run); one entry for all of them.
        ``for_selectors``: only when some consumer has a selector (nobody else skips)."""
        report = SealReport()
        consumers = list(self.consumers.all().values())
        if for_selectors and not any(c.get("selector") for c in consumers):
            return report
        state = self.log.refresh()
        idx = state.pages
        unneeded = set(consumed(state, consumers))
        found: list[list[Any]] = []
        idents: dict[str, bytes | None] = {}
        for i in unsealed_rows(state):
            if i in unneeded:
                continue  # every consumer is past it (or cannot match it): cleanup's
            if max_bytes is not None and report.bytes_read and \
                    report.bytes_read + idx.bytes[i] > max_bytes:
                break
            ref = idx.ref(i)
            found.append([ref.name, ref.seq, ref.rows,
                          row_stats(self.storage, self.layout.pages, ref)])
            idents[ref.name] = self._ident(ref.name)
            report.bytes_read += ref.bytes
        if not found:
            return report

        def build(fresh: LogState) -> dict[str, Any] | None:
            # the rows as read, in the segments read (an address deleted and made again
            # meanwhile numbers its segments afresh: their random ids differ)
            kept = [row for row in found
                    if fresh.pages.row_without_stats(*row[:3]) is not None
                    and self._ident(row[0]) == idents[row[0]]]
            if not kept:
                return None
            report.rows, report.messages = len(kept), sum(row[2] for row in kept)
            return append_entry(fresh.next_seq, [], sealed=kept)

        self.log.publish(build)
        return report

    def _ident(self, segment: str) -> bytes | None:
        """A segment's header (its random id), ``None`` when it is gone."""
        try:
            return self.storage.read_range(f"{self.layout.pages}/{segment}", 0, HEAD)
        except NotFound:
            return None


#: Pages folders being sealed in the background by this process (one thread per address).
_RUNNING: set[str] = set()
_RUNNING_LOCK = threading.Lock()


def seal_in_background(sealer: Sealer, max_bytes: int) -> bool:
    """Start ``sealer.seal(max_bytes=..., for_selectors=True)`` on a daemon thread, unless one
    is sealing the same address in this process; whether it started. Maintenance calls it
    after an acknowledgement or a Spark commit, which must not wait for a run to be read
    (a run of many single sends takes seconds). Best effort: a failure is logged; the next
    maintenance tries again."""
    key = sealer.layout.pages
    with _RUNNING_LOCK:
        if key in _RUNNING:
            return False
        _RUNNING.add(key)

    def run() -> None:
        try:
            sealer.seal(max_bytes=max_bytes, for_selectors=True)
        except DurableQueueError as exc:
            log.warning("%s: sealing failed and will be retried later: %s", key, exc)
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(key)

    threading.Thread(target=run, name=f"dq-seal {key}", daemon=True).start()
    return True


def _after_fork_in_child() -> None:
    _RUNNING.clear()  # the threads stayed in the parent


os.register_at_fork(after_in_child=_after_fork_in_child)
