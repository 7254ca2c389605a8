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
           | entry (JSON) | frames (page frames: b"DQFR" ..., see ``_format.frame``)
           (b"DQJu" for a unit written without a sync, fsync=never|periodic: only a synced
           unit followed by the next one proves it was whole once, see ``judge_tail``)

    roll mark = b"DQJN" | u32 crc | u64 version | u32 prev | u32 0 | u64 0

``crc`` (CRC32C) covers everything in the unit after it; ``prev`` is the ``crc`` of the unit
before it in the segment (the first unit's is the header's crc, which covers the random id).
A reader that knows where the last unit it applied ends (a :class:`JournalPosition`) reads the next
one there; it is the next commit only if its magic, its version (one more than the last),
its ``prev`` and its crc all hold. So no reader ever applies half a commit, and nothing past
the last valid unit is ever read as one: leftovers cannot pass ``prev``, which chains every
unit to the one before it.

What is there when it is not the next unit is judged by the torn-tail rule
(:func:`~.._format.unit.judge_tail`; docs/architecture.md, "Damage versus a torn tail"):
zeros (allocated ahead, nothing written yet) and a unit torn by a crash (a write cut short, or
a power cut that kept only some of its 4 KiB pages) are the journal's end, which the next
writer zeroes (synced) and then writes over; anything else is damage (:class:`DamagedLogError`
naming the segment and offset): readers stop before it, writers refuse to append after it,
``verify`` fails and ``repair`` takes it out. A read that races a unit's write can see it
half-copied, which may look like damage: that verdict is checked again under the publish
lock before it is reported. Writers keep the space after the last unit zeros: before the
first write of a process into a segment they read it to its end, and zero (and sync) what a
crash left there.

A unit that does not fit in the segment's ``pageSizeBytes`` goes to the next segment: the
writer first puts a roll mark where the unit would have gone (same version and ``prev``,
synced), then writes the new segment's header and the unit. A reader that finds the mark
reads the next version at the start of the next segment, so looking for new units costs one
read of one place. A writer killed after the mark and before the new segment's unit leaves a
mark that points at nothing: the next writer zeroes the mark and writes its unit there (or
rolls again, zeroing first what the torn roll left in the next segment's file).

Exclusive publish: writers of one host hold ``log/_publish.lock`` (``flock``) while they read
the end of the journal and append, so two writers never both write version N. The journal
is therefore only for one host's disk; ``NoLinksLocalStorage`` (FUSE mounts of cloud volumes,
where neither locks nor appends are dependable across hosts) and object stores keep one file
per commit.

What each sync is for: the unit's ``fdatasync`` (``fsync=always``) makes the commit durable
before ``send`` returns; a crash before it can lose the commit on power failure (a killed
process loses nothing: the bytes are in the kernel). The first sync of a new segment also
syncs the pages folder (its directory entry).

Syncs outside the lock (issue 43): a writer lets the publish lock go once its unit is written
and syncs it after (:meth:`Journal.sync_unit`, still under its process's own lock: its next
unit waits for it), so writers of other processes append while the sync runs and the kernel
serves their syncs of the one file together (the publish lock is held ~50 us instead of
~200: 4 processes x 4 threads of single sends went from ~1.2x to ~2.4-2.9x one thread). What
keeps the guarantees:

* a sync covers every byte written to the segment before it, so a unit written after another
  is never durable while that one is not (within a segment); a roll syncs what is before its
  mark first when the unit it chains to may still be syncing (``prev_synced``), so a mark
  proves the units before it durable;
* ``send`` returns only after its own unit's sync; a unit whose sync has not finished can be
  read by readers of other processes, as before (the page cache);
* the torn-tail rule: a synced unit (``DQJU``) followed by the next unit was whole once only
  if the next one was written after its sync finished. A writer knows that of its own last
  unit, and of other processes' units through ``log/_synced`` (:class:`SyncedVersions`, each
  process's newest synced version, mapped); when it cannot tell, its entry says up to which
  version it knew units synced (``synced_to``) and the rule looks further
  (``_format.unit``): after a power cut that
  tore a unit whose sync had not finished, the units written meanwhile are a torn tail, not
  damage;
* a sync that fails: the writer takes the lock again and writes its unit again from memory
  (or finds another writer's unit in its place: not stored), as below. Units other processes
  appended after it meanwhile have their own syncs, which report the write-back error to them
  too (every open file of the segment that has not seen it), so none of them is
  acknowledged on the failed sync's behalf.

A sync that fails (``EIO``; PostgreSQL's "fsyncgate"): the kernel reports a write-back error
once and may have dropped the pages it could not write (Linux marks them clean: the file may
read back zeros, or older bytes, once they are evicted), so neither a second ``fdatasync`` nor
bytes read back from the file prove anything. The rule:

* the commit fails: ``append`` (or, for a sync run outside the lock, ``unit_sync_failed``)
  raises :class:`StorageError` naming the segment, the errno and that no message of the send
  was acknowledged (never a success for bytes not proven durable);
* under the publish lock (taken again for a sync run outside it), the bytes of that write (the
  unit; or a roll mark; or a new segment's header and first unit) are written again *from
  memory* (the copy the writer still holds, never what the file reads back) through a new
  descriptor, and synced. The unit then stays: a reader in another process may have applied
  it from the page cache before the sync failed, and taking it back would leave that reader's
  position inside whatever is written there next. So the failed send may still be delivered,
  like any commit whose answer was lost (sending again may store it twice);
* if that sync fails too, the writer keeps the bytes in memory (:meth:`Journal.settle`) and
  appends nothing more until they are written and synced: its next commit tries first (and
  fails again while the disk does). If what the file holds there by then is neither those
  bytes nor zeros, another writer wrote its own unit in their place (it found the dropped
  pages as zeros: the journal's end), and the copy is dropped: the failed send is not stored;
* so no acknowledged unit ever follows one whose bytes were not proven durable by this
  process, and the chain (``prev``) holds after a power cut. What is not covered: a writer in
  *another* process appends after the unit while this one still holds its bytes unproven (its
  own sync succeeds, so the disk works again) and the power fails before this one's next
  commit; a process that opens the segment after another one saw the write-back error (its
  descriptor does not get it: Linux reports an error to descriptors opened before it was
  seen), appends after the unit while its writer has not written it again yet (the sync runs
  outside the lock), and the power fails in that window (or, without a power cut, the dropped
  pages read back as zeros and a third writer takes the journal's end to be there before the
  first writes its unit again); and ``fsync=periodic``, whose
  ``syncfs`` failure is logged (those commits were
  acknowledged without a sync; a failure there can lose them as a power cut would, and with
  them the units synced after them).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import errno
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from crc32c import crc32c

from .._bounded import BoundedLRU
from .._format.entry import entry_of
from .._format.frame import FRAME_HEAD, FRAME_MAGIC, check, decode_batch, read_frame
from .._format.layout import numbered
from .._format.unit import (
    HEAD,
    PIECE,
    ROLL_MAGIC,
    SEGMENT_MAGIC,
    UNIT_MAGIC,
    UNITS,
    UNSYNCED_MAGIC,
    judge_tail,
)
from .._format.unit import MAX_UNIT as _MAX_UNIT
from .._format.unit import SEGMENT_HEAD as _SEGMENT_HEAD
from .._format.unit import UNIT_FIELDS as _UNIT_FIELDS
from .._format.unit import UNIT_HEAD as _UNIT_HEAD
from .._storage import (
    HEADROOM_BYTES,
    AppendFile,
    InPlaceFile,
    KeptLock,
    NotFound,
    RangeReader,
    Storage,
)
from ..errors import DamagedLogError, StorageError, StoreFullError

__all__ = ["SEGMENT_SUFFIX", "STATS_MIN_BYTES", "DamagedUnit", "Journal", "JournalPosition",
           "SyncedVersions",
           "can_journal",
           "is_segment", "read_units", "seek_units", "segment_name", "unit_page", "unit_time"]

SEGMENT_SUFFIX = ".dqj"
log = logging.getLogger(__name__)

#: ``_dirty_end`` reads a segment this much at a time, and compares it with these zeros.
_ZEROS = bytes(1 << 20)

#: ``SyncedVersions`` tries to map ``log/_synced`` again this long after it could not.
_SYNCED_RETRY_S = 5.0
#: A reader looking for the next unit reads this much at once: a single send's unit whole.
#: Never past the end of the 4 KiB block the head starts in: the block after a writer's last
#: unit is often preallocated and never read, and touching it makes the kernel read ahead
#: (zero-fill) a window of pages, ~0.9 ms each time a large unit's end moved the look there
#: (``benchmarks/bench_send_ab.py`` rows-10k: 25% more CPU a send).
_READ_AHEAD = 1024
_BLOCK = 4096
#: What to do about damage, in every error that reports it.
REPAIR_HINT = ("copy the address folder aside first if the data matters, then "
               "`durablequeue ROOT repair ADDRESS --apply` (Address.repair) records the "
               "messages from there on as lost, keeps the damaged bytes in damaged/ and lets "
               "the address work again")

#: A unit whose messages take at least this many bytes (about four frames) carries their
#: statistics in its commit record, and each of its frames' (see :func:`unit_page`):
#: selectors skip it, or its frames, without reading them. They cost such a send little.
#: Smaller units carry none (statistics would cost a small send a noticeable share of its
#: time, most of it hashing string columns for their value sets): the page index keeps
#: runs of them, which get their statistics once their segment rolled (``_ops.seal``).
STATS_MIN_BYTES = 4 << 20
#: Where the disk has no room for a whole page ahead, segments are allocated this much at a
#: time (or a unit's size, when that is larger or is all that fits): one file size a sync
#: commits per step, not per unit. See ``Journal._reserve``.
RESERVE_STEP = 1 << 20
#: ... and a whole page is tried again this long after it did not fit.
RESERVE_RETRY_S = 1.0


def unit_page(rows: int, nbytes: int,
              frames: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The page an ``append`` entry lists for the frames of its unit (``_log.commit_log`` gives
    it the segment's name and the unit's byte range when the unit is applied).

    ``frames``: each frame's ``{"rows", "length", "stats"}`` (``_format.page.encode_frames``), for a
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


#: what :meth:`Journal.read_next` finds: the entry, the position after it, its byte range
Found = tuple[dict[str, Any], JournalPosition, tuple[int, int]]


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
        #: ``(segment, offset)`` after which this process knows the segment holds only zeros
        #: (see ``_make_room``); the last segment it looked at to its end
        self._clean: tuple[int, int] | None = None
        self._scanned = 0
        #: the unit that readers last found torn (judged once, not at every look)
        self._torn: tuple[Any, ...] | None = None
        #: until then (monotonic) a whole page is not tried again (see ``_reserve``)
        self._short_until = 0.0
        #: ``(segment, offset, bytes)`` this process wrote and could not prove durable (its sync
        #: failed, and so did writing them again): written again before anything follows them
        #: (see ``settle``)
        self._pending: tuple[int, int, bytes] | None = None
        #: the unit :meth:`append` wrote whose sync :meth:`sync_unit` is to make
        self._unsynced: _Unsynced | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"], state["_file_segment"], state["_readers"] = None, 0, {}
        state["_checked"], state["_clean"], state["_scanned"] = None, None, 0
        state["_pending"], state["_unsynced"] = None, None
        return state

    def after_fork(self) -> None:
        """A forked child does not write or read through its parent's descriptors."""
        self._file, self._file_segment, self._readers = None, 0, {}
        self._checked, self._clean, self._scanned = None, None, 0
        self._pending = None  # the parent's to write (its lock, its memory)
        self._unsynced = None

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

    def read_next(self, position: JournalPosition, version: int,
                  confirm: Callable[[], AbstractContextManager[Any]] | None = None) -> tuple[
            dict[str, Any], JournalPosition, tuple[int, int]] | None:
        """The unit of ``version`` right after ``position`` (or at the start of the next
        segment, when a roll mark says so): ``(entry, position after it, (segment offset of
        the unit, end))``, or ``None`` when it is not (yet) there: nothing was written there,
        or what was is a unit torn by a crash (:func:`~.._format.unit.judge_tail`).

        ``confirm``: the publish lock. A unit being written looks damaged to a read that races
        the write, so what looks damaged is read again under the lock (no unit is being
        written then) before it is reported. Without it (the caller holds the lock), the first
        verdict is final.

        Raises
        ------
        DamagedLogError
            What is there is damage (see the module docstring): readers stop before it, and
            writers must not write over it.
        NotFound
            When ``position``'s segment is gone: the view is older than a cleanup that a
            checkpoint allowed, and must be reloaded.
        """
        try:
            return self._next(position, version)
        except DamagedLogError:
            if confirm is None:
                raise
        with confirm():
            return self._next(position, version)

    def _next(self, position: JournalPosition, version: int) -> tuple[
            dict[str, Any], JournalPosition, tuple[int, int]] | None:
        segment, offset, prev = position.segment, position.offset, position.prev
        if segment > 0:
            # the head, and what follows it: a small unit's body, read in the same call
            block_end = (offset // _BLOCK + 1) * _BLOCK
            ahead = max(_UNIT_HEAD.size, min(_READ_AHEAD, block_end - offset))
            data = self._read(segment, offset, offset + ahead)
            head = data[:_UNIT_HEAD.size]
            # Nothing there yet: ``None``. (A view whose segment cleanup deleted reads on
            # through its open descriptor to the roll mark every deleted segment ends with,
            # and then finds the next segment, or that both are gone: see ``_nothing``.)
            if not any(head):
                return None
            if len(head) < _UNIT_HEAD.size:
                return self._judged(segment, offset, version, prev)
            magic, crc, unit_version, unit_prev, entry_len, frames_len = _UNIT_HEAD.unpack(head)
            if unit_version != version or unit_prev != prev:
                return self._judged(segment, offset, version, prev)
            if magic in UNITS:
                return self._unit_body(segment, offset, head, version, data[_UNIT_HEAD.size:])
            if magic != ROLL_MAGIC or (entry_len, frames_len) != (0, 0) or \
                    crc != crc32c(_UNIT_FIELDS.pack(version, prev, 0, 0)):
                return self._judged(segment, offset, version, prev)
        # the start of the next segment (after a roll mark, or the first one)
        segment += 1
        try:
            head = self._read(segment, 0, HEAD)
        except NotFound:
            # The roll is under way (or the journal is empty), unless the segment the mark is
            # in is gone too, or a later segment exists (segments are made in order, so this
            # one was made and then deleted: compaction rewrote it and a cleanup that a newer
            # checkpoint allowed removed it, while the one with the mark kept live rows).
            # Either way this view is older than a cleanup, and reloads. (Unless it is there
            # now: between the look and the listing its roll, and the next, went through.)
            if self._later_segment(segment):
                try:
                    head = self._read(segment, 0, HEAD)
                except NotFound:
                    raise NotFound(errno.ENOENT, f"journal segment {self.path(segment)} was "
                                                 "removed (by a cleanup after a checkpoint "
                                                 "passed it)") from None
            else:
                return self._nothing(segment - 1)
        if len(head) < HEAD or not any(head):
            return None  # being created, or torn by a crash: not a segment yet
        magic, ident, crc = _SEGMENT_HEAD.unpack(head)
        if magic != SEGMENT_MAGIC or crc != crc32c(SEGMENT_MAGIC + ident):
            # written in one write into the file's first page: whole, or not there at all
            raise self._damage(segment, 0, version, "is a segment header that fails its "
                                                    "checksum")
        head = self._read(segment, HEAD, HEAD + _UNIT_HEAD.size)
        if not any(head):
            return None
        if len(head) < _UNIT_HEAD.size:
            return self._judged(segment, HEAD, version, crc)
        magic, _crc, unit_version, unit_prev, _e, _f = _UNIT_HEAD.unpack(head)
        if magic not in UNITS or unit_version != version or unit_prev != crc:
            return self._judged(segment, HEAD, version, crc)
        return self._unit_body(segment, HEAD, head, version)

    def _judged(self, segment: int, offset: int, version: int, prev: int) -> Found | None:
        """``None`` when what is at ``offset`` (not the unit of ``version``) is the journal's
        end; raises :class:`DamagedLogError` when it is damage (the torn-tail rule,
        :func:`~.._format.unit.judge_tail`, and what proves a unit committed: a later segment
        that holds a later unit)."""
        path = self.path(segment)
        try:
            size = self.storage.size(path)
        except NotFound:
            return None
        damage = judge_tail(lambda lo, hi: self._read(segment, lo, hi), offset, version, prev,
                            size)
        if damage is not None:
            raise self._damage(segment, damage.offset, version, damage.reason)
        head = self._read(segment, offset, offset + 4)
        if head in (UNIT_MAGIC, ROLL_MAGIC):
            later = self._later_unit(segment, version)
            if later is not None:
                raise self._damage(segment, offset, version, (
                    f"looks torn by a crash, but a later segment holds unit {later}: it was "
                    "committed before that one was written (damaged since)"))
        return None

    def _later_unit(self, segment: int, version: int) -> int | None:
        """The version of a whole unit (its crc checks) of ``version`` or later that starts a
        segment after ``segment``, if one does (one listing). A segment is made only after a
        roll mark of the version its first unit has was written, so such a unit proves every
        commit before it was made."""
        for name in sorted(self.storage.list(self.folder)):
            if not is_segment(name) or segment_number(name) <= segment:
                continue
            found = self.first_unit(segment_number(name))
            if found is not None and found >= version:
                return found
        return None

    def first_unit(self, segment: int) -> int | None:
        """The version of the first unit of ``segment`` if it is whole (its crc checks and
        its ``prev`` is the header's crc), else ``None``."""
        path = self.path(segment)
        try:
            data = self.storage.read_range(path, 0, HEAD + _UNIT_HEAD.size)
            if len(data) < HEAD + _UNIT_HEAD.size:
                return None
            _magic, _ident, header_crc = _SEGMENT_HEAD.unpack_from(data)
            _m, _c, version, _p, entry_len, frames_len = _UNIT_HEAD.unpack_from(data, HEAD)
            if entry_len + frames_len > _MAX_UNIT:
                return None
            data = self.storage.read_range(path, HEAD, HEAD + _UNIT_HEAD.size + entry_len +
                                           frames_len)
        except NotFound:
            return None
        return version if _unit_at(data, 0, version) == header_crc else None

    def proven_damage(self, position: JournalPosition, version: int,
                      why: str) -> DamagedLogError:
        """The damage at ``position``, the journal's readable end, where bytes that look like a
        unit torn by a crash lie although ``why`` proves the unit of ``version`` was committed
        (``CommitLog._prove_end``: a consumer's position, a checkpoint)."""
        segment, offset = position.segment, position.offset
        if segment == 0:
            segment, offset = 1, HEAD
        return self._damage(segment, offset, version, (
            f"looks like a unit torn by a crash (or zeros, with bytes after them), but {why}: "
            "it was committed and damaged since"))

    def _damage(self, segment: int, offset: int, version: int, reason: str) -> DamagedLogError:
        return DamagedLogError(
            f"{self.path(segment)}@{offset}", version,
            f"(where unit {version} should be) {reason}. Readers stop before it and writers "
            "do not append after it; " + REPAIR_HINT, partial=False)

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

    def _unit_body(self, segment: int, offset: int, head: bytes, version: int,
                   ahead: bytes = b"") -> tuple[
            dict[str, Any], JournalPosition, tuple[int, int]] | None:
        """``ahead``: bytes read with the head, after it (the whole unit, when it is small)."""
        _magic, crc, _version, prev, entry_len, frames_len = _UNIT_HEAD.unpack(head)
        start = offset + _UNIT_HEAD.size
        end = start + entry_len + frames_len
        if entry_len + frames_len > _MAX_UNIT:
            return self._judged(segment, offset, version, prev)
        fields = _UNIT_FIELDS.pack(version, prev, entry_len, frames_len)
        body = ahead[:end - start] if len(ahead) >= end - start else \
            self._read(segment, start, end)
        if len(body) < end - start or crc32c(body, crc32c(fields)) != crc:
            # Being written, torn by a crash, or damaged: the rule tells which. A read that
            # raced the unit's write (a pwrite is not atomic against a pread) may get it whole
            # the second time; a torn unit that readers keep finding is judged once.
            seen = (segment, offset, head, len(body), crc32c(body))
            if seen == self._torn:
                return None
            body = self._read(segment, start, end)
            if len(body) < end - start or crc32c(body, crc32c(fields)) != crc:
                found = self._judged(segment, offset, version, prev)  # raises for damage
                self._torn = seen
                return found
        entry = entry_of(body[:entry_len])
        return entry, JournalPosition(segment, end, crc), (offset, end)

    def tail(self, position: JournalPosition) -> bytes:
        """The bytes after ``position`` up to the last one that is not zero: a unit torn by a
        crash (or one being written right now), which readers never read and the next commit
        zeroes before it writes there."""
        if position.segment == 0:
            return b""
        end = self._dirty_end(position.segment, position.offset)
        return self._read(position.segment, position.offset, end)

    def _dirty_end(self, segment: int, offset: int) -> int:
        """Where the bytes that are not zeros after ``offset`` end (``offset``: none), read to
        the end of the segment file."""
        try:
            size = self.storage.size(self.path(segment))
        except NotFound:
            return offset
        end = lo = offset
        while lo < size:
            chunk = self._read(segment, lo, min(size, lo + len(_ZEROS)))
            if chunk != _ZEROS[:len(chunk)]:
                end = lo + len(chunk.rstrip(b"\0"))
            if not chunk:
                break
            lo += len(chunk)
        return end

    def clear_tail(self, position: JournalPosition, nbytes: int, *, sync: bool) -> None:
        """Write zeros over ``nbytes`` after ``position`` (the caller holds the publish lock,
        so no writer is in the middle of a unit there)."""
        file = self._open(position.segment, position.offset)
        file.write(bytes(nbytes))
        file.seek(position.offset)
        if sync:
            file.sync()

    def _make_room(self, segment: int, offset: int) -> None:
        """Before a writer writes at ``offset``: zeros from there to the segment's end, as the
        torn-tail rule needs (a unit torn by a crash is told from damage by its 4 KiB blocks of
        zeros, so no unit may be written over the bytes of another). What a crash left there
        (a torn unit, which ``read_next`` judged so) is zeroed and synced first. Looked at
        once per process and segment to the segment's end (a power cut may keep later pages
        of a torn unit and not its head), then only where a unit starts (a killed writer's
        unit always begins with its head)."""
        head = self._read(segment, offset, offset + _UNIT_HEAD.size)
        if any(head) or self._scanned != segment:
            end = self._dirty_end(segment, offset)
            self._scanned = segment
            if end > offset:
                log.warning("journal %s: zeroing %d bytes after the last commit at offset %d "
                            "(a unit torn by a crash, never committed) before writing there",
                            self.path(segment), end - offset, offset)
                try:
                    self.clear_tail(JournalPosition(segment, offset), end - offset, sync=True)
                except StorageError:
                    # the zeros may not be on disk (a failed sync may drop them, and the torn
                    # bytes read back): the next writer looks at the whole tail again
                    self._scanned = 0
                    raise
        self._clean = (segment, offset)

    # -- repairing damage ----------------------------------------------------------------------
    def read_range(self, segment: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a segment."""
        return self._read(segment, start, end)

    def header_crc(self, segment: int) -> int:
        """The crc in a segment's header: the ``prev`` of its first unit."""
        _magic, _ident, crc = _SEGMENT_HEAD.unpack(self._read(segment, 0, HEAD))
        return int(crc)

    def damaged_unit(self, segment: int, offset: int, version: int) -> DamagedUnit:
        """What lies at ``offset`` of ``segment``, where the unit of ``version`` should be and
        damage is (see :class:`DamagedUnit`), for repair. Reads from ``offset`` to the last
        byte of the segment that is not zero."""
        dirty = self._dirty_end(segment, offset)
        if self.first_unit(segment + 1) == version:
            return DamagedUnit(segment, offset, offset + _UNIT_HEAD.size, None, True,
                               max(dirty, offset + _UNIT_HEAD.size), None, None, mark=True)
        size = self.storage.size(self.path(segment))
        head = self._read(segment, offset, offset + _UNIT_HEAD.size)
        if len(head) == _UNIT_HEAD.size:  # a whole unit ends in zeros (its stream's end mark)
            _m, _c, _v, _p, entry_len, frames_len = _UNIT_HEAD.unpack(head)
            if entry_len + frames_len <= _MAX_UNIT:
                dirty = max(dirty, min(size, offset + _UNIT_HEAD.size + entry_len + frames_len))
        # (and a roll mark ends in 12 zero bytes)
        data = self._read(segment, offset, min(size, dirty + _UNIT_HEAD.size))
        entry: dict[str, Any] | None = None
        stated: int | None = None
        if len(data) >= _UNIT_HEAD.size:
            magic, _c, unit_version, _p, entry_len, frames_len = _UNIT_HEAD.unpack_from(data)
            if magic in UNITS and unit_version == version and \
                    entry_len + frames_len <= len(data) - _UNIT_HEAD.size:
                stated = _UNIT_HEAD.size + entry_len + frames_len
                try:
                    parsed = json.loads(data[_UNIT_HEAD.size:_UNIT_HEAD.size + entry_len])
                    entry = parsed if isinstance(parsed, dict) else None
                except ValueError:
                    entry = None
        # the unit after it: at its stated end, else wherever a head of the next version
        # checks (its crc), in case the damage is in the lengths
        candidates = [] if stated is None else [stated]
        for magic in (*UNITS, ROLL_MAGIC):
            at = data.find(magic, 1)
            while at >= 0:
                candidates.append(at)
                at = data.find(magic, at + 1)
        for at in candidates:
            found = _unit_at(data, at, version + 1)
            if found is not None:
                return DamagedUnit(segment, offset, offset + at, found, True, dirty, entry,
                                   self._next_seq_after(segment, data, at, version + 1))
        if stated is not None:
            # the last unit, its head whole: a view that applied it before it was damaged
            # (in a process still running) appends after its end, chained to its crc
            crc = _UNIT_HEAD.unpack_from(data)[1]
            return DamagedUnit(segment, offset, offset + stated, crc, False, dirty, entry, None)
        return DamagedUnit(segment, offset, None, None, False, dirty, entry, None)

    def _next_seq_after(self, segment: int, data: bytes, at: int, version: int) -> int | None:
        """The first ``_seq`` of the first ``append`` from the unit of ``version`` at ``at`` of
        ``data`` on (following the chain, and a roll mark to the next segment's first unit)."""
        while True:
            magic, _crc, _v, _p, entry_len, frames_len = _UNIT_HEAD.unpack_from(data, at)
            if magic == ROLL_MAGIC:
                try:
                    head = self.storage.read_range(self.path(segment + 1), 0,
                                                   HEAD + _UNIT_HEAD.size + (1 << 16))
                except NotFound:
                    return None
                found = _unit_at(head, HEAD, version) if len(head) > HEAD else None
                if found is None:
                    return None
                data, at = head, HEAD
                magic, _crc, _v, _p, entry_len, frames_len = _UNIT_HEAD.unpack_from(data, at)
            try:
                entry = json.loads(data[at + _UNIT_HEAD.size:at + _UNIT_HEAD.size + entry_len])
            except ValueError:
                return None
            if entry.get("op") in ("append", "lost"):
                return int(entry["seq"])
            at += _UNIT_HEAD.size + entry_len + frames_len
            version += 1
            if _unit_at(data, at, version) is None:
                return None

    def restore_mark(self, unit: DamagedUnit, version: int, prev: int) -> None:
        """Write the roll mark of ``version`` (chained to ``prev``) again where ``unit`` (a
        damaged mark, :attr:`DamagedUnit.mark`) is, synced. The caller holds the publish lock
        and kept a copy of the damaged bytes."""
        mark = _UNIT_HEAD.pack(ROLL_MAGIC, crc32c(_UNIT_FIELDS.pack(version, prev, 0, 0)),
                               version, prev, 0, 0)
        file = self._open(unit.segment, unit.offset)
        file.write(mark)
        file.sync()
        self._clean = None

    def splice(self, unit: DamagedUnit, version: int, prev: int, entry: bytes, *,
               sync: bool) -> None:
        """Write the unit of ``version`` (chained to ``prev``) holding ``entry`` in place of
        the damaged ``unit``: exactly as long, with the crc the unit after it chains to (4
        bytes of filler after the entry are chosen for it, CRC32C being affine), so that every
        unit after it reads on unchanged, and a view that applied the damaged unit before
        appends after it in the right place. What follows it in the journal's tail (bytes of
        no unit) is zeroed. The caller holds the publish lock and kept a copy of the damaged
        bytes.

        Raises
        ------
        ValueError
            The damaged unit is too short to hold ``entry``.
        """
        assert unit.end is not None and unit.next_prev is not None
        length = unit.end - unit.offset
        filler = length - _UNIT_HEAD.size - len(entry)
        if filler < 4:
            raise ValueError(f"the damaged unit at {self.path(unit.segment)}@{unit.offset} is "
                             f"{length} bytes, too short for the {len(entry)}-byte record "
                             "that takes its place")
        fields = _UNIT_FIELDS.pack(version, prev, len(entry), filler)
        start = crc32c(bytes(filler - 4), crc32c(entry, crc32c(fields)))
        forced = _force_crc(start, unit.next_prev)
        head = _UNIT_HEAD.pack(UNIT_MAGIC, unit.next_prev, version, prev, len(entry), filler)
        data = head + entry + bytes(filler - 4) + forced
        file = self._open(unit.segment, unit.offset)
        file.write(data)
        if not unit.units_after and unit.dirty_end > unit.end:
            file.write(bytes(unit.dirty_end - unit.end))
        if sync:
            file.sync()
        self._clean = None

    # -- writing --------------------------------------------------------------------------------
    def append(self, position: JournalPosition, version: int, entry: bytes,
               frames: bytes | bytearray | memoryview = b"", *,
               sync: bool, lock: KeptLock | None = None, defer: bool = False,
               prev_synced: bool = True) -> tuple[JournalPosition, tuple[int, int]]:
        """Write the unit of ``version`` after ``position`` (rolling to a new segment when it
        does not fit in ``page_size_bytes``) and, with ``sync``, make it durable. Returns the
        position after it and its ``(offset, end)`` in its segment. The caller holds the
        publish lock and has read the journal up to ``position``.

        ``lock``: the publish lock held. A segment kept open is looked up by its path (was the
        address deleted and made again under this view?) before it is written again, unless
        the lock watches its own file (:attr:`KeptLock.watched`) and neither it nor its
        ``renewed`` count changed since the last look: an address goes with its lock file.

        ``defer`` (with ``sync``): the unit's sync is left to :meth:`sync_unit`, which the
        caller calls once it let the publish lock go (writers of other processes append while
        it runs; see the module docstring, "Syncs outside the lock"). ``prev_synced``: whether
        the caller knows the unit before this one synced; if not, a roll syncs what is before
        its mark first (a mark proves the unit before it was synced)."""
        if not can_journal(self.storage):
            raise StorageError(errno.ENOTSUP, (
                f"{self.folder}: this address keeps its commits in a journal (on-disk format "
                f"4), which only a local disk can write; {self.storage.url} "
                f"({type(self.storage).__name__}) cannot (no appends, locks or hard links). "
                "Write to it from a local path on the host that holds it"))
        if self._pending is not None:
            # (CommitLog settles before it reads the log: what it writes again may be the
            # unit this view ends with)
            raise self._unproven("nothing is appended after them")
        self._drop_poisoned()
        size = _UNIT_HEAD.size + len(entry) + len(frames)
        segment, offset, prev = position.segment, position.offset, position.prev
        file = self._file
        if file is not None and self._file_segment == segment:
            checked = (lock, lock.renewed) if lock is not None and lock.watched else None
            if checked is None or checked != self._checked:
                if file.gone():  # the address was deleted (and made again) under this view
                    self.close()
                    raise NotFound(errno.ENOENT, f"journal segment {self.path(segment)} is gone")
                self._checked = checked
        if segment > 0 and self._clean != (segment, offset):
            self._make_room(segment, offset)
        fresh = segment == 0 or (offset + size > self.page_size_bytes and offset > HEAD)
        if fresh and segment > 0:
            # A roll mark where the unit would have gone sends readers to the next segment
            # (so that a look for new units reads one place). It is synced before the new
            # segment's unit: that unit is reachable once durable.
            mark = _UNIT_HEAD.pack(ROLL_MAGIC, crc32c(_UNIT_FIELDS.pack(version, prev, 0, 0)),
                                   version, prev, 0, 0)
            file = self._open(segment, offset)
            self._reserve(file, offset, len(mark), messages=bool(frames))
            if not prev_synced:
                # (whatever this handle's fsync mode: a mark proves what is before it synced)
                self._sync(file, segment, offset, (), version, " (before its roll mark)",
                           messages=bool(frames), force=True)
            file.write(mark)
            if sync:
                # durable before the new segment's unit: a unit reachable only through a mark
                # that a power cut took back would be lost with it
                self._sync(file, segment, offset, (mark,), version, " (its roll mark)",
                           messages=bool(frames))
        written: tuple[bytes | bytearray | memoryview, ...] = ()
        start = offset
        if fresh:
            segment += 1
            segment_head, prev = _segment_head(os.urandom(16))
            offset = 0
            if self.storage.exists(self.path(segment)):
                self._make_room(segment, 0)  # a roll torn by a crash left this file
            self._scanned = segment
            file = self._open(segment, 0)
            self._reserve(file, 0, HEAD + size, messages=bool(frames))
            try:
                file.write(segment_head)
            except StoreFullError:
                self._unwrite(file, 0)
                raise
            written, start, offset = (segment_head,), 0, HEAD
        else:
            file = self._open(segment, offset)
            self._reserve(file, offset, size, messages=bool(frames))
        head, crc = _unit(version, prev, entry, frames, sync)
        small = len(frames) < (1 << 16)
        written += (head + entry + frames,) if small else (head + entry, frames)
        try:
            file.write(written[-1] if small else written[-2])
            if not small:
                file.write(frames)  # large: no copy into one buffer
        except StoreFullError:
            self._unwrite(file, offset)
            raise
        if sync and defer:
            self._unsynced = _Unsynced(file, segment, start, written, version, bool(frames))
        elif sync:
            # the commit: durable before the send returns (a power cut before it may take it
            # back; a killed process loses nothing)
            self._sync(file, segment, start, written, version, "", messages=bool(frames))
        self._clean = (segment, offset + size)
        return JournalPosition(segment, offset + size, crc), (offset, offset + size)

    def sync_unit(self) -> None:
        """The sync :meth:`append` left (``defer``), outside the publish lock: the commit. When
        it fails the caller takes the lock again and calls :meth:`unit_sync_failed`.

        Raises
        ------
        StorageError
            The sync failed (the unit stays to be judged by :meth:`unit_sync_failed`)."""
        unsynced = self._unsynced
        if unsynced is not None:
            unsynced.file.sync()
            self._unsynced = None

    def sync_through(self, position: JournalPosition) -> None:
        """Make every unit up to ``position`` durable, whoever wrote them: one ``fdatasync`` of
        its segment through a descriptor of its own (a sync covers every byte written to the
        file before it, and a roll mark is synced before the next segment gets a unit, so the
        earlier segments are). For a checkpoint of a view that may end with another
        process's unit whose sync has not finished (see ``CommitLog.checkpoint_now``).

        Raises
        ------
        NotFound
            The segment is gone (the address was deleted).
        StorageError
            The sync failed: what the view holds may not be durable."""
        if not self.storage.fsync or position.segment == 0:
            return
        path = self.path(position.segment)
        if self.storage.capabilities.overwrite:
            file: InPlaceFile | AppendFile = self.storage.open_inplace(path)
        else:  # (opening to append would make the file if it were gone)
            if not self.storage.exists(path):
                raise NotFound(errno.ENOENT, f"journal segment {path} was removed (the "
                               "address was deleted)")
            file = self.storage.open_append(path, at=position.offset)
        try:
            file.sync()
        finally:
            file.close()

    def unit_sync_failed(self, exc: StorageError) -> StorageError:
        """Under the publish lock again, after :meth:`sync_unit` failed: the unit's bytes are
        written again from memory and synced (through a new descriptor) unless the file no
        longer holds them or zeros there (then a writer that found them gone put its own unit
        there, and this send is not stored); returns the error the send raises. Other
        writers may have appended after the unit meanwhile: their own syncs report the
        failure to them too (a write-back error is reported to every open file of the segment
        that has not seen it)."""
        unsynced = self._unsynced
        self._unsynced = None
        if unsynced is None:  # closed meanwhile: the address was deleted (and made again)
            return StorageError(exc.errno or errno.EIO, (
                f"journal {self.folder}: the fdatasync of a unit failed ({exc}), and the "
                "address was deleted (or made again) before it could be written again; no "
                "message of this send was acknowledged, and it is not stored"))
        segment, offset = unsynced.segment, unsynced.start
        if not self._ours_or_zeros_there(segment, offset,
                                         b"".join(bytes(p) for p in unsynced.written)):
            self._drop_poisoned(force=True)
            self._clean = None
            cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
            log.error("journal %s: the fdatasync after writing unit %d failed (%s), and "
                      "another writer's unit took its place", self.path(segment),
                      unsynced.version, cause)
            return StorageError(exc.errno or errno.EIO, (
                f"journal segment {self.path(segment)}: the fdatasync after writing unit "
                f"{unsynced.version} failed ({cause}); no message of this send was "
                "acknowledged, and it is not stored (another writer's unit took its place)"))
        return self._sync_failed(segment, offset, unsynced.written, unsynced.version, "", exc,
                                 messages=unsynced.messages)

    def forget_unsynced(self) -> None:
        """Drop the unit :meth:`sync_unit` was to sync (its sync failed and was dealt with, or
        could not be)."""
        self._unsynced = None

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

    def _unwrite(self, file: AppendFile, start: int) -> None:
        """Zeros over what a write that found the disk full left of its unit after ``start``
        (nothing half written is read, and no unit is written over another's bytes; zeros
        need no new room), and the logical end back at ``start``. Where even that fails,
        the next append looks at the tail again (``_make_room``)."""
        end = file.tell()
        if end > start:
            try:
                file.seek(start)
                file.write(bytes(end - start))
            except StorageError:
                self._clean = None
        file.seek(start)

    def _sync(self, file: AppendFile, segment: int, offset: int,
              parts: tuple[bytes | bytearray | memoryview, ...], version: int, what: str, *,
              messages: bool, force: bool = False) -> None:
        """``file.sync()`` after writing ``parts`` at ``offset`` of ``segment`` (``what``: empty
        for the unit of ``version`` itself, else what was written for it: its roll mark); when
        it fails, see :meth:`_sync_failed`."""
        try:
            file.sync(force=force)
        except StorageError as exc:
            raise self._sync_failed(segment, offset, parts, version, what, exc,
                                    messages=messages) from exc

    def _sync_failed(self, segment: int, offset: int,
                     parts: tuple[bytes | bytearray | memoryview, ...], version: int,
                     what: str, exc: StorageError, *, messages: bool) -> StorageError:
        """The error for a commit whose sync failed, once what it wrote was written again from
        memory and synced through a new descriptor, or kept to be (the module docstring: "A
        sync that fails"). The caller holds the publish lock: no other writer has appended
        after these bytes."""
        path = self.path(segment)
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        if not parts:  # the sync before a roll mark: nothing of this commit was written yet
            self._drop_poisoned(force=True)
            self._clean = None
            log.error("journal %s: the fdatasync before writing unit %d%s failed: %s", path,
                      version, what, cause)
            return StorageError(exc.errno or errno.EIO, (
                f"journal segment {path}: the fdatasync before writing unit {version}{what} "
                f"failed ({cause}); nothing of this commit was written, and no message of it "
                "was acknowledged"))
        try:
            self._write_from_memory(segment, offset, parts)
        except StorageError as again:
            self._pending = (segment, offset, b"".join(bytes(p) for p in parts))
            after = (f"Writing its bytes again from memory failed too ({again}): this journal "
                     "takes no more commits from this process until they are written and "
                     "synced (each commit tries first)")
        else:
            after = ("Its bytes were then written again from memory through a new descriptor "
                     "and synced: its messages may still be delivered, as those of a send "
                     "whose answer was lost (sending again may store them twice)")
        told = "no message of this send was acknowledged" if messages else \
            "this commit was not acknowledged"
        log.error("journal %s: the fdatasync after writing unit %d%s failed: %s", path,
                  version, what, cause)
        return StorageError(exc.errno or errno.EIO, (
            f"journal segment {path}: the fdatasync after writing unit {version}{what} "
            f"failed ({cause}); {told}. {after}"))

    def _write_from_memory(self, segment: int, offset: int,
                           parts: tuple[bytes | bytearray | memoryview, ...]) -> None:
        """Write ``parts`` at ``offset`` of ``segment`` through a new descriptor and sync them
        (the one that failed is poisoned: it writes nothing more).

        Raises
        ------
        StorageError
            The new sync fails too (the new descriptor is poisoned in turn)."""
        self._drop_poisoned(force=True)
        file = self._open(segment, offset)
        for part in parts:
            file.write(part)
        file.sync()

    def _drop_poisoned(self, *, force: bool = False) -> None:
        """Close the open segment if a sync of it failed (or, ``force``, whatever it is): the
        next write opens it again."""
        file = self._file
        if file is not None and (force or file.poisoned):
            if file.poisoned:
                self._clean = None  # its last bytes may not be on disk: look again
            self._file = None
            with contextlib.suppress(StorageError):
                file.close()

    def settle(self) -> None:
        """Before a commit reads the log (under the publish lock): write again what this
        process could not prove durable (its sync failed, and so did writing it again), from
        its copy in memory, and sync it, so that nothing is appended after bytes a power cut
        may take back. Unless the file no longer holds them or zeros there: then another writer
        put its own unit in their place, and the copy is dropped (that send is not stored).

        Raises
        ------
        StorageError
            The sync failed again: the commit is refused (nothing is appended)."""
        self._drop_poisoned()
        pending = self._pending
        if pending is None:
            return
        segment, offset, data = pending
        if not self._ours_or_zeros_there(segment, offset, data):
            log.warning("journal %s: the %d bytes at offset %d whose sync failed are no longer "
                        "there (another writer's unit took their place): not written again",
                        self.path(segment), len(data), offset)
            self._pending = None
            return
        try:
            self._write_from_memory(segment, offset, (data,))
        except StorageError as exc:
            raise self._unproven(f"writing them again failed ({exc})") from exc
        log.warning("journal %s: the %d bytes at offset %d whose sync failed were written "
                    "again and synced", self.path(segment), len(data), offset)
        self._pending = None

    def _ours_or_zeros_there(self, segment: int, offset: int, data: bytes) -> bool:
        """Whether the segment still holds ``data`` (or zeros) at ``offset``: not when another
        writer, which found them gone, put its own unit there (or the segment is gone)."""
        try:
            there = self.storage.read_range(self.path(segment), offset, offset + len(data))
        except NotFound:
            return False
        return _ours_or_zeros(there, data, offset)

    def _unproven(self, why: str) -> StorageError:
        assert self._pending is not None
        segment, offset, data = self._pending
        return StorageError(errno.EIO, (
            f"journal segment {self.path(segment)}: the {len(data)} bytes this process wrote "
            f"at offset {offset} are not proven durable (their fdatasync failed); {why}, so "
            "no message of this send was acknowledged. The disk reports write errors: check "
            "it (dmesg); each new commit tries to write them again first"))

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
        self._unsynced = None  # (its sync, if it failed, finds the address gone)
        if self._pending is not None:
            # (the address may have been deleted and made again: they are not written there)
            segment, offset, data = self._pending
            log.warning("journal %s: closed with %d bytes at offset %d whose sync failed and "
                        "that were not written again; a send that failed may be lost with "
                        "them", self.path(segment), len(data), offset)
            self._pending = None
        self._clean, self._scanned = None, 0
        if self._file is not None:
            self._file.close()
            self._file = None
        for reader in self._readers.values():
            reader.close()
        self._readers = {}


@dataclass(frozen=True)
class _Unsynced:
    """A unit :meth:`Journal.append` wrote and left to :meth:`Journal.sync_unit`: its open
    segment file, where its bytes start (a new segment's head and the unit) and the bytes."""

    file: AppendFile
    segment: int
    start: int
    written: tuple[bytes | bytearray | memoryview, ...]
    version: int
    messages: bool


class SyncedVersions:
    """``log/_synced`` (mode 0600, mapped by every writer process of the host): the newest unit
    version each process saw synced, 8 bytes in the slot of its pid (64 slots). A writer under
    the publish lock reads it to know whether the unit it chains to is synced yet
    (:meth:`newest`); if not, its entry says how far it knew (``synced_to``, ``_format.unit``:
    then the unit's presence proves no more than that after a power cut). A hint, read
    and written without a lock, through the mapping (a ``pwrite`` per send would put the file's
    times in the journal commit of the next segment sync): two processes sharing a slot, a lost
    write, a missing file make it say *less* is synced (a lower ``synced_to``: a torn
    unit after a power cut is then taken for a torn tail, as an unsynced one is); a file left
    from an address deleted and made again, or a torn read of a slot, may say more (a torn
    tail then reads as damage: loud, never a silent loss)."""

    SLOTS = 64

    def __init__(self, storage: Storage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._map: mmap.mmap | None = None
        self._slots: memoryview | None = None
        self._failed = 0.0  # when mapping it last failed (monotonic): tried again a while after

    def _open(self) -> memoryview | None:
        if self._slots is None and time.monotonic() - self._failed >= _SYNCED_RETRY_S:
            opener = getattr(self._storage, "open_shared", None)
            try:
                if opener is not None:
                    fd = opener(self._path, 8 * self.SLOTS)
                    try:
                        self._map = mmap.mmap(fd, 8 * self.SLOTS)
                    finally:
                        os.close(fd)
                    self._slots = memoryview(self._map).cast("Q")
            except (OSError, StorageError) as exc:
                log.warning("journal: cannot map %s (%s); units written while another's sync "
                            "runs say synced_to 0", self._path, exc)
            self._failed = 0.0 if self._slots is not None else time.monotonic()
        return self._slots

    def newest(self) -> int:
        """The newest unit version some process saw synced (0: none known)."""
        slots = self._open()
        return 0 if slots is None else max(slots)

    def note(self, version: int) -> None:
        """This process saw the unit of ``version`` synced."""
        slots = self._open()
        if slots is not None:
            slots[os.getpid() % self.SLOTS] = version

    def close(self) -> None:
        """Unmapped (the address was made again, or this is a forked child): mapped afresh at
        the next use."""
        slots, mapped = self._slots, self._map
        self._slots, self._map, self._failed = None, None, 0.0
        if slots is not None:
            slots.release()
        if mapped is not None:
            mapped.close()

    def after_fork(self) -> None:
        """A forked child maps its own (unmapping its copy changes nothing for the parent)."""
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None, "_slots": None, "_failed": 0.0}


@dataclass(frozen=True)
class DamagedUnit:
    """Damage in a journal as repair sees it: at ``offset`` of ``segment``; ``end``: where the
    damaged unit ends and ``next_prev`` the crc a unit after it chains to: the unit after it
    starts there when ``units_after`` (``next_seq``: the first ``_seq`` of the first
    ``append`` from there on), else the damage is the journal's tail and these come from its
    head, which is whole; ``None`` when neither can be told; ``dirty_end``: where the bytes
    that are not zeros end in the segment; ``entry``: the damaged unit's record, if it still
    parses (its checksum failed: a hint, not the truth)."""

    segment: int
    offset: int
    end: int | None
    next_prev: int | None
    units_after: bool
    dirty_end: int
    entry: dict[str, Any] | None
    next_seq: int | None
    #: a roll mark belongs there: the next segment starts with a whole unit of this version
    #: (a mark holds nothing: it is written again, and nothing is lost)
    mark: bool = False

    @property
    def extent(self) -> int:
        """Where the damaged bytes end: the unit after it, else the last byte not zero."""
        if self.units_after and self.end is not None:
            return self.end
        return max(self.dirty_end, self.end or 0)


def _ours_or_zeros(there: bytes, ours: bytes, at: int) -> bool:
    """Whether ``there`` (read from file offset ``at``) holds ``ours`` or zeros in each of its
    4 KiB pieces (a failed sync may drop any of the pages it could not write)."""
    if len(there) > len(ours):
        return False
    lo, end = 0, len(ours)
    while lo < end:
        hi = min(end, ((at + lo) // PIECE + 1) * PIECE - at)
        piece = there[lo:hi]
        if piece != ours[lo:hi][:len(piece)] and piece.count(0) != len(piece):
            return False
        lo = hi
    return True


def _unit_at(data: bytes, at: int, version: int) -> int | None:
    """The ``prev`` of the unit or roll mark of ``version`` at ``at`` of ``data`` if it checks
    (its crc), else ``None``."""
    if at + _UNIT_HEAD.size > len(data):
        return None
    magic, crc, unit_version, prev, entry_len, frames_len = _UNIT_HEAD.unpack_from(data, at)
    if unit_version != version or magic not in (*UNITS, ROLL_MAGIC):
        return None
    end = at + _UNIT_HEAD.size + entry_len + frames_len
    if end > len(data):
        return None
    fields = _UNIT_FIELDS.pack(version, prev, entry_len, frames_len)
    if crc32c(data[at + _UNIT_HEAD.size:end], crc32c(fields)) != crc:
        return None
    return int(prev)


def _force_crc(start: int, target: int) -> bytes:
    """The 4 bytes that take CRC32C from ``start`` to ``target``: ``crc32c(b, start)`` is affine
    in the 32 bits of ``b``, so they solve a linear system over GF(2)."""
    base = crc32c(bytes(4), start)
    basis: list[tuple[int, int]] = []  # (vector, the input bits that make it), distinct top bits
    for bit in range(32):
        vector, combo = crc32c((1 << bit).to_bytes(4, "little"), start) ^ base, 1 << bit
        for b_vector, b_combo in basis:
            if vector ^ b_vector < vector:
                vector, combo = vector ^ b_vector, combo ^ b_combo
        if vector:
            basis.append((vector, combo))
            basis.sort(reverse=True)
    want, combo = target ^ base, 0
    for b_vector, b_combo in basis:
        if want ^ b_vector < want:
            want, combo = want ^ b_vector, combo ^ b_combo
    if want:  # pragma: no cover - CRC32C's map is invertible
        raise ValueError("no 4 bytes give this crc")
    return combo.to_bytes(4, "little")


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


def unit_time(storage: Storage, path: str, span: tuple[int, int], seq: int) -> int | None:
    """The commit time (epoch microseconds) of the unit of the published range ``span`` that
    holds ``_seq`` ``seq``, ``None`` when it holds none before ``seq``. From the range's unit
    directory: the first call of a process lists the range's unit heads and entries (reading at
    most the range, one segment), later ones only the units published since."""
    directory = _directory(storage, path, span)
    with directory.lock:
        i = bisect.bisect_right(directory.seqs, seq) - 1
        return directory.times[i] if i >= 0 else None


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
