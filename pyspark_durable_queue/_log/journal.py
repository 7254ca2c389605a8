"""The local journal of an address (on-disk format 4): commit records and messages in one file.

Who uses it: :class:`~.commit_log.CommitLog` publishes and replays entries through it when the
address was created with ``journal`` on a local disk (``Storage.capabilities``: ``append``,
``locks`` and ``hard_links``); readers reach the messages it holds through :func:`read_units`.

A commit is one *unit* appended to the open *segment* under the log's publish lock, followed
by one ``fdatasync``: the commit record (the same JSON entry a ``log/<N>.json`` file holds) and
the frames of the messages it appends, in one write into space allocated ahead. That is the
whole publish: no file is created per commit, and the sync commits no file size (segments are
allocated ``pageSizeBytes`` at a time). Segments roll at ``pageSizeBytes``, so a backlog of
single sends is a few full files, and each segment is also the "page" its messages live in::

    pages/00000000000000000001.dqj          segment 1 (numbered, never reused)
        b"DQJRNL01" | 16-byte random id | u32 crc32c | 4 zero bytes      32-byte header
        unit*                                                              back to back
        zeros                                                              allocated ahead

    unit = b"DQJU" | u32 crc | u64 version | u32 prev | u32 entry length | u64 frames length
           | entry (JSON) | frames (page frames: b"DQFR" ..., see ``_page``)
           (b"DQJu" for a unit written without a sync, fsync=never|periodic)

    roll mark = b"DQJN" | u32 crc | u64 version | u32 prev | u32 0 | u64 0

``crc`` (CRC32C) covers everything in the unit after it; ``prev`` is the ``crc`` of the unit
before it in the segment (the first unit's is the header's crc, which covers the random id).
A reader that knows where the last unit it applied ends (a :class:`JournalPosition`) reads the next
one there; it is the next commit only if its magic, its version (one more than the last),
its ``prev`` and its crc all hold. Anything else (zeros allocated ahead, a unit being written,
a unit torn by a crash, bytes left over from a torn unit that a shorter one overwrote) is not a
unit. So no reader ever applies half a commit, and nothing past the last valid unit is ever
read as one: leftovers cannot pass ``prev``, which chains every unit to the one before it.

A unit that does not fit in the segment's ``pageSizeBytes`` goes to the next segment: the
writer first puts a roll mark where the unit would have gone (same version and ``prev``,
synced), then writes the new segment's header and the unit. A reader that finds the mark
reads the next version at the start of the next segment, so looking for new units costs one
read of one place. A writer killed after the mark and before the new segment's unit leaves a
mark that points at nothing: the next writer writes its unit over the mark (or rolls again).

Exclusive publish: writers of one host hold ``log/_publish.lock`` (``flock``) while they read
the end of the journal and append, so two writers never both write version N. The journal
is therefore only for one host's disk; ``NoLinksLocalStorage`` (FUSE mounts of cloud volumes,
where neither locks nor appends are dependable across hosts) and object stores keep one file
per commit.

What each sync is for: the unit's ``fdatasync`` (``fsync=always``) makes the commit durable
before ``send`` returns; a crash before it can lose the commit on power failure (a killed
process loses nothing: the bytes are in the kernel). The first sync of a new segment also
syncs the pages folder (its directory entry).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import errno
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from crc32c import crc32c

from .._bounded import BoundedLRU
from .._format.frame import FRAME_HEAD, FRAME_MAGIC, check, decode_batch, read_frame
from .._format.layout import numbered
from .._storage import HEADROOM_BYTES, AppendFile, KeptLock, NotFound, RangeReader, Storage
from ..errors import DamagedLogError, StorageError, StoreFullError

__all__ = ["SEGMENT_SUFFIX", "STATS_MIN_BYTES", "Journal", "JournalPosition", "can_journal",
           "is_segment", "read_units", "seek_units", "segment_name", "unit_page"]

SEGMENT_SUFFIX = ".dqj"
SEGMENT_MAGIC = b"DQJRNL01"
UNIT_MAGIC = b"DQJU"
#: a unit written without a sync (``fsync=never|periodic``): see ``_unit_body``
UNSYNCED_MAGIC = b"DQJu"
UNITS = (UNIT_MAGIC, UNSYNCED_MAGIC)
ROLL_MAGIC = b"DQJN"
_SEGMENT_HEAD = struct.Struct("<8s16sI4x")  # magic, random id, crc of magic + id
_UNIT_HEAD = struct.Struct("<4sIQIIQ")  # magic, crc, version, prev, entry length, frames length
_UNIT_FIELDS = struct.Struct("<QIIQ")  # what the crc covers of the head
HEAD = _SEGMENT_HEAD.size
#: A unit longer than this is not a unit (a corrupt length): no reader allocates more.
_MAX_UNIT = 1 << 34
#: A unit whose messages take at least this many bytes (about four frames) carries their
#: statistics in its commit record, and each of its frames' (see :func:`unit_page`):
#: selectors skip it, or its frames, without reading them. They cost such a send under 2%.
#: Smaller units carry none (statistics would cost a single send ~50 us, a 10,000-row send
#: ~5-8%, most of it hashing string columns for their value sets): the page index keeps
#: runs of them, which get their statistics once their segment rolled (``_seal``).
STATS_MIN_BYTES = 4 << 20
#: Where the disk has no room for a whole page ahead, segments are allocated this much at a
#: time (or a unit's size, when that is larger or is all that fits): one file size a sync
#: commits per step, not per unit. See ``Journal._reserve``.
RESERVE_STEP = 1 << 20
#: ... and a whole page is tried again this long after it did not fit.
RESERVE_RETRY_S = 1.0


def unit_page(rows: int, nbytes: int,
              frames: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The page an ``append`` entry lists for the frames of its unit (``_log`` gives it the
    segment's name and the unit's byte range when the unit is applied).

    ``frames``: each frame's ``{"rows", "length", "stats"}`` (``_page.encode_frames``), for a
    unit of at least :data:`STATS_MIN_BYTES`. The page then carries the unit's statistics
    (``stats``, merged: the index row of the unit has them, as a page file's row does) and,
    with more than one frame, the frame index itself (``frames``: ``[rows, length, stats]``
    each), which :func:`read_units` uses to read only the frames a selector may match."""
    page: dict[str, Any] = {"journal": True, "rows": rows, "bytes": nbytes, "stats": {}}
    if frames:
        from .._format.stats import merge_stats

        page["stats"] = merge_stats([f["stats"] for f in frames])
        if len(frames) > 1:
            page["frames"] = [[f["rows"], f["length"], f["stats"]] for f in frames]
    return page


def can_journal(storage: Storage) -> bool:
    """Whether ``storage`` can write a journal: appends in place, and a lock that excludes
    every other writer (one host's disk, with hard links: not a FUSE mount of a cloud
    volume)."""
    capabilities = storage.capabilities
    return capabilities.append and capabilities.locks and capabilities.hard_links


def segment_name(number: int) -> str:
    return f"{numbered(number)}{SEGMENT_SUFFIX}"


def is_segment(name: str) -> bool:
    return name.endswith(SEGMENT_SUFFIX) and name[:-len(SEGMENT_SUFFIX)].isdigit()


def segment_number(name: str) -> int:
    return int(name[:-len(SEGMENT_SUFFIX)])


@dataclass(frozen=True)
class JournalPosition:
    """Where the last applied unit ends: its segment, the offset after it, and its crc (the
    next unit's ``prev``). Segment 0: nothing was written yet."""

    segment: int = 0
    offset: int = 0
    prev: int = 0

    def to_list(self) -> list[int]:
        return [self.segment, self.offset, self.prev]

    @classmethod
    def from_list(cls, values: Any) -> JournalPosition:
        segment, offset, prev = (int(v) for v in values)
        return cls(segment, offset, prev)


def _segment_head(ident: bytes) -> tuple[bytes, int]:
    crc = crc32c(SEGMENT_MAGIC + ident)
    return _SEGMENT_HEAD.pack(SEGMENT_MAGIC, ident, crc), crc


def _unit(version: int, prev: int, entry: bytes,
          frames: bytes | bytearray | memoryview, synced: bool) -> tuple[bytes, int]:
    fields = _UNIT_FIELDS.pack(version, prev, len(entry), len(frames))
    crc = crc32c(frames, crc32c(entry, crc32c(fields)))
    head = _UNIT_HEAD.pack(UNIT_MAGIC if synced else UNSYNCED_MAGIC, crc, version, prev,
                           len(entry), len(frames))
    return head, crc


class Journal:
    """The segments of one address's journal (see the module docstring).

    Concurrency guarantee: readers need no lock (they apply only complete, checksummed units).
    :meth:`append` must be called with the commit log's publish lock held (``flock`` across
    processes, the log's own lock between threads); this object keeps one open segment per
    process for the writer, guarded by that lock too.
    """

    def __init__(self, storage: Storage, folder: str, page_size_bytes: int) -> None:
        self.storage = storage
        self.folder = folder
        self.page_size_bytes = page_size_bytes
        self._file: AppendFile | None = None
        self._file_segment = 0
        #: the publish lock and its ``renewed`` when ``_file`` was last seen to be its path's
        self._checked: tuple[KeptLock, int] | None = None
        self._readers: dict[int, RangeReader] = {}
        #: until then (monotonic) a whole page is not tried again (see ``_reserve``)
        self._short_until = 0.0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"], state["_file_segment"], state["_readers"] = None, 0, {}
        state["_checked"] = None
        return state

    def after_fork(self) -> None:
        """A forked child does not write or read through its parent's descriptors."""
        self._file, self._file_segment, self._readers = None, 0, {}
        self._checked = None

    def path(self, segment: int) -> str:
        return f"{self.folder}/{segment_name(segment)}"

    # -- reading --------------------------------------------------------------------------------
    def exists(self, position: JournalPosition) -> bool:
        """Whether the segment ``position`` is in is still there (cleanup removes consumed
        segments that a checkpoint has passed; a view inside one must reload)."""
        return position.segment == 0 or self.storage.exists(self.path(position.segment))

    def _read(self, segment: int, start: int, end: int) -> bytes:
        """Bytes of a segment, through a descriptor kept open for the segment being read."""
        reader = self._readers.get(segment)
        if reader is None:
            reader = self.storage.open_reader(self.path(segment))  # NotFound: not there
            for number in [n for n in self._readers if n < segment]:
                self._readers.pop(number).close()  # readers move forward only
            self._readers[segment] = reader
        return reader.read(start, end)

    def read_next(self, position: JournalPosition, version: int) -> tuple[
            dict[str, Any], JournalPosition, tuple[int, int]] | None:
        """The unit of ``version`` right after ``position`` (or at the start of the next
        segment, when a roll mark says so): ``(entry, position after it, (segment offset of
        the unit, end))``, or ``None`` when it is not (yet) there.

        Raises
        ------
        NotFound
            When ``position``'s segment is gone: the view is older than a cleanup that a
            checkpoint allowed, and must be reloaded.
        """
        segment, offset, prev = position.segment, position.offset, position.prev
        if segment > 0:
            head = self._read(segment, offset, offset + _UNIT_HEAD.size)
            # Nothing there yet: ``None``. (A view whose segment cleanup deleted reads on
            # through its open descriptor to the roll mark every deleted segment ends with,
            # and then finds the next segment, or that both are gone: see ``_nothing``.)
            if len(head) < _UNIT_HEAD.size:
                return None
            magic, crc, unit_version, unit_prev, entry_len, frames_len = _UNIT_HEAD.unpack(head)
            if unit_version != version or unit_prev != prev:
                return None
            if magic in UNITS:
                return self._unit_body(segment, offset, head, version)
            if magic != ROLL_MAGIC or (entry_len, frames_len) != (0, 0) or \
                    crc != crc32c(_UNIT_FIELDS.pack(version, prev, 0, 0)):
                return None
        # the start of the next segment (after a roll mark, or the first one)
        segment += 1
        try:
            head = self._read(segment, 0, HEAD)
        except NotFound:
            # The roll is under way (or the journal is empty), unless the segment the mark is
            # in is gone too, or a later segment exists (segments are made in order, so this
            # one was made and then deleted: compaction rewrote it and a cleanup that a newer
            # checkpoint allowed removed it, while the one with the mark kept live rows).
            # Either way this view is older than a cleanup, and reloads.
            if self._later_segment(segment):
                raise NotFound(errno.ENOENT, f"journal segment {self.path(segment)} was "
                                             "removed (by a cleanup after a checkpoint "
                                             "passed it)") from None
            return self._nothing(segment - 1)
        if len(head) < HEAD:
            return None
        magic, ident, crc = _SEGMENT_HEAD.unpack(head)
        if magic != SEGMENT_MAGIC or crc != crc32c(SEGMENT_MAGIC + ident):
            return None  # being created, or torn by a crash: not a segment yet
        head = self._read(segment, HEAD, HEAD + _UNIT_HEAD.size)
        if len(head) < _UNIT_HEAD.size:
            return None
        magic, _crc, unit_version, unit_prev, _e, _f = _UNIT_HEAD.unpack(head)
        if magic not in UNITS or unit_version != version or unit_prev != crc:
            return None
        return self._unit_body(segment, HEAD, head, version)

    def _later_segment(self, segment: int) -> bool:
        """Whether a segment after ``segment`` exists (one listing; only looked at when a roll
        mark, or an empty view, points at a segment that is not there: the listing of an empty
        journal's folder is short)."""
        return any(is_segment(name) and segment_number(name) > segment
                   for name in self.storage.list(self.folder))

    def _nothing(self, segment: int) -> Any:
        """Nothing new after a position in ``segment``: ``None``, once it is sure that the
        segment is still there (a descriptor kept open reads a deleted file on)."""
        if segment > 0 and not self.storage.exists(self.path(segment)):
            reader = self._readers.pop(segment, None)
            if reader is not None:
                reader.close()
            raise NotFound(errno.ENOENT, f"journal segment {self.path(segment)} was removed "
                                         "(by a cleanup after a checkpoint passed it)")
        return None

    def _unit_body(self, segment: int, offset: int, head: bytes, version: int) -> tuple[
            dict[str, Any], JournalPosition, tuple[int, int]] | None:
        unit_magic, crc, _version, prev, entry_len, frames_len = _UNIT_HEAD.unpack(head)
        if entry_len + frames_len > _MAX_UNIT:
            return None
        start = offset + _UNIT_HEAD.size
        end = start + entry_len + frames_len
        fields = _UNIT_FIELDS.pack(version, prev, entry_len, frames_len)
        body = self._read(segment, start, end)
        if len(body) < end - start:
            return None
        if crc32c(body, crc32c(fields)) != crc:
            # Being written, torn by a crash, or left over from a torn unit: the end of the
            # journal, which the next writer overwrites. Unless it was synced before the next
            # unit was written and that one follows it intact: then it was whole once and was
            # damaged since (a bad disk), and overwriting it would lose what follows. (Without
            # a sync, a power failure may keep a later unit and not this one: that is a
            # lost tail, as fsync=never|periodic allow.)
            after = self._read(segment, end, end + _UNIT_HEAD.size)
            if unit_magic != UNIT_MAGIC or len(after) < _UNIT_HEAD.size:
                return None
            magic, _c, after_version, after_prev, _e, _f = _UNIT_HEAD.unpack(after)
            if magic not in (*UNITS, ROLL_MAGIC) or after_version != version + 1 \
                    or after_prev != crc:
                return None
            # Or this read raced the unit's write (a pwrite is not atomic against a pread: the
            # body came half-copied, and the next unit was written since): read it again, now
            # that the next unit says it is complete.
            body = self._read(segment, start, end)
            if crc32c(body, crc32c(fields)) != crc:
                raise DamagedLogError(
                    f"{self.path(segment)}@{offset}", version,
                    "fails its checksum although the units after it are intact (damaged "
                    "after it was written); readers stop before it. Copy the address "
                    "folder aside and ask for help: nothing was overwritten",
                    partial=False)
        entry = json.loads(body[:entry_len])
        return entry, JournalPosition(segment, end, crc), (offset, end)

    def tail(self, position: JournalPosition, window: int = 1 << 20) -> bytes:
        """The bytes after ``position`` up to the last one that is not zero: an unfinished
        unit (a writer killed while writing it, or one writing right now), which readers never
        read and the next commit writes over. At most ``window`` bytes."""
        if position.segment == 0:
            return b""
        data = self._read(position.segment, position.offset, position.offset + window)
        return data.rstrip(b"\0")

    def clear_tail(self, position: JournalPosition, nbytes: int, *, sync: bool) -> None:
        """Write zeros over ``nbytes`` after ``position`` (the caller holds the publish lock,
        so no writer is in the middle of a unit there)."""
        file = self._open(position.segment, position.offset)
        file.write(bytes(nbytes))
        file.seek(position.offset)
        if sync:
            file.sync()

    # -- writing --------------------------------------------------------------------------------
    def append(self, position: JournalPosition, version: int, entry: bytes,
               frames: bytes | bytearray | memoryview = b"", *,
               sync: bool, lock: KeptLock | None = None) -> tuple[JournalPosition, tuple[int, int]]:
        """Write the unit of ``version`` after ``position`` (rolling to a new segment when it
        does not fit in ``page_size_bytes``) and, with ``sync``, make it durable. Returns the
        position after it and its ``(offset, end)`` in its segment. The caller holds the
        publish lock and has read the journal up to ``position``.

        ``lock``: the publish lock held. A segment kept open is looked up by its path (was the
        address deleted and made again under this view?) before it is written again, unless
        the lock watches its own file (:attr:`KeptLock.watched`) and neither it nor its
        ``renewed`` count changed since the last look: an address goes with its lock file."""
        if not can_journal(self.storage):
            raise StorageError(errno.ENOTSUP, (
                f"{self.folder}: this address keeps its commits in a journal (on-disk format "
                f"4), which only a local disk can write; {self.storage.url} "
                f"({type(self.storage).__name__}) cannot (no appends, locks or hard links). "
                "Write to it from a local path on the host that holds it"))
        size = _UNIT_HEAD.size + len(entry) + len(frames)
        segment, offset, prev = position.segment, position.offset, position.prev
        if self._file is not None and self._file.poisoned:
            self._write_again(self._file)
        file = self._file
        if file is not None and self._file_segment == segment:
            checked = (lock, lock.renewed) if lock is not None and lock.watched else None
            if checked is None or checked != self._checked:
                if file.gone():  # the address was deleted (and made again) under this view
                    self.close()
                    raise NotFound(errno.ENOENT, f"journal segment {self.path(segment)} is gone")
                self._checked = checked
        fresh = segment == 0 or (offset + size > self.page_size_bytes and offset > HEAD)
        if fresh and segment > 0:
            # A roll mark where the unit would have gone sends readers to the next segment
            # (so that a look for new units reads one place). It is synced before the new
            # segment's unit: that unit is reachable once durable.
            mark = _UNIT_HEAD.pack(ROLL_MAGIC, crc32c(_UNIT_FIELDS.pack(version, prev, 0, 0)),
                                   version, prev, 0, 0)
            file = self._open(segment, offset)
            self._reserve(file, offset, len(mark), messages=bool(frames))
            file.write(mark)
            if sync:
                file.sync()
        if fresh:
            segment += 1
            segment_head, prev = _segment_head(os.urandom(16))
            offset = 0
            file = self._open(segment, 0)
            self._reserve(file, 0, HEAD + size, messages=bool(frames))
            try:
                file.write(segment_head)
            except StoreFullError:
                self._unwrite(file, 0)
                raise
            offset = HEAD
        else:
            file = self._open(segment, offset)
            self._reserve(file, offset, size, messages=bool(frames))
        head, crc = _unit(version, prev, entry, frames, sync)
        try:
            file.write(head + entry + frames if len(frames) < (1 << 16) else head + entry)
            if len(frames) >= (1 << 16):
                file.write(frames)  # large: no copy into one buffer
        except StoreFullError:
            self._unwrite(file, offset)
            raise
        if sync:
            file.sync()
        return JournalPosition(segment, offset + size, crc), (offset, offset + size)

    def _reserve(self, file: AppendFile, offset: int, size: int, *, messages: bool) -> None:
        """Room for ``size`` bytes at ``offset``, the open segment's logical end, allocated
        before they are written (a full disk fails here, before any byte of the unit is).
        Ahead up to the end of the page when the disk has room, so that the syncs of the units
        that follow commit no file size; else in steps of :data:`RESERVE_STEP` or for this
        unit alone (a nearly full disk still takes small sends). A unit that holds
        ``messages`` leaves :data:`HEADROOM_BYTES` of the disk free (acknowledgements and
        cleanup need some: a ``remove`` unit, a checkpoint); other units may use them. One
        ``statvfs`` per reservation (once a page while the disk has room); a whole page is
        tried again :data:`RESERVE_RETRY_S` after the disk refused it.

        Raises
        ------
        StoreFullError
            Not even ``size`` bytes fit."""
        allocated = file.allocated
        if offset + size <= allocated:
            return  # the common case: allocated ahead
        page = max(size, self.page_size_bytes - offset)
        free = self.storage.free_bytes()
        room = None if free is None else free - (HEADROOM_BYTES if messages else 0)
        tries = {max(size, min(page, RESERVE_STEP)), size}
        if time.monotonic() >= self._short_until:
            tries.add(page)
        for n in sorted(tries, reverse=True):
            if room is not None and offset + n - max(offset, allocated) > room:
                continue
            try:
                file.preallocate(n)
                return
            except StoreFullError:
                if n == size:
                    raise
                self._short_until = time.monotonic() + RESERVE_RETRY_S
        raise StoreFullError("allocate", file.path, headroom=HEADROOM_BYTES if messages else 0)

    @staticmethod
    def _unwrite(file: AppendFile, start: int) -> None:
        """Zeros over what a write that found the disk full left of its unit after ``start``
        (nothing half written is read, whatever the tail rule; zeros need no new room), and
        the logical end back at ``start``."""
        end = file.tell()
        if end > start:
            with contextlib.suppress(StorageError):
                file.seek(start)
                file.write(bytes(end - start))
        file.seek(start)

    def _write_again(self, file: AppendFile) -> None:
        """The open segment's last sync failed (``file`` is poisoned): what it wrote since its
        last good sync is read back (what the kernel holds) and written again through a new
        descriptor, then synced, before another unit may follow it. Else a unit synced later
        could be durable while one before it is not, and a power cut would cut the chain
        there, losing acknowledged commits after it. The send whose sync failed was told so
        (it may or may not be stored, as any commit whose answer was lost); nothing here
        turns that into a success.

        Raises
        ------
        StorageError
            The new sync fails too (the new descriptor is poisoned in turn)."""
        segment, unsynced = self._file_segment, file.unsynced()
        self._file = None
        file.close()
        if unsynced is None or not self.storage.fsync:
            return
        lo, hi = unsynced
        data = self._read(segment, lo, hi)
        again = self._open(segment, lo)
        again.write(data)
        again.sync()

    def _open(self, segment: int, offset: int) -> AppendFile:
        file = self._file
        if file is None or self._file_segment != segment:  # the segment rolled
            if file is not None:
                file.close()
            self._file = None
            file = self.storage.open_append(self.path(segment), at=offset)
            self._file, self._file_segment = file, segment
        elif file.tell() != offset:
            # Another process appended since: on from where its unit ends. (The same open file
            # keeps its folder synced once per process, not once per reopening.)
            file.seek(offset)
        return file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for reader in self._readers.values():
            reader.close()
        self._readers = {}


# -- reading messages ---------------------------------------------------------------------------
@dataclass
class UnitFrames:
    """The messages of one unit: its first ``_seq``, commit time and decoded record batches;
    or ``skipped`` messages from ``seq`` on that a frame filter ruled out (not read)."""

    seq: int
    ts: int
    batches: list[pa.RecordBatch]
    skipped: int = 0


#: ``frame_filter(stats, first _seq, rows, commit time)`` of :func:`read_units`: whether a
#: frame with these statistics may hold a wanted message.
FrameFilter = Callable[[dict[str, Any], int, int, int], bool]


#: One frame of a unit's frame index: rows, bytes (head included), statistics.
FrameIndex = list[tuple[int, int, dict[str, Any]]]


class _Directory:
    """Where each unit of a segment's published range starts: ``_seq`` and offset, in order,
    learnt as the range is read (a range grows while its segment is open); and the frame
    index of each unit that has one (by offset: units of at least ``STATS_MIN_BYTES``, so at
    most a few per segment)."""

    __slots__ = ("end", "frames", "lock", "offsets", "seqs", "times")

    def __init__(self, start: int) -> None:
        # 24 bytes a unit (Python int lists would take ~100)
        self.seqs = array.array("q")
        self.offsets = array.array("q")
        self.times = array.array("q")  # each unit's commit time (never decreasing)
        self.frames: dict[int, FrameIndex] = {}
        self.end = start  # offset up to which units are listed
        self.lock = threading.Lock()


#: Unit directories of journal segments per process (one per published range being read):
#: a few bytes per unit, so a consumer keeping up with a growing segment reads only new units.
_DIRECTORIES: BoundedLRU[tuple[str, int, bytes], _Directory] = BoundedLRU(
    "journal unit directories", 64)


def _directory(storage: Storage, path: str, span: tuple[int, int]) -> _Directory:
    """The unit directory of a published range, listed up to its end."""
    lo, hi = span
    # keyed by the segment's header too (its random id): a segment of an address deleted and
    # made again under the same name is another file
    ident = storage.read_range(path, 0, HEAD)
    directory = _DIRECTORIES.get_or_load((path, lo, ident), lambda: _Directory(lo))
    with directory.lock:
        if directory.end < hi:
            _list_units(storage, path, directory, hi)
    return directory


def seek_units(storage: Storage, path: str, span: tuple[int, int], ts_us: int) -> int | None:
    """The first ``_seq`` of the published range ``span`` committed at or after ``ts_us``
    (microseconds), ``None`` when every unit of it is older."""
    directory = _directory(storage, path, span)
    with directory.lock:
        i = bisect.bisect_left(directory.times, ts_us)
        return directory.seqs[i] if i < len(directory.seqs) else None


#: Units are read together while they total at most this many bytes (a run of small commits:
#: one read); a larger unit is read a frame (~1 MiB) at a time, and only the frames that hold
#: wanted messages, so that memory does not grow with the size of one send.
_WHOLE_READ_BYTES = 1 << 20


def read_units(storage: Storage, path: str, span: tuple[int, int], start: int,
               end: int, frame_filter: FrameFilter | None = None) -> Iterator[UnitFrames]:
    """The messages ``start <= _seq < end`` of the published range ``span`` of the segment at
    ``path``, decoded, in order: each unit holding some of them with all its frames (units
    are read together while they are small), or, for a unit larger than
    :data:`_WHOLE_READ_BYTES`, the frames of it that hold some, one at a time. Each
    :class:`UnitFrames` says the ``_seq`` of its first message.

    ``frame_filter``: frames of a unit with a frame index (see :func:`unit_page`) whose
    statistics it rules out are not read; they come as ``skipped`` messages.

    Raises
    ------
    CorruptPageError
        When a published unit does not verify (the range was published, so it must).
    """
    hi = span[1]
    directory = _directory(storage, path, span)
    with directory.lock:
        seqs, offsets = directory.seqs, directory.offsets
        first = max(0, bisect.bisect_right(seqs, start) - 1)
        last = bisect.bisect_left(seqs, end)
        if first >= last:
            return
        bounds = [*offsets[first:last], offsets[last] if last < len(offsets) else hi]
        first_seqs, times = seqs[first:last], directory.times[first:last]
        indexes = [directory.frames.get(at) for at in bounds[:-1]] if directory.frames \
            else [None] * len(first_seqs)
    reader = storage.open_reader(path)
    try:
        k = 0
        while k < len(first_seqs):
            index = indexes[k]
            if index is not None and (frame_filter is not None or
                                      bounds[k + 1] - bounds[k] > _WHOLE_READ_BYTES):
                yield from _indexed_frames(reader, path, bounds[k], bounds[k + 1], index,
                                           first_seqs[k], times[k], start, end, frame_filter)
                k += 1
                continue
            if bounds[k + 1] - bounds[k] > _WHOLE_READ_BYTES:
                yield from _unit_frames(reader, path, bounds[k], bounds[k + 1],
                                        first_seqs[k], times[k], start, end)
                k += 1
                continue
            n = 1  # the small units that follow each other, read at once
            while k + n < len(first_seqs) and \
                    bounds[k + n + 1] - bounds[k] <= _WHOLE_READ_BYTES:
                n += 1
            yield from _small_units(reader, path, bounds[k], bounds[k + n],
                                    first_seqs[k:k + n], times[k:k + n])
            k += n
    finally:
        reader.close()


def _small_units(reader: RangeReader, path: str, lo: int, hi: int, first_seqs: Any,
                 times: Any) -> Iterator[UnitFrames]:
    """The units in ``[lo, hi)``, read at once, every frame decoded."""

    buf = pa.py_buffer(reader.read(lo, hi))
    check(buf.size == hi - lo, path, lo, "segment shorter than published")
    # the directory already knows each unit's _seq and time: only the frames are read here
    for k, (_at, body_at, entry_len, frames_len) in enumerate(_walk(buf, lo, path)):
        frames_end = body_at + entry_len + frames_len
        batches = []
        offset = body_at + entry_len
        while offset < frames_end:
            payload, rows, offset = read_frame(buf, offset, path, FRAME_MAGIC, base=lo)
            batches.append(decode_batch(payload, rows, path, lo + offset))
        yield UnitFrames(first_seqs[k], times[k], batches)


def _unit_frames(reader: RangeReader, path: str, lo: int, hi: int, seq: int, ts: int,
                 start: int, end: int) -> Iterator[UnitFrames]:
    """The frames of the unit ``[lo, hi)`` (first ``_seq`` ``seq``) that hold messages
    ``start <= _seq < end``, each read and decoded on its own. The frames before them are read
    one at a time too and only checked (their checksum covers the row count that places the
    frames after them; they are not decoded); reading stops after the last one wanted."""

    head = reader.read(lo, lo + _UNIT_HEAD.size)
    check(len(head) == _UNIT_HEAD.size, path, lo, "segment shorter than published")
    magic, _crc, _version, _prev, entry_len, frames_len = _UNIT_HEAD.unpack(head)
    check(magic in UNITS, path, lo, f"bad unit magic {magic!r}")
    offset = lo + _UNIT_HEAD.size + entry_len
    check(offset + frames_len == hi, path, lo, "unit length differs from the published range")
    while offset < hi and seq < end:
        frame_head = reader.read(offset, offset + FRAME_HEAD.size)
        check(len(frame_head) == FRAME_HEAD.size, path, offset, "frame header past its unit")
        frame_magic, length, _rows, _frame_crc = FRAME_HEAD.unpack(frame_head)
        check(frame_magic == FRAME_MAGIC, path, offset, f"bad frame magic {frame_magic!r}")
        after = offset + FRAME_HEAD.size + length
        check(after <= hi, path, offset, "frame payload past its unit")
        buf = pa.py_buffer(reader.read(offset, after))
        payload, rows, _ = read_frame(buf, 0, path, FRAME_MAGIC, base=offset)
        if seq + rows > start:
            yield UnitFrames(seq, ts, [decode_batch(payload, rows, path, offset)])
        seq += rows
        offset = after


def _indexed_frames(reader: RangeReader, path: str, lo: int, hi: int, index: FrameIndex,
                    seq: int, ts: int, start: int, end: int,
                    frame_filter: FrameFilter | None) -> Iterator[UnitFrames]:
    """The frames of the unit ``[lo, hi)`` (first ``_seq`` ``seq``) that hold messages
    ``start <= _seq < end`` and that ``frame_filter`` does not rule out, each read and decoded
    on its own. Its frame index (from its commit record, which the log verified) places every
    frame, so no other frame is read."""

    head = reader.read(lo, lo + _UNIT_HEAD.size)
    check(len(head) == _UNIT_HEAD.size, path, lo, "segment shorter than published")
    _magic, _crc, _version, _prev, entry_len, frames_len = _UNIT_HEAD.unpack(head)
    offset = lo + _UNIT_HEAD.size + entry_len
    check(offset + frames_len == hi and sum(f[1] for f in index) == frames_len, path, lo,
           "the unit's frame index differs from its length")
    for rows, length, stats in index:
        fseq, after = seq, offset + length
        seq, offset = seq + rows, after
        if seq <= start:
            continue
        if fseq >= end:
            return
        if frame_filter is not None and not frame_filter(stats, fseq, rows, ts):
            yield UnitFrames(fseq, ts, [], skipped=rows)
            continue
        buf = pa.py_buffer(reader.read(after - length, after))
        payload, got, _ = read_frame(buf, 0, path, FRAME_MAGIC, base=after - length)
        check(got == rows, path, after - length, "frame rows differ from the unit's index")
        yield UnitFrames(fseq, ts, [decode_batch(payload, rows, path, after - length)])


def _list_units(storage: Storage, path: str, directory: _Directory, hi: int) -> None:
    """Extend ``directory`` with the units in ``[directory.end, hi)``: only their heads and
    entries are read (a window of small units at once; a large unit's frames are stepped
    over)."""

    at = directory.end
    seqs, offsets, times = [], [], []  # added once the whole range is listed
    indexes: dict[int, FrameIndex] = {}
    reader = storage.open_reader(path)
    try:
        while at < hi:
            # a window of small units at once; of a large unit, its head and entry only
            window = reader.read(at, min(hi, at + _LIST_WINDOW))
            check(len(window) >= _UNIT_HEAD.size, path, at, "segment shorter than published")
            pos = 0
            while pos + _UNIT_HEAD.size <= len(window):
                magic, _crc, _version, _prev, entry_len, frames_len = \
                    _UNIT_HEAD.unpack_from(window, pos)
                check(magic in UNITS, path, at + pos, f"bad unit magic {magic!r}")
                body = pos + _UNIT_HEAD.size
                if body + entry_len > len(window):
                    if pos > 0:
                        break  # read again from this unit
                    window = reader.read(at, at + body + entry_len)  # a long entry
                    check(len(window) == body + entry_len, path, at,
                           "segment shorter than published")
                entry = json.loads(window[body:body + entry_len])
                seqs.append(int(entry["seq"]))
                offsets.append(at + pos)
                times.append(int(entry["ts"]))
                index = _frame_index(entry)
                if index is not None:
                    indexes[at + pos] = index
                pos = body + entry_len + frames_len
            at += pos
    finally:
        reader.close()
    check(at == hi, path, hi, "units overrun the published range")
    directory.seqs.extend(seqs)
    directory.offsets.extend(offsets)
    directory.times.extend(times)
    directory.frames.update(indexes)
    directory.end = hi


#: Units are listed from windows of this many bytes: small units many at a time, a large
#: one without reading its frames.
_LIST_WINDOW = 64 << 10


def _frame_index(entry: dict[str, Any]) -> FrameIndex | None:
    """The frame index of a unit's commit record (see :func:`unit_page`), if it has one."""
    for page in entry.get("pages", ()) if entry.get("op") == "append" else ():
        frames = page.get("frames") if page.get("journal") else None
        if frames:
            return [(int(rows), int(length), stats) for rows, length, stats in frames]
    return None


def _walk(buf: bytes | pa.Buffer, base: int, path: str) -> Iterator[tuple[int, int, int, int]]:
    """The units of ``buf`` (published units back to back, read from offset ``base``):
    ``(offset, offset of the entry, entry length, frames length)`` in ``buf``."""

    at, size = 0, len(buf) if isinstance(buf, bytes) else buf.size
    while at < size:
        magic, _crc, _version, _prev, entry_len, frames_len = _UNIT_HEAD.unpack_from(buf, at)
        check(magic in UNITS, path, base + at, f"bad unit magic {magic!r}")
        body_at = at + _UNIT_HEAD.size
        yield at, body_at, entry_len, frames_len
        at = body_at + entry_len + frames_len
