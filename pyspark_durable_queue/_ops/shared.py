"""A shared consumer's state: which rows are leased to which handle, which wait for
redelivery, and where new rows start; kept as a chain of write-once epochs.

A shared consumer (``address.consumer(name, shared=True)``) is one subscription that any
number of handles, in any number of processes and hosts, receive from: each row goes to one
handle at a time, under a lease (SQS's visibility timeout, Kafka share groups' acquisition
lock). Its state::

    cursor    every row at or above it was never claimed
    leases    {_seq: (holder, delivery count, lease expiry ms)}: rows claimed by a handle
    pending   {_seq: (delivery count, due ms)}: rows nacked, or given back by a handle that
              closed (count 0: prefetched and never delivered)
    holders   {id: [id, host, pid, pid start, last seen ms, boot id, pid namespace]}: the
              handles that hold leases (records written before the last two have five)
    moving    a dead-letter move begun and not finished (as an exclusive consumer's window)
    counters  delivered, redelivered, acked, nacked, expired, dead_lettered, dropped, moves

Every row below the cursor that is neither leased, pending nor moving is settled
(acknowledged, dead-lettered, expired, or skipped by the selector), so the state holds
O(in flight) rows, never O(backlog); its ``ack_point`` (the lowest row not settled) is the
consumer's watermark, written to ``consumers/<name>.wm`` for cleanup now and then (it only
trails: a lower watermark keeps more pages, never fewer).

Every change (a claim of a batch, an ack, a nack, a renewal, a handle's close) reads the newest
state and writes the next whole (``_format/shared.py``: O(in flight) bytes), in one of two
ways (:func:`shared_store` picks):

- :class:`SharedLog`, on a local disk: the states are appended to ``consumers/_shared/<name>/
  <generation>.log`` under the lock file ``lock`` beside it (``flock``: the kernel drops it
  when a holder dies), one ``fdatasync`` per change; the newest whole, checksummed state in the
  file is the state, so a writer killed half-way leaves a torn state that readers skip and the
  next writer leaves behind (it starts the next generation). Past ``ROTATE_BYTES`` the state
  starts the next generation (a file created whole: ``fsync`` of it and its folder) and the
  old file is deleted.
- :class:`SharedChain`, on object stores (no appends, no locks): one write-once file per epoch,
  ``consumers/_shared/<name>/<epoch>``, published with :meth:`Storage.create` (a conditional
  PUT): of two handles that change the state at once exactly one wins the epoch, and the other
  reads it and applies its change again. Epochs more than ``KEEP`` behind the newest are
  deleted by the writer that passes them; a writer that finds an epoch ``KEEP`` above the one
  it created (stalled past the pruning: it made a pruned epoch again) deletes its own and
  tries again.

Either way a crash at any point leaves the newest whole state as the state: the change was made
or it was not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .._format import shared as shared_file
from .._format.layout import is_numbered, numbered
from .._storage import NotFound, Storage
from ..errors import DamagedMetadataError
from .lease import _alive, _process_start

__all__ = ["HOST", "SharedChain", "SharedLog", "SharedState", "SharedStore", "holder_record",
           "shared_store"]

log = logging.getLogger(__name__)

#: epochs kept behind the newest: readers that listed a moment ago still find theirs, and a
#: writer that finds an epoch this far above the one it created knows it made a pruned epoch
#: again (that many publications while it lists would make it take its own for one)
KEEP = 64
#: a holder that has not been seen for this long and holds nothing is forgotten
_FORGET_HOLDER_MS = 10 * 60_000
#: how stale a holder's "last seen" time may get before a change notes it again
_SEEN_EVERY_MS = 60_000

HOST = socket.gethostname()
_T = TypeVar("_T")
#: what a log reader asks for at once (it reads on while it gets as much)
_READ_BYTES = 1 << 16


def _boot_id() -> str | None:
    """This kernel's boot id (Linux): containers of one host share it, another boot or
    machine has another."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> int | None:
    """The inode of this process's pid namespace (Linux): processes that see the same pids
    share it; a container with its own pid namespace has another."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


#: where a pid of this process means the same process: a holder's pid is judged here only
#: when its record names the same boot and pid namespace (a container sharing the hostname
#: but not the pids, or another boot, would judge another process's pid)
BOOT_ID = _boot_id()
PID_NAMESPACE = _pid_namespace()

#: how long a process of this host found running is taken for running without looking again:
#: every claim asks of each holder, and a look (``/proc/<pid>/stat``) costs ~0.3 ms; a holder
#: that dies is seen this much later at most
_ALIVE_FOR_S = 1.0
#: ``{(pid, pid start): when it was last found running (monotonic s)}``
_SEEN_RUNNING: dict[tuple[int, str | None], float] = {}


def _running(pid: int, start: str | None) -> bool:
    key = (pid, start)
    now = time.monotonic()
    seen = _SEEN_RUNNING.get(key)
    if seen is not None and now - seen < _ALIVE_FOR_S:
        return True
    if not _alive(pid, start):
        _SEEN_RUNNING.pop(key, None)
        return False
    if len(_SEEN_RUNNING) > 4096:  # bounded: holders come and go
        _SEEN_RUNNING.clear()
    _SEEN_RUNNING[key] = now
    return True


_ME: tuple[int, str | None] = (-1, None)


def holder_record(holder: str, now_ms: int) -> list[Any]:
    """What the state says of a handle of this process: ``[id, host, pid, pid start, seen,
    boot id, pid namespace]`` (the pid and its start tell a live process from a dead one on the
    same host, in the same boot and pid namespace; records written before the last two are
    judged by host and pid alone)."""
    global _ME
    pid = os.getpid()
    if _ME[0] != pid:  # once per process (a fork has its own)
        _ME = (pid, _process_start(pid))
    return [holder, HOST, pid, _ME[1], now_ms, BOOT_ID, PID_NAMESPACE]


def _where(record: list[Any]) -> list[Any]:
    """What names a holder's process in its record: host, pid, pid start, boot id, pid
    namespace (the last two absent from records written before them)."""
    return [*record[1:4], *record[5:7]]


class _Tracked(dict):  # type: ignore[type-arg]
    """A dict that notes the keys set or deleted since it was made (a state's copy): what
    :meth:`SharedState.diff` looks at, so a change costs O(rows changed), not O(in flight)."""

    __slots__ = ("touched",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.touched: set[Any] = set()

    def __setitem__(self, key: Any, value: Any) -> None:
        self.touched.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.touched.add(key)
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self.touched.add(key)
        return super().pop(key, *default)


def _changes(mine: dict[Any, Any], theirs: dict[Any, Any]) -> tuple[list[Any], list[Any]]:
    """``(keys set to another value, keys removed)`` from ``theirs`` to ``mine``."""
    keys = mine.touched if isinstance(mine, _Tracked) else mine.keys() | theirs.keys()
    changed, removed = [], []
    missing = object()
    for key in keys:
        value = mine.get(key, missing)
        if value is missing:
            if key in theirs:
                removed.append(key)
        elif theirs.get(key, missing) != value:
            changed.append(key)
    return changed, removed


class SharedState:
    """One epoch of a shared consumer's state (see the module docstring); changed only on a
    copy (:meth:`copy`) that :meth:`SharedChain.update` publishes."""

    __slots__ = ("counters", "cursor", "holders", "leases", "moving", "pending")

    def __init__(self, cursor: int, leases: dict[int, tuple[str, int, int]] | None = None,
                 pending: dict[int, tuple[int, int]] | None = None,
                 holders: dict[str, list[Any]] | None = None,
                 moving: dict[str, Any] | None = None,
                 counters: dict[str, int] | None = None) -> None:
        self.cursor = cursor
        self.leases = leases if leases is not None else {}
        self.pending = pending if pending is not None else {}
        self.holders = holders if holders is not None else {}
        self.moving = moving
        self.counters = counters if counters is not None else {}

    def __repr__(self) -> str:
        return (f"SharedState(cursor={self.cursor}, leased={len(self.leases)}, "
                f"pending={len(self.pending)}, holders={len(self.holders)})")

    def copy(self, *, track: bool = True) -> SharedState:
        """A copy to change: its row maps note what changes (for :meth:`diff`; not when
        ``track`` is false: a reader applying others' changes needs no diff of them)."""
        # dict.copy: a plain copy first (a dict subclass is copied item by item)
        kind: Callable[[dict[Any, Any]], dict[Any, Any]] = _Tracked if track else dict
        return SharedState(self.cursor, kind(dict.copy(self.leases)),
                           kind(dict.copy(self.pending)), kind(dict.copy(self.holders)),
                           self.moving, dict(self.counters))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SharedState):
            return NotImplemented
        return all(getattr(self, a) == getattr(other, a) for a in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    # -- bytes ----------------------------------------------------------------------------------
    def encode(self) -> bytes:
        used = {h for h, _, _ in self.leases.values()}
        if self.moving is not None and self.moving.get("holder"):
            used.add(self.moving["holder"])
        holders = [self.holders.get(h) or [h, "", 0, None, 0] for h in sorted(used)]
        holders += [r for h, r in sorted(self.holders.items()) if h not in used]
        return shared_file.encode(self.cursor, self.leases, self.pending, holders,
                                  {"moving": self.moving, "counters": self.counters})

    @classmethod
    def decode(cls, data: bytes) -> SharedState:
        record = shared_file.decode(data)
        holders = {str(h[0]): list(h) for h in record["holders"]}
        return cls(record["cursor"], record["leases"], record["pending"], holders,
                   record["moving"], {k: int(v) for k, v in record["counters"].items()})

    def diff(self, before: SharedState) -> dict[str, Any]:
        """What changed from ``before`` to this state (empty: nothing), as JSON-safe lists: a
        change record of the log (:meth:`apply` makes this state of ``before`` again)."""
        change: dict[str, Any] = {}
        if self.cursor != before.cursor:
            change["cursor"] = self.cursor
        for key, mine, theirs in (("leased", self.leases, before.leases),
                                  ("pending", self.pending, before.pending)):
            changed, removed = _changes(mine, theirs)
            if changed:
                change[key] = [[s, *mine[s]] for s in changed]
            if removed:
                change["un" + key] = removed
        changed, removed = _changes(self.holders, before.holders)
        if changed:
            change["holders"] = [self.holders[h] for h in changed]
        if removed:
            change["gone"] = removed
        if self.moving != before.moving:
            change["moving"] = self.moving
        if self.counters != before.counters:
            change["counters"] = {k: v for k, v in self.counters.items()
                                  if before.counters.get(k) != v}
        return change

    def apply(self, change: dict[str, Any], *, in_place: bool = False) -> SharedState:
        """A copy of this state with ``change`` (a :meth:`diff`) made (``in_place``: this
        state, changed: a reader applying a run of changes copies once, not once each)."""
        state = self if in_place else self.copy(track=False)
        state.cursor = int(change.get("cursor", state.cursor))
        leases, pending = state.leases, state.pending
        for seq in change.get("unleased", ()):
            del leases[seq]
        leases.update({int(seq): (str(holder), int(count), int(expires))
                       for seq, holder, count, expires in change.get("leased", ())})
        for seq in change.get("unpending", ()):
            del pending[seq]
        pending.update({int(seq): (int(count), int(due))
                        for seq, count, due in change.get("pending", ())})
        for holder in change.get("gone", ()):
            del state.holders[holder]
        for record in change.get("holders", ()):
            state.holders[str(record[0])] = list(record)
        if "moving" in change:
            state.moving = change["moving"]
        state.counters.update(change.get("counters", {}))
        return state

    # -- questions ------------------------------------------------------------------------------
    @property
    def ack_point(self) -> int:
        """The lowest row not settled: the consumer's watermark."""
        low = self.cursor
        if self.leases:
            low = min(low, min(self.leases))
        if self.pending:
            low = min(low, min(self.pending))
        if self.moving is not None and self.moving["rows"]:
            low = min(low, min(s for s, _ in self.moving["rows"]))
        return low

    def dead(self, holder: str) -> bool:
        """The holder is a handle of a process of this host that is no longer running: its
        record names this host, and this boot and pid namespace (a record without them: this
        host only), and its pid with that start time is gone (a process found running is
        looked at again after ``_ALIVE_FOR_S``). Otherwise its leases have to run out."""
        record = self.holders.get(holder)
        if record is None or record[1] != HOST:
            return False
        if len(record) >= 7 and (record[5] != BOOT_ID or record[6] != PID_NAMESPACE):
            return False  # its pid means another process here: its leases run out instead
        return not _running(int(record[2]), record[3])

    def reclaimable(self, now_ms: int, limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` rows another handle may take now, lowest first, with how many times
        each was delivered: rows pending and due, rows whose lease ran out or whose holder
        died."""
        out = [(s, c) for s, (c, due) in self.pending.items() if due <= now_ms]
        dead: dict[str, bool] = {}
        for seq, (holder, count, expires) in self.leases.items():
            if expires <= now_ms:
                out.append((seq, count))
            else:
                gone = dead.get(holder)
                if gone is None:
                    gone = dead[holder] = self.dead(holder)
                if gone:
                    out.append((seq, count))
        out.sort()
        return out[:limit]

    def next_change_ms(self) -> int | None:
        """When a row becomes available to claim without any new message: the first due
        pending row or the first lease to run out (``None`` when neither)."""
        times = [due for _, due in self.pending.values()]
        times += [expires for _, _, expires in self.leases.values()]
        return min(times) if times else None

    def leased_to(self, holder: str) -> list[int]:
        return sorted(s for s, (h, _, _) in self.leases.items() if h == holder)

    # -- changes (on a copy) --------------------------------------------------------------------
    def count(self, counter: str, n: int = 1) -> None:
        if n:
            self.counters[counter] = self.counters.get(counter, 0) + n

    def lease(self, holder: str, rows: list[tuple[int, int]], expires_ms: int) -> None:
        """Lease ``rows`` (``(_seq, delivery count)``) to ``holder``."""
        for seq, count in rows:
            self.pending.pop(seq, None)
            self.leases[seq] = (holder, count, expires_ms)

    def seen(self, holder: str, now_ms: int) -> None:
        """Note the holder as seen now: when the state does not know it, it was forked, or it
        was last noted ``_SEEN_EVERY_MS`` ago (noted at every change, every claim of a handle
        that waits for messages wrote and synced a state)."""
        record = self.holders.get(holder)
        mine = holder_record(holder, now_ms)
        if record is None or _where(record) != _where(mine) \
                or now_ms - int(record[4]) >= _SEEN_EVERY_MS:
            self.holders[holder] = mine

    def forget_holders(self, now_ms: int) -> None:
        """Forget holders that hold nothing and were not seen for a while, or are dead (the
        holder of a move is kept: a dead one's move is taken over at once)."""
        used = {h for h, _, _ in self.leases.values()}
        if self.moving is not None:
            used.add(str(self.moving.get("holder")))
        for holder, record in list(self.holders.items()):
            if holder not in used and (now_ms - int(record[4]) > _FORGET_HOLDER_MS
                                       or self.dead(holder)):
                del self.holders[holder]


class SharedStore(Protocol):
    """Where a shared consumer's state is kept: :class:`SharedLog` or :class:`SharedChain`."""

    folder: str

    def current(self) -> SharedState: ...

    def update(self, change: Callable[[SharedState], _T]) -> tuple[_T, SharedState]: ...


def shared_store(storage: Storage, folder: str, *, start: Callable[[], int]) -> SharedStore:
    """The store of a shared consumer's state in ``folder``: an appended log where the storage
    appends in place and locks (a local disk), a chain of epochs elsewhere."""
    caps = storage.capabilities
    if caps.append and caps.locks:
        return SharedLog(storage, folder, start=start)
    return SharedChain(storage, folder, start=start)


def _damaged(path: str, exc: Exception) -> DamagedMetadataError:
    return DamagedMetadataError(path, f"not a shared consumer state ({exc})", (
        f"shared consumer state {path} is damaged ({exc}); deleting it makes the consumer "
        "go on from the state before it, or from its watermark (rows leased or acknowledged "
        "since are delivered again)"))


class SharedLog:
    """A shared consumer's states appended to a log file on a local disk (see the module
    docstring). Not thread-safe: a handle calls it under its own lock; the lock file orders
    the handles of the host."""

    #: a log longer than this starts the next generation (with a whole state; a new handle
    #: reads the generation's file whole and applies its changes)
    ROTATE_BYTES = 256 << 10

    def __init__(self, storage: Storage, folder: str, *, start: Callable[[], int]) -> None:
        self.storage = storage
        self.folder = folder
        self._start = start
        self._generation = -1
        #: the offset after the last whole state read (or written) in the generation's file
        self._offset = 0
        #: bytes follow the last whole record read (a record being written, or torn)
        self._torn = False
        self._state: SharedState | None = None
        self._file: Any = None
        #: the generation's file kept open for reading what others append
        self._reader: Any = None
        self._lock: Any = None
        self._made = False

    def _path(self, generation: int) -> str:
        return f"{self.folder}/{numbered(generation)}.log"

    def _generations(self) -> list[int]:
        try:
            names = self.storage.list(self.folder)
        except NotFound:
            return []
        return sorted(int(n[:-4]) for n in names if n.endswith(".log") and is_numbered(n[:-4]))

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _catch_up(self) -> None:
        """Apply what other handles appended since (or read the newest generation, when it
        changed)."""
        for attempt in range(5):
            reader = self._reader
            if (attempt == 0 and reader is not None and self._state is not None
                    and not reader.gone()
                    and not self.storage.exists(self._path(self._generation + 1))):
                # the newest still: the file read is there, and the next generation is
                # created as the held one + 1 (it is deleted only after that)
                newest = self._generation
            else:
                self._close_reader()
                generations = self._generations()
                if not generations:
                    self._generation, self._offset, self._torn = 0, 0, False
                    self._state = SharedState(self._start())
                    return
                newest = generations[-1]
                if newest != self._generation:
                    self._close_file()
                    self._generation, self._offset, self._state = newest, 0, None
                try:
                    reader = self._reader = self.storage.open_reader(self._path(newest))
                except NotFound:  # rotated away between the listing and the open
                    continue
            path = self._path(newest)
            # read to the end through the open file (no stat of it: a stat between another
            # handle's append and its fdatasync makes that sync write the inode's times too)
            parts = []
            at = self._offset
            while True:
                part = reader.read(at, at + _READ_BYTES)
                parts.append(part)
                at += len(part)
                if len(part) < _READ_BYTES:
                    break
            data = b"".join(parts) if len(parts) > 1 else parts[0]
            size = at
            found, after = shared_file.records(data)
            state = self._state
            mine = False  # ``state`` is a copy of this read's own (changed in place)
            try:
                for whole, record in found:
                    if whole:
                        state, mine = SharedState.decode(record), True
                    elif state is None:
                        raise ValueError("a change before any whole state")
                    else:
                        if not mine:
                            state, mine = state.copy(track=False), True
                        state = state.apply(json.loads(record), in_place=True)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise _damaged(path, exc) from exc
            if state is None:
                raise _damaged(path, ValueError(f"no whole state in its {size} bytes"))
            self._state = state
            self._offset += after
            self._torn = after < len(data)
            return
        raise RuntimeError(f"the state of shared consumer {self.folder} rotates faster than it "
                           "can be read")

    def current(self) -> SharedState:
        """The newest state (what other handles appended is read first)."""
        self._catch_up()
        assert self._state is not None
        return self._state

    def update(self, change: Callable[[SharedState], _T]) -> tuple[_T, SharedState]:
        """Apply ``change`` to a copy of the newest state and append what it changed, under
        the lock file (``change`` may read the log, and raise to change nothing)."""
        if not self._made:
            self.storage.makedirs(self.folder)
            self._made = True
        file = None
        with contextlib.ExitStack() as stack:
            if self._lock is None:  # kept open between changes: an open and a close less each
                self._lock = self.storage.kept_lock(f"{self.folder}/lock")
            try:
                stack.enter_context(self._lock)
            except NotFound:  # the folder is gone: say so when the consumer was deleted
                self._start()
                raise
            self._catch_up()
            before = self._state
            assert before is not None
            state = before.copy()
            result = change(state)
            delta = state.diff(before)
            if not delta:
                return result, before
            # bytes after the last whole record, under the lock, are a torn record: after a
            # power cut whole records may follow it (written later, kept by the cut), which
            # a record written over the tear would put behind it, applied to a state they
            # were not made from; a new generation leaves them in the old file, deleted
            if self._generation == 0 or self._offset > self.ROTATE_BYTES or self._torn:
                self._start_generation(state.encode())
                file = None
            else:
                file = self._append(shared_file.encode_change(delta))
            self._state = state
        if file is not None:
            # synced after the lock is released: handles of other processes append meanwhile
            # and their syncs and this one are merged by the kernel. Nothing is returned (a
            # lease handed out, an ack reported done) before this sync, and a later state that
            # builds on this one is in the same file after it, so it is never durable without
            # this one (a process killed before its sync leaves its bytes in the page cache)
            try:
                file.sync()
            except BaseException:
                self._close_file()
                raise
        return result, state

    def _append(self, data: bytes) -> Any:
        """Write ``data`` at the end of the generation's file (not synced yet); the file."""
        if self._file is None:
            self._file = self.storage.open_append(self._path(self._generation),
                                                  at=self._offset)
        file = self._file
        try:
            if file.tell() != self._offset:  # another handle appended meanwhile
                file.seek(self._offset)
            file.write(data)
        except BaseException:
            self._close_file()  # opened again, at the offset, by the next change
            raise
        self._offset += len(data)
        return file

    def _start_generation(self, data: bytes) -> None:
        """Write ``data`` as the first state of the next generation's file, then delete the
        older files."""
        old = self._generation
        if not self.storage.create(self._path(old + 1), data):
            raise RuntimeError(f"{self._path(old + 1)} exists while this handle holds the lock "
                               "of its folder: another host writes there (shared consumers "
                               "need one host per local folder)")
        self._close_file()
        self._close_reader()
        self._generation, self._offset = old + 1, len(data)
        for generation in self._generations():
            if generation <= old:
                self.storage.delete(self._path(generation))


class SharedChain:
    """The epochs of one shared consumer's state in ``folder`` (see the module docstring).

    Not thread-safe: a handle calls it under its own lock; handles of one process each have
    their own chain object, and the storage's lock file orders them on a local disk.
    """

    def __init__(self, storage: Storage, folder: str, *, start: Callable[[], int]) -> None:
        self.storage = storage
        self.folder = folder
        #: where the first epoch's cursor comes from (the consumer's state file)
        self._start = start
        self._epoch = -1
        self._state: SharedState | None = None
        self._locks = storage.capabilities.locks
        self._made = False

    def _path(self, epoch: int) -> str:
        return f"{self.folder}/{numbered(epoch)}"

    def _epochs(self) -> list[int]:
        try:
            names = self.storage.list(self.folder)
        except NotFound:
            return []
        return sorted(int(n) for n in names if is_numbered(n))

    def _read(self, epoch: int) -> SharedState:
        path = self._path(epoch)
        data = self.storage.read(path)
        try:
            return SharedState.decode(data)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise _damaged(path, exc) from exc

    def _newest(self) -> tuple[int, list[int]]:
        """The newest epoch (read into ``_state`` when it is not the one held), and the
        epochs listed."""
        for _ in range(5):
            epochs = self._epochs()
            newest = epochs[-1] if epochs else 0
            if newest == self._epoch and self._state is not None:
                return newest, epochs
            if newest == 0:
                self._epoch, self._state = 0, SharedState(self._start())
                return 0, epochs
            try:
                state = self._read(newest)
            except NotFound:  # pruned between the listing and the read: list again
                continue
            self._epoch, self._state = newest, state
            return newest, epochs
        raise RuntimeError(f"the state of shared consumer {self.folder} moves faster than it "
                           "can be read")

    def current(self) -> SharedState:
        """The newest state (read again when another handle changed it)."""
        self._newest()
        assert self._state is not None
        return self._state

    def update(self, change: Callable[[SharedState], _T]) -> tuple[_T, SharedState]:
        """Apply ``change`` to a copy of the newest state and publish it as the next epoch;
        again on the state that won when another handle published first. ``change`` may read
        the log (a claim reads the rows it takes) and raise to change nothing. Returns what
        ``change`` returned and the state published."""
        if not self._made:
            self.storage.makedirs(self.folder)
            self._made = True
        with self.storage.lock(f"{self.folder}/lock"):
            while True:
                epoch, epochs = self._newest()
                assert self._state is not None
                state = self._state.copy()
                result = change(state)
                if state == self._state:
                    return result, self._state
                if not self.storage.create(self._path(epoch + 1), state.encode()):
                    continue  # another handle published first: again on its state
                if not self._locks:
                    # stale past the pruning: this epoch had been pruned (an epoch KEEP above
                    # it was published) and this handle made it again, outside the chain. An
                    # epoch just above it is another handle's built on this one (deleting
                    # this one then and applying the change again applied it twice: a claim
                    # leased two batches, an ack raised LeaseExpiredError for its own rows)
                    if any(e >= epoch + 1 + KEEP for e in self._epochs()):
                        self.storage.delete(self._path(epoch + 1))
                        continue
                self._epoch, self._state = epoch + 1, state
                for old in epochs:
                    if old <= epoch + 1 - KEEP:
                        self.storage.delete(self._path(old))
                return result, state


def now_ms() -> int:
    return int(time.time() * 1000)
