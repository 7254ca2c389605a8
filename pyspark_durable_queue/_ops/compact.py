"""Compaction: runs of small pages of the live backlog rewritten as full pages of large frames,
swapped in with one commit-log entry.

Who calls it: ``Address.compact`` (the client, the CLI's ``compact``), and cleanup
(``Cleaner.maybe_cleanup``) once ``compactSmallPages`` of the backlog's pages are small.

Small pages pile up wherever commits are small: single sends on object stores and with
``journal=False`` (a page file per commit), short-lived producers, Spark streams with short
triggers (a page per task per micro-batch); a journal's rows are full segments but hold a frame
per commit. A consumer reads them a file, or a frame, at a time. Compaction reads a run of
adjacent small rows (page files under half of ``pageSizeBytes``, journal rows; a run's first
page file only once the rest is as big: ``plan_runs``) through the
ordinary reader, re-frames the messages into frames of about a MiB (``PageWriter``: checksums
and statistics computed afresh) and pages of ``pageSizeBytes``, and publishes a ``compact``
entry that replaces exactly those rows (``LogState._swap``). ``_seq`` never changes, and each
message keeps its commit time: a compacted frame stores ``_timestamp`` as a column, which
readers use instead of the row's commit time (``_read.scan.add_system_columns``), and its statistics
let selectors on ``_timestamp`` skip it as before. A message sent with ``ttl_ms`` keeps it the
same way: the hidden ``_ttl_ms`` column is read through (the scan's schema has it) and written
into the frames that hold such messages (a frame where no message has one leaves it out).

Safety, step by step:

* Before the swap the new pages are files no entry names (orphans if the process dies,
  collected by cleanup after ``orphanGraceMs``); they are synced, with their folder, before the
  entry is published.
* The swap is built on the freshest log (``CommitLog.publish``): if cleanup removed one of the
  rows, or another compaction replaced them, meanwhile, the swap is abandoned and the new pages
  deleted. A journal row that grew past what was read (its segment is still being written)
  keeps the rest as a row of its own.
* After the swap the replaced files are no longer listed; they stay for ``compactGraceMs``
  (``LogState.retired``) for readers that planned on them (a Spark task planned before the
  swap, a consumer's snapshot), then cleanup deletes them as orphans. A reader that finds one
  gone anyway reads the same ``_seq`` range from the pages the log holds now (``Scan``'s
  ``resolve``), so no reader misses or reads a message twice, however long it waited.

Memory: messages stream through one frame's worth of buffer and a private page cache of four
pages, whatever the backlog's size.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from .._format.page import FRAME_MAX_ROWS, FRAME_TARGET_BYTES, PageInfo, PageWriter
from .._format.schema import SEQ, TIMESTAMP, TTL, TTL_FIELD
from .._log.commit_log import LogState
from .._log.index import PageIndex, PageRef
from .._log.state import compact_entry
from .._read.cache import PageCache
from .._read.scan import Scan
from ..errors import DataLossError
from .context import OnAddress

__all__ = ["CompactReport", "Compactor", "small_rows"]

#: A page file under ``pageSizeBytes // SMALL_FRACTION`` is small.
SMALL_FRACTION = 2
#: Rows one swap replaces at most (its entry lists them).
MAX_REPLACED = 10_000
#: Passes of one ``compact()`` without a byte budget (see ``Compactor.compact``).
PASSES = 3

_CACHE: PageCache | None = None
_CACHE_LOCK = threading.Lock()


def _cache() -> PageCache:
    """Compaction's own page cache (4 pages: the one read and those read ahead), so that it
    does not evict the pages consumers of this process are reading."""
    global _CACHE
    with _CACHE_LOCK:
        if _CACHE is None:
            _CACHE = PageCache(max_pages=4)
        return _CACHE


@dataclass
class CompactReport:
    """What a compaction did (or, in a dry run, would do)."""

    dry_run: bool
    #: runs of adjacent small rows rewritten (or to rewrite)
    runs: int = 0
    #: rows of the page index they held: page files and journal rows
    pages_before: int = 0
    #: pages written (a dry run: the estimate, one per ``pageSizeBytes``)
    pages_after: int = 0
    messages: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    #: runs whose swap was abandoned: another process removed or replaced their rows meanwhile
    abandoned: int = 0
    #: the new pages' names
    pages: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "runs": self.runs, "pages_before": self.pages_before,
                "pages_after": self.pages_after, "messages": self.messages,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "abandoned": self.abandoned, "pages": self.pages}


def small_rows(state: LogState, page_size_bytes: int, *,
               open_segment: bool = True) -> list[int]:
    """For each row of the page index, how many small pieces compaction would rewrite in it
    (0: none, the row is left as it is): 1 for a page file under half a page; for a journal
    row whose commits average under half a frame (``PageWriter.frame_bytes``), its units
    (a frame per commit). ``open_segment``: also the rows of the journal segment still being
    written (which grow)."""
    idx = state.pages
    current = None
    if not open_segment and state.journal is not None:
        from .._log.journal import segment_name

        current = segment_name(state.journal.segment)
    small_page = page_size_bytes // SMALL_FRACTION
    small_unit = min(FRAME_TARGET_BYTES, page_size_bytes // 2) // SMALL_FRACTION
    out = []
    for i in range(len(idx)):
        if idx.spans[i] is None:
            out.append(1 if idx.bytes[i] < small_page else 0)
        elif idx.names[i] != current and idx.bytes[i] < small_unit * idx.units[i]:
            out.append(idx.units[i])
        else:
            out.append(0)
    return out


def plan_runs(state: LogState, small: list[int], needed: list[bool],
              max_bytes: int | None = None) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` to compact: adjacent small rows that a consumer still needs,
    at most :data:`MAX_REPLACED` rows and, in all, about ``max_bytes``. A lone page file is
    left as it is (rewriting it alone makes the same page); a lone journal row is not (its
    frames become large)."""
    idx = state.pages
    runs: list[tuple[int, int]] = []
    budget = max_bytes
    i, n = 0, len(small)
    while i < n and (budget is None or budget > 0):
        if not (small[i] and needed[i]):
            i += 1
            continue
        lo = i
        size = idx.bytes[i]
        i += 1
        while i < n and small[i] and needed[i] and idx.seq[i] == idx.ends[i - 1] \
                and i - lo < MAX_REPLACED and (budget is None or size < budget):
            size += idx.bytes[i]
            i += 1
        # Size-tiered: a page file bigger than the rest of the run after it (an earlier
        # compaction's part-filled output) is left until as much again is there to merge into
        # it, so each byte is rewritten O(log(page / commit)) times, not once per pass while
        # the backlog grows a commit at a time.
        rest = size - idx.bytes[lo]
        while i - lo >= 2 and idx.spans[lo] is None and idx.bytes[lo] > rest:
            lo += 1
            size, rest = rest, rest - idx.bytes[lo]
        if i - lo >= 2 or idx.spans[lo] is not None:
            runs.append((lo, i))
            if budget is not None:
                budget -= size
    return runs


class Compactor(OnAddress):
    """Compaction of one address (see the module docstring).

    Concurrency guarantee: compactions, cleanups, sends and readers in any number of processes
    may overlap. A swap replaces only rows that the freshest log still holds exactly as they
    were read; anything else abandons it.
    """

    def due(self) -> bool:
        """Whether ``compactSmallPages`` small pieces (page files, commits of a journal row;
        rolled segments only) are in the backlog."""
        threshold = self.settings.compact_small_pages
        if threshold <= 0:
            return False
        state, n = self._view()
        small = small_rows(state, self.settings.page_size_bytes, open_segment=False)[:n]
        needed = self._needed(state)[:n]
        pieces = sum(k for k, need in zip(small, needed, strict=True) if need)
        return pieces >= threshold and bool(plan_runs(state, small, needed))

    def compact(self, *, dry_run: bool = False, open_segment: bool = True,
                max_bytes: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> CompactReport:
        """Rewrite the backlog's runs of small rows as full pages (see the module docstring).

        ``open_segment``: also the rows of the journal segment being written; ``max_bytes``:
        stop after about this many bytes of small rows; ``progress(bytes read, bytes to
        read)`` is called as the runs are read.

        A run holds at most :data:`MAX_REPLACED` rows, so a long stretch of small rows is
        compacted as several runs, each ending in a part-filled page; without ``max_bytes`` a
        second pass (at most :data:`PASSES` in all) merges those. The report counts what was
        there before and what is there after (a page written and replaced again in one call
        counts in neither)."""
        report = CompactReport(dry_run=dry_run)
        for _pass in range(1 if dry_run or max_bytes is not None else PASSES):
            state, n = self._view()
            small = small_rows(state, self.settings.page_size_bytes,
                               open_segment=open_segment)[:n]
            runs = plan_runs(state, small, self._needed(state)[:n], max_bytes)
            if dry_run:
                self._estimate(state, runs, report)
                return report
            self._compact_runs(state, runs, report, progress)
            if not any(hi - lo >= MAX_REPLACED for lo, hi in runs):
                break  # no run was cut short: nothing left for another pass to merge
        return report

    # -- internals ------------------------------------------------------------------------------
    def _estimate(self, state: LogState, runs: list[tuple[int, int]],
                  report: CompactReport) -> None:
        """A dry run's report: adjacent runs (one long stretch cut at MAX_REPLACED rows)
        end up in ``ceil(bytes / pageSizeBytes)`` pages together."""
        idx, page = state.pages, self.settings.page_size_bytes
        stretch = 0
        for k, (lo, hi) in enumerate(runs):
            size = sum(idx.bytes[lo:hi])
            report.runs += 1
            report.pages_before += hi - lo
            report.messages += idx.ends[hi - 1] - idx.seq[lo]
            report.bytes_read += size
            stretch += size
            if k + 1 == len(runs) or runs[k + 1][0] != hi:
                report.pages_after += max(1, -(-stretch // page))
                stretch = 0

    def _compact_runs(self, state: LogState, runs: list[tuple[int, int]],
                      report: CompactReport,
                      progress: Callable[[int, int], None] | None) -> None:
        idx = state.pages
        total = sum(idx.bytes[i] for lo, hi in runs for i in range(lo, hi))
        # every run's references are taken now: this process's sends may grow the index's
        # last row in place while the runs are read (the swap keeps what grew)
        planned = [[idx.ref(i) for i in range(lo, hi)] for lo, hi in runs]
        done = 0
        if progress is not None:
            progress(0, total)
        for refs in planned:
            self._compact_run(state, refs, report,
                              None if progress is None else _offset(progress, done, total))
            done += sum(r.bytes for r in refs)

    def _view(self) -> tuple[LogState, int]:
        """The log as it is now, and how many rows of its index to plan on: a copy whose
        index other threads' removals and swaps do not replace (they replace the live
        state's), while this process's publishes may still append rows to it."""
        state = copy.copy(self.log.refresh())
        return state, len(state.pages)

    def _needed(self, state: LogState) -> list[bool]:
        """For each row, whether a consumer still needs it (cleanup takes the others)."""
        from .cleanup import consumed

        gone = set(consumed(state, list(self.consumers.all().values())))
        return [i not in gone for i in range(len(state.pages))]

    def _compact_run(self, state: LogState, refs: list[PageRef], report: CompactReport,
                     progress: Callable[[int], None] | None) -> None:
        assert state.schema is not None
        first, end = refs[0].seq, refs[-1].end
        writer = PageWriter(self.storage, self.layout.pages,
                            page_size_bytes=self.settings.page_size_bytes,
                            compression=self.settings.compression, make_folder=False)
        pieces: list[tuple[int, int, int]] = []  # rows, first and last commit time of each
        try:
            pending: list[pa.RecordBatch] = []
            size = rows = 0

            def flush() -> None:
                nonlocal pending, size, rows
                if not pending:
                    return
                chunk = pa.concat_batches(pending)
                pending, size, rows = [], 0, 0
                ttl = chunk.column(TTL)
                if ttl.null_count == len(ttl):  # no message of these has a TTL
                    chunk = chunk.drop_columns([TTL])
                # cut so that each piece is exactly one frame (see frame_batches)
                step = max(1, min(FRAME_MAX_ROWS,
                                  chunk.num_rows * writer.frame_bytes // max(1, chunk.nbytes)))
                for at in range(0, chunk.num_rows, step):
                    piece = chunk.slice(at, step)
                    times = piece.column(TIMESTAMP)
                    pieces.append((piece.num_rows, times[0].value, times[-1].value))
                    writer.write(piece)

            run_bytes = sum(r.bytes for r in refs)
            # one scan of the whole run: the next page is read ahead while this one is decoded
            # the hidden TTL column read through (frames without it: nulls), never applied
            schema = state.schema.append(TTL_FIELD)
            for batch, position in Scan(self.storage, self.layout.pages, refs, first, end,
                                        schema=schema, cache=_cache()):
                if batch is None or not batch.num_rows:
                    continue
                batch = batch.drop_columns([SEQ])
                pending.append(batch)
                size += batch.nbytes
                rows += batch.num_rows
                if size >= writer.frame_bytes or rows >= FRAME_MAX_ROWS:
                    flush()
                if progress is not None:
                    progress(run_bytes * (position - first) // (end - first))
            flush()
            pages = writer.close()
        except DataLossError:
            writer.abort()
            if self._still_held(refs):
                raise  # lost for everyone, not only for this compaction
            report.abandoned += 1  # removed (or replaced) under this compaction
            return
        except BaseException:
            writer.abort()
            raise
        if sum(p.rows for p in pages) != end - first:
            writer.abort()
            raise AssertionError(f"compaction of _seq {first}..{end - 1} read "
                                 f"{sum(p.rows for p in pages)} messages")
        self.storage.sync_folder(self.layout.pages)  # the new pages' entries, before the swap
        rows_of = _page_rows(pages, pieces, first)
        published = None
        try:
            published = self.log.publish(lambda st: _swap_entry(st, refs, rows_of))
        finally:
            if published is None:
                with contextlib.suppress(Exception):
                    writer.abort()
        if published is None:
            report.abandoned += 1
            return
        # pages this call wrote and now replaced again (a second pass) count in neither total
        again = {r.name for r in refs} & set(report.pages)
        report.runs += 1
        report.pages_before += len(refs) - len(again)
        report.pages_after += len(pages) - len(again)
        report.messages += sum(r.rows for r in refs if r.name not in again)
        report.bytes_read += sum(r.bytes for r in refs)
        report.bytes_written += sum(p.bytes for p in pages)
        report.pages = [p for p in report.pages if p not in again] + [p.name for p in pages]


    def _still_held(self, refs: list[PageRef]) -> bool:
        """Whether the freshest log still holds ``refs`` as they were read."""
        return _held(self.log.refresh().pages, refs) is not None


def _offset(progress: Callable[[int, int], None], base: int,
            total: int) -> Callable[[int], None]:
    return lambda done: progress(base + done, total)


def _page_rows(pages: list[PageInfo], pieces: list[tuple[int, int, int]],
               first: int) -> list[dict[str, Any]]:
    """The index rows of the new pages, with their first and last commit times from the
    pieces written (``(rows, first time, last time)`` each). A page ends where a frame does;
    should one end inside a piece, its times are bounds (earlier, later), never wrong."""
    out = []
    k, used, seq = 0, 0, first
    for page in pages:
        need, ts, ts_last = page.rows, pieces[k][1], pieces[k][2]
        while need > 0:
            take = min(need, pieces[k][0] - used)
            need -= take
            used += take
            ts_last = pieces[k][2]
            if used == pieces[k][0]:
                k, used = k + 1, 0
        out.append({"name": page.name, "seq": seq, "rows": page.rows, "bytes": page.bytes,
                    "ts": ts, "ts_last": ts_last, "stats": page.stats})
        seq += page.rows
    return out


def _held(idx: PageIndex, refs: list[PageRef]) -> tuple[int, int] | None:
    """The rows ``[lo, hi)`` of ``idx`` holding what ``refs`` were read from, or ``None`` when
    those rows are not the ones read (removed by cleanup, replaced by another swap)."""
    lo, hi = idx.covering(refs[0].seq, refs[-1].end)
    if [(idx.names[i], idx.seq[i]) for i in range(lo, hi)] != [(r.name, r.seq) for r in refs]:
        return None
    return lo, hi


def _swap_entry(state: LogState, refs: list[PageRef],
                rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``compact`` entry replacing ``refs`` on ``state`` (the freshest log), or ``None``
    when the log no longer holds them as they were read."""
    first, end = refs[0].seq, refs[-1].end
    idx: PageIndex = state.pages
    held = _held(idx, refs)
    if held is None:
        return None
    _lo, hi = held
    out = list(rows)
    last = hi - 1
    if idx.ends[last] > end:  # a journal row that grew since: the rest stays a row of its own
        span, read = idx.spans[last], refs[-1].span
        if span is None or read is None:
            return None
        out.append({"name": idx.names[last], "seq": end, "rows": idx.ends[last] - end,
                    "bytes": span[1] - read[1], "ts": rows[-1]["ts_last"],
                    "ts_last": idx.ts_last[last], "span": [read[1], span[1]]})
    return compact_entry(first, end, [[r.name, r.seq] for r in refs], out)
