"""The commit log of an address: numbered write-once entries, with periodic checkpoints.

An address's state (which pages are live, their ``_seq`` ranges, the schema, the transactions
already applied, drop counters) is the fold of its log entries, like Delta Lake's ``_delta_log``::

    log/00000000000000000001.json            entry 1
    log/00000000000000000002.json            entry 2 ...
    log/00000000000000000100.checkpoint.arrow state after entry 100 (one row per live page)
    log/_last_checkpoint                     hint: newest checkpoint version (checked, may lag)

Entries are published with :meth:`Storage.create`: atomic and exclusive, so two writers can
never both create entry N and no reader sees half an entry. A writer that loses the race reads
the winner's entry and retries on top of it (optimistic concurrency); ``_seq`` ranges are assigned
while building the entry, so they stay dense in commit order.

The kinds of entries and how they fold into a state are in :mod:`.state`.

Opening reads the newest checkpoint and at most ``CHECKPOINT_EVERY - 1`` entries after it.

Retention (:meth:`CommitLog.expire`, run by cleanup): entries older than ``logRetentionMs`` that
come before the newest checkpoint are deleted, oldest first (the checkpoint's own entry stays).
Every entry carries a random ``id``; a view of the log (``LogState``) remembers the id of the
entry it ends with. A process whose view is older than the retention could otherwise take a
deleted entry's free number for a new one, or believe nothing new was published, so a view is
checked (its last entry is still there, with its id) before it is trusted:

* when the log is opened (else it is reloaded from the newest checkpoint found by listing, not
  from the hint, which a slow writer can set back);
* by a refresh after ``VERIFY_EVERY_S`` without one (retention is at least
  ``MIN_RETENTION_S``, so entries published after a view's last refresh cannot be gone yet);
* by a writer right after publishing entry N, when its view was last checked (or seen to move
  on) ``VERIFY_EVERY_S`` ago or more (it paused between its refresh and the publish?): if entry
  N-1 it built on is gone, its entry is withdrawn and the commit retried on a reloaded view. A
  view checked more recently is trusted, as ``refresh`` trusts it.

Publishing writers on one host queue on a lock file (``log/_publish.lock``, ``flock``) instead
of racing; on object stores they race, and a loser backs off (randomised, exponential) before
it builds its entry again.

An address with a journal (format 4, local disks: :mod:`.journal`) keeps its entries as units
of the journal instead of ``log/<N>.json`` files: the same JSON entries, numbered the same way,
appended under the publish lock (which is what makes them exclusive there) with one
``fdatasync``. ``log/`` then holds its checkpoints, which also record where in the journal
their state ends, written every ``JOURNAL_CHECKPOINT_EVERY`` entries or
``JOURNAL_CHECKPOINT_BYTES`` of units.
"""
from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import random
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
from crc32c import crc32c

from .._format import checked
from .._format.entry import ENTRY_JSON, entry_bytes
from .._format.layout import numbered
from .._options import MIN_LOG_RETENTION_MS
from .._storage import KeptLock, NotFound, Storage
from ..errors import DamagedLogError, DamagedStoreError, StorageError
from .index import PageIndex
from .journal import Journal, JournalPosition, SyncedVersions, segment_name
from .state import LogState, schema_from_text, schema_to_text, seq_ranges_text, subtract_ranges

__all__ = ["CHECKPOINT_EVERY", "CommitLog", "LogState", "PageIndex", "schema_from_text",
           "schema_to_text", "seq_ranges_text", "subtract_ranges"]

log = logging.getLogger(__name__)

CHECKPOINT_EVERY = 100
#: A journal's commits are cheap and many: a checkpoint (the whole page index) every 100 would
#: cost more than the commits, while replaying this many units when opening is quick.
JOURNAL_CHECKPOINT_EVERY = 1000
#: ... or after this many bytes of units, whichever comes first: opening replays the units
#: after the newest checkpoint and checks each one's checksum, which covers its messages, so
#: large sends would otherwise make opening read up to 1,000 of them.
JOURNAL_CHECKPOINT_BYTES = 64 << 20
#: the checkpoint hint's file name, in the log folder
LOG_HINT = "_last_checkpoint"
CHECKPOINT_SUFFIX = ".checkpoint.arrow"
_PARTIAL_RETRIES = 20
#: A view not refreshed for this long is checked before it is trusted (see the docstring).
VERIFY_EVERY_S = 10.0
#: The shortest log retention allowed (``_options.MIN_LOG_RETENTION_MS``), in seconds.
MIN_RETENTION_S = MIN_LOG_RETENTION_MS / 1000
_LOAD_ATTEMPTS = 5
_PARTIAL_WAIT_S = 0.05
_PUBLISH_LOCK = "_publish.lock"
#: ``journal.SyncedVersions``: the newest unit each writer process of the host saw synced
_SYNCED = "_synced"
_BACKOFF_S = 0.002
_BACKOFF_MAX_S = 0.1


def _clock() -> float:
    """Seconds that keep counting while the machine is suspended (a suspended reader's view
    ages like any other), where the platform has such a clock."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


_LIVE: weakref.WeakSet[CommitLog] = weakref.WeakSet()

#: How often a waiting reader looks for entries of other processes (see CommitLog.wait): on one
#: host (``locks``) a look is one failed ``open``, cheap, so often; on object stores a request,
#: so backing off from the first interval to the last.
POLL_LOCAL_S = 0.001
POLL_REMOTE_S = (0.02, 1.0)


class _Publications:
    """Wakes the waiters of every commit log of this process when one of them publishes: a
    counter under a condition (read before a look, so a publish between the look and the wait
    is not missed)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.count = 0

    def published(self) -> None:
        with self.cond:
            self.count += 1
            self.cond.notify_all()


_PUBLICATIONS = _Publications()


class _EntryIds:
    """Ids of the entries this process publishes: 32 hex digits, 16 of a random prefix drawn
    once per process (and again in a forked child) and 16 of a counter. Unique as the random
    ids were (two processes share a prefix with odds of 2**-64) without a ``getrandom`` call
    per commit; an id only tells one entry from another published under the same number."""

    def __init__(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


_IDS = _EntryIds()


def _after_fork_in_child() -> None:
    global _PUBLICATIONS, _IDS
    _PUBLICATIONS = _Publications()
    _IDS = _EntryIds()  # the parent's prefix and counter would repeat its ids
    for commit_log in list(_LIVE):
        commit_log._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def entry_name(version: int) -> str:
    return f"{numbered(version)}.json"


def _entry_versions(names: Iterable[str]) -> list[int]:
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def checkpoint_name(version: int) -> str:
    return f"{numbered(version)}{CHECKPOINT_SUFFIX}"


class CommitLog:
    """The numbered, write-once commit log of one address.

    Concurrency guarantee: any number of processes may publish concurrently; each entry number
    is won by exactly one of them (:meth:`Storage.create`), losers rebuild their entry on top of
    the winner's. Readers never see a partial entry. ``state`` is this process's view, brought up
    to date by :meth:`refresh`. Threads may share one log: folding and publishing hold a
    per-object lock, and a ``remove`` replaces ``state.pages`` instead of changing it, so an
    index a reader took stays consistent.
    """

    def __init__(self, storage: Storage, folder: str, journal: Journal | None = None, *,
                 checksums: bool = False) -> None:
        self.storage = storage
        self.folder = folder
        #: the address's journal (format 4), where its entries are units instead of files
        self.journal = journal
        #: what units the writers of this host saw synced (a journal's syncs run outside the
        #: publish lock: see ``_publish_unit``); made at the first publish of a journal
        self._synced: SyncedVersions | None = None
        #: entries, checkpoints and the hint carry checksums (on-disk format 5)
        self.checksums = checksums
        self._state: LogState | None = None
        self._lock = threading.RLock()
        self._verified = _clock()  # when the view was last checked or seen to move on
        #: whether other processes appended units between this process's last two journal
        #: publishes (see ``_ops.group_commit._commit_group``); ``_last_unit``: the version of the
        #: last unit it published.
        self.others_writing = False
        self._last_unit = -1
        #: damage the journal's readable part ends at (a :class:`DamagedLogError` naming the
        #: segment and offset), as the last look at the log found it: ``state`` holds what is
        #: before it; readers raise it once they reach the end, writers at once
        self.damage: DamagedLogError | None = None
        self._publish_lock: KeptLock | None = None  # made at the first publish
        self._renewed_seen = 0  # the lock's ``renewed`` this view was last checked against
        #: where the address's consumers are (their acknowledged ``_seq`` positions), set by
        #: the address that opens a journal: one past the log's readable end proves that what
        #: follows it was committed (see ``_prove_end``)
        self.positions: Callable[[], Iterable[int]] | None = None
        #: damage that proof found where the readable part ends (``_prove_end``): it holds
        #: while the view ends there
        self._proven: tuple[JournalPosition, DamagedLogError] | None = None
        _LIVE.add(self)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"], state["damage"] = None, None  # rebuilt lazily where unpickled
        state["_publish_lock"], state["_renewed_seen"] = None, 0
        state["_last_unit"] = -1  # (its sync is this process's to finish)
        state["positions"], state["_proven"] = None, None  # executors only read
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._verified = _clock()
        _LIVE.add(self)

    def _after_fork(self) -> None:
        # A thread of the parent may have held the lock, or been half-way through folding an
        # entry, when the process forked: the child starts with a free lock and a fresh view.
        self._lock = threading.RLock()
        self._state = None
        self._last_unit = -1  # the parent's last unit may still be syncing
        if self.journal is not None:
            self.journal.after_fork()
        if self._synced is not None:
            self._synced.after_fork()

    @property
    def state(self) -> LogState:
        with self._lock:
            if self._state is None:
                self._state = self._load()
                self._verified = _clock()
            return self._state

    def check_damage(self) -> None:
        """Raise the :class:`DamagedLogError` the journal's readable part ends at, if the
        last look found one (:attr:`damage`)."""
        damage = self.damage
        if damage is not None:
            cls, args = damage.__reduce__()
            raise cls(*args)

    def forget(self) -> None:
        """Drop this process's view; the next look loads the log afresh (after repair set a
        damaged entry aside)."""
        with self._lock:
            self._state = None

    def refresh(self) -> LogState:
        """Apply entries published since the last look (one failed read when there are none;
        when the view has been neither checked nor moved on for ``VERIFY_EVERY_S``, one more
        read checks it first)."""
        with self._lock:
            started = _clock()
            state = self.state
            checked = started - self._verified >= VERIFY_EVERY_S
            if checked and not self._still_there(state):
                state = self._reload()
            before = state.version
            try:
                self._replay(state)
            except NotFound:
                # a journal view older than a cleanup that removed its segment
                state = self._reload()
                self._replay(state)
            if checked or state.version != before:
                self._verified = started
            return state

    def wait(self, version: int, timeout_s: float | None) -> LogState:
        """The state once the log has moved past ``version``, or after ``timeout_s`` seconds
        (``None``: no limit), whichever comes first.

        Entries published by this process wake the waiter at once; those of other processes
        are found by looking (``refresh``) every ``POLL_LOCAL_S`` on one host (a failed
        ``open``), and on object stores every ``POLL_REMOTE_S[0]``, backing off to
        ``POLL_REMOTE_S[1]`` (each look is a request).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        local = self.storage.capabilities.locks
        interval = POLL_LOCAL_S if local else POLL_REMOTE_S[0]
        while True:
            publications = _PUBLICATIONS
            with publications.cond:
                seen = publications.count
            state = self.refresh()
            if state.version > version:
                return state
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return state
            with publications.cond:
                if publications.count == seen:
                    publications.cond.wait(interval if left is None else min(interval, left))
            if not local:
                interval = min(interval * 1.5, POLL_REMOTE_S[1])

    def _reload(self) -> LogState:
        log.info("commit log %s moved past this process's view (entries were expired); "
                 "reloading from the newest checkpoint", self.folder)
        self._state = self._load(trust_hint=False)
        self._verified = _clock()
        return self._state

    def _still_there(self, state: LogState) -> bool:
        """Whether the log was not expired past ``state``: the entry it ends with is still
        there, and is the very entry it applied (same id), not one a stale writer published
        under the freed number. Retention never deletes the newest checkpoint's own entry, so
        a current view always passes. A view of an empty log is stale once a checkpoint hint
        exists (a hint is written before anything can be expired)."""
        version = state.version
        if version == 0:
            return not self.storage.exists(f"{self.folder}/{LOG_HINT}")
        if self.journal is not None:
            # segments are numbered and never reused: a view whose segment is still there
            # can read on from where it ends
            return self.journal.exists(state.journal or JournalPosition())
        try:
            entry = self.read_entry(version)
        except NotFound:
            return False
        except ValueError:
            # Being written (no hard links): a view only applies complete entries, so this
            # one is not the entry the view ends with.
            return False
        if entry.get("id") is not None or state.last_id is not None:
            return bool(entry.get("id") == state.last_id)
        # Entries of releases without ids: a drop republished after a lost race kept its
        # first time, so the view's running maximum may be later than the entry's own time.
        return int(entry.get("ts", -1)) <= state.last_ts

    def _predecessor_there(self, state: LogState) -> bool:
        """``_still_there`` for the view a just-published entry extends. The entry is out:
        a failing read must not turn it into a failed commit (a caller would send again)."""
        for attempt in range(3):
            try:
                return self._still_there(state)
            except StorageError as exc:
                if attempt == 2:
                    log.warning("commit log %s: could not check entry %d after publishing "
                                "entry %d (%s); taking the publish as good", self.folder,
                                state.version, state.version + 1, exc)
                time.sleep(0.05 * (attempt + 1))
        return True

    # -- publishing -----------------------------------------------------------------------------
    def publish(self, build: Callable[[LogState], dict[str, Any] | None],
                frames: bytes | bytearray | memoryview | None = None, *,
                spare: bool = False) -> tuple[int, dict[str, Any]] | None:
        """Publish the entry that ``build`` makes from the freshest state.

        ``build`` is called with the state brought up to date, and again after every lost race;
        it returns the entry, or ``None`` to publish nothing (then this returns ``None``). It may
        raise to abandon the publish.

        ``frames`` (a journal only): the page frames of the messages the entry appends, written
        in the same unit; the entry names them with one page ``{"journal": true, "rows",
        "bytes", "stats"}``, which gets the segment's name and the unit's range when applied.

        ``spare``: the caller commits often (the group commit of sends): the entry and a
        checkpoint due after it may be staged in files made ahead (see ``Storage.create``).

        Returns
        -------
        (version, entry) of the published entry.
        """
        # Writers on one host queue for the log (flock) instead of racing for it: a loser would
        # otherwise write and sync a new entry on every retry. Object stores race, and back off.
        with self._lock:
            journal = self.journal
            if journal is not None:
                with self._publisher():
                    self._follow_lock()
                    published = self._publish_unit(journal, build, frames)
                if published is not None:
                    self._sync_unit(journal, published[0], spare)
                return published
            return self._publish_files(build, frames, spare)

    def _publish_files(self, build: Callable[[LogState], dict[str, Any] | None],
                       frames: bytes | bytearray | memoryview | None,
                       spare: bool) -> tuple[int, dict[str, Any]] | None:
        """:meth:`publish` of an address without a journal: an entry file per commit."""
        with self._publisher():
            self._follow_lock()
            if frames is not None:
                raise ValueError(f"{self.folder} has no journal to write frames to")
            lost = 0
            while True:
                state = self.refresh()
                entry = build(state)
                if entry is None:
                    return None
                entry = _stamped(entry, state)
                version = state.version + 1
                data = self._encode(entry)
                path = f"{self.folder}/{entry_name(version)}"
                if self.storage.create(path, data, spare=spare):
                    if _clock() - self._verified >= VERIFY_EVERY_S and \
                            not self._predecessor_there(state):
                        # Entry `version` existed and was expired while this view was older:
                        # the number was free again but is not ours. Withdraw and retry.
                        self.storage.delete(path)
                        self._reload()
                        continue
                    state.apply(version, entry)
                    self._published(state, CHECKPOINT_EVERY, spare)
                    return version, entry
                lost += 1
                if not self.storage.capabilities.locks:
                    # Many writers racing for one object: spread their next attempts.
                    time.sleep(random.uniform(0, min(_BACKOFF_MAX_S, _BACKOFF_S * 2 ** lost)))

    def _publisher(self) -> KeptLock:
        """The publish lock (made once, under ``_lock``): one file kept open on a local disk."""
        lock = self._publish_lock
        if lock is None:
            lock = self._publish_lock = self.storage.kept_lock(f"{self.folder}/{_PUBLISH_LOCK}")
        return lock

    def _follow_lock(self) -> None:
        """Under the publish lock: when the lock had to open its file again since this view
        last looked (the address may have been deleted, or moved aside, and made again), the
        view and the journal's open files are dropped, and the entry is built on the log the
        folder holds now."""
        lock = self._publish_lock
        if lock is not None and lock.renewed != self._renewed_seen:
            self._renewed_seen = lock.renewed
            if self.journal is not None:
                self.journal.close()
            if self._synced is not None:
                self._synced.close()
            self._reload()

    def _publish_unit(self, journal: Journal, build: Callable[[LogState], dict[str, Any] | None],
                      frames: bytes | bytearray | memoryview | None
                      ) -> tuple[int, dict[str, Any]] | None:
        """Append the entry as a journal unit (the publish lock is held: it is what makes the
        unit's number ours alone). With ``fsync=always`` the unit's sync is left to
        :meth:`_sync_unit`, after the lock is let go."""
        sync = self.storage.fsync
        for attempt in (1, 2):
            # bytes of an earlier commit of this process whose sync failed are written again
            # (and synced) first: the view read next may end with them (Journal.settle)
            journal.settle()
            state = self.refresh()
            self.check_damage()  # nothing is appended after damage: it would be written over
            # units of other processes since this one's last: writers elsewhere are busy, and
            # a leader had better read their units before it takes the lock
            self.others_writing = state.version != self._last_unit
            entry = build(state)
            if entry is None:
                return None
            entry = _stamped(entry, state)
            version = state.version + 1
            data = entry_bytes(entry)
            # The unit this one chains to may be another process's whose sync still runs (syncs
            # run outside the lock): then this entry says up to which version units are known
            # synced, and a power cut that tears that unit leaves a torn tail, not damage
            # (``_format.unit``: SYNCED_TO). This process's own last unit is synced (its lock
            # is held across the sync). Whatever this handle's own fsync mode: another
            # handle's unit before it may be syncing.
            prev_synced = not self.others_writing or state.version <= 0
            if not prev_synced:
                synced_to = self._synced_versions().newest()
                prev_synced = synced_to >= state.version
                if not prev_synced:
                    data = data[:-1] + b',"synced_to":%d}' % synced_to
            # The unit's fdatasync (fsync=always) is the commit: before it a power failure may
            # take the entry back (a killed process loses nothing), so publish returns only
            # after it (:meth:`_sync_unit`).
            try:
                position, span = journal.append(state.journal or JournalPosition(), version, data,
                                                b"" if frames is None else frames,
                                                sync=sync, defer=True, prev_synced=prev_synced,
                                                lock=self._publish_lock)
                break
            except NotFound:
                if attempt == 2:
                    raise
                self._reload()  # the view's segment is gone: the address was made again
        else:  # pragma: no cover - the loop breaks or raises
            raise AssertionError("unreachable")
        _apply_unit(state, version, entry, position, span)
        self._last_unit = version
        return version, entry

    def _sync_unit(self, journal: Journal, version: int, spare: bool) -> None:
        """The commit of the unit of ``version`` just appended: its sync, once the publish lock
        is let go (under the view's own lock: this process's next unit waits for it), so that
        writers of other processes append while it runs and the kernel makes one flush of
        several syncs. A sync covers every byte written before it in the segment (a roll mark
        is synced before the next segment gets a unit), so a unit of another process that was
        written after this one is never durable while this one is not. When it fails, under the
        lock again, this unit is written again from memory (see ``Journal.unit_sync_failed``)
        and the view loads afresh."""
        try:
            journal.sync_unit()
        except StorageError as exc:
            self._last_unit = -1  # (its number may be another writer's unit now)
            try:
                with self._publisher():
                    self._follow_lock()  # made again meanwhile: nothing is written there
                    error = journal.unit_sync_failed(exc)
                    self._reload()  # the unit may not be there (or not yet): read it again
            finally:
                journal.forget_unsynced()
            raise error from exc
        if self.storage.fsync:
            self._synced_versions().note(version)
        state = self.state
        if state.version == version:
            self._published(state, JOURNAL_CHECKPOINT_EVERY, spare)

    def _synced_versions(self) -> SyncedVersions:
        """``log/_synced`` (made at its first use)."""
        if self._synced is None:
            self._synced = SyncedVersions(self.storage, f"{self.folder}/{_SYNCED}")
        return self._synced

    def _published(self, state: LogState, checkpoint_every: int, spare: bool) -> None:
        """After this process published ``state.version``: wake the waiters, and write the
        checkpoint when one is due."""
        _PUBLICATIONS.published()
        if state.version % checkpoint_every == 0 or \
                state.unit_bytes >= JOURNAL_CHECKPOINT_BYTES:
            state.unit_bytes = 0
            try:
                self.write_checkpoint(state, spare=spare)
            except StorageError as exc:
                # The entry is published: failing now would make the caller retry a commit
                # that succeeded. Opening replays a few more.
                log.warning("could not write checkpoint %d in %s: %s", state.version,
                            self.folder, exc)

    def take_out_damage(self, entry: dict[str, Any],
                        set_aside: Callable[[str, int, bytes], None]) -> bool:
        """Take the damage the journal's readable part ends at (:attr:`damage`) out, under the
        publish lock, once ``set_aside(segment name, offset, bytes)`` has kept a copy of it:
        ``entry`` (a ``lost`` entry) takes the damaged unit's place: written in the damaged
        unit's bytes with the crc the unit after it chains to (:meth:`Journal.splice`), so
        that the units after it read on unchanged, and a view in a running process that
        applied the unit before it was damaged appends in the right place; when the damaged
        unit's length cannot be told (its head is damaged and nothing after it found), the
        damaged bytes are zeroed and ``entry`` is published there. Returns whether
        there was damage to take out (another process may have done it)."""
        journal = self.journal
        if journal is None:
            return False
        with self._lock, self._publisher():
            self._follow_lock()
            state = self.refresh()
            damage = self.damage
            if damage is None:
                return False
            path, _, offset_text = damage.path.rpartition("@")
            name = path.rsplit("/", 1)[-1]
            unit = journal.damaged_unit(int(name.split(".", 1)[0]), int(offset_text),
                                        damage.version)
            set_aside(name, unit.offset, journal.read_range(
                unit.segment, unit.offset,
                unit.extent))
            position = state.journal or JournalPosition()
            if unit.mark:  # nothing lost: the mark is written again
                journal.restore_mark(unit, state.version + 1, position.prev)
                self.forget()
                return True
            data = ENTRY_JSON.encode(_stamped(entry, state)).encode()
            if unit.end is None or unit.end - unit.offset < len(data) + 64:
                # nothing tells how long it was (or it is too short to hold the entry): the
                # entry goes where it starts, over zeros
                journal.clear_tail(JournalPosition(unit.segment, unit.offset),
                                   unit.dirty_end - unit.offset, sync=True)
                self.forget()
                self.publish(lambda _state: entry)
                return True
            prev = position.prev if position.segment == unit.segment else \
                journal.header_crc(unit.segment)
            journal.splice(unit, state.version + 1, prev, data, sync=True)
            self.forget()
            return True

    def clear_journal_tail(self, set_aside: Callable[[str, int, bytes], None]) -> int:
        """Zero the unfinished unit after the journal's last commit, under the publish lock
        (so it is not one being written), once ``set_aside(segment name, offset, bytes)`` has
        kept a copy; returns the bytes cleared."""
        journal = self.journal
        if journal is None:
            return 0
        with self._lock, self._publisher():
            self._follow_lock()
            position = self.refresh().journal or JournalPosition()
            torn = journal.tail(position)
            if torn:
                # Torn by a crash (never acknowledged) or, if its writer synced it, damaged
                # since: the two look the same, so a copy is kept (repair never deletes).
                set_aside(segment_name(position.segment), position.offset, torn)
                journal.clear_tail(position, len(torn), sync=self.storage.fsync)
            return len(torn)

    def write_checkpoint(self, state: LogState, *, spare: bool = False) -> None:
        """Write the state after ``state.version`` as a checkpoint (first writer wins);
        ``spare``: see :meth:`publish`."""
        table = state.pages.to_table()
        header = json.dumps(state.header(), separators=(",", ":")).encode()
        table = table.replace_schema_metadata({b"dq.state": header})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        data = sink.getvalue().to_pybytes()
        if self.checksums:
            data += _CHECKPOINT_TRAILER.pack(_CHECKPOINT_MAGIC, crc32c(data))
        self.storage.create(f"{self.folder}/{checkpoint_name(state.version)}", data,
                            spare=spare)
        # Never set the hint back (a writer that stalled before its checkpoint): readers would
        # load an old checkpoint first (and then notice, but that costs a listing). The look
        # and the replace are one step under the publish lock on one host: checkpoints are
        # written outside it (after a journal unit's sync, and by cleanup), and two writers
        # that both looked before either replaced would otherwise leave the older hint.
        with self._publisher():
            if self._hint() < state.version:
                hint: dict[str, Any] = {"version": state.version}
                if state.journal is not None:  # where replaying starts (see _ops.cleanup)
                    hint["journal"] = state.journal.to_list()
                self.storage.replace(f"{self.folder}/{LOG_HINT}", self._encode(hint))

    def checkpoint_now(self) -> JournalPosition | None:
        """Write a checkpoint of the freshest state now, under the view's lock (its fold does
        not move meanwhile); returns where its state ends in the journal. Cleanup calls it when
        only the lack of a newer checkpoint keeps consumed journal segments on disk."""
        with self._lock:
            state = self.refresh()
            if self.journal is not None and state.journal is not None:
                # The view may end with another process's unit whose sync still runs (syncs
                # run outside the publish lock): a checkpoint must not name a state that a
                # power cut can take back, so the units it covers are made durable first.
                self.journal.sync_through(state.journal)
            state.unit_bytes = 0
            self.write_checkpoint(state)
            return state.journal

    def checkpoint_position(self) -> JournalPosition | None:
        """Where in the journal the newest checkpoint's state ends (from the hint), ``None``
        without one."""
        try:
            hint = checked.loads(self.storage.read(f"{self.folder}/{LOG_HINT}"),
                                 required=self.checksums)
            return JournalPosition.from_list(hint["journal"])
        except NotFound:
            return None
        except (ValueError, KeyError, TypeError):
            return None

    def _hint(self) -> int:
        try:
            return int(checked.loads(self.storage.read(f"{self.folder}/{LOG_HINT}"),
                                     required=self.checksums)["version"])
        except NotFound:
            return -1
        except (ValueError, KeyError, TypeError):
            return -1  # a damaged hint only costs a listing

    # -- retention ------------------------------------------------------------------------------
    def expire(self, retention_s: float, *, now: float | None = None,
               dry_run: bool = False) -> list[str]:
        """Delete entries before the newest checkpoint that are older than ``retention_s``,
        and the checkpoints older than them. Returns the names deleted (or that would be).

        The newest checkpoint is the one the hint names, and only if it reads: a reader opening
        the log needs it. Entries go oldest first and as an unbroken run, so an expired entry
        means every earlier one is gone too (see the module docstring).
        """
        now = time.time() if now is None else now
        newest = self._hint()
        if newest <= 0 or self.read_checkpoint(newest) is None:
            return []
        listed = self.storage.list_detailed(self.folder)
        if self.journal is not None:
            # No entry files: only checkpoints older than the newest two and the retention go
            # (segments go with the pages they hold, see _ops.cleanup).
            kept = sorted((int(n.split(".", 1)[0]), mtime) for n, _, mtime in listed
                          if n.endswith(CHECKPOINT_SUFFIX) and n.split(".", 1)[0].isdigit())
            doomed = [checkpoint_name(v) for v, mtime in kept[:-2]
                      if v < newest and now - mtime >= retention_s]
            if not dry_run:
                for name in doomed:
                    self.storage.delete(f"{self.folder}/{name}")
            return doomed
        ages = {int(n[:-5]): mtime for n, _, mtime in listed
                if n.endswith(".json") and n[:-5].isdigit()}
        upto = 0
        for version in sorted(ages):
            if version >= newest or now - ages[version] < retention_s:
                break  # the newest checkpoint's entry stays: current views end there or later
            upto = version
        if upto == 0:
            return []
        checkpoints = sorted(int(n.split(".", 1)[0]) for n, _, _ in listed
                             if n.endswith(CHECKPOINT_SUFFIX) and n.split(".", 1)[0].isdigit())
        doomed = [checkpoint_name(v) for v in checkpoints if v < upto]
        doomed += [entry_name(v) for v in sorted(ages) if v <= upto]
        if not dry_run:
            for name in doomed:
                self.storage.delete(f"{self.folder}/{name}")
        return doomed

    # -- loading --------------------------------------------------------------------------------
    def _load(self, *, trust_hint: bool = True) -> LogState:
        """The newest state: a checkpoint and the entries after it, checked against concurrent
        retention (the hint may name a checkpoint whose successors were already expired)."""
        self._proven = None
        for _ in range(_LOAD_ATTEMPTS):
            # what proves commits, read before the replay (which must then reach them)
            proof = self._proof() if self.journal is not None else None
            state = self._load_checkpoint(trust_hint=trust_hint)
            try:
                self._replay(state)
            except NotFound:  # a journal segment removed while loading: a newer checkpoint
                trust_hint = False
                continue
            if self._still_there(state):
                if proof is not None:
                    self._prove_end(state, *proof)
                return state
            trust_hint = False
        raise StorageError(errno.EAGAIN, (
            f"commit log {self.folder}: could not read a consistent state in {_LOAD_ATTEMPTS} "
            "attempts; entries are being expired faster than they can be read (is "
            "logRetentionMs very short?)"))

    def _proof(self) -> tuple[int, int]:
        """What outside the journal's units proves commits (read when the log is loaded): the
        version the checkpoint hint names, and the furthest consumer position."""
        positions = self.positions
        return self._hint(), max(positions() if positions is not None else (), default=-1)

    def _prove_end(self, state: LogState, covered: int, position: int) -> None:
        """Damage, not a torn tail, where the journal's readable part ends with bytes after
        it (a unit that looks torn by a crash) although something proves that commits follow:
        the checkpoint hint names a later version (a checkpoint covers them), or a consumer
        acknowledged messages past ``state.next_seq`` (it was delivered them). Both were read
        before the replay; under the publish lock the log is read on and the tail looked at
        again (a unit being written is not a torn one). Sets :attr:`damage`.

        Only a tail with bytes counts: a consumer may be made to start past the end (``start``
        a ``_seq``), and a journal whose last units were lost to zeros entirely leaves nothing
        to tell them from the space allocated ahead."""
        journal = self.journal
        if journal is None or self.damage is not None or \
                (covered <= state.version and position <= state.next_seq):
            return
        with self._publisher():
            self._replay(state)
            end = state.journal or JournalPosition()
            if self.damage is not None or not journal.tail(end):
                return
            if covered > state.version:
                why = (f"the checkpoint hint ({LOG_HINT}) names version {covered}: a checkpoint "
                       f"covered the commits up to it")
            elif position > state.next_seq:
                why = (f"a consumer acknowledged messages up to _seq {position}, past the last "
                       f"readable commit (next _seq {state.next_seq}): they were committed")
            else:
                return
            self.damage = journal.proven_damage(end, state.version + 1, why)
            self._proven = (end, self.damage)
            log.error("commit log %s: %s", self.folder, self.damage)

    def _load_checkpoint(self, *, trust_hint: bool = True) -> LogState:
        hint = self._hint() if trust_hint else -1
        if hint > 0:
            state = self.read_checkpoint(hint)
            if state is not None:
                return state
        names = self.storage.list(self.folder)
        versions = sorted((int(n.split(".", 1)[0]) for n in names
                           if n.endswith(CHECKPOINT_SUFFIX)), reverse=True)
        for version in versions:
            state = self.read_checkpoint(version)
            if state is not None:
                return state
        entries = _entry_versions(names)
        if entries and entries[0] > 1:
            raise DamagedStoreError(self.folder, (
                f"entries before {entries[0]} were expired and no checkpoint is readable "
                f"(found {[checkpoint_name(v) for v in versions]})"), (
                f"commit log {self.folder}: entries before {entries[0]} were expired and no "
                f"checkpoint is readable (found {[checkpoint_name(v) for v in versions]}); "
                "the address cannot be opened without losing its state"))
        return LogState()

    def read_checkpoint(self, version: int) -> LogState | None:
        try:
            data = self.storage.read(f"{self.folder}/{checkpoint_name(version)}")
        except NotFound:
            return None
        try:
            return LogState.from_checkpoint(checkpoint_table(data, required=self.checksums))
        except (pa.ArrowInvalid, KeyError, ValueError) as exc:
            # A checkpoint only saves replaying entries (which are never deleted): a damaged
            # one, or one still being written where there are no hard links, is passed over.
            log.warning("checkpoint %s in %s is unreadable (%s); using an older checkpoint "
                        "or the log entries", checkpoint_name(version), self.folder, exc)
            return None

    def _replay(self, state: LogState) -> None:
        if self.journal is not None:
            self._replay_units(self.journal, state)
            return
        while True:
            version = state.version + 1
            try:
                data = self.storage.read(f"{self.folder}/{entry_name(version)}")
            except NotFound:
                return
            entry = self._parse_entry(version, data)
            try:
                state.apply(version, entry)
            except StorageError:
                raise
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                # a damaged or foreign entry; ValueError covers bad base64 and ArrowInvalid
                raise DamagedLogError(f"{self.folder}/{entry_name(version)}", version,
                                      f"is malformed ({type(exc).__name__}: {exc})",
                                      partial=False) from exc

    def _replay_units(self, journal: Journal, state: LogState) -> None:
        self.damage = None
        while True:
            version = state.version + 1
            # what looks damaged is looked at again under the publish lock (a unit being
            # written looks damaged to a read that races it)
            try:
                found = journal.read_next(state.journal or JournalPosition(), version,
                                          confirm=self._publisher)
            except DamagedLogError as exc:
                # the state is what can be read: readers read up to it, then get the error
                self.damage = exc
                return
            if found is None:
                proven = self._proven
                if proven is not None and proven[0] == (state.journal or JournalPosition()):
                    self.damage = proven[1]
                return
            entry, position, span = found
            try:
                _apply_unit(state, version, entry, position, span)
            except StorageError:
                raise
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                where = f"{journal.path(position.segment)}@{span[0]}"
                raise DamagedLogError(where, version,
                                      f"is malformed ({type(exc).__name__}: {exc})",
                                      partial=False) from exc

    def _parse_entry(self, version: int, data: bytes) -> dict[str, Any]:
        # Where the filesystem has no hard links, entries are created with O_EXCL and can be
        # seen before their writer finished: give an incomplete entry a moment to complete.
        path = f"{self.folder}/{entry_name(version)}"
        for attempt in range(_PARTIAL_RETRIES + 1):
            try:
                return checked.loads(data, required=self.checksums)
            except checked.ChecksumError as exc:
                # An entry being written (no hard links) is cut short, so it does not parse;
                # one that parses and fails its checksum was changed after it was written.
                complete = _parses(data)
                if complete or attempt == _PARTIAL_RETRIES:
                    raise DamagedLogError(path, version, str(exc), partial=not complete) from exc
            except ValueError as exc:
                if attempt == _PARTIAL_RETRIES:
                    raise DamagedLogError(path, version, f"is not valid JSON ({exc})",
                                          partial=True) from exc
            except TypeError as exc:
                raise DamagedLogError(path, version, f"is {exc}, not an entry",
                                      partial=False) from exc
            time.sleep(_PARTIAL_WAIT_S)
            data = self.storage.read(path)
        raise AssertionError("unreachable")

    def read_entry(self, version: int) -> dict[str, Any]:
        """Entry ``version`` (``ValueError``/``TypeError`` when it does not read as one)."""
        return checked.loads(self.storage.read(f"{self.folder}/{entry_name(version)}"),
                             required=self.checksums)

    def _encode(self, obj: dict[str, Any]) -> bytes:
        """An entry or the hint as its file holds it."""
        return checked.dumps(obj) if self.checksums else ENTRY_JSON.encode(obj).encode()


#: What follows a checkpoint's Arrow IPC file from format 5: a magic and the CRC32C of the file.
_CHECKPOINT_MAGIC = b"DQCK"
_CHECKPOINT_TRAILER = struct.Struct("<4sI")


def _parses(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def checkpoint_table(data: bytes, *, required: bool) -> pa.Table:
    """A checkpoint file's table, its checksum trailer checked (``ChecksumError`` when it
    fails, or is missing while ``required``; ``pa.ArrowInvalid`` when the file does not read).
    An Arrow file ends with ``ARROW1``, so a trailer is told apart from none whatever the
    format."""
    size = _CHECKPOINT_TRAILER.size
    if len(data) < size or data[-size:-size + 4] != _CHECKPOINT_MAGIC:
        if required:
            raise checked.ChecksumError("has no checksum trailer")
    else:
        (crc,) = struct.unpack_from("<I", data, len(data) - 4)
        data = data[:-size]
        if crc32c(data) != crc:
            raise checked.ChecksumError("fails its checksum")
    return pa.ipc.open_file(pa.py_buffer(data)).read_all()


def _stamped(entry: dict[str, Any], state: LogState) -> dict[str, Any]:
    """``entry`` with its format version, a fresh time and id (on every attempt: commit times
    never go backwards, and an entry is told apart from another published under the same
    number)."""
    return {**entry, "v": entry.get("v", 1),
            "ts": max(int(time.time() * 1_000_000), state.last_ts), "id": _IDS.next()}


def _apply_unit(state: LogState, version: int, entry: dict[str, Any], position: JournalPosition,
                span: tuple[int, int]) -> None:
    """Fold a journal unit in: its page of frames is the unit's range of its segment."""
    for page in entry.get("pages", ()) if entry.get("op") == "append" else ():
        if page.get("journal"):
            page["name"] = segment_name(position.segment)
            page["span"] = list(span)
            page["bytes"] = span[1] - span[0]
            if page.get("stats"):  # what tells this unit's statistics from any other's
                page["stats"] = {**page["stats"], "id": entry.get("id")}
    state.apply(version, entry)
    state.journal = position
    state.unit_bytes += span[1] - span[0]
