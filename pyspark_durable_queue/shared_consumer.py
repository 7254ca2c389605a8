"""Shared consumers: one subscription, many workers, a lease per message.

``address.consumer("pool", shared=True, lease_ms=30_000)`` returns a :class:`SharedConsumer`.
Any number of handles of it, in any number of processes (and hosts, on object stores), receive
disjoint messages: a handle claims a batch of rows (``prefetch``) under a lease, hands them out
from memory, and settles exactly the rows it is given back (``ack``), gives them back
(``nack``), or extends their lease (``renew``). A row whose lease runs out, or whose holder is a
dead process of this host, is delivered again to whichever handle claims next, its
``_delivery_count`` one higher; ``max_delivery_attempts`` and the dead-letter address apply as
for an exclusive consumer. The state and how it is written: ``_ops/shared.py``.

Guarantees: at-least-once (a row is settled only by an ``ack`` written before its lease
passed to another handle); no order across the handles of a pool; each ``receive`` returns its
rows in ``_seq`` order, rows delivered again first.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from ._format.schema import DELIVERY_COUNT_FIELD, SEQ, unexpired
from ._log.commit_log import seq_ranges_text
from ._ops import dead_letter
from ._ops.shared import SharedState, SharedStore, now_ms
from ._ops.window import redelivery_delay_ms
from .consumer import (
    ConsumerAddress,
    SelectingHandle,
    _delivered_schema,
    _int32s,
    _now_us,
    _runs,
    _with_position,
    open_state,
    read_new_until,
    rows_of,
    rows_of_until,
)
from .errors import (
    ConsumerClosedError,
    InvalidOptionError,
    LeaseExpiredError,
)

if TYPE_CHECKING:
    from ._read.scan import Snapshot
    from .selector import Selector

__all__ = ["LEASE_MS", "PREFETCH", "SharedAddress", "SharedConsumer"]

log = logging.getLogger(__name__)

#: Default lease of a received row (SQS's default visibility timeout).
LEASE_MS = 30_000
#: Default number of rows a handle claims at once.
PREFETCH = 100
#: How often at most a handle writes the consumer's watermark file for cleanup (it trails the
#: state: a lower watermark keeps more pages, never fewer).
_WATERMARK_EVERY_S = 1.0
#: A prefetched row whose lease has less than this left (a quarter of a shorter lease) is not
#: handed out (it would expire in the worker's hands): it is given back to whoever claims next.
_MARGIN_MS = 200


class SharedAddress(ConsumerAddress, Protocol):
    """What a shared consumer uses of its address: a consumer's surface and its state chain."""

    def shared_chain(self, name: str, start: int) -> SharedStore: ...


class SharedConsumer(SelectingHandle):
    """A handle of a shared consumer (see the module docstring). Obtain one with
    ``address.consumer(name, shared=True)``.

    ``lease_ms``: how long a received row stays this handle's before it is delivered to another
    (:meth:`renew` extends it). ``prefetch``: how many rows one claim takes (one write to the
    store per claim; unreturned rows go back on :meth:`close`). Thread-safe: one lock
    serialises the handle's calls.
    """

    shared = True

    def __init__(self, address: SharedAddress, state: dict[str, Any], *,
                 lease_ms: int = LEASE_MS, prefetch: int = PREFETCH,
                 ack_flush_ms: int = 1000) -> None:
        for what, value, low in (("lease_ms", lease_ms, 1), ("prefetch", prefetch, 1),
                                 ("ack_flush_ms", ack_flush_ms, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidOptionError(f"{what} must be an integer >= {low}, not {value!r}")
        self.address = address
        self.name: str = state["name"]
        self._state = state
        self.lease_ms = lease_ms
        self.prefetch = prefetch
        self.ack_flush_ms = ack_flush_ms
        #: this handle's id in the consumer's state (its leases name it)
        self.holder = uuid.uuid4().hex[:16]
        self._chain = address.shared_chain(self.name, int(state["position"]))
        self._lock = threading.RLock()
        self._closed = False
        #: rows claimed and not handed out yet
        self._ahead: _Prefetched | None = None
        #: claimed rows whose lease ran out before they were handed out: given back by the
        #: next claim with their delivery count unchanged (they were not delivered)
        self._lapsed: set[int] = set()
        #: rows handed out and not settled by this handle: {_seq: delivery count}
        self._out: dict[int, int] = {}
        #: rows handed out whose lease a renew() found passed to another handle: out of
        #: ``_out`` (renew() and ack() of everything leave them alone), and an ack, nack or
        #: renew naming one raises LeaseExpiredError
        self._lost: set[int] = set()
        #: rows handed out whose lease ran out and that this handle claimed again (prefetched,
        #: not handed out again yet): an ack or nack of the first delivery settles the row, so
        #: it leaves the prefetched rows too (else it was handed out again after its ack)
        self._twice: set[int] = set()
        #: rows acknowledged with flush=False, written by the next flush
        self._deferred: set[int] = set()
        self._deferred_since: float | None = None
        self._wm_written = int(state["position"])
        self._wm_at = 0.0
        self._selector: Selector | None = None
        #: new rows read from the log before a claim's lock (see ``_read_candidates``)
        self._candidates: _Candidates | None = None
        self._selector_schema: pa.Schema | None = None
        #: notes the handle when it is collected without close(): the next claim of a handle
        #: of the process gives its rows back (a finalizer runs in any thread: no I/O there)
        self._finalizer = weakref.finalize(self, _COLLECTED.append,
                                           (self._chain.folder, self.holder))
        self._finalizer.atexit = False
        _OPEN.add(self)

    def __repr__(self) -> str:
        return (f"SharedConsumer({self.address.name!r}, {self.name!r}, holder={self.holder!r}, "
                f"out={len(self._out)})")

    # -- what it is -----------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """The consumer's watermark as this handle last saw it: every row below is settled."""
        return self.state().ack_point

    def state(self) -> SharedState:
        """The consumer's shared state as it is now (rows leased, pending, its holders)."""
        # under the handle's lock: the chain (a log's offset and open file) is not thread-safe,
        # and a read racing a change of another thread moved the log's offset twice
        with self._lock:
            return self._chain.current()

    def _check_open(self) -> None:
        if self._closed:
            raise ConsumerClosedError(f"consumer {self.name} of {self.address.name} is closed")

    # -- receiving ------------------------------------------------------------------------------
    def receive(self, max_messages: int = 1000, max_bytes: int = 16 << 20, *,
                timeout_ms: float | None = 0) -> pa.Table:
        """The next messages for this handle, leased to it for ``lease_ms``: rows due for
        redelivery (nacked, or whose lease ran out) first, then new ones, each table in
        ``_seq`` order, with ``_seq``, ``_timestamp`` and ``_delivery_count``. ``timeout_ms``
        as for :meth:`Consumer.receive` (``0``: at once, ``None``: as long as it takes)."""
        if max_messages < 1 or max_bytes < 1:
            raise InvalidOptionError("max_messages and max_bytes must be positive")
        if timeout_ms is not None and timeout_ms < 0:
            raise InvalidOptionError(f"timeout_ms must be >= 0 or None, not {timeout_ms}")
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            with self._lock:
                self._check_open()
                table = self._hand_out(max_messages, max_bytes)
                have = table.num_rows
                if have >= max_messages or (have and table.nbytes >= max_bytes):
                    return table
                version, wake_ms = self._claim(max(max_messages - have, self.prefetch),
                                               max_bytes)
                more = self._hand_out(max_messages - have, max_bytes - table.nbytes)
                if more.num_rows:
                    table = pa.concat_tables([table, more]) if have else more
            if table.num_rows or timeout_ms == 0:
                return table
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return table
            if wake_ms is not None:  # a row comes due, or a lease runs out
                until = wake_ms / 1000 - time.time()
                # due already and not claimed: a dead row waits for the dead-letter move in
                # flight (looked at again in 50 ms, not in a loop of claims)
                until = 0.05 if until <= 0 else until + 0.001
                left = until if left is None else min(left, until)
            self.address.wait_for_commit(version, left)

    def _hand_out(self, max_messages: int, max_bytes: int) -> pa.Table:
        """Up to ``max_messages`` claimed rows whose lease has time left, from memory."""
        ahead = self._ahead
        if ahead is None:
            return _delivered_schema(self.address.schema).empty_table()
        if ahead.until is not None and _now_us() >= ahead.until:
            # one of them expired since it was read: all go back, and the claim that takes
            # them again reads them again (settling the expired ones)
            self._lapsed.update(ahead.rest_seqs())
            self._ahead = None
            self._twice.clear()
            return _delivered_schema(self.address.schema).empty_table()
        now = now_ms()
        margin = min(_MARGIN_MS, self.lease_ms // 4)  # a short lease still hands rows out
        at, end, expires = ahead.at, len(ahead.seqs), ahead.expires
        first = at
        while at < end and expires[at] - now < margin:
            at += 1
        if at > first:  # ran out in memory: another handle may have them already
            self._lapsed.update(ahead.seqs[first:at])
        take = min(max_messages, end - at)
        if take and max_bytes < (end - at) * ahead.row_bytes:
            take = max(1, min(take, int(max_bytes // max(1.0, ahead.row_bytes))))
        part = ahead.table.slice(at, take)
        seqs = ahead.seqs[at:at + take]
        self._out.update(zip(seqs, ahead.counts[at:at + take], strict=True))
        ahead.at = at + take
        if ahead.at >= end:
            self._ahead = None
        if self._lost:
            self._lost.difference_update(seqs)
        if self._twice:
            self._twice.difference_update(seqs)
            if self._ahead is None:
                self._twice.clear()
        return _with_position(part, seqs[-1] + 1 if seqs else 0, seqs[-1] if seqs else None)

    def _claim(self, limit: int, max_bytes: int) -> tuple[int, int | None]:
        """Claim up to ``limit`` rows for this handle (one epoch of the state): rows due again
        first, then new rows from the cursor. Returns the log version the new rows were looked
        for in and when the next row becomes due otherwise."""
        settings = self.address.delivery_settings()
        attempts = settings.max_delivery_attempts
        room_total = int(settings.max_in_flight)
        snapshot = self.address.snapshot()
        selector = self._selector_for(snapshot.schema)

        # new rows are read before the lock (from the cursor as last seen, a few claims' worth
        # when other handles claim too), so that under it a claim only picks those still
        # past the cursor: reading under the lock made every other handle wait for the read
        if snapshot.schema is not None:
            self._read_candidates(snapshot, selector, limit, max_bytes)
        candidates = self._candidates
        collected = _collected_of(self._chain.folder)
        lapsed = set(self._lapsed)
        # deferred acks go with the claim (the same append): left leased until their flush,
        # a handle's acknowledged rows filled max_in_flight and receive() came back empty
        # with the backlog unclaimed
        deferred = self._deferred
        settled: list[int] = []

        def claim(state: SharedState) -> tuple[list[tuple[int, int]], pa.Table | None,
                                               int | None, dict[str, Any] | None, int]:
            now = now_ms()
            settled[:] = _settle(state, self.holder, deferred)
            # the lease starts now, after the wait for the lock, not when receive was called
            expires = now + self.lease_ms
            for holder in collected:
                give_back_rows(state, holder, set(), now)
            for seq in lapsed:  # still ours: given back uncounted (they were not delivered)
                held = state.leases.get(seq)
                if held is not None and held[0] == self.holder:
                    del state.leases[seq]
                    state.pending[seq] = (held[1] - 1, now)
            state.seen(self.holder, now)
            state.forget_holders(now)
            again = state.reclaimable(now, limit)
            dead = [(s, c) for s, c in again if 0 < attempts <= c]
            again = [(s, c + 1) for s, c in again if not 0 < attempts <= c]
            move = None
            if state.moving is not None:
                # one move at a time: a second would replace the one in flight, whose rows
                # are then settled unsent if its holder dies (or sent under a lower version
                # of the move key than the second's, which counts as a duplicate); dead rows
                # stay where they are (pending or expired leases) until it is finished
                if _abandoned(state, now):
                    move = dict(state.moving, holder=self.holder, expires=now + self.lease_ms)
                    state.moving = move
            elif dead:
                move = _begin_move(state, self.holder, dead, settings.dead_letter_address,
                                   f"max_delivery_attempts ({attempts}) reached", now,
                                   self.lease_ms)
            state.lease(self.holder, again, expires)
            state.count("redelivered", sum(1 for _, c in again if c > 1))
            new = until = None
            room = min(limit - len(again),
                       room_total - len(state.leases) - len(state.pending))
            if room > 0 and snapshot.schema is not None and state.cursor < snapshot.end:
                taken = None if candidates is None else candidates.take(state.cursor, room,
                                                                        max_bytes)
                if taken is None:  # the cursor passed what was read before the lock
                    taken = read_new_until(self.address, snapshot, state.cursor, room,
                                           max_bytes, selector=selector, skip=[],
                                           consumer=self.name, lost=_no_loss)
                new, position, until = taken
                seqs = new.column(SEQ).to_pylist()
                state.lease(self.holder, [(s, 1) for s in seqs], expires)
                state.count("delivered", len(seqs))
                state.cursor = max(state.cursor, position)
            elif snapshot.damage is not None and state.cursor >= snapshot.end:
                raise snapshot.damage
            return again, new, until, move, expires

        (again, new, until, move, expires), state = self._chain.update(claim)
        self._lapsed -= lapsed
        self._twice.update(s for s, _ in again if s in self._out or s in self._lost)
        if deferred:
            self._deferred = set()
            self._deferred_since = None
            if settled:
                self._log_lost(settled)
        self._after_change(state)
        if move is not None and move.get("holder") == self.holder:
            self._finish_move(move)
        parts = []
        if again:
            table, until_again = self._read_again(again, snapshot)
            parts.append(table)
            until = _earliest(until, until_again)
        if new is not None and new.num_rows:
            parts.append(new)
        if parts:
            table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            times = [expires] * table.num_rows
            if self._ahead is not None:
                table = pa.concat_tables([self._ahead.rest(), table])
                times = self._ahead.expires[self._ahead.at:] + times
                until = _earliest(until, self._ahead.until)
            self._ahead = _Prefetched(table, times, until)
        return snapshot.version, state.next_change_ms()

    def _read_candidates(self, snapshot: Snapshot, selector: Selector | None, limit: int,
                         max_bytes: int) -> None:
        """Make ``_candidates`` hold the new rows from the cursor (as the state says now,
        read without the lock) for this claim and the claims other handles make meanwhile:
        what it holds already past the cursor, and more read from the log when that is less
        than ``limit`` rows per handle the state knows."""
        state = self._chain.current()
        cursor = state.cursor
        if cursor >= snapshot.end:
            return
        want = limit * min(_CANDIDATE_HANDLES, max(1, len(state.holders)))
        have = self._candidates
        if have is not None and not have.usable(cursor, snapshot):
            have = self._candidates = None
        if have is not None and (have.left(cursor) >= want or have.end >= snapshot.end):
            return
        start = cursor if have is None else have.end
        table, position, until = read_new_until(self.address, snapshot, start, want, max_bytes,
                                                selector=selector, skip=[],
                                                consumer=self.name, lost=_no_loss)
        read = _Candidates(table, start, position, snapshot.schema, until)
        self._candidates = read if have is None else have.joined(cursor, read)

    def _read_again(self, rows: list[tuple[int, int]], snapshot: Snapshot
                    ) -> tuple[pa.Table, int | None]:
        """The rows claimed again, read by ``_seq``, with their delivery counts, and when the
        first of them expires (see :class:`_Prefetched`); rows that expired meanwhile, or whose
        pages are gone, are settled here."""
        counts = dict(rows)
        seqs = sorted(counts)
        # without the rows whose ttl_ms ended (as Consumer._redeliver): read without the TTL
        # again only to tell them from rows whose pages are gone, for the count
        table, until = rows_of_until(self.address, snapshot, seqs, ttl_now=_now_us())
        found = table.column(SEQ).to_pylist()
        if len(found) < len(seqs):
            missing = sorted(set(seqs) - set(found))
            held = rows_of(self.address, snapshot, missing).column(SEQ).to_pylist()
            found = sorted({*found, *held, *(s for s in missing
                                              if any(a <= s < b for a, b in snapshot.expired))})
        alive_table = unexpired(table, self.address.delivery_settings().expire_before())
        alive = alive_table.column(SEQ).to_pylist() if alive_table.num_rows < table.num_rows \
            else table.column(SEQ).to_pylist()
        table = alive_table
        gone = sorted(set(seqs) - set(alive))
        if gone:
            expired = len(found) - len(alive)
            again = sum(1 for s in gone if counts[s] > 1)  # counted as redelivered by the claim
            log.info("consumer %s of %s: messages _seq %s to be delivered again expired or were "
                     "removed; settling them", self.name, self.address.name,
                     seq_ranges_text(_runs(gone)))

            def settle(state: SharedState) -> None:
                for seq in gone:
                    held = state.leases.get(seq)
                    if held is not None and held[0] == self.holder:
                        del state.leases[seq]
                state.count("expired", expired)
                state.count("redelivered", -again)

            _, state = self._chain.update(settle)
            self._after_change(state)
        packed = [counts[s] for s in alive]
        return table.append_column(DELIVERY_COUNT_FIELD, _int32s(
            b"".join(c.to_bytes(4, "little") for c in packed))), until

    def messages(self, *, timeout_ms: float | None = None) -> Iterator[dict[str, Any]]:
        """Messages one at a time as dicts (see :meth:`Consumer.messages`); acknowledge each
        with ``ack(msg["_seq"])``."""
        while True:
            table = self.receive(1, timeout_ms=timeout_ms)
            if table.num_rows == 0:
                return
            yield table.to_pylist()[0]

    def batches(self, max_messages: int = 1000,
                max_bytes: int = 16 << 20) -> Iterator[pa.Table]:
        while True:
            batch = self.receive(max_messages, max_bytes)
            if batch.num_rows == 0:
                return
            yield batch

    def __iter__(self) -> Iterator[pa.Table]:
        return self.batches()

    # -- settling -------------------------------------------------------------------------------
    def _seqs(self, batch: pa.Table | int | Iterable[int] | None) -> list[int]:
        if batch is None:
            return sorted(self._out)
        if isinstance(batch, bool):
            raise TypeError("a _seq is an int, not a bool")
        if isinstance(batch, int):
            return [batch]
        if isinstance(batch, pa.Table):
            return batch.column(SEQ).to_pylist() if batch.num_rows else []
        if isinstance(batch, dict) and SEQ in batch:
            return [int(batch[SEQ])]
        try:
            return [int(s) for s in batch]
        except TypeError:
            raise TypeError(f"takes a received table, a _seq, _seq values or a message, not "
                            f"{type(batch).__name__}") from None

    def _check_mine(self, seqs: list[int], what: str) -> None:
        for seq in seqs:
            if seq not in self._out and seq not in self._lost:
                raise InvalidOptionError(
                    f"cannot {what} _seq {seq} of shared consumer {self.name}: this handle "
                    "does not hold it (it was not delivered to it, or it was settled already)")

    def _drop_ahead(self, seqs: list[int]) -> None:
        """Take rows acknowledged or given back out of the prefetched ones (rows claimed
        again by this handle while their first delivery was out: see ``_twice``)."""
        if not self._twice:
            return
        drop = self._twice.intersection(seqs)
        if not drop or self._ahead is None:
            return
        self._twice -= drop
        ahead = self._ahead
        keep = [s not in drop for s in ahead.rest_seqs()]
        if all(keep):
            return
        expires = [e for e, k in zip(ahead.expires[ahead.at:], keep, strict=True) if k]
        rest = ahead.rest().filter(pa.array(keep))
        self._ahead = _Prefetched(rest, expires, ahead.until) if rest.num_rows else None

    def ack(self, batch: pa.Table | int | Iterable[int] | None = None, *,
            flush: bool = True) -> None:
        """Settle exactly these rows (a received table, a ``_seq``, ``_seq`` values; nothing:
        every row this handle holds). Never cumulative.

        ``flush=False`` defers the write to the handle's next claim (the same append),
        flushing ack, :meth:`flush`, :meth:`close` or ``ack_flush_ms`` (at most half of
        ``lease_ms``) after the first deferred ack, whichever comes first; the rows stay
        leased meanwhile, so a lease that runs out first delivers them again
        (at-least-once).

        Raises :class:`LeaseExpiredError` when a row's lease passed to another handle (this
        one held it past ``lease_ms``): the other handle has it now.
        """
        with self._lock:
            self._check_open()
            seqs = self._seqs(batch)
            self._check_mine(seqs, "acknowledge")
            for seq in seqs:
                self._out.pop(seq, None)
                self._lost.discard(seq)
            self._deferred.update(seqs)
            self._drop_ahead(seqs)
            if not flush and self.ack_flush_ms > 0:
                # at most half a lease: deferred past the lease, every ack came too late
                wait_s = min(self.ack_flush_ms, self.lease_ms // 2) / 1000
                now = time.monotonic()
                if self._deferred_since is None:
                    self._deferred_since = now
                    _flusher().schedule(self, now + wait_s)
                if now - self._deferred_since < wait_s:
                    return
            self._write_acks(raise_lost=seqs)

    def _write_acks(self, raise_lost: Sequence[int] = ()) -> None:
        """Settle the deferred rows (one epoch); raise for those of ``raise_lost`` whose lease
        passed to another handle (the others are only logged: their ack was deferred)."""
        if not self._deferred:
            self._deferred_since = None
            return
        todo = self._deferred

        def settle(state: SharedState) -> list[int]:
            lost = _settle(state, self.holder, todo)
            state.seen(self.holder, now_ms())
            return lost

        lost, state = self._chain.update(settle)
        self._deferred = set()
        self._deferred_since = None
        self._after_change(state)
        self.address.maybe_cleanup()
        if lost:
            self._log_lost(lost, raise_lost)

    def _log_lost(self, lost: list[int], raise_lost: Sequence[int] = ()) -> None:
        """Say that acks of ``lost`` came too late: raise when one is of ``raise_lost`` (the
        rows of a flushing ack), log otherwise (their ack was deferred)."""
        message = (f"shared consumer {self.name} of {self.address.name}: the lease on "
                   f"_seq {seq_ranges_text(_runs(lost))} ran out before this handle "
                   f"acknowledged it (lease_ms={self.lease_ms}); another handle holds it "
                   "now, or did: it is delivered again")
        if set(lost) & set(raise_lost):
            raise LeaseExpiredError(message)
        log.warning(message)

    def flush(self) -> None:
        """Write deferred acknowledgements now."""
        with self._lock:
            if self._closed:  # close() wrote them and the watermark (the ack flusher calls
                return        # a closed handle at exit, when its consumer may be gone)
            self._write_acks()
            self._write_watermark(force=True)

    def nack(self, batch: pa.Table | int | Iterable[int], *,
             delay_ms: int | None = None) -> None:
        """Give rows back: delivered again (to any handle) once ``delay_ms`` passed (default:
        the address's redelivery delay with backoff, as :meth:`Consumer.nack`). A row
        delivered ``max_delivery_attempts`` times goes to the dead-letter address instead.
        Raises :class:`LeaseExpiredError` naming the rows whose lease passed to another
        handle, after giving the others back (as :meth:`ack` settles the others)."""
        if delay_ms is not None and (isinstance(delay_ms, bool) or delay_ms < 0):
            raise InvalidOptionError(f"delay_ms must be >= 0 or None, not {delay_ms!r}")
        with self._lock:
            self._check_open()
            seqs = self._seqs(batch)
            self._check_mine(seqs, "nack")
            settings = self.address.delivery_settings()
            attempts = settings.max_delivery_attempts

            def give_back(state: SharedState) -> tuple[list[int], dict[str, Any] | None]:
                now = now_ms()
                lost, dead = [], []
                for seq in seqs:
                    held = state.leases.get(seq)
                    if held is None or held[0] != self.holder:
                        lost.append(seq)
                        continue
                    count = held[1]
                    if 0 < attempts <= count:
                        dead.append((seq, count))
                        continue
                    delay = delay_ms if delay_ms is not None else redelivery_delay_ms(
                        count, settings.redelivery_delay_ms,
                        settings.redelivery_delay_multiplier, settings.max_redelivery_delay_ms)
                    del state.leases[seq]
                    state.pending[seq] = (count, now + int(delay))
                state.count("nacked", len(seqs) - len(dead) - len(lost))
                move = None
                if dead:
                    if state.moving is not None:  # one move at a time: these wait for it
                        for seq, count in dead:
                            del state.leases[seq]
                            state.pending[seq] = (count, now)
                    else:
                        move = _begin_move(state, self.holder, dead,
                                           settings.dead_letter_address,
                                           f"max_delivery_attempts ({attempts}) reached", now,
                                           self.lease_ms)
                return lost, move

            # the rows still held are given back, the lost ones forgotten (as ack does): a
            # lost row left in ``_out`` would make every later renew() and ack() raise
            (lost, move), state = self._chain.update(give_back)
            self._drop_ahead(seqs)
            for seq in seqs:
                self._out.pop(seq, None)
                self._lost.discard(seq)
            self._after_change(state)
            if move is not None:
                self._finish_move(move)
            if lost:
                raise LeaseExpiredError(
                    f"cannot nack _seq {seq_ranges_text(_runs(lost))} of shared consumer "
                    f"{self.name}: its lease ran out and passed to another handle (the other "
                    "rows were given back)")

    def renew(self, batch: pa.Table | int | Iterable[int] | None = None, *,
              lease_ms: int | None = None) -> None:
        """Extend the lease of these rows (nothing: every row this handle holds, prefetched
        ones too) to ``lease_ms`` from now (default: the handle's). For long jobs: renew
        before the lease runs out. Raises :class:`LeaseExpiredError` naming the rows whose
        lease passed to another handle, after renewing the others (the lost rows are this
        handle's no more; prefetched ones that were lost are dropped without a word)."""
        lease = self.lease_ms if lease_ms is None else lease_ms
        if isinstance(lease, bool) or not isinstance(lease, int) or lease < 1:
            raise InvalidOptionError(f"lease_ms must be an integer >= 1, not {lease_ms!r}")
        with self._lock:
            self._check_open()
            seqs = self._seqs(batch)
            ahead: list[int] = []
            if batch is None:
                if self._ahead is not None:
                    ahead = self._ahead.rest_seqs()
            else:
                self._check_mine(seqs, "renew")
            until = now_ms() + lease

            def extend(state: SharedState) -> tuple[list[int], set[int]]:
                lost = [s for s in seqs if state.leases.get(s, ("",))[0] != self.holder]
                gone = {s for s in ahead if state.leases.get(s, ("",))[0] != self.holder}
                for seq in (*seqs, *ahead):
                    held = state.leases.get(seq)
                    if held is not None and held[0] == self.holder:
                        state.leases[seq] = (self.holder, held[1], until)
                state.seen(self.holder, now_ms())
                return lost, gone

            # the rows still held are renewed; the lost ones leave ``_out`` for ``_lost`` (left
            # in ``_out``, a lost row made every later renew() raise and renew nothing), lost
            # prefetched ones are dropped: they were never handed out
            (lost, gone), _ = self._chain.update(extend)
            for seq in lost:
                if self._out.pop(seq, None) is not None:
                    self._lost.add(seq)
            if self._ahead is not None and batch is None:
                rest = self._ahead.rest()
                if gone:
                    rest = rest.filter(pa.array([s not in gone for s in ahead]))
                self._ahead = _Prefetched(rest, [until] * rest.num_rows, self._ahead.until) \
                    if rest.num_rows else None
            if lost:
                raise LeaseExpiredError(
                    f"cannot renew _seq {seq_ranges_text(_runs(lost))} of shared consumer "
                    f"{self.name}: its lease ran out and passed to another handle (the other "
                    "rows were renewed)")

    # -- dead letters ---------------------------------------------------------------------------
    def _finish_move(self, move: dict[str, Any]) -> None:
        """Send the move's dead letters under its transaction key, then settle its rows (as an
        exclusive consumer does: see ``Consumer._finish_move``)."""
        rows = {int(s): int(c) for s, c in move["rows"]}
        seqs = sorted(rows)
        text = seq_ranges_text(_runs(seqs))
        target = move["target"]
        if target is None:
            log.warning("consumer %s of %s: messages _seq %s are dropped: %s and the address has "
                        "no dead_letter_address", self.name, self.address.name, text,
                        move["reason"])
        else:
            table = rows_of(self.address, self.address.snapshot(), seqs)
            if table.num_rows:
                self.address.send_dead_letters(
                    target, dead_letter.letters(self.address.name, self.name, table, rows,
                                                move["reason"]),
                    dead_letter.move_key(self.address.name, self.name, move["number"]))
            log.info("consumer %s of %s: messages _seq %s moved to dead-letter address %s: %s",
                     self.name, self.address.name, text, target, move["reason"])

        def settle(state: SharedState) -> None:
            if state.moving is None or state.moving["number"] != move["number"]:
                return  # finished by another handle meanwhile
            state.moving = None
            state.count("dead_lettered" if target is not None else "dropped", len(seqs))

        _, state = self._chain.update(settle)
        self._after_change(state)

    # -- the watermark --------------------------------------------------------------------------
    def _after_change(self, state: SharedState) -> None:
        self._write_watermark(force=False, state=state)

    def _write_watermark(self, *, force: bool, state: SharedState | None = None) -> None:
        """Write the ack point to the consumer's watermark file (what cleanup reads), at most
        every ``_WATERMARK_EVERY_S`` unless forced."""
        now = time.monotonic()
        if not force and now - self._wm_at < _WATERMARK_EVERY_S:
            return
        self._wm_at = now
        point = (state or self._chain.current()).ack_point
        if point <= self._wm_written:
            return
        self._state = dict(self._state, position=point, updated=time.time())
        self.address.save_consumer_position(self.name, self._state)
        self._wm_written = point

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    def open(cls, address: SharedAddress, name: str, *, selector: str | None = None,
             start: Any = None, create: bool = True, lease_ms: int = LEASE_MS,
             prefetch: int = PREFETCH, ack_flush_ms: int = 1000) -> SharedConsumer:
        """Open (or create) the shared consumer ``name``; see :meth:`Address.consumer`.
        A ``selector`` other than the one it was created with is refused (the handles of a
        pool share one)."""
        state = open_state(address, name, selector=selector, start=start, create=create,
                           shared=True)
        if selector is not None and (selector or None) != state.get("selector"):
            raise InvalidOptionError(
                f"shared consumer {name!r} of {address.name!r} has selector "
                f"{state.get('selector')!r}, not {selector!r}: the handles of a shared "
                "consumer share its selector (use another consumer name)")
        return cls(address, state, lease_ms=lease_ms, prefetch=prefetch,
                   ack_flush_ms=ack_flush_ms)

    def close(self) -> None:
        """Write deferred acknowledgements and give back the rows this handle holds: those
        prefetched and not handed out (their delivery count unchanged) and those handed out and
        not settled (delivered again at once, as Artemis does when a consumer closes)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._write_acks()
                undelivered = self._ahead.rest_seqs() if self._ahead else []
                _give_back(self._chain, self.holder, {*undelivered, *self._lapsed})
                self._write_watermark(force=True)
            finally:
                self._closed = True
                self._ahead = None
                self._out = {}
                self._lost = set()
                self._lapsed = set()
                self._twice = set()
                self._finalizer.detach()

    def __enter__(self) -> SharedConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def delete(self) -> None:
        """Remove the consumer, its shared state with it."""
        with self._lock:
            self._deferred = set()
            self.address.delete_consumer_state(self.name)
            self._closed = True
            self._finalizer.detach()

    def backlog(self) -> tuple[int, int]:
        """``(messages, bytes)`` retained at or after the consumer's watermark."""
        return self.address.backlog(self.position)


def _begin_move(state: SharedState, holder: str, rows: list[tuple[int, int]],
                target: str | None, reason: str, now: int, lease_ms: int) -> dict[str, Any]:
    """Take ``rows`` out of the leases into a dead-letter move (the state's ``moving``): only
    when no other move is in flight (one at a time: see ``claim`` in :meth:`_claim`)."""
    assert state.moving is None, state.moving
    number = state.counters.get("moves", 0) + 1
    state.counters["moves"] = number
    for seq, _ in rows:
        state.leases.pop(seq, None)
        state.pending.pop(seq, None)
    move = {"number": number, "target": target, "reason": reason,
            "rows": [[s, c] for s, c in sorted(rows)], "holder": holder,
            "expires": now + lease_ms}
    state.moving = move
    return move


class _Prefetched:
    """Rows claimed and not handed out yet: ``table`` from row ``at`` on, with each row's
    ``_seq``, delivery count and lease expiry as lists (made once per claim: a receive(1)
    takes one row by index, without slicing columns or measuring bytes). ``until``: when the
    first of them expires (epoch microseconds, by ``ttl_ms`` or ``expiry_delay_ms``; ``None``:
    none does); past it the rest is given back and read again, never handed out expired."""

    __slots__ = ("at", "counts", "expires", "row_bytes", "seqs", "table", "until")

    def __init__(self, table: pa.Table, expires: list[int], until: int | None) -> None:
        self.table = table
        self.until = until
        self.at = 0
        self.seqs: list[int] = table.column(SEQ).to_pylist()
        self.counts: list[int] = table.column(DELIVERY_COUNT_FIELD.name).to_pylist()
        self.expires = expires
        #: the mean size of a row (``Table.nbytes`` of a slice costs ~30 us)
        self.row_bytes = table.nbytes / table.num_rows if table.num_rows else 0.0

    def rest(self) -> pa.Table:
        return self.table.slice(self.at)

    def rest_seqs(self) -> list[int]:
        return self.seqs[self.at:]


#: a handle reads new rows ahead for at most this many handles' claims
_CANDIDATE_HANDLES = 8
#: rows read ahead are used for at most this long (they were unexpired when read)
_CANDIDATE_FOR_S = 1.0


class _Candidates:
    """New rows read from the log before a claim takes the lock: every row of ``[start,
    end)`` that the selector matches and that was unexpired when read, at ``read_at``, and
    stays so until ``until`` (as :class:`_Prefetched`'s).
    Under the lock a claim takes those at or past the state's cursor (the rows below it were
    claimed meanwhile by other handles); a claim whose cursor is outside ``[start, end)``
    reads under the lock instead."""

    __slots__ = ("end", "read_at", "row_bytes", "schema", "seqs", "start", "table", "until")

    def __init__(self, table: pa.Table, start: int, end: int, schema: pa.Schema | None,
                 until: int | None, read_at: float | None = None) -> None:
        self.table = table
        self.until = until
        self.seqs = table.column(SEQ).to_numpy()
        self.start = start
        self.end = end
        self.schema = schema
        self.read_at = time.monotonic() if read_at is None else read_at
        self.row_bytes = table.nbytes / table.num_rows if table.num_rows else 0.0

    def usable(self, cursor: int, snapshot: Snapshot) -> bool:
        """Whether rows past ``cursor`` may be taken from here (the cursor within, the same
        schema, read a short while ago, none expired since)."""
        return (self.start <= cursor < self.end and self.schema == snapshot.schema
                and time.monotonic() - self.read_at < _CANDIDATE_FOR_S
                and (self.until is None or _now_us() < self.until))

    def left(self, cursor: int) -> int:
        return len(self.seqs) - int(self.seqs.searchsorted(cursor))

    def joined(self, cursor: int, more: _Candidates) -> _Candidates:
        """These rows from ``cursor`` on, then ``more`` (read from this one's end)."""
        at = int(self.seqs.searchsorted(cursor))
        table = pa.concat_tables([self.table.slice(at), more.table])
        return _Candidates(table, cursor, more.end, self.schema,
                           _earliest(self.until, more.until), self.read_at)

    def take(self, cursor: int, room: int, max_bytes: int
             ) -> tuple[pa.Table, int, int | None] | None:
        """Up to ``room`` rows (and about ``max_bytes``, one at least) at or past ``cursor``,
        the cursor after them and ``until``, or ``None`` when the cursor is not within."""
        if not self.start <= cursor < self.end:
            return None
        at = int(self.seqs.searchsorted(cursor))
        left = len(self.seqs) - at
        take = min(room, left)
        if self.row_bytes:
            take = min(take, max(1, int(max_bytes // self.row_bytes)))
        part = self.table.slice(at, take)
        # every row left was examined: past the last taken, the next row not taken
        after = self.end if take == left else int(self.seqs[at + take])
        return part, after, self.until


def _earliest(a: int | None, b: int | None) -> int | None:
    """The earlier of two expiry horizons (``None``: never)."""
    return b if a is None else a if b is None else min(a, b)


def _settle(state: SharedState, holder: str, seqs: set[int]) -> list[int]:
    """Settle the rows of ``seqs`` that ``holder`` still holds (acknowledged); the others,
    whose lease passed to another handle, in order."""
    lost = []
    done = 0
    for seq in seqs:
        held = state.leases.get(seq)
        if held is not None and held[0] == holder:
            del state.leases[seq]
            done += 1
        else:
            lost.append(seq)
    state.count("acked", done)
    return sorted(lost)


def _abandoned(state: SharedState, now: int) -> bool:
    """The move in ``state`` was begun by a handle that died, or long enough ago."""
    move = state.moving
    assert move is not None
    return int(move.get("expires", 0)) <= now or state.dead(str(move.get("holder")))


def _give_back(chain: SharedStore, holder: str, undelivered: set[int]) -> None:
    """Give back every row ``holder`` holds (one epoch) and forget the holder: rows it
    handed out are due again at once, counted as delivered; ``undelivered`` ones (prefetched,
    never handed out) keep their delivery count."""

    def give_back(state: SharedState) -> None:
        give_back_rows(state, holder, undelivered, now_ms())

    chain.update(give_back)


def give_back_rows(state: SharedState, holder: str, undelivered: set[int], now: int) -> None:
    for seq in state.leased_to(holder):
        _, count, _ = state.leases.pop(seq)
        state.pending[seq] = (count - 1 if seq in undelivered else count, now)
    state.holders.pop(holder, None)


#: ``(chain folder, holder)`` of handles collected without close(), given back by the next
#: claim of a handle of the same consumer in the process (or at exit)
_COLLECTED: list[tuple[str, str]] = []
#: the open handles of the process, closed at exit (deferred acks written, rows given back)
_OPEN: weakref.WeakSet[SharedConsumer] = weakref.WeakSet()


def _collected_of(folder: str) -> list[str]:
    """Take the holders of ``folder``'s collected handles off the list."""
    mine = [h for f, h in _COLLECTED if f == folder]
    if mine:
        _COLLECTED[:] = [(f, h) for f, h in _COLLECTED if f != folder]
    return mine


def _close_all() -> None:
    for handle in list(_OPEN):
        try:
            handle.close()
        except Exception as exc:  # the store is gone: the leases run out instead
            log.warning("shared consumer %s of %s: could not give back its rows at exit (%s); "
                        "they are delivered again when their leases run out", handle.name,
                        handle.address.name, exc)


def _after_fork_in_child() -> None:
    # the parent's handles are the parent's to close: a child's exit must not give their rows
    # back while the parent works on them, nor must the child's copy of one, collected there
    # (its finalizer would have the child's next claim give the parent's rows back)
    global _OPEN
    for handle in list(_OPEN):
        handle._finalizer.detach()
    _OPEN = weakref.WeakSet()
    _COLLECTED.clear()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)


def _no_loss(begin: int, end: int) -> list[tuple[int, int, str]]:
    return []


def _flusher() -> Any:
    from . import consumer

    return consumer._FLUSHER
