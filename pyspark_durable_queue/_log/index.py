"""The live pages of an address, as the commit log describes them (``LogState.pages``), and
the one reference to published messages of a page (:class:`PageRef`).

Kept as parallel columns: a few dozen bytes per page, never per message. Readers plan on it
(which pages hold a ``_seq`` range, which may match a selector, where a time falls) without
touching page files; what they read, plan and clean up is a :class:`PageRef`, built from the
index by :meth:`PageIndex.ref` only.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .._bounded import BoundedLRU

__all__ = ["PARSED_STATS", "PageIndex", "PageRef"]

#: Parsed page statistics kept per process (an LRU shared by every index; page names are
#: unique): planning over a huge backlog does not hold every page's statistics in memory.
PARSED_STATS = 4096
_PARSED: BoundedLRU[str, dict[str, Any]] = BoundedLRU("parsed page statistics", PARSED_STATS)
#: The statistics text of a row without statistics (a journal row of small units).
_NONE = "{}"


@dataclass(frozen=True, slots=True)
class PageRef:
    """Published messages of one page file: what planning, reading and cleanup work on.

    Built from the index in one place, :meth:`PageIndex.ref`. Small and picklable (one tuple):
    task slices travel to Spark executors inside their partitions.

    Attributes
    ----------
    name : str
        The page file, in the address's pages folder.
    seq : int
        ``_seq`` of the first message referenced.
    rows : int
        Messages referenced: ``seq <= _seq < seq + rows`` (``end``).
    bytes : int
        Size of the page file.
    ts : int
        Commit time of the messages, epoch microseconds.
    frames : tuple of int, optional
        ``(first, stop)``: only the file's frames ``first <= i < stop`` are referenced, and
        ``seq`` is the first message of frame ``first``. ``None``: every frame of the file.
    lo, hi : int
        The ``_seq`` range to read, inside ``[seq, end)``: a task's slice (:meth:`slice`).
        Default: all of the reference.
    span : tuple of int, optional
        ``(offset, end)``: the published byte range of a journal segment (``_log.journal``) that
        holds the messages, a run of consecutive units; ``None`` for a page file. ``ts`` is
        then the first unit's commit time (each unit carries its own).
    """

    name: str
    seq: int
    rows: int
    bytes: int
    ts: int
    frames: tuple[int, int] | None = None
    lo: int = -1
    hi: int = -1
    span: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.lo < 0:
            object.__setattr__(self, "lo", self.seq)
        if self.hi < 0:
            object.__setattr__(self, "hi", self.seq + self.rows)

    def __reduce__(self) -> tuple[type[PageRef], tuple[Any, ...]]:
        # one flat tuple (a few dozen bytes), not a dataclass state dict
        return PageRef, (self.name, self.seq, self.rows, self.bytes, self.ts, self.frames,
                         self.lo, self.hi, self.span)

    @property
    def end(self) -> int:
        """The ``_seq`` after the last message referenced."""
        return self.seq + self.rows

    @property
    def whole(self) -> bool:
        """Whether the ``_seq`` range to read is all of the reference."""
        return self.lo <= self.seq and self.hi >= self.end

    @property
    def nbytes(self) -> int:
        """Bytes of ``[lo, hi)``, estimated from the file size (planning balances tasks by it)."""
        return self.bytes * (self.hi - self.lo) // max(1, self.rows)

    def slice(self, lo: int, hi: int) -> PageRef:
        """The same reference, reading only ``lo <= _seq < hi`` (clamped to it)."""
        return PageRef(self.name, self.seq, self.rows, self.bytes, self.ts, self.frames,
                       max(lo, self.seq), min(hi, self.end), self.span)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (``frames``, ``lo`` and ``hi`` only when they narrow the reference)."""
        out: dict[str, Any] = {"name": self.name, "seq": self.seq, "rows": self.rows,
                               "bytes": self.bytes, "ts": self.ts}
        if self.frames is not None:
            out["frames"] = list(self.frames)
        if not self.whole:
            out["lo"], out["hi"] = self.lo, self.hi
        if self.span is not None:
            out["span"] = list(self.span)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PageRef:
        frames, span = d.get("frames"), d.get("span")
        return cls(str(d["name"]), int(d["seq"]), int(d["rows"]), int(d["bytes"]), int(d["ts"]),
                   None if frames is None else (int(frames[0]), int(frames[1])),
                   int(d.get("lo", -1)), int(d.get("hi", -1)),
                   None if span is None else (int(span[0]), int(span[1])))


class PageIndex:
    """Live pages of an address in ``_seq`` order, kept as parallel columns.

    Memory is a few dozen bytes per page, never per message. Statistics are kept as JSON text
    until a selector asks for them.

    The index of a ``LogState`` only ever grows (:meth:`add`, pages after the last one); a
    ``remove`` entry replaces it with :meth:`without` (:meth:`remove` changes an index in
    place and is for indexes nobody else holds). A row, once added, changes only by growing
    (or, a run of small units in a rolled segment, by gaining statistics: :meth:`add_stats`):
    a journal unit that continues the last row's range in the same segment extends that row
    (one row per run of units, not per commit), its range first and its end last. So a
    ``_read.scan.Snapshot`` keeps the index it was taken from and reads it up to its own end.

    Journal rows (``spans[i]`` set): a unit with statistics (one of at least
    ``_log.journal.STATS_MIN_BYTES``) is a row of its own, which never grows, with its statistics
    as a page file's row has them; the small units between them, which carry none, form one
    row per run (``stats(i)`` is ``None``: it may hold anything). ``ts`` is the first unit's
    commit time and ``ts_last`` the last one's; ``units`` counts the commits a row holds (1 for
    a page file), which tells compaction a row of many small units.
    """

    __slots__ = ("_stats", "bytes", "ends", "names", "rows", "seq", "spans", "ts", "ts_last",
                 "units")
    _COLUMNS = ("names", "seq", "ends", "rows", "bytes", "ts", "_stats", "spans", "ts_last",
                "units")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.seq: list[int] = []
        self.ends: list[int] = []
        self.rows: list[int] = []
        self.bytes: list[int] = []
        self.ts: list[int] = []
        self._stats: list[str] = []  # JSON text: what checkpoints store, parsed on demand
        self.spans: list[tuple[int, int] | None] = []
        self.ts_last: list[int] = []
        self.units: list[int] = []

    def __len__(self) -> int:
        return len(self.names)

    def add(self, name: str, seq: int, rows: int, nbytes: int, ts: int, stats: Any,
            span: tuple[int, int] | None = None, ts_last: int | None = None,
            units: int = 1) -> None:
        if span is not None and not stats and self.names and self.names[-1] == name and \
                self.spans[-1] is not None and self.spans[-1][1] == span[0] and \
                self.ends[-1] == seq and self._stats[-1] == _NONE:
            # the next small unit of the last row's journal segment, a run of small units:
            # the row grows (range first, end last, so a reader never sees an end its range
            # does not hold)
            last = self.spans[-1]
            assert last is not None
            self.spans[-1] = (last[0], span[1])
            self.bytes[-1] += nbytes
            self.rows[-1] += rows
            self.ts_last[-1] = ts
            self.units[-1] += units
            self.ends[-1] = seq + rows
            return
        self.spans.append(span)
        self.ts_last.append(ts if ts_last is None else ts_last)
        self.units.append(units)
        self.seq.append(seq)
        self.ends.append(seq + rows)
        self.rows.append(rows)
        self.bytes.append(nbytes)
        self.ts.append(ts)
        if isinstance(stats, str):
            self._stats.append(stats)
        elif span is not None:
            self._stats.append(json.dumps(stats, separators=(",", ":")) if stats else _NONE)
        else:
            self._stats.append(json.dumps(stats, separators=(",", ":")))
            _PARSED.put(name, stats)
        self.names.append(name)  # last: ``len`` counts a page only once all columns hold it

    def ref(self, i: int) -> PageRef:
        """Page ``i``, whole: the one place a :class:`PageRef` is built from the index."""
        return PageRef(self.names[i], self.seq[i], self.rows[i], self.bytes[i], self.ts[i],
                       span=self.spans[i])

    def refs(self, start: int, end: int | None = None) -> Iterator[PageRef]:
        """Live pages overlapping ``[start, end)``, lazily (a backlog may have many pages)."""
        i = self.find(start)
        while i < len(self) and (end is None or self.seq[i] < end):
            yield self.ref(i)
            i += 1

    def stats(self, i: int) -> dict[str, Any] | None:
        """Page ``i``'s statistics (parsed ones are kept in a process-wide LRU); ``None`` for
        a journal row of small units, which has none."""
        text = self._stats[i]
        if self.spans[i] is None:
            return _PARSED.get_or_load(self.names[i], lambda: json.loads(text))
        if text == _NONE:
            return None
        # a segment's name is not unique (every address numbers its own): keyed by the text
        stats = _PARSED.get_or_load(text, lambda: json.loads(text))
        # A release before statistics of journal rows grows the last row by the next unit
        # whatever its statistics say (and its checkpoints keep them): statistics that do not
        # count the row's messages are not the row's.
        return stats if stats.get("rows") == self.rows[i] else None

    def is_run(self, i: int) -> bool:
        """Whether row ``i`` is a run of small journal units without statistics (one that
        sealing may give them, see ``_ops.seal``)."""
        return self.spans[i] is not None and self._stats[i] == _NONE

    def row_without_stats(self, name: str, seq: int, rows: int) -> int | None:
        """The journal row ``name`` from ``seq`` holding ``rows`` messages, if it is live and
        has no statistics (a run of small units): its position, else ``None``."""
        i = self.find(seq)
        if i < len(self) and self.names[i] == name and self.seq[i] == seq and \
                self.rows[i] == rows and self.is_run(i):
            return i
        return None

    def add_stats(self, name: str, seq: int, rows: int, stats: dict[str, Any]) -> bool:
        """Give the run of small units ``name`` from ``seq`` (``rows`` messages, in a rolled
        segment: it never grows again) its statistics, if it is still a row without them
        (a ``stats`` entry, ``_ops.seal``); whether it was. The only change to a row other than
        growing: from unknown to known, so a reader holding this index stays right."""
        i = self.row_without_stats(name, seq, rows)
        if i is None:
            return False
        self._stats[i] = json.dumps(stats, separators=(",", ":"))
        return True

    def remove(self, names: Iterable[str]) -> None:
        gone = set(names)
        if not gone:
            return
        keep = [i for i, n in enumerate(self.names) if n not in gone]
        for attr in self._COLUMNS:
            col = getattr(self, attr)
            setattr(self, attr, [col[i] for i in keep])

    def without(self, names: Iterable[str]) -> PageIndex:
        """A new index without ``names``; this one is left as it was (copy-on-write, so a
        reader iterating it by position in another thread never skips a page)."""
        out = PageIndex()
        for attr in self._COLUMNS:
            setattr(out, attr, list(getattr(self, attr)))
        out.remove(names)
        return out

    def replaced(self, first: int, end: int, rows: list[dict[str, Any]]) -> PageIndex:
        """A new index in which the rows holding ``[first, end)`` are replaced by ``rows``
        (dicts of ``name, seq, rows, bytes, ts, ts_last, stats`` and optionally ``span``, in
        ``_seq`` order, holding exactly ``[first, end)`` and, for a journal row that grew
        past ``end``, the rest of it); this one is left as it was (copy-on-write, see
        :meth:`without`). What compaction's swap does (``_ops.compact``)."""
        lo, hi = self.covering(first, end)
        out = PageIndex()
        for attr in self._COLUMNS:
            setattr(out, attr, getattr(self, attr)[:lo])
        for row in rows:
            span = row.get("span")
            out.add(str(row["name"]), int(row["seq"]), int(row["rows"]), int(row["bytes"]),
                    int(row["ts"]), row.get("stats") or {},
                    None if span is None else (int(span[0]), int(span[1])),
                    int(row.get("ts_last", row["ts"])), int(row.get("units", 1)))
        for attr in self._COLUMNS:
            getattr(out, attr).extend(getattr(self, attr)[hi:])
        return out

    def covering(self, first: int, end: int) -> tuple[int, int]:
        """``(lo, hi)``: rows ``lo <= i < hi`` are those holding messages of ``[first, end)``."""
        lo = hi = self.find(first)
        while hi < len(self) and self.seq[hi] < end:
            hi += 1
        return lo, hi

    def find(self, position: int) -> int:
        """Index of the first page holding a ``_seq`` >= ``position`` (``len`` if none)."""
        return bisect.bisect_right(self.ends, position)

    def seek_time(self, ts_us: int, end: int,
                  refine: Callable[[PageRef, int], int | None] | None = None) -> int:
        """The first ``_seq`` committed at or after ``ts_us`` (microseconds), ``end`` when
        none is retained. Commit times never go backwards, so this is a binary search.

        A time inside a journal row (whose units have their own times) is found in the row by
        ``refine(ref, ts_us)`` (which reads it, see ``Snapshot.seek_time``); without one the
        answer is the row's start, which may be a little early, never late."""
        i = bisect.bisect_left(self.ts, ts_us)
        if i > 0 and self.ts_last[i - 1] >= ts_us:
            found = None if refine is None else refine(self.ref(i - 1), ts_us)
            return self.seq[i - 1] if found is None else found
        return self.seq[i] if i < len(self) else end

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """``[first, end)`` ranges in ``[start, end)`` that no live page holds."""
        out = []
        at = start
        i = self.find(start)
        while i < len(self) and self.seq[i] < end and at < end:
            if self.seq[i] > at:
                out.append((at, self.seq[i]))
            at = max(at, self.ends[i])
            i += 1
        if at < end:
            out.append((at, end))
        return out

    def to_table(self) -> pa.Table:
        return pa.table({
            "name": pa.array(self.names, pa.string()),
            "seq": pa.array(self.seq, pa.int64()),
            "rows": pa.array(self.rows, pa.int64()),
            "bytes": pa.array(self.bytes, pa.int64()),
            "ts": pa.array(self.ts, pa.int64()),
            "stats": pa.array(self._stats, pa.string()),
            "span_lo": pa.array([None if s is None else s[0] for s in self.spans], pa.int64()),
            "span_hi": pa.array([None if s is None else s[1] for s in self.spans], pa.int64()),
            "ts_last": pa.array(self.ts_last, pa.int64()),
            "units": pa.array(self.units, pa.int64()),
        })

    @classmethod
    def from_table(cls, table: pa.Table) -> PageIndex:
        index = cls()
        index.names = table.column("name").to_pylist()
        index.seq = table.column("seq").to_pylist()
        index.rows = table.column("rows").to_pylist()
        index.ends = [s + r for s, r in zip(index.seq, index.rows, strict=True)]
        index.bytes = table.column("bytes").to_pylist()
        index.ts = table.column("ts").to_pylist()
        index._stats = table.column("stats").to_pylist()
        if "span_lo" in table.column_names:  # format 4
            index.spans = [None if lo is None else (lo, hi) for lo, hi in zip(
                table.column("span_lo").to_pylist(), table.column("span_hi").to_pylist(),
                strict=True)]
            index.ts_last = table.column("ts_last").to_pylist()
        else:
            index.spans = [None] * len(index.names)
            index.ts_last = list(index.ts)
        if "units" in table.column_names:
            index.units = table.column("units").to_pylist()
        else:  # written before compaction: a journal row's units unknown, taken for messages
            index.units = [1 if span is None else rows
                           for span, rows in zip(index.spans, index.rows, strict=True)]
        return index
