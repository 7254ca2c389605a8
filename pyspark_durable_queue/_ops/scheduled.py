"""Scheduled delivery: messages stored outside the log until due, then appended once.

Who calls it: ``Address``. ``send(rows, deliver_at=...)`` / ``send(rows, delay_ms=...)``
writes one file (``_format/scheduled.py``) under ``<address>/scheduled/`` and returns once it
is durable; nothing enters the log, so a schedule a year ahead holds back no watermark and no
cleanup. Whoever next touches the address (a send, a consumer's read or wait, a cleanup, the
Spark source's ``latestOffset``) calls :meth:`Scheduler.release`, which costs a comparison of
two numbers with the clock until something may be due: the process's :class:`ScheduleClock`
for the address holds the earliest due time it knows (from its own schedules, and from a
listing of the folder at most every ``cleanup_interval_ms``, which finds other processes').

A release appends each due file's rows with its own transaction key
(``_log/txn.py``: ``scheduled:<id>``, version 0), then deletes the file. A crash between the
two leaves the file; the next release appends it again, which the key makes a duplicate, and
deletes it: never twice, never lost. Files are released in name order (due time, then send
order), one commit each, at most :data:`ROUND_FILES` a round.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from .._format.scheduled import ScheduledName, decode, encode, new_name
from .._log.txn import scheduled_txn
from .._storage import NotFound
from ..errors import DurableQueueError
from .commit import CommitResult
from .context import AddressContext, OnAddress

__all__ = ["MERGE_KEY", "MIN_LISTING_MS", "ROUND_FILES", "WAITING_LISTING_MS", "ScheduleClock",
           "Scheduler", "schedule_clock"]

log = logging.getLogger(__name__)

#: Files one release appends at most before it lets its caller go on (the rest are due at
#: once for the next touch).
ROUND_FILES = 1000
#: The folder is listed at most every ``max(cleanup_interval_ms, MIN_LISTING_MS)``: with a
#: cleanup interval of 0 every receive would list it.
MIN_LISTING_MS = 100
#: A consumer waiting for messages on a local disk (idle, and a local listing is cheap: see
#: docs/decisions.md) lists the folder this often, so that another process's schedule is
#: appended within about this long of its time; on object stores, where a listing is a
#: request, it waits for the listing interval.
WAITING_LISTING_MS = 50
#: Schema metadata of a scheduled file whose send had ``merge_schema=True``.
MERGE_KEY = b"dq.merge_schema"

#: ``send(table, key, merge_schema)``: how a release appends (``Address._send``).
Send = Callable[[pa.Table, tuple[str, int], bool], CommitResult]


class ScheduleClock:
    """What one process knows of an address's scheduled folder, shared by its handles.

    Concurrency guarantee: thread-safe. ``_lock`` guards ``next_due_ms``, ``listed_at`` and
    ``_noted``; ``releasing`` is taken without waiting by the one thread that releases (another
    thread that finds it taken goes on: the release under way appends what is due).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.releasing = threading.Lock()
        #: the earliest due time known (epoch ms; ``inf``: none known)
        self.next_due_ms = math.inf
        #: when the folder was last listed (``time.monotonic()``; ``-inf``: never)
        self.listed_at = -math.inf
        #: the earliest due time noted since the listing under way began
        self._noted = math.inf

    def note(self, due_ms: float) -> None:
        """A schedule due at ``due_ms`` exists (written by this process, or listed)."""
        with self._lock:
            self.next_due_ms = min(self.next_due_ms, due_ms)
            self._noted = min(self._noted, due_ms)

    def may_be_due(self, now_ms: float, interval_ms: int) -> bool:
        """Whether a release could find something: a known schedule is due, or the folder was
        not listed for ``interval_ms`` (another process may have scheduled)."""
        return now_ms >= self.next_due_ms or \
            (time.monotonic() - self.listed_at) * 1000 >= interval_ms

    def wait_s(self, now_ms: float, interval_ms: int) -> float:
        """Seconds until :meth:`may_be_due` turns true (a waiting consumer wakes then)."""
        until_listing = self.listed_at + interval_ms / 1000 - time.monotonic()
        return max(0.0, min((self.next_due_ms - now_ms) / 1000, until_listing))

    def _listing(self) -> None:
        with self._lock:
            self._noted = math.inf

    def _listed(self, next_due_ms: float) -> None:
        with self._lock:
            self.next_due_ms = min(next_due_ms, self._noted)
            self.listed_at = time.monotonic()


_CLOCKS: dict[tuple[str, str], ScheduleClock] = {}
_CLOCKS_LOCK = threading.Lock()


def schedule_clock(storage_root: str, folder: str) -> ScheduleClock:
    """The clock of the address at ``folder``, shared by every handle in this process."""
    with _CLOCKS_LOCK:
        clock = _CLOCKS.get((storage_root, folder))
        if clock is None:
            clock = _CLOCKS[(storage_root, folder)] = ScheduleClock()
        return clock


class Scheduler(OnAddress):
    """The scheduled messages of one address (built per use on its context).

    Concurrency guarantee: any number of processes may schedule, release and cancel at once;
    each file is written once (``Storage.create``), appended under its own transaction key and
    deleted after, so concurrent releases append it once. A cancel that races a release of the
    same file may come too late (the release read it first): it then reports it delivered,
    unless the release has not committed yet when the cancel looks.
    """

    def __init__(self, ctx: AddressContext, clock: ScheduleClock) -> None:
        super().__init__(ctx)
        self.clock = clock

    def schedule(self, table: pa.Table, due_ms: int, merge_schema: bool) -> ScheduledName:
        """Store ``table`` (conformed by the caller) to be appended at ``due_ms``; returns
        once the file is durable."""
        if merge_schema:
            table = table.replace_schema_metadata({MERGE_KEY: b"1"})
        name = new_name(due_ms, table.num_rows)
        self.storage.makedirs(self.layout.scheduled)
        # exclusive: the name has 32 random bits and a rising stamp, so it is ours
        if not self.storage.create(self.layout.scheduled_file(name.file), encode(table)):
            raise DurableQueueError(f"scheduled file {name.file} of address {self.name!r} "
                                    "exists already; send again")
        self.clock.note(due_ms)
        return name

    def listing(self) -> list[ScheduledName]:
        """The scheduled files, in release order (due time, then send order)."""
        names = (ScheduledName.parse(n) for n in self.storage.list(self.layout.scheduled))
        return sorted(n for n in names if n is not None)

    def listing_ms(self, *, waiting: bool = False) -> int:
        """How long a listing of the folder holds (``waiting``: for a consumer waiting for
        messages; see :data:`WAITING_LISTING_MS`)."""
        interval = max(self.settings.cleanup_interval_ms, MIN_LISTING_MS)
        if waiting and self.storage.capabilities.locks:  # a local disk
            return min(interval, WAITING_LISTING_MS)
        return interval

    def release(self, send: Send, *, force: bool = False, waiting: bool = False) -> int:
        """Append the due files' rows (see the module docstring); the messages appended.

        Costs a comparison with the clock unless something may be due (``force``: list the
        folder anyway; ``waiting``: the caller waits for messages, see :meth:`listing_ms`).
        Failures are logged, not raised: the files stay for a later release, looked at again
        after ``cleanup_interval_ms``."""
        interval = self.listing_ms(waiting=waiting)
        now_ms = time.time() * 1000
        if not force and not self.clock.may_be_due(now_ms, interval):
            return 0
        if not self.clock.releasing.acquire(blocking=False):
            return 0  # another thread of this process is releasing
        try:
            self.clock._listing()
            try:
                names = self.listing()
            except DurableQueueError as exc:
                log.warning("address %s: cannot list scheduled messages (tried again in "
                            "%d ms): %s", self.name, interval, exc)
                self.clock._listed(now_ms + interval)
                return 0
            ready = [n for n in names if n.due_ms <= now_ms]
            later = min((n.due_ms for n in names if n.due_ms > now_ms), default=math.inf)
            if len(ready) > ROUND_FILES:
                ready, later = ready[:ROUND_FILES], now_ms
            released = 0
            for name in ready:
                try:
                    released += self._release(name, send)
                except DurableQueueError as exc:
                    log.warning("address %s: scheduled message %s was not delivered (tried "
                                "again in %d ms; `durablequeue ROOT scheduled %s --cancel %s` "
                                "removes it): %s", self.name, name.id, interval, self.name,
                                name.id, exc)
                    later = min(later, now_ms + interval)
                    break
            self.clock._listed(later)
            return released
        finally:
            self.clock.releasing.release()

    def _release(self, name: ScheduledName, send: Send) -> int:
        path = self.layout.scheduled_file(name.file)
        try:
            data = self.storage.read(path)
        except NotFound:
            return 0  # another process released it, or it was cancelled
        table = decode(data, path)
        merge = (table.schema.metadata or {}).get(MERGE_KEY) == b"1"
        if merge:
            table = table.replace_schema_metadata(None)
        result = send(table, scheduled_txn(name.id), merge)
        # the rows are in the log (or were already: a duplicate); a crash before this delete
        # leaves the file, which the next release finds a duplicate and deletes
        self.storage.delete(path)
        return result.count

    def cancel(self, schedule_id: str) -> bool:
        """Remove a scheduled file before it is due; ``False`` when it is gone (released, or
        cancelled) or its release got it first."""
        name = ScheduledName.parse(schedule_id)
        if name is None:
            return False
        path = self.layout.scheduled_file(name.file)
        if not self.storage.exists(path):
            return False
        self.storage.delete(path)
        key, version = scheduled_txn(name.id)
        return self.log.refresh().txns.get(key, -1) < version

    def summary(self) -> dict[str, Any]:
        """``scheduled_messages``, ``scheduled_sends`` and the earliest due time (epoch ms or
        ``None``), from the file names alone (one listing, no reads)."""
        names = self.listing()
        if names:
            self.clock.note(names[0].due_ms)
        return {"scheduled_messages": sum(n.rows for n in names),
                "scheduled_sends": len(names),
                "next_scheduled_ms": names[0].due_ms if names else None}
