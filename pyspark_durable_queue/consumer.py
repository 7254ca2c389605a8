"""Durable consumers: a name, an optional selector, and an acknowledged watermark.

A consumer's state (see ``_ops.registry``) holds ``position``: every ``_seq`` below it is
settled. Messages are delivered in ``_seq`` order from an in-memory cursor; ``ack`` moves
the durable watermark up to what was delivered. After a crash the consumer resumes at its
watermark, so unacknowledged messages are delivered again (at-least-once for the Python client;
Spark's checkpoint makes the source exactly-once).

``nack`` gives messages back: they wait in the consumer's window (``_ops.window``) for their
redelivery delay and are delivered again before newer messages; the watermark stays below them
until they are acknowledged. Every row returned carries ``_delivery_count`` (1 the first time,
as JMSXDeliveryCount).

One message at a time: ``receive`` reads ahead (up to ``READ_AHEAD_ROWS`` messages) and hands
out slices of what it read, so ``receive(1)`` costs a few microseconds until the read-ahead is
used up; ``receive(timeout_ms=...)`` waits for a message (``CommitLog.wait``); an
``ack(flush=False)`` moves the watermark in memory only, and the deferred acknowledgements
(see :class:`_AckFlusher`) are written by the next flushing ack, :meth:`Consumer.flush`,
:meth:`Consumer.close`, a process exit, or ``ack_flush_ms`` after the first of them.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pyarrow as pa

from ._format.schema import (
    DELIVERY_COUNT_FIELD,
    SEQ,
    TIMESTAMP,
    compile_selector,
    unexpired,
    with_system_schema,
)
from ._log.commit_log import seq_ranges_text, subtract_ranges
from ._ops import dead_letter
from ._ops.lease import OWNERS
from ._ops.window import DeliveryWindow, redelivery_delay_ms
from ._positions import EARLIEST, parse_position
from .errors import (
    ConsumerClosedError,
    ConsumerNotFoundError,
    DataLossError,
    InvalidOptionError,
)
from .settings import validate_name

if TYPE_CHECKING:
    from ._ops.lease import ConsumerLease
    from ._read.cache import PageCache
    from ._read.scan import Snapshot
    from .selector import Selector
    from .settings import AddressSettings

__all__ = ["CONSUMER_SURFACE", "Consumer", "ConsumerAddress", "resolve_start"]

log = logging.getLogger(__name__)

POSITION_KEY = b"dq.position"
#: the ``_seq`` of the last row of the table the label was made for: a part of the table
#: (a slice, a filter) that does not end with it is acknowledged up to its own last row
LAST_KEY = b"dq.last"
#: ``receive`` of fewer messages than this reads this many ahead (at most READ_AHEAD_BYTES) and
#: serves the next calls from them.
READ_AHEAD_ROWS = 4096
READ_AHEAD_BYTES = 4 << 20
#: Default of ``ack_flush_ms``: how long a deferred acknowledgement may stay unwritten.
ACK_FLUSH_MS = 1000
#: How long an owner's lease lasts without renewal (a heartbeat renews it every third): what
#: another host waits, at most, after the owner's host died (on the owner's own host a dead
#: owner's claim is free at once).
OWNER_LEASE_MS = 60_000


class ConsumerAddress(Protocol):
    """What a consumer uses of its address, and nothing else: its name and schema, a
    :meth:`snapshot` of the log (an immutable view), :meth:`wait_for_commit`,
    :meth:`read_cache`, the consumer state methods, cleanup after an acknowledgement and the
    backlog. :class:`~pyspark_durable_queue.address.Address` implements it (each method's
    docstring is there); the consumer never imports the address module."""

    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> pa.Schema | None: ...

    def snapshot(self) -> Snapshot: ...

    def wait_for_commit(self, version: int, timeout_s: float | None) -> None: ...

    def read_cache(self) -> PageCache: ...

    def consumer_state_path(self, name: str) -> str: ...

    def load_consumer_state(self, name: str) -> dict[str, Any]: ...

    def create_consumer_state(self, name: str, state: dict[str, Any]) -> bool: ...

    def save_consumer_state(self, name: str, state: dict[str, Any]) -> None: ...

    def save_consumer_position(self, name: str, state: dict[str, Any], *,
                               state_changed: bool = False) -> None: ...

    def delete_consumer_state(self, name: str) -> None: ...

    def load_consumer_window(self, name: str) -> dict[str, Any] | None: ...

    def save_consumer_window(self, name: str, record: dict[str, Any] | None) -> None: ...

    def delivery_settings(self) -> AddressSettings: ...

    def send_dead_letters(self, target: str, letters: pa.Table,
                          key: tuple[str, int]) -> object: ...

    def maybe_cleanup(self) -> object: ...

    def backlog(self, position: int | None = None) -> tuple[int, int]: ...

    def consumer_lease(self, name: str, ttl_ms: int) -> ConsumerLease: ...


#: The names of :class:`ConsumerAddress`: ``consumer.py`` reads nothing else of an address
#: (``tests/test_consumer_contract.py`` checks its source).
CONSUMER_SURFACE = frozenset(name for name in vars(ConsumerAddress) if not name.startswith("_"))


def open_state(address: ConsumerAddress, name: str, *, selector: str | None, start: Any,
               create: bool, shared: bool) -> dict[str, Any]:
    """The state of consumer ``name`` (created when missing and ``create``): what
    :meth:`Consumer.open` and a shared consumer's open share. Raises
    :class:`InvalidOptionError` when it exists as the other kind (shared or exclusive)."""
    validate_name(name, "consumer")
    if selector:
        from .selector import Selector

        Selector(selector)  # a syntax error must surface before anything is persisted
    position = None if start is None else parse_position(start, "start")
    created = False
    try:
        state = address.load_consumer_state(name)
    except ConsumerNotFoundError:
        if not create:
            raise
        now = time.time()
        first = (position or EARLIEST).resolve(address.snapshot())
        state = {"name": name, "selector": selector or None, "position": first,
                 "created": now, "updated": now}
        if shared:
            state["shared"] = True
        created = address.create_consumer_state(name, state)
        if not created:
            state = address.load_consumer_state(name)
    if position is not None and not created:
        log.warning("consumer %s of %s already exists: it resumes at its watermark _seq %d "
                    "and start=%s is ignored (it applies to new consumers only); move it "
                    "with Consumer.seek(...), or use a new consumer name", name,
                    address.name, int(state["position"]), position)
    if bool(state.get("shared")) != shared:
        kind = "shared" if state.get("shared") else "exclusive"
        raise InvalidOptionError(
            f"consumer {name!r} of {address.name!r} is {kind}: open it with "
            f"shared={not shared} (or use another consumer name)")
    return state


def resolve_start(address: ConsumerAddress, start: Any) -> int:
    """The ``_seq`` a position names now: ``earliest`` (first retained), ``latest`` (next to
    be written), a ``_seq``, a Spark offset ``{"seq": N}`` or a time (``datetime``; see
    :mod:`._positions`)."""
    return parse_position(start).resolve(address.snapshot())


_F = TypeVar("_F", bound=Callable[..., Any])


def _serialised(method: _F) -> _F:
    """Run ``method`` holding the consumer's lock."""
    @functools.wraps(method)
    def locked(self: Consumer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


class SelectingHandle:
    """What a consumer's handle (:class:`Consumer`, a shared consumer's) knows of its selector:
    the text stored with the consumer and the selector compiled for a schema, kept until the
    schema changes. The handle sets ``_state``, ``_selector`` and ``_selector_schema``."""

    _state: dict[str, Any]
    _selector: Selector | None
    _selector_schema: pa.Schema | None

    @property
    def selector_text(self) -> str | None:
        return self._state.get("selector") or None

    def _selector_for(self, schema: pa.Schema | None) -> Selector | None:
        """The selector compiled for ``schema`` (kept until the schema changes)."""
        if not self.selector_text:
            return None
        if self._selector is None or self._selector_schema != schema:
            self._selector = compile_selector(self.selector_text, schema)
            self._selector_schema = schema
        return self._selector


class Consumer(SelectingHandle):
    """A durable consumer of an address. Obtain one with :meth:`Address.consumer`.

    A consumer is one reader: its acknowledgement is a cumulative watermark (everything before
    it is done), so it cannot track messages handed to several workers independently. Its
    methods may be called from several threads (``_lock`` serialises ``receive``, ``ack``,
    ``seek`` and ``delete``, and guards ``position``, ``cursor`` and the persisted state), but
    competing readers need separate consumers, each with its own watermark.

    Concurrency guarantee: the watermark file is replaced atomically; a consumer is meant to
    have one owner at a time (the Spark source enforces it with a lease).
    """

    def __init__(self, address: ConsumerAddress, state: dict[str, Any], *,
                 ack_flush_ms: int = ACK_FLUSH_MS, wait_ms: float = 0) -> None:
        if ack_flush_ms < 0:
            raise InvalidOptionError(f"ack_flush_ms must be >= 0, not {ack_flush_ms}")
        if wait_ms < 0:
            raise InvalidOptionError(f"wait_ms must be >= 0, not {wait_ms}")
        self.address = address
        self.name: str = state["name"]
        self._state = state
        written = int(state["position"])
        #: rows settled out of order and rows waiting for redelivery (see ``_ops/window.py``)
        self._window = DeliveryWindow.restore(written, address.load_consumer_window(self.name))
        #: the window file holds pending rows (it must be written when they change)
        self._window_on_disk = self._window.in_use
        #: the window changed since it was last written
        self._window_dirty = False
        #: the acknowledged watermark: every row below it is settled (written, or deferred:
        #: see ``flushed``)
        self.position: int = self._window.watermark
        #: the watermark as last written to the consumer's state
        self.flushed: int = written
        #: after the last new message received (rows waiting for redelivery are below it)
        self.cursor: int = self._window.ack_point
        self.ack_flush_ms = ack_flush_ms
        self._deferred_since: float | None = None  # monotonic time of the oldest unwritten ack
        self._closed = False
        #: how long the first receive waits for another process's ownership to end
        self.wait_ms = wait_ms
        #: the process's lease on the consumer, once this handle received (see :meth:`_own`)
        self._lease: ConsumerLease | None = None
        #: gives the share back when this handle is collected without close()
        self._give_back: weakref.finalize[Any, Any] | None = None
        self._selector: Selector | None = None
        self._selector_schema: pa.Schema | None = None
        self._lock = threading.RLock()
        # read ahead: messages from the cursor on, the next one at row _ahead_at, and the
        # position after them (past the unmatched messages examined after the last one)
        self._ahead: pa.Table | None = None
        self._ahead_seqs: Any = None
        self._ahead_at = 0
        self._ahead_end = 0
        #: until when (epoch us) no message of the read-ahead expires (None: never), and that
        #: of the last read (see read_new_until)
        self._ahead_until: int | None = None
        self._read_until: int | None = None
        #: the table ``receive`` returned last: ``ack`` of it takes its label as it is (a
        #: part of a table has the table's label, which ``ack`` checks otherwise)
        self._last_table: pa.Table | None = None
        #: rows of the window this handle handed out again above its cursor (a consumer
        #: opened again at its ack point hands those out first): an ack of one of them, or
        #: of one nacked again since, settles no row below it that is not handed out yet
        self._again_above: set[int] = set()

    def __repr__(self) -> str:
        return (f"Consumer({self.address.name!r}, {self.name!r}, position={self.position}, "
                f"selector={self.selector_text!r})")

    @property
    def path(self) -> str:
        return self.address.consumer_state_path(self.name)

    @property
    def selector(self) -> Selector | None:
        """The compiled selector, for the address's current schema: compiled again when the
        schema grows (mergeSchema), or a newly added column it names would stay NULL and its
        pages would be skipped."""
        if not self.selector_text:
            return None
        return self._selector_for(self.address.schema)

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    def open(cls, address: ConsumerAddress, name: str, *, selector: str | None = None,
             start: Any = None, create: bool = True,
             ack_flush_ms: int = ACK_FLUSH_MS, wait_ms: float = 0) -> Consumer:
        """Open (or create) a consumer; see :meth:`Address.consumer`.

        ``start`` applies to a new consumer only (default ``earliest``); given for one that
        exists, it is ignored with a warning saying where the consumer resumes. A ``selector``
        that differs from the stored one replaces it (see :meth:`_change_selector`).
        """
        state = open_state(address, name, selector=selector, start=start, create=create,
                           shared=False)
        consumer = cls(address, state, ack_flush_ms=ack_flush_ms, wait_ms=wait_ms)
        if selector is not None and (selector or None) != state.get("selector"):
            consumer._change_selector(selector or None)
        consumer._warn_unknown_identifiers()
        return consumer

    def _change_selector(self, selector: str | None) -> None:
        """Replace the stored selector, keeping the watermark.

        Cleanup may have removed pages past the watermark that the old selector could not
        match; the new one might have matched them. Those ``_seq`` ranges are recorded as lost
        for this consumer (the Python consumer warns when it passes them, the Spark source
        applies ``failOnDataLoss``), never skipped silently.
        """
        old = self.selector_text
        snapshot = self.address.snapshot()
        # repair's own losses (snapshot.lost) are reported anyway, with their own reason
        lost = [] if not old else subtract_ranges(snapshot.gaps(self.position), snapshot.lost)
        log.warning("consumer %s of %s: selector changed from %r to %r%s", self.name,
                    self.address.name, old, selector,
                    f"; messages _seq {seq_ranges_text(lost)} were removed by cleanup because "
                    "the old selector could not match them, and are lost to the new one"
                    if lost else "")
        reason = f"selector changed from {old!r} to {selector!r}"
        self._state = dict(self._state, selector=selector, updated=time.time(),
                           lost=[*self._lost, *([a, b, reason] for a, b in lost)])
        self._selector = None
        self.address.save_consumer_state(self.name, self._state)

    @property
    def _lost(self) -> list[list[Any]]:
        return list(self._state.get("lost") or [])

    def lost_in(self, begin: int, end: int) -> list[tuple[int, int, str]]:
        """``(first, end, reason)`` of the messages in ``[begin, end)`` this consumer lost
        (see :meth:`_change_selector`)."""
        return [(max(int(a), begin), min(int(b), end), str(why)) for a, b, why in self._lost
                if int(a) < end and int(b) > begin]

    def _warn_unknown_identifiers(self) -> None:
        schema = self.address.schema
        if self.selector is None or schema is None:
            return
        unknown = self.selector.unknown_identifiers(with_system_schema(schema))
        if unknown:
            log.warning("consumer %s of %s: selector %r uses %s, which %s not a column of the "
                        "address; as in JMS it is NULL for every message", self.name,
                        self.address.name, self.selector_text, ", ".join(sorted(unknown)),
                        "is" if len(unknown) == 1 else "are")

    @_serialised
    def delete(self) -> None:
        """Remove the consumer (and the Spark source's lease records for it); cleanup no
        longer keeps pages for it."""
        self._deferred_since = None
        lease = self._lease or OWNERS.lease_of(self.path)
        if lease is None:
            self.address.delete_consumer_state(self.name)
        else:
            with lease.paused():  # its heartbeat would write a claim into the folder deleted
                self.address.delete_consumer_state(self.name)
            OWNERS.drop(self.path)  # nothing to release: the claims went with the folder
        # nothing left to write: deferred acks of a deleted consumer are dropped, not retried
        self.flushed = self.position
        self._window_dirty = False

    def _persist(self) -> None:
        # the window first: the watermark only rises, so a crash between the two writes leaves
        # a watermark at or below every pending row the window names (see _ops/window.py)
        if self._window_dirty:
            if self._window.in_use or self._window_on_disk:
                self.address.save_consumer_window(self.name, self._window.record(self.flushed))
                self._window_on_disk = self._window.in_use
            self._window_dirty = False
            if self.position == self.flushed:
                self._deferred_since = None
                return
        lost = self._lost
        self._state = dict(self._state, position=self.position, updated=time.time())
        if lost:  # ranges passed for good are forgotten
            self._state["lost"] = [r for r in lost if int(r[1]) > self.position]
        self.address.save_consumer_position(
            self.name, self._state, state_changed=bool(lost) and self._state["lost"] != lost)
        self.flushed = self.position
        self._deferred_since = None

    def _check_open(self) -> None:
        if self._closed:
            raise ConsumerClosedError(f"consumer {self.name} of {self.address.name} is closed")

    def _own(self) -> None:
        """Make this process the consumer's owner (its first ``receive``), or raise
        :class:`ConsumerInUseError` when another process owns it for longer than ``wait_ms``.
        Handles in one process share the ownership; the last one's :meth:`close`, or the
        process's exit, gives it up. Raises the same error once the lease was lost (this
        process stalled past it and another took the consumer over)."""
        lease = self._lease
        if lease is None:
            self._lease = OWNERS.take(self.path, lambda: self.address.consumer_lease(
                self.name, OWNER_LEASE_MS), self.wait_ms / 1000)
            # a handle dropped without close() gives its share back when it is collected; not
            # at exit: deferred acks are written first (_FLUSHER), then OWNERS releases
            give_back = weakref.finalize(self, OWNERS.collected, self.path)
            give_back.atexit = False
            self._give_back = give_back
            self._lease.report = _status_of(weakref.ref(self))  # in flight, for stats()
            self._catch_up()
        elif not lease.held:
            lease.check()  # raises what it lost the lease to

    def adopt_lease(self, lease: ConsumerLease) -> None:
        """Own the consumer through ``lease``, a claim its caller holds and renews (the Spark
        source's query): acknowledgements check it instead of taking the process's own."""
        self._lease = lease

    def _catch_up(self) -> None:
        """Now that this process owns the consumer: take up the state the previous owner
        left, when this handle has nothing unwritten (it was opened, maybe long before, and
        waited for the owner to go, who acknowledged meanwhile; its stale position would
        deliver those messages again and move the watermark back)."""
        if self.position != self.flushed or self._window_dirty:
            return
        try:
            state = self.address.load_consumer_state(self.name)
        except ConsumerNotFoundError:
            return  # deleted meanwhile: as before, this handle goes on with what it has
        written = int(state["position"])
        window = DeliveryWindow.restore(written, self.address.load_consumer_window(self.name))
        if written == self.flushed and window.record(written) == self._window.record(written):
            return
        if state.get("selector") != self._state.get("selector"):
            self._selector = None
        self._state = state
        self._window = window
        self._window_on_disk = window.in_use
        self.position = window.watermark
        self.flushed = written
        self.cursor = window.ack_point
        self._again_above.clear()
        self._forget_ahead()

    def _forget_ahead(self) -> None:
        self._ahead = None
        self._ahead_seqs = None
        self._ahead_until = None

    # -- consuming ------------------------------------------------------------------------------
    def receive(self, max_messages: int = 1000, max_bytes: int = 16 << 20, *,
                timeout_ms: float | None = 0) -> pa.Table:
        """The next messages after the cursor, in ``_seq`` order, as a ``pyarrow.Table``.

        Includes ``_seq``, ``_timestamp`` and ``_delivery_count`` (int32: 1 on a message's
        first delivery, then one more each time it is delivered again after a :meth:`nack`;
        a delivery a crash interrupted is not counted). Messages nacked and due come first, in
        a table of their own. Not acknowledged until :meth:`ack`. At least one message is
        returned when one is available, even if it alone exceeds ``max_bytes``.

        ``timeout_ms``: how long to wait for a message (matching the selector) when none is
        available: ``0`` (the default) returns an empty table at once, ``None`` waits as long
        as it takes. A message committed by this process wakes the wait at once; one committed
        by another process is seen within ~1 ms on a local disk, and within 20 ms to 1 s on an
        object store (the interval backs off while nothing comes; see ``CommitLog.wait``).
        """
        if max_messages < 1 or max_bytes < 1:
            raise InvalidOptionError("max_messages and max_bytes must be positive")
        if timeout_ms is not None and timeout_ms < 0:
            raise InvalidOptionError(f"timeout_ms must be >= 0 or None, not {timeout_ms}")
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            with self._lock:
                self._check_open()
                self._own()
                if self._window.moving is not None:  # a dead-letter move a crash stopped
                    self._finish_move()
                table, version = self._next(max_messages, max_bytes)
                self._last_table = table
                due_ms = self._window.next_due_ms() if self._window.pending_count() else None
            if table.num_rows or timeout_ms == 0:
                return table
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return table
            if due_ms is not None:  # a nacked row becomes due: wake for it
                until_due = max(0.0, due_ms / 1000 - time.time()) + 0.0005
                left = until_due if left is None else min(left, until_due)
            if version == _BLOCKED:  # max_in_flight reached: only acks (other threads) help
                time.sleep(_BLOCKED_POLL_S if left is None else min(left, _BLOCKED_POLL_S))
                continue
            self.address.wait_for_commit(version, left)  # unlocked: acks may flush meanwhile

    def _next(self, max_messages: int, max_bytes: int) -> tuple[pa.Table, int]:
        """The next messages (rows due for redelivery first, then the read-ahead, refilled
        when used up) and the log version they were looked for in (``-1`` when they came from
        the read-ahead or the window, ``_BLOCKED`` when ``max_in_flight`` stops new ones)."""
        window = self._window
        if window.waiting():
            due = window.due(int(time.time() * 1000), max_messages)
            if due:
                table = self._redeliver(due)
                if table.num_rows:
                    return table, -1
        if window.pending_count():  # the window is in use: it stays within max_in_flight rows
            room = self._max_in_flight() - (self.cursor - self.position)
            if room <= 0:
                return _delivered_schema(self.address.schema).empty_table(), _BLOCKED
            max_messages = min(max_messages, room)
        if self._ahead is None:
            if max_messages >= READ_AHEAD_ROWS:  # large reads go straight through
                table, position, version = self._read(max_messages, max_bytes)
                self.cursor = position
                return _with_position(table, position), version
            table, position, version = self._read(READ_AHEAD_ROWS,
                                                  min(READ_AHEAD_BYTES, max_bytes))
            if not table.num_rows:
                self.cursor = position
                return _with_position(table, position), version
            # first deliveries: a count of 1 each, added once per read-ahead
            self._ahead, self._ahead_at, self._ahead_end = table, 0, position
            self._ahead_seqs = table.column(SEQ).to_numpy()
            self._ahead_until = self._read_until
        elif self._ahead_until is not None and _now_us() >= self._ahead_until:
            # a message read ahead may have expired since (ttl_ms, expiry_delay_ms): the rest
            # is read again from the cursor, as of now
            self._forget_ahead()
            return self._next(max_messages, max_bytes)
        ahead = self._ahead
        at = self._ahead_at
        rows = ahead.num_rows
        take = min(max_messages, rows - at)
        if max_bytes < READ_AHEAD_BYTES:
            take = max(1, min(take, max_bytes * rows // max(1, ahead.nbytes)))
        part = ahead.slice(at, take)
        at += take
        last = int(self._ahead_seqs[at - 1])
        if at >= rows:
            position = self._ahead_end
            self._forget_ahead()
        else:
            position = last + 1
            self._ahead_at = at
        self.cursor = position
        return _with_position(part, position, last), -1

    def _max_in_flight(self) -> int:
        return int(self.address.delivery_settings().max_in_flight)

    def _redeliver(self, seqs: list[int]) -> pa.Table:
        """Rows of the window due for redelivery, read by ``_seq`` (a selector consumer's rows
        matched when first delivered: no selector now), handed out again. A row whose page is
        gone (removed by repair) is settled as lost, with a warning."""
        table = self._rows(seqs, ttl_now=_now_us())
        found = table.column(SEQ).to_pylist()
        if len(found) < len(seqs):  # expired by their ttl_ms, held or whose pages went
            missing = sorted(set(seqs) - set(found))     # because all their messages expired
            expired_pages = self.address.snapshot().expired
            found = sorted({*found, *self._rows(missing).column(SEQ).to_pylist(),
                            *(s for s in missing if any(a <= s < b for a, b in expired_pages))})
        table = unexpired(table, self.address.delivery_settings().expire_before())
        if table.num_rows < len(found):  # expired while waiting: settled, as for everyone
            alive = table.column(SEQ).to_pylist()
            expired = sorted(set(found) - set(alive))
            log.info("consumer %s of %s: messages _seq %s waiting for redelivery expired "
                     "(expiry_delay_ms, ttl_ms); settling them", self.name, self.address.name,
                     seq_ranges_text(_runs(expired)))
            self._window.hand_out(expired)
            self._window.settle_rows(expired)
            self._window_dirty = True
            self.position = self._window.watermark
            seqs = [s for s in seqs if s not in set(expired)]
            found = alive
        if len(found) < len(seqs):
            gone = sorted(set(seqs) - set(found))
            log.warning("consumer %s of %s: messages _seq %s waiting for redelivery are lost "
                        "(their pages were removed by retention, or damaged and removed by "
                        "repair); settling them",
                        self.name, self.address.name, seq_ranges_text(_runs(gone)))
            self._window.hand_out(gone)
            self._window.settle_rows(gone)
            self._window_dirty = True
            self.position = self._window.watermark
        counts = self._window.hand_out(found)
        self._again_above.update(s for s in found if s >= self.cursor)
        packed = struct.pack(f"<{len(counts)}i", *counts)
        table = table.append_column(DELIVERY_COUNT_FIELD, _int32s(packed))
        return _with_position(table, max(found) + 1 if found else self.position)

    def _rows(self, seqs: list[int], ttl_now: int | None = None) -> pa.Table:
        """The rows of these ``_seq`` values that the address still holds, in ``_seq`` order
        (no selector: they matched when first delivered); ``ttl_now``: without those whose
        ``ttl_ms`` expired by then."""
        return rows_of(self.address, self.address.snapshot(), seqs, ttl_now)

    def _read(self, max_messages: int, max_bytes: int) -> tuple[pa.Table, int, int]:
        """Read messages from the cursor: ``(table, position after them, log version)``.

        A page that retention removed after the view was taken is missing: the read starts
        over on the log as it is now, which reports the removed range as lost (a few times,
        since retention may go on removing; nothing read before is returned twice, as
        nothing was returned)."""
        snapshot = self.address.snapshot()
        for attempt in range(3):
            try:
                return self._read_in(snapshot, max_messages, max_bytes)
            except DataLossError:
                fresh = self.address.snapshot()
                if attempt == 2 or fresh.version == snapshot.version:
                    raise
                log.info("consumer %s of %s: a page went while it was read (retention); "
                         "reading again from the log as it is now", self.name,
                         self.address.name)
                snapshot = fresh
        raise AssertionError("unreachable")

    def _read_in(self, snapshot: Snapshot, max_messages: int,
                 max_bytes: int) -> tuple[pa.Table, int, int]:
        if snapshot.schema is None or self.cursor >= snapshot.end:
            if snapshot.damage is not None:  # everything before it was read: say so
                raise snapshot.damage
            return _delivered_schema(snapshot.schema).empty_table(), self.cursor, snapshot.version
        # rows of the window read again (dead-lettered ones, and, after a reopen at the ack
        # point, rows that wait for redelivery): never delivered as new, nor counted as such
        seqs = self._window.pending_from(self.cursor)
        if self._window.settled:
            seqs = sorted({*seqs, *self._window.settled})
        table, position, self._read_until = read_new_until(
            self.address, snapshot, self.cursor, max_messages, max_bytes,
            selector=self._selector_for(snapshot.schema), skip=seqs, consumer=self.name,
            lost=self.lost_in)
        return table, position, snapshot.version

    def batches(self, max_messages: int = 1000, max_bytes: int = 16 << 20) -> Iterator[pa.Table]:
        """:meth:`receive` until nothing (matching) is left; acknowledging stays the caller's::

            for batch in consumer.batches(max_messages=10_000):
                process(batch)
                consumer.ack(batch)
        """
        while True:
            batch = self.receive(max_messages, max_bytes)
            if batch.num_rows == 0:
                return
            yield batch

    def __iter__(self) -> Iterator[pa.Table]:
        """``for batch in consumer``: :meth:`batches` with the default sizes."""
        return self.batches()

    def messages(self, *, timeout_ms: float | None = None) -> Iterator[dict[str, Any]]:
        """Messages one at a time, as dicts of their columns with ``_seq``, ``_timestamp`` and
        ``_delivery_count``::

            for msg in consumer.messages(timeout_ms=5000):   # stops after 5 s without one
                handle(msg)
                consumer.ack(msg["_seq"], flush=False)        # or consumer.ack() per batch

        ``timeout_ms``: how long to wait for the next message; ``None`` (the default) waits as
        long as it takes, ``0`` stops when none is available. ``ack()`` acknowledges what the
        loop has seen (the cursor is just after the message last yielded, and a message
        delivered again is settled on its own), so leaving the loop early gives nothing away.
        """
        while True:
            table = self.receive(1, timeout_ms=timeout_ms)
            if table.num_rows == 0:
                return
            yield table.to_pylist()[0]

    @_serialised
    def ack(self, batch: pa.Table | int | None = None, *, flush: bool = True) -> None:
        """Acknowledge messages: everything received so far (no argument), everything up to
        and including a received table (and the non-matching messages skipped before it), or
        up to and including a ``_seq``. A part of a received table (a slice) acknowledges up
        to its own last row. The watermark never moves backwards (see :meth:`seek`).

        What is settled is what this handle handed out: with no argument, every message it
        returned and that is not settled yet, messages delivered again after a :meth:`nack`
        among them; a message nacked and not delivered again since (its ``delay_ms`` has not
        passed, or it has not been received yet) is never settled by an ``ack``, which
        leaves it to be delivered again. A consumer opened again (after :meth:`close`, or a
        crash) delivers the nacked messages it kept above its watermark first, as they come
        due, then the other unacknowledged ones again from its watermark: acknowledging one
        of the first (by table, by ``_seq`` or with no argument) settles it and the messages
        this handle handed out below it, never those below it that it has not delivered again
        yet. A ``_seq`` or table past everything received otherwise skips: the cursor reads on
        after it.

        ``flush=False`` defers writing the watermark: it moves in memory at once (``position``)
        and is written by the next flushing ack, :meth:`flush`, :meth:`close`, the process's
        exit, or ``ack_flush_ms`` after the oldest deferred ack, whichever comes first. A crash
        (SIGKILL, power loss) before then delivers the messages acknowledged since the last
        write again: at-least-once, like JMS's ``DUPS_OK_ACKNOWLEDGE``. Nothing is lost either
        way. Cleanup may run after a write (at most every ``cleanup_interval_ms``).

        Only the consumer's owner acknowledges: a handle that has not received yet takes the
        ownership first (as its first ``receive`` would, waiting up to ``wait_ms``). Raises
        :class:`ConsumerInUseError` when another process owns the consumer, or when this
        process owned it and lost it (it stalled past the lease and another process took the
        consumer over): its acknowledgements would move the other owner's watermark.
        """
        self._check_open()
        self._own()
        window = self._window
        if batch is None:
            new = self.cursor
        elif isinstance(batch, int) and not isinstance(batch, bool):
            new = batch + 1
        elif isinstance(batch, pa.Table):
            meta = batch.schema.metadata or {}
            rows = batch.num_rows
            if POSITION_KEY in meta and (not rows or batch is self._last_table or meta.get(
                    LAST_KEY) == str(batch.column(SEQ)[rows - 1].as_py()).encode()):
                new = int(meta[POSITION_KEY])
            elif rows:
                import pyarrow.compute as pc

                new = int(pc.max(batch.column(SEQ)).as_py()) + 1
            else:
                new = self.position
        else:
            raise TypeError(f"ack() takes a received table, a _seq or nothing, not "
                            f"{type(batch).__name__}")
        # rows handed out again above the cursor (a consumer reopened at its ack point hands
        # out the rows its window kept first): settled one by one, never the rows below them,
        # which it has not handed out again yet
        again: list[int] = []
        if batch is None:
            again = list(window.out)
        elif new > self.cursor and self._again_above and self._of_window(batch):
            again = [s for s in window.out if s < new]
            new = self.cursor
        if new > self.cursor:  # acknowledged past what was received: read on from there
            self.cursor = new
            self._forget_ahead()
        if window.settle(new):
            self._window_dirty = True
        if again and window.settle_out(again):
            self._window_dirty = True
        if self.cursor < window.ack_point:  # the ack point passed rows settled one by one
            self.cursor = window.ack_point
            self._forget_ahead()
        self.position = window.watermark
        if self.position == self.flushed and not self._window_dirty:
            return
        if not flush and self.ack_flush_ms > 0:
            now = time.monotonic()
            if self._deferred_since is None:
                self._deferred_since = now
                _FLUSHER.schedule(self, now + self.ack_flush_ms / 1000)
                return
            if now - self._deferred_since < self.ack_flush_ms / 1000:
                return
        self._persist()
        self.address.maybe_cleanup()

    @_serialised
    def _settle_below(self, end: int) -> None:
        """Settle every row below ``end``, the rows waiting for redelivery there included, and
        acknowledge up to it as :meth:`ack` of ``end - 1`` does: a reader of the whole range
        delivered them (the Spark source's commit, ``spark/_source.py``). A dead-letter move a
        crash stopped is finished first, as the next :meth:`receive` would finish it."""
        self._check_open()
        self._own()
        if self._window.moving is not None:
            self._finish_move()
        if self._window.settle_below(end):
            self._window_dirty = True
        self.ack(end - 1)

    @_serialised
    def _unsettled_in(self, begin: int, end: int) -> list[tuple[int, int]]:
        """The runs of ``[begin, end)`` that are not settled (``DeliveryWindow.unsettled``):
        what the Spark source reads of a batch, without the rows a Python client of the
        consumer acknowledged above its watermark."""
        return self._window.unsettled(begin, end)

    def _of_window(self, batch: pa.Table | int) -> bool:
        """Whether ``batch`` (acknowledged past the cursor) holds a row this handle handed
        out again above its cursor (and maybe nacked again since), rather than rows it has
        yet to read (an ack of those skips them: the cursor reads on after them)."""
        above = self._again_above = {s for s in self._again_above if s >= self.cursor}
        if not above:
            return False
        if isinstance(batch, int):
            return batch in above
        return bool(batch.num_rows) and not above.isdisjoint(batch.column(SEQ).to_pylist())

    @_serialised
    def nack(self, batch: pa.Table | int, *, delay_ms: int | None = None) -> None:
        """Give messages back: they are delivered again once ``delay_ms`` passed, before
        newer messages; the others keep flowing meanwhile. Written before it returns.

        ``batch``: a received table (its every row) or one ``_seq``. ``delay_ms`` (default:
        the address's ``redelivery_delay_ms`` x ``redelivery_delay_multiplier`` ** (deliveries
        - 1), at most ``max_redelivery_delay_ms``, as Artemis) wins over the settings. A row
        already waiting for redelivery stays as it is. Later cumulative acknowledgements
        (:meth:`ack`) do not settle a nacked row until it was delivered again.

        A row delivered ``max_delivery_attempts`` times (an address setting; unset: no limit)
        is not delivered again: it goes to the address's ``dead_letter_address`` (created on
        first use; see ``_ops/dead_letter.py`` for its columns), or is dropped with a warning
        without one, and counts as settled. The move is written before it is made, and a
        crash half-way is finished by the next ``receive``: never lost, never stored twice.

        Raises
        ------
        InvalidOptionError
            A row was not delivered yet, or is already acknowledged, or ``delay_ms < 0``.
        """
        self._check_open()
        self._own()  # another owner's window is not ours to change
        if delay_ms is not None and (isinstance(delay_ms, bool) or delay_ms < 0):
            raise InvalidOptionError(f"delay_ms must be >= 0 or None, not {delay_ms!r}")
        if isinstance(batch, int) and not isinstance(batch, bool):
            seqs = [batch]
        elif isinstance(batch, pa.Table):
            seqs = batch.column(SEQ).to_pylist() if batch.num_rows else []
        else:
            raise TypeError(f"nack() takes a received table or a _seq, not "
                            f"{type(batch).__name__}")
        window = self._window
        # every row is checked before any is nacked: a refused call changes nothing
        todo: list[tuple[int, int]] = []  # (_seq, its delivery count)
        for seq in seqs:
            if seq in window.out:
                todo.append((seq, window.out[seq]))
            elif seq in window.pending or (window.moving and seq in window.moving.rows):
                continue  # waiting for redelivery, or being dead-lettered
            elif seq in window.settled:
                raise InvalidOptionError(
                    f"cannot nack _seq {seq} of consumer {self.name}: it is settled already "
                    "(dead-lettered, or acknowledged after it was delivered again)")
            elif seq >= self.cursor:
                raise InvalidOptionError(
                    f"cannot nack _seq {seq} of consumer {self.name}: it was not delivered "
                    f"yet (the consumer has received up to _seq {self.cursor - 1})")
            elif seq < window.ack_point:
                raise InvalidOptionError(
                    f"cannot nack _seq {seq} of consumer {self.name}: it is already "
                    f"acknowledged (every message below _seq {window.ack_point} that was not "
                    "nacked is)")
            else:
                todo.append((seq, 1))
        if self.selector_text:
            self._refuse_skipped([seq for seq, count in todo if count == 1])
        settings = self.address.delivery_settings()
        attempts = settings.max_delivery_attempts
        now_ms = int(time.time() * 1000)
        dead: dict[int, int] = {}
        for seq, count in todo:
            if 0 < attempts <= count:
                dead[seq] = count
                continue
            delay = delay_ms if delay_ms is not None else redelivery_delay_ms(
                count, settings.redelivery_delay_ms, settings.redelivery_delay_multiplier,
                settings.max_redelivery_delay_ms)
            window.nack(seq, count, now_ms + int(delay))
            self._window_dirty = True
        if dead:
            window.begin_move(dead, settings.dead_letter_address,
                              f"max_delivery_attempts ({attempts}) reached")
            self._window_dirty = True
        if self._window_dirty:
            self.position = window.watermark
            self._persist()  # a move's intent is durable before its dead letters are sent
        if dead:
            self._finish_move()

    def _finish_move(self) -> None:
        """Send the dead letters of the window's move (begun by :meth:`nack`, or by a process
        that died before finishing it) under the move's transaction key, then settle its rows
        (see ``_ops/dead_letter.py``). Without a dead-letter address the rows are dropped, as
        Artemis drops them, with a warning."""
        move = self._window.moving
        assert move is not None
        seqs = sorted(move.rows)
        text = seq_ranges_text(_runs(seqs))
        if move.target is None:
            log.warning("consumer %s of %s: messages _seq %s are dropped: %s and the address has "
                        "no dead_letter_address", self.name, self.address.name, text,
                        move.reason)
        else:
            rows = self._rows(seqs)
            if rows.num_rows < len(seqs):
                gone = sorted(set(seqs) - set(rows.column(SEQ).to_pylist()))
                log.warning("consumer %s of %s: messages _seq %s to be dead-lettered are lost "
                            "(their pages were removed by retention, or damaged and removed by "
                            "repair)", self.name, self.address.name, seq_ranges_text(_runs(gone)))
            if rows.num_rows:
                self.address.send_dead_letters(
                    move.target,
                    dead_letter.letters(self.address.name, self.name, rows, move.rows,
                                        move.reason),
                    dead_letter.move_key(self.address.name, self.name, move.number))
            log.info("consumer %s of %s: messages _seq %s moved to dead-letter address %s: %s",
                     self.name, self.address.name, text, move.target, move.reason)
        self._window.finish_move()
        self._window_dirty = True
        self.position = self._window.watermark
        if self.cursor < self._window.ack_point:  # reopened at the move's first row
            self.cursor = self._window.ack_point
            self._forget_ahead()
        self._persist()

    def _refuse_skipped(self, seqs: list[int]) -> None:
        """Raise :class:`InvalidOptionError` when the selector does not match one of ``seqs``
        (first deliveries, below the cursor): the consumer skipped it, never delivered it, and
        nacking it would deliver a row its selector does not match."""
        if not seqs:
            return
        snapshot = self.address.snapshot()
        selector = self._selector_for(snapshot.schema)
        matched: set[int] = set()
        for first, end in _runs(seqs):
            for batch, _ in snapshot.messages(first, end, selector=selector,
                                              cache=self.address.read_cache(),
                                              fail_on_data_loss=False):
                if batch is not None and batch.num_rows:
                    matched.update(batch.column(SEQ).to_pylist())
        skipped = sorted(set(seqs) - matched)
        if skipped:
            raise InvalidOptionError(
                f"cannot nack _seq {skipped[0]} of consumer {self.name}: it was not delivered "
                f"(its selector {self.selector_text!r} does not match it)")

    @_serialised
    def flush(self) -> None:
        """Write deferred acknowledgements (see :meth:`ack`) now; a no-op without any."""
        if self.position != self.flushed or self._window_dirty:
            self._persist()
            self.address.maybe_cleanup()

    def close(self) -> None:
        """Write deferred acknowledgements; the consumer then refuses to receive or acknowledge
        (its state stays: open it again to go on). Also ``with address.consumer(...) as c:``."""
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._closed = True
                self._forget_ahead()
                if self._lease is not None:
                    self._lease = None
                    if self._give_back is not None:  # else adopted: the query's to release
                        self._give_back.detach()
                        OWNERS.give_back(self.path)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_serialised
    def seek(self, start: Any) -> None:
        """Move the watermark and cursor (also back) to ``earliest``, ``latest``, a ``_seq``,
        or a time (a ``datetime``: the first message committed at or after it; naive means
        UTC). Takes the consumer's ownership first, as :meth:`ack` does."""
        self._check_open()
        self._own()
        self.position = resolve_start(self.address, start)
        self.cursor = self.position
        self._again_above.clear()
        self._forget_ahead()
        # rows waiting for redelivery and rows settled out of order are forgotten: the window
        # goes before the watermark moves (a window left over a lower watermark would hide the
        # rows above it)
        self._window = self._window.abandon(self.position)  # the counters stay
        self._window_dirty = False
        self.address.save_consumer_window(
            self.name, self._window.record(self.position) if self._window.in_use else None)
        self._window_on_disk = self._window.in_use
        self.flushed = -1  # the watermark is written even when it did not move
        self._persist()

    def backlog(self) -> tuple[int, int]:
        """``(messages, bytes)`` retained at or after this consumer's watermark (selector not
        applied)."""
        return self.address.backlog(self.position)


def rows_of(address: ConsumerAddress, snapshot: Snapshot, seqs: list[int],
            ttl_now: int | None = None) -> pa.Table:
    """The rows of these ``_seq`` values that ``snapshot`` still holds, in ``_seq`` order, with
    the system columns (no selector: rows read again matched when first delivered);
    ``ttl_now``: without those whose ``ttl_ms`` expired by then (epoch microseconds)."""
    return _rows_with_ttl_horizon(address, snapshot, seqs, ttl_now)[0]


def rows_of_until(address: ConsumerAddress, snapshot: Snapshot, seqs: list[int],
                  ttl_now: int | None = None) -> tuple[pa.Table, int | None]:
    """:func:`rows_of`, and until when none of them expires by ``ttl_ms`` (with ``ttl_now``)
    or ``expiry_delay_ms`` (as :func:`read_new_until`)."""
    table, until = _rows_with_ttl_horizon(address, snapshot, seqs, ttl_now)
    return table, _delay_horizon(address, table, until)


def _rows_with_ttl_horizon(address: ConsumerAddress, snapshot: Snapshot, seqs: list[int],
                           ttl_now: int | None) -> tuple[pa.Table, int | None]:
    """:func:`rows_of` and the earliest ``ttl_ms`` deadline among them (the scans'
    ``ttl_horizon``; ``None`` without one)."""
    full = with_system_schema(snapshot.schema)
    cache = address.read_cache()
    batches: list[pa.RecordBatch] = []
    until = None
    for first, end in _runs(seqs):
        scan = snapshot.messages(first, end, cache=cache, fail_on_data_loss=False,
                                 ttl_now=ttl_now)
        for batch, _ in scan:
            if batch is not None and batch.num_rows:
                batches.append(batch)
        first_ttl = getattr(scan, "ttl_horizon", None)
        if first_ttl is not None and (until is None or first_ttl < until):
            until = first_ttl
    table = pa.Table.from_batches(batches, schema=full) if batches else full.empty_table()
    return table, until


def _delay_horizon(address: ConsumerAddress, table: pa.Table, until: int | None) -> int | None:
    """``until`` (epoch microseconds), or earlier if the address's ``expiry_delay_ms`` ends
    sooner for the oldest message of ``table``."""
    settings = address.delivery_settings()
    if settings.expiry_delay_ms <= 0 or not table.num_rows:
        return until
    import pyarrow.compute as pc  # only with expiry_delay_ms: a plain read loads none

    oldest = pc.min(table.column(TIMESTAMP)).cast(pa.int64()).as_py()
    ends = oldest + settings.expiry_delay_ms * 1000
    return ends if until is None else min(until, ends)


def read_new(address: ConsumerAddress, snapshot: Snapshot, start: int, max_messages: int,
             max_bytes: int, *, selector: Selector | None, skip: list[int], consumer: str,
             lost: Callable[[int, int], list[tuple[int, int, str]]]) -> tuple[pa.Table, int]:
    """Messages of ``snapshot`` from ``start`` that ``selector`` matches, not expired, not in
    ``skip``: up to ``max_messages`` (and about ``max_bytes``; one at least), as first
    deliveries (``_delivery_count`` 1), and the position after them (past the messages
    examined and not matched). Ranges lost to retention or repair, and those ``lost`` says the
    consumer lost, are logged as they are passed."""
    table, position, _ = read_new_until(address, snapshot, start, max_messages, max_bytes,
                                        selector=selector, skip=skip, consumer=consumer,
                                        lost=lost)
    return table, position


def read_new_until(address: ConsumerAddress, snapshot: Snapshot, start: int,
                   max_messages: int, max_bytes: int, *, selector: Selector | None,
                   skip: list[int], consumer: str,
                   lost: Callable[[int, int], list[tuple[int, int, str]]]
                   ) -> tuple[pa.Table, int, int | None]:
    """:func:`read_new`, and until when (epoch microseconds) none of the messages returned
    expires (by ``ttl_ms`` or ``expiry_delay_ms``; ``None``: never): a read-ahead kept past
    it is read again, so that a message is never handed out after it expired."""
    full = with_system_schema(snapshot.schema)
    cache = address.read_cache()
    batches: list[pa.RecordBatch] = []
    count = 0
    size = 0
    position = start
    settings = address.delivery_settings()
    expire_before = settings.expire_before()
    skipped = pa.array(skip, pa.int64()) if skip else None
    scan = snapshot.messages(start, selector=selector, cache=cache, ttl_now=_now_us())
    for batch, after in scan:
        if batch is not None and expire_before is not None:
            batch = unexpired(batch, expire_before)  # never delivered once expired
        if skipped is not None and batch is not None and batch.num_rows:
            batch = _without(batch, skipped)
        if batch is None or batch.num_rows == 0:
            position = after
            continue
        avg = max(1, batch.nbytes // batch.num_rows)
        take = min(batch.num_rows, max_messages - count, (max_bytes - size) // avg)
        if not batches:
            take = max(take, 1)  # one message always goes, however large
        if take < batch.num_rows:
            if take > 0:
                part = batch.slice(0, take)
                batches.append(part)
                count += take
                position = part.column(SEQ)[take - 1].as_py() + 1
            break
        batches.append(batch)
        count += batch.num_rows
        size += batch.nbytes
        position = after
        if count >= max_messages or size >= max_bytes:
            break
    else:
        # everything up to the log's end was examined (removed ranges have no pages)
        position = max(position, snapshot.end)
    for a, b in snapshot.lost_in(start, position):
        log.warning("consumer %s of %s: messages _seq %d..%d are lost (%s); skipping them",
                    consumer, address.name, a, b - 1,
                    "retention (retentionMs / retentionBytes) removed them before this "
                    "consumer read them" if not subtract_ranges([(a, b)], snapshot.retention)
                    else "their pages were damaged and removed by repair")
    for a, b, why in lost(start, position):
        log.warning("consumer %s of %s: messages _seq %d..%d are lost to this consumer "
                    "(%s; cleanup had removed them as unmatched by the old selector); "
                    "skipping them", consumer, address.name, a, b - 1, why)
    table = pa.Table.from_batches(batches, schema=full) if batches else full.empty_table()
    ones = _int32s(_ONE * table.num_rows)  # first deliveries
    until = _delay_horizon(address, table, getattr(scan, "ttl_horizon", None))
    return table.append_column(DELIVERY_COUNT_FIELD, ones), position, until


#: ``_next``'s version when ``max_in_flight`` stops new messages, and how often a waiting
#: ``receive`` looks again then.
_BLOCKED = -2
_BLOCKED_POLL_S = 0.01


_ONE = struct.pack("<i", 1)


def _status_of(handle: weakref.ref[Consumer]) -> Callable[[], dict[str, Any]]:
    """What the owner's lease claims say of the consumer (``ConsumerLease.report``): its
    messages in flight, as the handle that last took the lease sees them (a handle of the
    process that was collected reports nothing)."""
    def status() -> dict[str, Any]:
        consumer = handle()
        if consumer is None:
            return {}
        cursor = consumer.cursor
        return {"cursor": cursor, "in_flight": consumer._window.in_flight(cursor)}
    return status


def _int32s(packed: bytes) -> pa.Array:
    """Little-endian int32 values as an Arrow array (from buffers: ``pa.array`` of numbers
    imports pandas, which the read path does not need)."""
    return pa.Array.from_buffers(pa.int32(), len(packed) // 4, [None, pa.py_buffer(packed)])


def _delivered_schema(schema: pa.Schema | None) -> pa.Schema:
    """What ``receive`` returns: the address's columns, the system columns, the delivery
    count."""
    return with_system_schema(schema).append(DELIVERY_COUNT_FIELD)


def _runs(seqs: list[int]) -> list[tuple[int, int]]:
    """Sorted ``_seq`` values as ``[first, end)`` runs."""
    runs: list[tuple[int, int]] = []
    for s in sorted(seqs):
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return runs


def _without(batch: pa.RecordBatch, seqs: pa.Array) -> pa.RecordBatch:
    """``batch`` without the rows of these ``_seq`` values."""
    import pyarrow.compute as pc  # only consumers with a window in use get here

    column = batch.column(batch.schema.get_field_index(SEQ))
    return batch.filter(pc.invert(pc.is_in(column, value_set=seqs)))


def _with_position(table: pa.Table, position: int, last: int | None = None) -> pa.Table:
    """``table`` labelled with the position after it (``ack(table)`` goes there, past the
    non-matching messages skipped after its last row) and its last row's ``_seq`` (``last``,
    when the caller knows it), which tells the table from a part of it."""
    meta = {POSITION_KEY: str(position).encode()}
    if table.num_rows:
        if last is None:
            last = table.column(SEQ)[table.num_rows - 1].as_py()
        meta[LAST_KEY] = str(last).encode()
    return table.replace_schema_metadata(meta)


class _AckFlusher:
    """Writes deferred acknowledgements that are due: one daemon thread per process, started
    by the first deferred ack. It holds each consumer with unwritten acks until it wrote them
    (a consumer dropped by its owner still gets its acks written)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, Consumer]] = {}
        self._thread: threading.Thread | None = None

    def schedule(self, consumer: Consumer, due: float) -> None:
        with self._cond:
            known = self._due.get(id(consumer))
            if known is not None and known[0] <= due:
                return
            self._due[id(consumer)] = (due, consumer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dq-ack-flusher",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._cond.wait()
                now = time.monotonic()
                first = min(due for due, _ in self._due.values())
                if first > now:
                    self._cond.wait(first - now)
                    continue
                ready = [c for due, c in self._due.values() if due <= now]
                for consumer in ready:
                    del self._due[id(consumer)]
            for consumer in ready:
                _flush_quietly(consumer)

    def flush_all(self) -> None:
        with self._cond:
            pending = [c for _, c in self._due.values()]
            self._due.clear()
        for consumer in pending:
            _flush_quietly(consumer)


def _flush_quietly(consumer: Consumer) -> None:
    try:
        consumer.flush()
    except Exception as exc:  # a deleted consumer, a storage error: the acks stay unwritten
        # names no position: a shared consumer reads its position from the store that just
        # failed, and a warning that raised ended the flusher's thread (and every later flush)
        log.warning("consumer %s of %s: could not write deferred acknowledgements (%s); they "
                    "will be delivered again", consumer.name, consumer.address.name, exc)


_FLUSHER = _AckFlusher()


def _after_fork_in_child() -> None:
    # the parent's deferred acks are the parent's to write; the child starts without a thread
    global _FLUSHER
    _FLUSHER = _AckFlusher()


atexit.register(lambda: _FLUSHER.flush_all())
os.register_at_fork(after_in_child=_after_fork_in_child)


def _now_us() -> int:
    """The time ``ttl_ms`` deadlines are judged at (epoch microseconds)."""
    return int(time.time() * 1e6)
