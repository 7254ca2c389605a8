"""An address: one folder, one schema, a commit log of pages, and its consumers.

``Address`` is a facade: each operation is a delegation to the engine module that owns it
(files: ``_format.layout``; consumer state: ``_ops.registry``; publishing and the full policy:
``_ops.commit``; cleanup and retention: ``_ops.cleanup``; schema: ``_format.schema``; repair:
``_ops.repair``).

A :class:`~.consumer.Consumer` uses an address only through its Protocol
:class:`~.consumer.ConsumerAddress` (the names in ``consumer.CONSUMER_SURFACE``: the public ones and
a few methods kept for it: a snapshot of the log, waiting for a commit, the page cache bounded
for the address, its consumer state), a :class:`~.producer.Producer` through
:class:`~.producer.ProducerAddress`; ``tests/test_consumer_contract.py`` keeps it so.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import pyarrow as pa

from ._format.layout import AddressLayout
from ._format.page import PageInfo, PageWriter
from ._format.schema import TTL, arrow_table, as_rows, conform_schema, rows_to_table, with_ttl
from ._log.commit_log import CommitLog, LogState
from ._log.index import PageRef
from ._log.journal import Journal, can_journal
from ._log.meta import CURRENT, Format, create_meta, read_meta, write_meta
from ._log.txn import app_txn, committed
from ._ops.cleanup import Cleaner, CleanupReport
from ._ops.commit import CommitResult, Committer
from ._ops.compact import Compactor, CompactReport
from ._ops.context import AddressContext
from ._ops.expiry import ExpiryMover, ExpiryReport
from ._ops.group_commit import SendRequest, send_queue
from ._ops.metrics import Backlogs, address_metrics, consumer_metrics, leased
from ._ops.registry import ConsumerRegistry
from ._ops.scheduled import Scheduler, schedule_clock
from ._ops.seal import Sealer, SealReport, seal_in_background
from ._ops.shared import SharedStore, shared_store
from ._ops.window import DeliveryWindow
from ._read.cache import PageCache, page_cache
from ._read.scan import Snapshot
from ._storage import NotFound, Storage, open_storage
from .consumer import Consumer
from .errors import AddressNotFoundError, DurableQueueError, InvalidOptionError
from .producer import Producer
from .settings import HANDLE_KEYS, AddressSettings, parse_options, validate_name
from .shared_consumer import LEASE_MS, PREFETCH, SharedConsumer

if TYPE_CHECKING:
    from ._ops.lease import ConsumerLease
    from ._ops.repair import RepairReport

__all__ = ["Address", "CleanupReport", "CommitResult"]

log = logging.getLogger(__name__)

#: What one automatic compaction (after a cleanup) rewrites at most, in pages: it runs in the
#: acknowledging or committing caller's thread.
AUTO_COMPACT_PAGES = 4


def _consumer_positions(registry: ConsumerRegistry) -> Callable[[], list[int]]:
    """Where the consumers of ``registry`` are, for the commit log's proof of commits
    (``CommitLog.positions``): none when a consumer's file is damaged (``verify`` reports
    that). A closure over the registry, not a method: the log keeps no address alive."""

    def positions() -> list[int]:
        try:
            consumers = registry.all().values()
        except DurableQueueError:
            return []
        out = []
        for state in consumers:
            try:
                out.append(int(state["position"]))
            except (KeyError, TypeError, ValueError):
                continue  # a damaged state file of formats 1-4 (unchecked): verify reads it
        return out

    return positions


class Address:
    """A durable address. Obtain one with :meth:`DurableQueue.address`.

    Concurrency guarantee: any number of processes may send to and consume from one address at
    the same time; commits are serialised by the commit log (exactly one writer wins each entry,
    losers retry on top), so ``_seq`` stays dense and in commit order. An ``Address`` is
    thread-safe: threads may share one handle (or hold one each); their concurrent sends are
    committed in groups (:mod:`._ops.group_commit`). A :class:`Consumer` is one reader (see its
    docs).
    """

    def __init__(self, storage: Storage, name: str, settings: AddressSettings) -> None:
        self.name = validate_name(name)
        self.storage = open_storage(storage.url, storage.storage_options,
                               fsync=settings.fsync == "always")
        self.layout = AddressLayout(self.storage.join(self.name))
        self.log = CommitLog(self.storage, self.layout.log)
        self.registry = ConsumerRegistry(self.storage, self.layout, self.name)
        self._sends = send_queue(self.storage.root, self.layout.folder)
        self._clock = schedule_clock(self.storage.root, self.layout.folder)
        #: The address's on-disk format and its features (``_log/meta.py``); set by
        #: :meth:`open`.
        self.format = Format(CURRENT)
        self.settings = settings

    @property
    def settings(self) -> AddressSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: AddressSettings) -> None:
        # the engine parts read the settings they are given: a change reaches them all
        self._settings = settings
        if self.log.journal is not None:
            self.log.journal.page_size_bytes = settings.page_size_bytes
        self._context = AddressContext(self.name, self.storage, self.layout, self.log,
                                       self.registry, settings)
        self._committer = Committer(self._context)
        self._compactor = Compactor(self._context)
        # every send asks it whether a schedule is due: made once, not per send
        self._schedules = Scheduler(self._context, self._clock)
        last = getattr(self, "_cleaner", None)
        self._cleaner = Cleaner(self._context)
        if last is not None:
            self._cleaner.last = last.last
        if settings.expiry_address:
            self._cleaner.before = self._move_expired_quietly

    def __repr__(self) -> str:
        return f"Address({self.storage.url!r}, {self.name!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # drop the cached fold; the journal's open files stay this handle's (a copy's writes
        # are looked at under its own publish lock)
        journal = self.log.journal
        state["log"] = CommitLog(self.storage, self.layout.log,
                                 None if journal is None else copy.copy(journal),
                                 checksums=self.log.checksums)
        del state["_context"], state["_committer"], state["_cleaner"], state["_compactor"]
        del state["_sends"], state["_clock"], state["_schedules"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sends = send_queue(self.storage.root, self.layout.folder)
        self._clock = schedule_clock(self.storage.root, self.layout.folder)
        self.settings = state["_settings"]

    # -- paths (see _format.layout) -------------------------------------------------------------
    @property
    def folder(self) -> str:
        return self.layout.folder

    @property
    def pages_folder(self) -> str:
        return self.layout.pages

    @property
    def consumers_folder(self) -> str:
        return self.layout.consumers

    # -- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, storage: Storage, name: str, *, create: bool = True,
             **settings: Any) -> Address:
        """Open an address, creating it when ``create`` (settings persisted on creation).

        Settings given for an existing address that differ from the persisted ones are
        updated (and logged), so that changing an option and restarting takes effect.
        """
        validate_name(name)
        parsed = parse_options(settings, "address")  # validates even when the address exists
        given = AddressSettings(**parsed)
        explicit = {k: getattr(given, k) for k in parsed}  # by snake_case key, aliases resolved
        layout = AddressLayout(storage.join(name))
        try:
            meta = read_meta(storage, layout)
        except NotFound:
            if not create:
                raise AddressNotFoundError(
                    f"address {name!r} does not exist under {storage.url}") from None
            validate_name(name, new=True)  # a comma only in the names of existing addresses
            for folder in layout.folders:
                storage.makedirs(folder)
            if given.journal:
                storage.probe_hard_links()  # a mount without links gets no journal
            new = Format(CURRENT, journal=given.journal and can_journal(storage))
            meta = create_meta(storage, layout, name, new, given.to_json())
        fmt = Format.of(meta, layout.meta, name)
        current = AddressSettings.from_json(meta.get("settings", {}))
        handle = {k: v for k, v in explicit.items() if k in HANDLE_KEYS}
        if handle:
            current = current.replace(**handle)  # this handle's alone (fsync)
        changed = {k: v for k, v in explicit.items()
                   if k not in HANDLE_KEYS and getattr(current, k) != v}
        if changed:
            log.info("address %s: updating settings %s", name, changed)
            current = current.replace(**changed)
            meta["settings"] = current.to_json()
            write_meta(storage, layout, meta)
        if current.dead_letter_address == name:
            raise InvalidOptionError(
                f"address {name!r} names itself as its dead_letter_address; dead letters must "
                "go elsewhere (e.g. dead_letter_address='DLQ')")
        if current.expiry_address == name:
            raise InvalidOptionError(
                f"address {name!r} names itself as its expiry_address; expired messages must "
                "go elsewhere (e.g. expiry_address='ExpiryQueue')")
        address = cls(storage, name, current)
        address.format = fmt
        address.log.checksums = address.registry.checksums = fmt.checksums
        if fmt.journal:
            address.log.journal = Journal(address.storage, layout.pages,
                                          current.page_size_bytes)
            # consumers past the journal's readable end prove it damaged, not torn
            address.log.positions = _consumer_positions(address.registry)
        address.registry.watermark_files = fmt.watermark_files
        return address

    # -- state ----------------------------------------------------------------------------------
    @property
    def schema(self) -> pa.Schema | None:
        """The address's user schema (``None`` before the first send)."""
        return self.log.refresh().schema

    @property
    def state(self) -> LogState:
        return self.log.refresh()

    # -- sending --------------------------------------------------------------------------------
    def send(self, data: Any, *, merge_schema: bool = False,
             txn: tuple[str, int] | None = None, deliver_at: dt.datetime | None = None,
             delay_ms: int | None = None, ttl_ms: int | None = None) -> CommitResult:
        """Append messages: a ``pyarrow.Table``/``RecordBatch``, a ``pandas.DataFrame``, a
        list of dicts, or one dict.

        Returns once the messages are durably published (or dropped by the DROP policy), or,
        with ``deliver_at`` or ``delay_ms``, durably scheduled.

        Thread-safe. Sends that arrive while another send of this address (through any handle
        in this process) is committing are committed together by the next commit: one page
        file, one sync, one commit-log entry; each caller still gets its own ``_seq`` range,
        transaction result and full-policy outcome (see :mod:`._ops.group_commit`).

        Parameters
        ----------
        txn : (str, int), optional
            ``(app id, version)`` makes the send idempotent: when the address already holds
            this version (or a later one) of the app id, nothing is stored and the result has
            ``duplicate=True``. It is the same transaction as a Spark batch write with
            ``txnAppId``/``txnVersion`` of the same values. An empty send records nothing.
        ttl_ms : int, optional
            Time to live: these messages expire ``ttl_ms`` milliseconds after they were
            committed (``_timestamp + ttl_ms``), or at the address's ``expiry_delay_ms`` if
            that comes first. An expired message is never delivered and counts as settled for
            every consumer. Stored with the messages (it survives compaction and is the same
            for every reader); a scheduled send's TTL counts from when it is appended.

        Raises
        ------
        SchemaMismatchError
            The data does not fit the address's schema (names the columns).
        AddressFullError
            FAIL policy and the address is full, or BLOCK waited ``block_timeout_ms``.
        TypeError, InvalidOptionError
            ``txn`` is not a ``(str, int >= 0)`` pair.

        Other Parameters
        ----------------
        deliver_at : datetime, optional
            Scheduled delivery: the messages are stored now (outside the address's sequence:
            they hold back no watermark and no cleanup) and appended, with new ``_seq`` values,
            when this time has come, by whatever touches the address next (a send, a consumer's
            receive or wait, a cleanup, a Spark micro-batch's planning; see
            :mod:`._ops.scheduled` and the README for how soon). Must be timezone-aware. A time
            already past sends at once. The result has ``count=0`` and ``scheduled``, the
            schedule's id (``durablequeue ROOT scheduled ADDR --cancel ID``).
        delay_ms : int, optional
            As ``deliver_at``, that many milliseconds from now (``0`` sends at once). Not with
            ``deliver_at``, nor with ``txn``.
        """
        due = None if deliver_at is None and delay_ms is None else _due_ms(deliver_at, delay_ms)
        if ttl_ms is not None and (isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int)
                                   or ttl_ms <= 0):
            raise InvalidOptionError(f"ttl_ms must be an int > 0 (milliseconds), got {ttl_ms!r}; "
                                     "leave it out for messages that do not expire")
        self._schedules.release(self._send_released)  # release_due(), one call less
        if due is not None:
            if txn is not None:
                raise InvalidOptionError(
                    "txn cannot be combined with deliver_at or delay_ms: a scheduled send is "
                    "not idempotent; send the transaction without a schedule")
            if due > time.time() * 1000:
                return self._schedule(data, due, merge_schema, ttl_ms)
        return self._send(data, app_txn(txn) if txn is not None else None, merge_schema, ttl_ms)

    def _schedule(self, data: Any, due_ms: int, merge_schema: bool,
                  ttl_ms: int | None = None) -> CommitResult:
        rows = as_rows(data)
        table = rows_to_table(rows) if rows is not None else arrow_table(data)
        if table.num_rows == 0:
            return CommitResult(-1, 0, -1)
        # checked now (a year ahead is too late to learn the rows do not fit); merged at release
        conformed, _ = conform_schema(table, self.log.refresh().schema, merge_schema)
        kept = table if merge_schema else conformed
        if ttl_ms is not None:  # kept in the file as the hidden column; taken out at release
            kept = with_ttl(kept, ttl_ms)
        name = self._scheduler().schedule(kept, due_ms, merge_schema)
        return CommitResult(-1, 0, -1, scheduled=name.id)

    def _scheduler(self) -> Scheduler:
        return self._schedules

    def release_due(self, *, force: bool = False) -> int:
        """Append the scheduled messages that are due (see :meth:`send`'s ``deliver_at``);
        the number appended. Cheap when none may be due (a comparison with the clock); the
        folder is listed when a known schedule is due, or ``cleanup_interval_ms`` after the
        last listing (to find other processes' schedules), or when ``force``. Every send,
        consumer read, cleanup and Spark micro-batch plan calls it."""
        return self._scheduler().release(self._send_released, force=force)

    def _send_released(self, table: pa.Table, key: tuple[str, int],
                       merge_schema: bool) -> CommitResult:
        ttl_ms = None
        if TTL in table.schema.names:  # scheduled with a TTL: it counts from now
            ttl_ms = int(table.column(TTL)[0].as_py()) if table.num_rows else None
            table = table.drop_columns([TTL])
        return self._send(table, key, merge_schema, ttl_ms)

    def scheduled(self) -> list[dict[str, Any]]:
        """The scheduled sends not yet appended, in the order they will be: ``id``,
        ``due`` (an aware UTC datetime), ``due_ms`` (epoch ms), ``rows`` and ``file`` (its
        path). From the file names alone."""
        return [{"id": n.id, "due": dt.datetime.fromtimestamp(n.due_ms / 1000, dt.timezone.utc),
                 "due_ms": n.due_ms, "rows": n.rows,
                 "file": self.layout.scheduled_file(n.file)}
                for n in self._scheduler().listing()]

    def cancel_scheduled(self, schedule_id: str) -> bool:
        """Remove scheduled send ``schedule_id`` (see :meth:`scheduled`) before it is
        appended; ``False`` when there is none by that id (already appended, or cancelled)."""
        return self._scheduler().cancel(schedule_id)

    def _send(self, data: Any, key: tuple[str, int] | None, merge_schema: bool,
              ttl_ms: int | None = None) -> CommitResult:
        settings = self._settings
        deadline = time.monotonic() + settings.block_timeout_ms / 1000
        request = SendRequest.of(data, key, merge_schema, deadline, settings.fsync, ttl_ms)
        if request.num_rows == 0:
            if key is not None and committed(self.log.refresh().txns, key):
                return CommitResult(-1, 0, -1, duplicate=True)
            return CommitResult(-1, 0, -1)
        result = self._sends.send(self._committer, request, many_txns=self.format.txns)
        if self._cleaner.retention_due():
            # past retentionMs / retentionBytes: cleanup only, on a background thread; the
            # compaction that follows an acknowledgement's cleanup would rewrite pages that
            # retention is about to remove
            self._cleaner.maybe_cleanup_in_background()
        return result

    def producer(self, **options: Any) -> Producer:
        """A batching producer: ``send(row)`` returns a future of the row's ``_seq``; rows are
        stored in batches by a background thread. Options (``linger_ms``,
        ``max_batch_messages``, ``max_batch_bytes``, ``max_buffer_bytes``, ``max_block_ms``,
        ``merge_schema``, ``ttl_ms``): see :class:`~pyspark_durable_queue.producer.Producer`."""
        return Producer(self, **options)

    def page_writer(self, *, make_folder: bool = True) -> PageWriter:
        """A writer of new (unpublished) pages for this address; used by Spark tasks and the
        group commit of sends (which knows the folder exists)."""
        return self._committer.page_writer(make_folder=make_folder)

    def commit(self, pages: Sequence[PageInfo], schema: pa.Schema, *,
               txn: tuple[str, int] | None = None, merge_schema: bool = False,
               ttl: bool = False) -> CommitResult:
        """Publish written pages as one commit-log entry, applying the full policy (see
        :mod:`._ops.commit`). Used by :meth:`send` and the Spark sink's driver-side commit. On any
        refusal (full, schema mismatch, duplicate transaction) the pages are deleted. ``ttl``:
        the pages' frames store a TTL column (``_format.schema.with_ttl``)."""
        return self._committer.commit(pages, schema, txn=txn, merge_schema=merge_schema,
                                      ttl=ttl)

    def discard(self, pages: Iterable[PageInfo]) -> None:
        """Delete pages written for a commit that will not happen (never a published one)."""
        self._committer.delete_unpublished(pages)

    # -- consumers ------------------------------------------------------------------------------
    @overload
    def consumer(self, name: str, *, selector: str | None = None, start: Any = None,
                 create: bool = True, ack_flush_ms: int = 1000, wait_ms: float = 0,
                 shared: Literal[False] = False) -> Consumer: ...

    @overload
    def consumer(self, name: str, *, selector: str | None = None, start: Any = None,
                 create: bool = True, ack_flush_ms: int = 1000, wait_ms: float = 0,
                 shared: Literal[True], lease_ms: int = LEASE_MS,
                 prefetch: int = PREFETCH) -> SharedConsumer: ...

    def consumer(self, name: str, *, selector: str | None = None, start: Any = None,
                 create: bool = True, ack_flush_ms: int = 1000, wait_ms: float = 0,
                 shared: bool = False, lease_ms: int = LEASE_MS,
                 prefetch: int = PREFETCH) -> Consumer | SharedConsumer:
        """Open (or create) the durable consumer ``name``.

        A new consumer starts at ``start``: ``"earliest"`` (the default), ``"latest"``, a
        ``_seq``, or a ``datetime`` (the first message committed at or after it; naive means
        UTC). An existing one resumes from its acknowledged watermark (a ``start`` given for
        it is ignored with a warning; move it with :meth:`Consumer.seek`).

        ``ack_flush_ms``: how long an ``ack(flush=False)`` may stay unwritten (see
        :meth:`Consumer.ack`).

        One owner: the consumer is exclusive, so the first ``receive`` makes this process its
        owner (a lease, shared by the process's handles of it, given up by the last one's
        ``close()`` or the process's exit; a Spark query reading it holds the same lease).
        Another process's ``receive`` then raises :class:`ConsumerInUseError` at once, or
        after waiting up to ``wait_ms`` for the owner to go.

        ``shared=True``: a shared consumer (:class:`SharedConsumer`): any number of handles,
        in any number of processes, receive disjoint messages, each row leased to its handle
        for ``lease_ms`` (default 30 s) and settled one by one; a handle claims ``prefetch``
        rows at a time (default 100). Whether a consumer is shared is stored with it: opening
        it as the other kind raises :class:`InvalidOptionError`.
        """
        if shared:
            return SharedConsumer.open(self, name, selector=selector, start=start,
                                       create=create, lease_ms=lease_ms, prefetch=prefetch,
                                       ack_flush_ms=ack_flush_ms)
        return Consumer.open(self, name, selector=selector, start=start, create=create,
                             ack_flush_ms=ack_flush_ms, wait_ms=wait_ms)

    def shared_chain(self, name: str, start: int) -> SharedStore:
        """The state of shared consumer ``name`` (a new one's cursor is ``start``): see
        :mod:`._ops.shared`."""

        def begin() -> int:
            # asked when the chain has no state yet (a new consumer, or its state deleted):
            # ConsumerNotFoundError when the consumer was deleted, so that a handle of it
            # stops instead of making a state that a new consumer of the name would adopt;
            # else its watermark (a deleted damaged state goes on from there), at least start
            return max(start, int(self.load_consumer_state(name)["position"]))

        return shared_store(self.storage, self.layout.shared(name), start=begin)

    def consumer_lease(self, name: str, ttl_ms: int) -> ConsumerLease:
        """A claim on consumer ``name`` that lasts ``ttl_ms`` without renewal (not yet
        acquired): one running Spark query per consumer (see :mod:`._ops.lease`). Used by the
        Spark source's driver."""
        from ._ops.lease import ConsumerLease

        return ConsumerLease(self.storage, self.layout.leases(name), name, ttl_ms,
                             checksums=self.format.checksums)

    def consumers(self) -> dict[str, dict[str, Any]]:
        """Persisted state of every consumer, by name."""
        return self.registry.all()

    def snapshot(self) -> Snapshot:
        """The address's messages as the log is now: an immutable view that does not move on
        with later sends or cleanups (see :class:`._read.scan.Snapshot`)."""
        self.release_due()  # a consumer's read: scheduled messages that are due come first
        state = self.log.refresh()
        return Snapshot.of(self.storage, self.layout, state, self.live_refs,
                           damage=self.log.damage)

    def live_refs(self, first: int, end: int) -> list[PageRef]:
        """The pages holding ``[first, end)`` as the log is now (a reader whose page
        compaction swapped out reads its messages from these)."""
        return list(self.log.refresh().pages.refs(first, end))

    def backlog(self, position: int | None = None) -> tuple[int, int]:
        """``(messages, bytes)`` not yet acknowledged by every consumer (or after
        ``position``). Without consumers, every retained message counts."""
        return self._committer.backlog_of(self.log.refresh(), position)

    # -- for consumers (consumer.ConsumerAddress): called by Consumer, in its process ----------
    def wait_for_commit(self, version: int, timeout_s: float | None) -> None:
        """Wait until the log moves past ``version`` (a :meth:`snapshot`'s), or ``timeout_s``
        seconds (``None``: as long as it takes). A commit of this process wakes it at once,
        another process's is found by polling (see ``CommitLog.wait``). Holds no lock of the
        caller's. Returns early, having appended it, when a scheduled message may be due
        (looking for other processes' schedules every ``WAITING_LISTING_MS`` on a local disk,
        see :mod:`._ops.scheduled`)."""
        scheduler = self._scheduler()
        listing_ms = scheduler.listing_ms(waiting=True)
        wait = self._clock.wait_s(time.time() * 1000, listing_ms)
        if self._clock.releasing.locked():
            # another thread of this process is appending what is due: its commit wakes the
            # wait at once; without this the waiter would spin, taking the GIL from it
            wait = max(wait, listing_ms / 1000)
        if timeout_s is None or wait < timeout_s:
            self.log.wait(version, wait)
            scheduler.release(self._send_released, waiting=True)
        else:
            self.log.wait(version, timeout_s)

    def read_cache(self) -> PageCache:
        """The process's page cache, holding at most this address's ``pageMaxCacheSize`` of
        its pages (see :mod:`._read.cache`)."""
        cache = page_cache()
        cache.limit(self.layout.pages, self.settings.page_max_cache_size)
        return cache

    def consumer_state_path(self, name: str) -> str:
        """The file that holds consumer ``name``'s state."""
        return self.layout.consumer_state(name)

    def load_consumer_state(self, name: str) -> dict[str, Any]:
        """Consumer ``name``'s state (see :mod:`._ops.registry`) with its current position;
        :class:`ConsumerNotFoundError` when it does not exist."""
        return self.registry.load(name)

    def create_consumer_state(self, name: str, state: dict[str, Any]) -> bool:
        """Create consumer ``name`` with ``state``; ``False`` when another process created it
        first (then load theirs)."""
        return self.registry.create(name, state)

    def save_consumer_state(self, name: str, state: dict[str, Any]) -> None:
        """Replace the state file of consumer ``name`` (its selector, lost ranges); from
        format 3 its position moves separately (:meth:`save_consumer_position`)."""
        self.registry.save(name, state)

    def save_consumer_position(self, name: str, state: dict[str, Any], *,
                               state_changed: bool = False) -> None:
        """Write an acknowledgement of consumer ``name``: ``state`` with its new position.
        Formats 1-2 replace the state file; format 3 moves the position in the consumer's
        watermark file, replacing the state file too only when ``state_changed``."""
        self.registry.acknowledge(name, state, state_changed=state_changed)

    def delete_consumer_state(self, name: str) -> None:
        """Remove consumer ``name``'s state, watermark, window and lease records."""
        self.registry.delete(name)

    def load_consumer_window(self, name: str) -> dict[str, Any] | None:
        """Consumer ``name``'s window file (rows settled out of order, rows waiting for
        redelivery: see :mod:`._ops.window`), ``None`` when it has none."""
        return self.registry.load_window(name)

    def save_consumer_window(self, name: str, record: dict[str, Any] | None) -> None:
        """Replace consumer ``name``'s window file atomically (``None``: remove it)."""
        self.registry.save_window(name, record)

    def send_dead_letters(self, target: str, letters: pa.Table,
                          key: tuple[str, int]) -> CommitResult:
        """Store a consumer's dead letters (``_ops/dead_letter.py``) in address ``target``,
        created with default settings on first use, under the move's transaction ``key``: a
        move repeated after a crash is a duplicate (nothing stored twice)."""
        if target == self.name:
            raise InvalidOptionError(
                f"address {self.name!r} names itself as its dead_letter_address; dead letters "
                "must go elsewhere (e.g. dead_letter_address='DLQ')")
        return Address.open(self.storage, target)._send(letters, key, False)

    def move_expired(self, *, now: float | None = None) -> ExpiryReport:
        """Move the messages that expired by ``now`` (epoch seconds, default the clock) to
        the address's ``expiry_address`` (created on first use), once per address, with their
        origin (the dead-letter columns, ``reason`` ``"expired"``); nothing without one.
        Cleanup (``maybe_cleanup``, ``cleanup(dry_run=False)``) does it first. Safe to run in
        any number of processes at once, and after a crash half-way (see
        :mod:`._ops.expiry`)."""
        return ExpiryMover(self._context).move(self._send_expired, now=now)

    def _send_expired(self, target: str, rows: pa.Table, key: tuple[str, int]) -> CommitResult:
        return Address.open(self.storage, target)._send(rows, key, False)

    def _move_expired_quietly(self) -> None:
        # before cleanup plans (best effort, as cleanup is: the next one moves them)
        try:
            self.move_expired()
        except DurableQueueError as exc:
            log.warning("address %s: moving expired messages to %s failed and will be "
                        "retried at the next cleanup: %s", self.name,
                        self.settings.expiry_address, exc)

    def delivery_settings(self) -> AddressSettings:
        """The address's settings, of which a consumer reads the redelivery delays and
        ``max_in_flight``."""
        return self.settings

    # -- maintenance ----------------------------------------------------------------------------
    def cleanup(self, *, dry_run: bool = True, orphans: bool = True, now: float | None = None,
                progress: Callable[[int, int], None] | None = None) -> CleanupReport:
        """Remove pages every consumer has acknowledged (or whose selector cannot match), orphan
        pages of dead writers, and expired commit-log entries; ``archive_data_logs`` moves
        pages to the archive folder instead. Defaults to a dry run that only reports (see
        :mod:`._ops.cleanup`). ``progress(files retired, files to retire)`` is called as files
        go. A cleanup that is not a dry run first appends the scheduled messages that are due."""
        if not dry_run:
            self.release_due()
        return self._cleaner.cleanup(dry_run=dry_run, orphans=orphans, now=now,
                                     progress=progress)

    def maybe_cleanup(self) -> CleanupReport | None:
        """Run cleanup if ``cleanup_interval_ms`` has passed since any process last did; then,
        once ``compact_small_pages`` of the backlog's pages are small, compact up to
        :data:`AUTO_COMPACT_PAGES` pages' worth of them, else, when a consumer has a selector,
        give a page's worth of the rolled journal segments' runs of small units their
        statistics on a background thread (:meth:`seal`); best effort, like cleanup."""
        self.release_due()
        report = self._cleaner.maybe_cleanup()
        if report is not None:
            budget = AUTO_COMPACT_PAGES * self.settings.page_size_bytes
            try:
                if self._compactor.due():
                    self._compactor.compact(open_segment=False, max_bytes=budget)
                else:  # compaction gives the pages it writes statistics itself
                    seal_in_background(self._sealer(), self.settings.page_size_bytes)
            except DurableQueueError as exc:
                log.warning("address %s: compaction or sealing failed and will be retried "
                            "later: %s", self.name, exc)
        return report

    def seal(self, *, max_bytes: int | None = None) -> SealReport:
        """Give the runs of small journal units in rolled segments their statistics, read
        once, so that selectors skip them without reading them (see :mod:`._ops.seal`); up to about
        ``max_bytes`` of them. Maintenance does it when compaction is not due."""
        return self._sealer().seal(max_bytes=max_bytes)

    def _sealer(self) -> Sealer:
        # made per use: it holds nothing of its own (the log and registry are this handle's)
        return Sealer(self._context)

    def compact(self, *, dry_run: bool = False, max_bytes: int | None = None,
                progress: Callable[[int, int], None] | None = None) -> CompactReport:
        """Rewrite runs of small pages of the backlog (page files under half of
        ``page_size_bytes``, journal rows) as full pages of large frames, swapped in with one
        commit-log entry per run: ``_seq`` and ``_timestamp`` never change, and no reader
        misses or reads a message twice across the swap (see :mod:`._ops.compact`). Pages every
        consumer acknowledged are left to cleanup. ``dry_run`` only reports what it would
        rewrite; ``max_bytes`` stops after about that many bytes of small pages;
        ``progress(bytes read, bytes to read)`` is called as runs are read."""
        return self._compactor.compact(dry_run=dry_run, max_bytes=max_bytes, progress=progress)

    def repair(self, *, dry_run: bool = True, grace_ms: int | None = None,
               now: float | None = None,
               progress: Callable[[int, int], None] | None = None) -> RepairReport:
        """Set aside a damaged last commit-log entry left by a killed writer, and take pages
        that are missing or fail verification out of the log, recording the messages they
        held as lost. Defaults to a dry run; moves files to ``damaged/``, never deletes.

        ``grace_ms`` (default 10 minutes): how old a damaged last entry must be before it is
        taken for abandoned. ``progress(bytes verified, bytes in all)`` is called as the
        pages are read. See :mod:`pyspark_durable_queue._ops.repair`.
        """
        from ._ops.repair import DEFAULT_GRACE_MS, repair

        return repair(self.storage, self.layout, self.log, dry_run=dry_run, now=now,
                      grace_ms=DEFAULT_GRACE_MS if grace_ms is None else grace_ms,
                      address=self.name, positions=self._positions(), progress=progress)

    def _positions(self) -> list[int]:
        """Where each consumer acknowledged up to (repair and verify: one past the log's end
        proves commits that are gone)."""
        return [int(c["position"]) for c in self.registry.all().values()]

    # -- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Messages, bytes, pages, per-consumer backlog and drop counters (JSON-safe), and the
        figures monitoring wants (see :mod:`._ops.metrics`): per consumer, the age of its
        oldest unsettled message (``oldest_unsettled_age_ms``: the message at its watermark,
        whatever its selector) and its messages in flight (``in_flight``, as its owner last
        reported them); per address, the age of the first retained message. Reads no
        messages: the log's index, each consumer's state files and lease claim.

        Raises
        ------
        DamagedLogError
            The journal is damaged: the figures would count only what is before the damage.
        """
        state = self.log.refresh()
        self.log.check_damage()
        idx = state.pages
        out: dict[str, Any] = {
            "address": self.name,
            "messages": sum(idx.rows),
            "bytes": sum(idx.bytes),
            "pages": len(idx),
            "first_seq": state.first_seq,
            "next_seq": state.next_seq,
            "commits": state.version,
            "dropped_messages": state.dropped_messages,
            "dropped_bytes": state.dropped_bytes,
            "dropped_sends": state.dropped_sends,
            # _seq ranges repair gave up (damaged pages, damage in a journal)
            "lost_messages": sum(end - first for first, end in state.lost),
            # what retention removed before every consumer had passed it
            "retention_removed_messages": state.retention_removed_messages,
            "retention_removed_bytes": state.retention_removed_bytes,
            # retained messages past expiry_delay_ms (never delivered; counted by whole index
            # rows whose newest message expired, so a lower bound by at most a page)
            "expired_messages": _expired(idx, self.settings.expire_before()),
            # pages cleanup removed because every message in them had expired (settled for
            # every consumer, not lost), and messages moved to the expiry_address
            "expired_removed_messages": state.expired_removed_messages,
            "expired_moved_messages": ExpiryMover(self._context).moved(),
            "schema": None if state.schema is None else str(state.schema),
            "settings": self.settings.to_json(),
            "format": int(self.format),
            "journal": self.format.journal,
            # formats 1-4: address.json, log entries, checkpoints, consumer state and leases
            # carry no checksum (messages and journal units do), so damage to them can go unseen
            "metadata_checksums": self.format.checksums,
            "consumers": {},
        }
        # SQS's "Delayed": scheduled sends not yet appended (from file names alone)
        out.update(self._scheduler().summary())
        now_ms = int(time.time() * 1000)
        out.update(address_metrics(state, now_ms=now_ms))
        backlogs = Backlogs(state)
        expire_before = self.settings.expire_before(now_ms / 1000)
        owned = leased(self.storage, self.layout)
        for name, c in self.registry.all().items():
            shared = self._shared_stats(name, int(c["position"]), now_ms) if c.get(
                "shared") else None
            position = int(c["position"]) if shared is None else shared["ack_point"]
            messages, nbytes = backlogs.after(position)
            row = out["consumers"][name] = {
                "position": position, "selector": c.get("selector"),
                "backlog_messages": messages, "backlog_bytes": nbytes,
                **(shared or self._window_stats(name, position, now_ms))}
            row.update(consumer_metrics(self.storage, self.layout, state, name, row,
                                        checksums=self.format.checksums, now_ms=now_ms,
                                        expire_before=expire_before, owned=owned))
            if shared is not None:
                row["in_flight"] = shared["leased"]
        return out

    def _shared_stats(self, name: str, position: int, now_ms: int) -> dict[str, Any]:
        """A shared consumer's state as stats (see ``_ops/shared.py``): rows leased to its
        handles (in flight), rows nacked and waiting (``redelivery_pending``, of which
        ``redelivery_delayed`` not due yet), the handles that hold leases or were seen
        lately (``handles``), when the first lease runs out (``first_lease_expiry_ms``,
        epoch ms, ``None`` without leases), and its counters."""
        shared = self.shared_chain(name, position).current()
        counters = shared.counters
        counts = [c for _, c, _ in shared.leases.values()] + [
            c for c, _ in shared.pending.values()]
        return {
            "shared": True, "ack_point": shared.ack_point, "cursor": shared.cursor,
            "leased": len(shared.leases), "handles": len(shared.holders),
            "first_lease_expiry_ms": min((e for _, _, e in shared.leases.values()),
                                         default=None),
            "redelivery_pending": len(shared.pending),
            "redelivery_delayed": sum(1 for _, due in shared.pending.values() if due > now_ms),
            "max_delivery_count": max(counts, default=0),
            "dead_lettered": counters.get("dead_lettered", 0),
            "dead_letters_dropped": counters.get("dropped", 0),
            "delivered": counters.get("delivered", 0),
            "redelivered": counters.get("redelivered", 0),
            "acknowledged": counters.get("acked", 0)}

    def _window_stats(self, name: str, position: int, now_ms: int) -> dict[str, Any]:
        """A consumer's delivery window as stats (see ``_ops/window.py``): the rows nacked and
        not settled since (``redelivery_pending``), those of them not due yet
        (``redelivery_delayed``, SQS's "delayed"), the highest delivery count among them, and
        ``ack_point``: every row below it that is not pending is settled (the watermark, or
        higher while nacked rows hold the watermark back)."""
        window = DeliveryWindow.restore(position, self.registry.load_window(name))
        pending, delayed, max_count = window.summary(now_ms)
        return {"ack_point": window.ack_point,
                "redelivery_pending": pending,
                "redelivery_delayed": delayed,
                "max_delivery_count": max_count,
                "dead_lettered": window.dead_lettered,
                "dead_letters_dropped": window.dropped}


def _expired(idx: Any, expire_before: int | None) -> int:
    """Messages of the index rows (pages, runs of journal units) whose newest message was
    committed before ``expire_before`` (epoch microseconds)."""
    if expire_before is None:
        return 0
    return sum(rows for rows, last in zip(idx.rows, idx.ts_last, strict=True)
               if last < expire_before)


def _due_ms(deliver_at: Any, delay_ms: Any) -> int | None:
    """When a send is due (epoch ms), ``None`` when it is not scheduled; checks the options."""
    if deliver_at is None and delay_ms is None:
        return None
    if deliver_at is not None and delay_ms is not None:
        raise InvalidOptionError(
            f"give deliver_at ({deliver_at!r}) or delay_ms ({delay_ms!r}), not both")
    if delay_ms is not None:
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, int) or delay_ms < 0:
            raise InvalidOptionError(
                f"delay_ms must be an int >= 0 (milliseconds), got {delay_ms!r}")
        return int(time.time() * 1000) + delay_ms
    if not isinstance(deliver_at, dt.datetime):
        raise InvalidOptionError(
            f"deliver_at must be a datetime, got {type(deliver_at).__name__} {deliver_at!r}")
    if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
        raise InvalidOptionError(
            f"deliver_at {deliver_at.isoformat()} has no time zone; give an aware datetime, "
            "e.g. datetime.now(timezone.utc) + timedelta(minutes=5)")
    return int(deliver_at.timestamp() * 1000)
