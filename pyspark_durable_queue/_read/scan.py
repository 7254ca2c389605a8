"""Navigating pages: the messages of a ``_seq`` range, filtered by a selector.

Shared by the Python consumer and the Spark reader. Pages (and frames inside a page) whose
statistics prove the selector cannot match are skipped without being read, which is what keeps a
restrictive selector from stalling behind a million non-matching messages (the Artemis caveat).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from .._bounded import BoundedLRU
from .._format.page import TAIL_GUESS, DecodedPage, read_footer, read_frames, read_page
from .._format.schema import (
    TIMESTAMP,
    TIMESTAMP_TYPE,
    TTL,
    as_schema,
    ttl_alive,
    ttl_horizon,
    with_system_schema,
)
from .._log.index import PageIndex, PageRef
from .._log.journal import read_units, seek_units
from .._log.state import subtract_ranges
from .._storage import NotFound, Storage
from ..errors import DataLossError
from .cache import PageCache, page_cache

if TYPE_CHECKING:
    from .._format.layout import AddressLayout
    from .._log.state import LogState
    from .._selector import Selector

__all__ = ["Scan", "Snapshot"]

#: What a scan yields: ``(batch or None, the _seq after what was examined)``.
Batches = Iterator[tuple[pa.RecordBatch | None, int]]


def index_stats(index: PageIndex) -> Callable[[PageRef], dict[str, Any] | None]:
    """Look up a page's statistics in the index (parsed on first use)."""
    def lookup(ref: PageRef) -> dict[str, Any] | None:
        i = index.find(ref.seq)
        if i < len(index) and index.names[i] == ref.name:
            return index.stats(i)
        return None

    return lookup


def page_stats(index_stats: dict[str, Any], seq: int, rows: int, ts: int) -> dict[str, Any]:
    """User column statistics of a page (or frame) merged with its system column statistics:
    ``rows`` messages from ``_seq`` ``seq``, committed at ``ts`` (epoch microseconds)."""
    from .._format.stats import system_stats  # only selectors need statistics

    sys = system_stats(seq, seq + rows, ts // 1000)
    cols = dict(index_stats.get("columns", {}))
    if TIMESTAMP in cols:  # a compacted page's frames carry each message's commit time
        del sys["columns"][TIMESTAMP]
    cols.update(sys["columns"])
    return {"rows": rows, "columns": cols}


#: Page verdicts of selectors: planning every micro-batch of a selective consumer asks about
#: the same pages again.
_VERDICTS: BoundedLRU[tuple[str, str], bool] = BoundedLRU("selector page verdicts", 65536)


def page_may_match(selector: Selector, stats: dict[str, Any] | None, ref: PageRef) -> bool:
    """``selector.may_match`` of a page, remembered per (selector, page). A journal row
    without statistics (a run of small units, which may still grow) may always match; a
    journal row with statistics is one unit, which never grows (``PageIndex.add``)."""
    if not stats:
        return True
    # A page file's name is unique. A segment's is not (every address numbers its own): a
    # journal row's statistics carry the random id of the entry that gave them
    # (``_log.commit_log``, ``_log.state``); without one the verdict is not kept.
    token = ref.name if ref.span is None else stats.get("id")
    if token is None:
        return bool(selector.may_match(page_stats(stats, ref.seq, ref.rows, ref.ts)))
    key = (selector.text, token)
    known = _VERDICTS.get(key)
    if known is None:
        known = bool(selector.may_match(page_stats(stats, ref.seq, ref.rows, ref.ts)))
        _VERDICTS.put(key, known)
    return known


def frame_numbers(ref: PageRef, frames: list[dict[str, Any]]) -> range:
    """The frames of a page file that ``ref`` references, in order (all without a range)."""
    return range(len(frames)) if ref.frames is None else range(*ref.frames)


def add_system_columns(batch: pa.RecordBatch, first_seq: int,
                       ts_us: int | pa.Array) -> pa.RecordBatch:
    """``batch`` with ``_seq`` from ``first_seq`` and ``_timestamp``: ``ts_us`` for every
    message (its commit's time), or one per message (a compacted frame's column)."""
    n = batch.num_rows
    # From buffers, not pa.array(ndarray): that probes for pandas types and so imports pandas
    # (memory in every Spark worker).
    seq = pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(
        np.arange(first_seq, first_seq + n, dtype=np.int64))])
    if isinstance(ts_us, int):
        ts = pa.Array.from_buffers(TIMESTAMP_TYPE, n, [None, pa.py_buffer(
            np.full(n, ts_us, dtype=np.int64))])
    else:
        ts = ts_us.cast(TIMESTAMP_TYPE)
    return pa.RecordBatch.from_arrays([*batch.columns, seq, ts],
                                      schema=with_system_schema(batch.schema))


class Scan:
    """The messages ``start <= _seq < end`` of the pages ``refs`` that the selector takes:
    iterating yields ``(batch, position)``.

    ``batch`` carries the user columns of ``schema`` plus ``_seq`` and ``_timestamp``; it is
    ``None`` when a page or frame was skipped. ``position`` is the ``_seq`` after the last
    message examined, so callers can advance a cursor past skipped data too. Nothing is read
    before the first item is asked for.

    Iterating walks the pages in order (:meth:`__iter__`). A page whose statistics rule the
    selector out is skipped unread; a journal row is read unit by unit (:meth:`journal_row`);
    a page file is read whole through the cache, or only the frames a selector or slice needs
    (:meth:`page`, :meth:`fetch`); a page found missing is read from the pages that hold its
    messages now, or reported lost (:meth:`missing`).

    Single use and single-threaded: ``refs`` is consumed by the walk. ``cache`` is the shared
    page cache, safe between threads on its own.

    Parameters
    ----------
    stats : callable, optional
        A page's statistics (or ``None``), for skipping whole pages without reading them.
    range_reads : bool
        Read only the frames of ``[start, end)`` when that is under half of an uncached page,
        even without a selector: for Spark tasks that each read a slice of a large page (the
        other slices are read by other tasks, so caching the whole page would not pay).
    resolve : callable, optional
        ``resolve(first, end)``: the live pages holding ``[first, end)`` as the log is now.
        A page found missing whose messages the log now holds in other pages (compaction
        swapped them in after ``refs`` were taken) is read from those; without it, or when
        the log does not hold them either, the page is lost.
    ttl_now : int, optional
        Drop the messages sent with a TTL (``send(rows, ttl_ms=N)``) that expired by then
        (epoch microseconds); ``None``: return them. Only frames that store a TTL column are
        looked at; :attr:`ttl_horizon` is the earliest deadline of those kept.
    """

    def __init__(self, storage: Storage, pages_folder: str, refs: Iterable[PageRef],
                 start: int, end: int, *, schema: pa.Schema, selector: Selector | None = None,
                 stats: Callable[[PageRef], dict[str, Any] | None] | None = None,
                 cache: PageCache | None = None, fail_on_data_loss: bool = True,
                 range_reads: bool = False,
                 resolve: Callable[[int, int], Iterable[PageRef]] | None = None,
                 ttl_now: int | None = None) -> None:
        self.storage = storage
        self.pages_folder = pages_folder
        self.refs = refs
        self.start = start
        self.end = end
        self.schema = schema
        #: ``schema`` with the system columns: what every yielded batch carries.
        self.full_schema = with_system_schema(schema)
        self.selector = selector
        self.stats = stats
        self.cache = cache or page_cache()
        self.fail_on_data_loss = fail_on_data_loss
        self.range_reads = range_reads
        self.resolve = resolve
        self.ttl_now = ttl_now
        #: The earliest TTL deadline (epoch microseconds) of the messages yielded so far
        #: (with ``ttl_now``); ``None``: none of them has a TTL. Until then, none of them
        #: expired by its TTL (a consumer's read-ahead is good until then).
        self.ttl_horizon: int | None = None

    def __iter__(self) -> Batches:
        """Walk the pages in range with their verdicts computed one page ahead, so the next
        page that will be read can be loaded in the background while this one is decoded."""
        in_range = ((ref, self.needed(ref)) for ref in self.refs if ref.end > self.start)
        current = next(in_range, None)
        while current is not None and current[0].seq < self.end:
            ref, wanted = current
            current = next(in_range, None)
            stop = min(ref.end, self.end)
            if not wanted:
                yield None, stop
            elif ref.span is not None:
                yield from self.journal_row(ref, stop)
            else:
                if current is not None and current[1]:
                    self.read_ahead(current[0])
                yield from self.page(ref, stop)

    def needed(self, ref: PageRef) -> bool:
        """Whether the selector may match ``ref`` by its statistics (no statistics: yes)."""
        if self.selector is None or self.stats is None:
            return True
        known = self.stats(ref)
        return known is None or page_may_match(self.selector, known, ref)

    def read_ahead(self, ref: PageRef) -> None:
        """Start loading the page file ``ref`` into the cache (a journal row: nothing)."""
        if ref.seq < self.end and ref.span is None:
            self.cache.prefetch(self.path(ref), self.loader(ref), ref.bytes)

    def journal_row(self, ref: PageRef, stop: int) -> Batches:
        """The messages of a journal row up to ``stop`` (its units, each with its own commit
        time); a segment found missing is handled by :meth:`missing` from where it stopped."""
        assert ref.span is not None
        lo = at = max(self.start, ref.seq)
        unit_filter = self.unit_may_match if self.selector is not None else None
        try:
            for unit in read_units(self.storage, self.path(ref), ref.span, lo, stop,
                                   unit_filter):
                if unit.skipped:
                    at = min(unit.seq + unit.skipped, stop)
                    yield None, at
                    continue
                seq = unit.seq
                for batch in unit.batches:
                    fseq, seq = seq, seq + batch.num_rows
                    if seq <= lo:
                        continue
                    if fseq >= stop:
                        return
                    a, at = max(lo, fseq), min(seq, stop)
                    yield self.messages(batch, fseq, a, at, unit.ts), at
        except NotFound as exc:
            yield from self.missing(ref, at, stop, "journal segment", exc)

    def page(self, ref: PageRef, stop: int) -> Batches:
        """The messages of a page file up to ``stop``, frame by frame; frames not read (or
        ruled out by their statistics) come as ``None``."""
        try:
            frames, batches, page = self.fetch(ref)
        except NotFound as exc:
            yield from self.missing(ref, max(self.start, ref.seq), stop, "page", exc)
            return
        seq = ref.seq
        for i in frame_numbers(ref, frames):
            frame = frames[i]
            fseq, seq = seq, seq + int(frame["rows"])
            if seq <= self.start:
                continue
            if fseq >= self.end:
                break
            lo, hi = max(self.start, fseq), min(seq, self.end)
            batch = batches.get(i)
            if batch is None or not self.frame_may_match(ref, frame, fseq):
                yield None, hi
                continue
            yield self.messages(batch, fseq, lo, hi, ref.ts), hi
        if page is not None:  # done with it: it stays cached, its memory goes back (mmap)
            page.release_memory()

    def fetch(self, ref: PageRef) -> tuple[list[dict[str, Any]], dict[int, pa.RecordBatch],
                                           DecodedPage | None]:
        """The page's frame index and its decoded frames: the whole page through the cache,
        or, when a selector (or a slice, with ``range_reads``) needs under half of an
        uncached page, only those frames (range reads guided by the footer; not cached)."""
        path = self.path(ref)
        sliced = self.range_reads and (self.start > ref.seq or self.end < ref.end)
        if (self.selector is not None or sliced) and not self.cache.peek(path):
            frames = self.footer(ref)["frames"]
            wanted, need = self.wanted_frames(ref, frames)
            if need * 2 < ref.bytes:
                got = read_frames(self.storage, path, frames, wanted)
                self.cache.note_read(need)
                return frames, got, None
        page = self.cache.get(path, self.loader(ref))
        return page.frames, dict(enumerate(page.batches)), page

    def footer(self, ref: PageRef) -> dict[str, Any]:
        """The footer of the page file ``ref`` (its frame index), through the cache."""
        path = self.path(ref)

        def load() -> dict[str, Any]:
            self.cache.note_read(min(TAIL_GUESS, ref.bytes))
            return read_footer(self.storage, path, ref.bytes)

        return self.cache.footer(path, load)

    def wanted_frames(self, ref: PageRef, frames: list[dict[str, Any]]) -> tuple[list[int], int]:
        """The frames of ``ref`` holding messages in range that the selector may match, and
        how many bytes they are."""
        wanted, need, seq = [], 0, ref.seq
        for i in frame_numbers(ref, frames):
            frame = frames[i]
            fseq, seq = seq, seq + int(frame["rows"])
            if seq > self.start and fseq < self.end and self.frame_may_match(ref, frame, fseq):
                wanted.append(i)
                need += int(frame["length"])
        return wanted, need

    def frame_may_match(self, ref: PageRef, frame: dict[str, Any], fseq: int) -> bool:
        """Whether the selector may match a page file's frame whose first is ``fseq``."""
        if self.selector is None or "stats" not in frame:
            return True
        return self.selector.may_match(
            page_stats(frame["stats"], fseq, int(frame["rows"]), ref.ts))

    def unit_may_match(self, stats: dict[str, Any], fseq: int, rows: int, ts: int) -> bool:
        """Whether the selector may match a journal unit's frame (``read_units``' filter)."""
        assert self.selector is not None
        return self.selector.may_match(page_stats(stats, fseq, rows, ts))

    def messages(self, batch: pa.RecordBatch, fseq: int, lo: int, hi: int,
                 ts: int) -> pa.RecordBatch:
        """Messages ``lo <= _seq < hi`` of a decoded frame whose first is ``fseq``: in the
        address schema, with the system columns, filtered by the selector."""
        part = batch.slice(lo - fseq, hi - lo) if (lo, hi) != (fseq, fseq + batch.num_rows) \
            else batch
        times = part.column(TIMESTAMP) if TIMESTAMP in part.schema.names else ts
        out = add_system_columns(as_schema(part, self.schema), lo, times)
        if not out.schema.equals(self.full_schema, check_metadata=False):
            out = out.cast(self.full_schema)
        if self.ttl_now is not None and TTL in part.schema.names:  # sent with ttl_ms
            ttl = part.column(TTL)
            out = ttl_alive(out, ttl, times, self.ttl_now)
            first = ttl_horizon(ttl, times, self.ttl_now)
            if first is not None and (self.ttl_horizon is None or first < self.ttl_horizon):
                self.ttl_horizon = first
        return self.selector.filter(out) if self.selector is not None else out

    def missing(self, ref: PageRef, lo: int, stop: int, what: str, exc: NotFound) -> Batches:
        """``[lo, stop)`` of a page (or journal segment) found missing: read from the pages
        that hold it now (compaction swapped it out), else lost (``fail_on_data_loss``)."""
        moved = self.relocated(ref, lo, stop)
        if moved is not None:
            yield from Scan(self.storage, self.pages_folder, moved, lo, stop, schema=self.schema,
                            selector=self.selector, cache=self.cache,
                            fail_on_data_loss=self.fail_on_data_loss,
                            range_reads=self.range_reads, resolve=self.resolve,
                            ttl_now=self.ttl_now)
        elif self.fail_on_data_loss:
            raise self.lost(ref, what) from exc
        else:
            yield None, stop

    def relocated(self, ref: PageRef, lo: int, stop: int) -> list[PageRef] | None:
        """The live pages that hold ``[lo, stop)`` of a missing page now, or ``None`` when no
        live pages hold all of it (removed by cleanup or repair, or lost)."""
        if self.resolve is None:
            return None
        moved = [r for r in self.resolve(lo, stop) if r.name != ref.name]
        at = lo
        for r in moved:
            if r.seq > at:
                return None
            at = max(at, r.end)
        return moved if at >= stop else None

    def lost(self, ref: PageRef, what: str) -> DataLossError:
        """The error for a page (or segment) that is gone with its messages."""
        return DataLossError(
            f"{what} {ref.name} holding _seq {ref.seq}..{ref.end - 1} is missing from "
            f"{self.pages_folder} although the commit log lists it (deleted by hand?); set "
            "failOnDataLoss=false to skip lost messages")

    def path(self, ref: PageRef) -> str:
        """The path of ``ref``'s file (page file or journal segment)."""
        return f"{self.pages_folder}/{ref.name}"

    def loader(self, ref: PageRef) -> Callable[[], DecodedPage]:
        """What the cache calls to read the page file ``ref`` whole."""
        path = self.path(ref)
        return lambda: read_page(self.storage, path)


def seek_page(storage: Storage, path: str, seq: int, ts_us: int) -> int | None:
    """The first ``_seq`` at or after ``ts_us`` in a compacted page whose first is ``seq``
    (``None``: none there, or not a page that stores its times)."""
    try:
        page = read_page(storage, path)
    except NotFound:
        return None
    for batch in page.batches:
        if TIMESTAMP not in batch.schema.names:
            return None
        times = batch.column(TIMESTAMP).cast(pa.int64()).to_numpy()
        i = int(np.searchsorted(times, ts_us, side="left"))
        if i < len(times):
            return seq + i
        seq += batch.num_rows
    return None


@dataclass(frozen=True)
class Snapshot:
    """An address's messages as one view of its commit log saw them: how the Python consumer
    and the CLI read an address (Spark tasks read planned page slices, see ``_read.tasks``).

    Immutable: it holds what it needs, captured when it was taken (:meth:`of`), never the
    live ``LogState``, which moves on as this process publishes and cleans up. The page index
    it holds is safe to keep: an index in a state only grows by appending pages at or after
    the state's ``next_seq`` (rows already in it never change), and a removal replaces the
    index instead of changing it (``PageIndex.without``); every query here stops at ``end``,
    so pages appended after the snapshot was taken are never seen.

    Attributes
    ----------
    storage : Storage
        Where the address's files are.
    pages_folder : str
        The address's pages folder.
    version : int
        The log version the view ends with (wait for the log to move past it for more).
    end : int
        The log's end: the ``_seq`` after the last message committed.
    first_seq : int
        The lowest retained ``_seq`` (``end`` when nothing is retained).
    schema : pyarrow.Schema or None
        The address's user schema (``None`` before the first send).
    lost : tuple of (int, int)
        ``[first, end)`` ranges that repair removed as damaged or retention removed before
        every consumer had passed them (see ``LogState.lost``, ``LogState.retention_lost``).
    retention : tuple of (int, int)
        Those of them that retention removed.
    """

    storage: Storage
    pages_folder: str
    version: int
    end: int
    first_seq: int
    schema: pa.Schema | None
    lost: tuple[tuple[int, int], ...] = ()
    pages: PageIndex = field(default_factory=PageIndex, repr=False, compare=False)
    #: Damage the log's readable part ends at (``CommitLog.damage``): a reader that reaches
    #: ``end`` raises it instead of waiting for more.
    damage: Exception | None = field(default=None, repr=False, compare=False)
    #: The live pages of a ``_seq`` range as the log is *now* (``Scan``'s ``resolve``): a
    #: page compaction swapped out after this view was taken is read from its successors.
    resolve: Callable[[int, int], Iterable[PageRef]] | None = field(
        default=None, repr=False, compare=False)
    retention: tuple[tuple[int, int], ...] = ()
    #: ``[first, end)`` ranges of pages cleanup removed because all their messages expired
    #: (``LogState.expired_removed``): settled for every consumer, so not :meth:`gaps`.
    expired: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, storage: Storage, layout: AddressLayout, state: LogState,
           resolve: Callable[[int, int], Iterable[PageRef]] | None = None,
           damage: Exception | None = None) -> Snapshot:
        """The snapshot of ``state`` (this process's view of the log, brought up to date).

        Read without the log's lock, in the order the fold writes (``LogState.apply`` sets
        ``version`` last): the version first, then the end, then the pages, so that the pages
        hold every message before ``end`` that is still retained and a wait for a version
        after ``version`` misses no commit past ``end``."""
        version = state.version
        end = state.next_seq
        pages = state.pages
        first = pages.seq[0] if len(pages) else end
        return cls(storage, layout.pages, version, end, min(first, end), state.schema,
                   tuple(state.lost) + tuple(state.retention_lost), pages, damage, resolve,
                   tuple(state.retention_lost), tuple(state.expired_removed))

    def refs(self, start: int, end: int | None = None) -> Iterator[PageRef]:
        """The pages overlapping ``[start, end)`` (``end``: the snapshot's end)."""
        return self.pages.refs(start, self.end if end is None else min(end, self.end))

    def gaps(self, start: int, end: int | None = None) -> list[tuple[int, int]]:
        """``[first, end)`` ranges in ``[start, end)`` that no page holds (removed), but for
        pages removed because all their messages expired."""
        gaps = self.pages.gaps(start, self.end if end is None else min(end, self.end))
        return subtract_ranges(gaps, self.expired) if self.expired and gaps else gaps

    def lost_in(self, begin: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[begin, end)`` that repair removed as damaged or retention removed
        (see ``lost``), in ``_seq`` order."""
        return sorted((max(a, begin), min(b, end)) for a, b in self.lost
                      if a < end and b > begin)

    @property
    def next_seq(self) -> int:
        """``end``, by the name a ``LogState`` gives it (positions resolve against either)."""
        return self.end

    def seek_time(self, ts_us: int) -> int:
        """The first ``_seq`` committed at or after ``ts_us`` (microseconds), ``end`` when
        none is retained."""
        def refine(ref: PageRef, ts: int) -> int | None:
            path = f"{self.pages_folder}/{ref.name}"
            if ref.span is None:  # a compacted page: its frames hold the times
                return seek_page(self.storage, path, ref.seq, ts)
            return seek_units(self.storage, path, ref.span, ts)

        return min(self.pages.seek_time(ts_us, self.end, refine), self.end)

    def messages(self, start: int, end: int | None = None, *, selector: Selector | None = None,
                 cache: PageCache | None = None, fail_on_data_loss: bool = True,
                 ttl_now: int | None = None) -> Iterable[tuple[pa.RecordBatch | None, int]]:
        """A :class:`Scan` of ``[start, end)`` (``end``: the snapshot's end), skipping pages the
        selector cannot match by their statistics; yields ``(batch or None, position after
        it)``. ``ttl_now``: see :class:`Scan` (the scan itself is returned: its
        ``ttl_horizon`` is read after the walk)."""
        if self.schema is None:
            return ()
        end = self.end if end is None else min(end, self.end)
        return Scan(self.storage, self.pages_folder, self.refs(start, end), start, end,
                    schema=self.schema, selector=selector,
                    stats=index_stats(self.pages) if selector is not None else None,
                    cache=cache, fail_on_data_loss=fail_on_data_loss,
                    resolve=self.resolve, ttl_now=ttl_now)
