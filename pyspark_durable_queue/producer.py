"""The batching producer: ``send(row)`` one message at a time, stored in batches.

Kafka's ``RecordAccumulator`` design. ``send`` appends the row to the open batch under a lock and
returns a light future; a background (daemon) sender thread takes a batch once it is full
(``max_batch_messages``, or ``max_batch_bytes`` by the estimated size) or ``linger_ms`` after its
first row, turns the whole batch into one Arrow table and publishes it with one
:meth:`Address.send <pyspark_durable_queue.Address.send>`. While one batch commits the next one
fills. ``max_buffer_bytes`` bounds what waits (Kafka's ``buffer.memory``): a ``send`` that finds
the buffer full blocks up to ``max_block_ms``, then raises :class:`BufferFullError`.

Who calls it: client code through :meth:`Address.producer`; nothing in the store or the Spark
adapter uses it.

Outcome of a row (its future):

- stored: ``result()`` is its ``_seq``; the rows of one batch get consecutive ``_seq`` in send
  order, and batches are committed in the order they were opened;
- not stored because of the row itself (a value that does not convert to Arrow or does not fit the
  address schema): ``InvalidMessageError`` / ``SchemaMismatchError``. The batch is split so that
  only the offending rows fail; the others are stored (in one commit);
- not stored because of the address: ``AddressFullError`` (FAIL policy, BLOCK timed out) or
  :class:`MessageDroppedError` (DROP policy; an ``AddressFullError``), for the whole batch;
- any other failure of the commit (storage): that exception, for the whole batch. Nothing is
  retried: a storage error can come after the entry was published, and a retry would store the
  rows twice.

The byte sizes are estimates, not measurements of each row: ``send`` does no per-row Arrow work.
The estimate is the Arrow size per row of the batches converted so far (a moving average),
starting from :data:`INITIAL_ROW_BYTES`, a deliberately high guess.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from ._format.schema import conform_schema, rows_to_table
from .errors import (
    BufferFullError,
    InvalidMessageError,
    InvalidOptionError,
    MessageDroppedError,
    ProducerClosedError,
    SchemaMismatchError,
)

if TYPE_CHECKING:
    from ._ops.commit import CommitResult

__all__ = ["INITIAL_ROW_BYTES", "MessageFuture", "Producer", "ProducerAddress"]

log = logging.getLogger(__name__)

#: Bytes per row assumed before the first batch was converted (the usual row is far smaller, so
#: the first batches are smaller than they need to be rather than over the limits).
INITIAL_ROW_BYTES = 1024
#: A sender thread with nothing to send for this long exits (a new one starts with the next
#: send), so an unclosed, unreferenced producer does not keep a thread forever.
_IDLE_EXIT_S = 10.0


class ProducerAddress(Protocol):
    """What a producer uses of its address: its name and schema, and ``send``
    (:class:`~pyspark_durable_queue.address.Address` implements it; the producer never imports
    the address module). A forked child's producer copies it (``copy.copy``), as unpickling
    would."""

    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> pa.Schema | None: ...

    def send(self, data: Any, *, merge_schema: bool = False,
             txn: tuple[str, int] | None = None, ttl_ms: int | None = None) -> CommitResult: ...
#: Errors that belong to rows rather than to the batch: the batch is split to find the rows.
_ROW_ERRORS = (InvalidMessageError, SchemaMismatchError)


class _Batch:
    """Rows sent together, and their outcome once the sender resolved it.

    ``rows`` is appended to under the producer's ``_lock`` until the sender takes the batch; the
    outcome fields are written once, by the sender, before ``_done`` is set, and only read after.
    ``_callbacks`` is guarded by ``_cb_lock``.
    """

    __slots__ = ("_callbacks", "_cb_lock", "_done", "created", "error", "first_seq", "outcomes",
                 "rows", "tracebacks")

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.created = time.monotonic()
        self._done = threading.Event()
        self._cb_lock = threading.Lock()
        self._callbacks: list[tuple[Callable[[MessageFuture], Any], int]] | None = []
        self.first_seq = -1
        self.error: BaseException | None = None  # the outcome of every row
        self.outcomes: list[int | BaseException] | None = None  # one per row, when split
        #: each error's traceback where the sender caught it, by id (see ``MessageFuture``)
        self.tracebacks: dict[int, TracebackType | None] = {}

    def outcome(self, index: int) -> int | BaseException:
        if self.outcomes is not None:
            return self.outcomes[index]
        if self.error is not None:
            return self.error
        return self.first_seq + index

    def resolve(self) -> None:
        """Publish the outcome (set before) and run the callbacks added so far."""
        for exc in (self.error, *(self.outcomes or ())):
            if isinstance(exc, BaseException):
                self.tracebacks.setdefault(id(exc), exc.__traceback__)
        with self._cb_lock:
            callbacks, self._callbacks = self._callbacks, None
            self._done.set()
        for fn, index in callbacks or ():
            _call(fn, MessageFuture(self, index))

    def forget(self, error: BaseException) -> None:
        """In a forked child: resolve with ``error`` without running callbacks (they belong to
        the parent's threads); the events and locks may have been copied while held."""
        self._done = threading.Event()
        self._cb_lock = threading.Lock()
        self._callbacks = None
        self.outcomes = None
        self.error = error
        self._done.set()


def _call(fn: Callable[[MessageFuture], Any], future: MessageFuture) -> None:
    try:
        fn(future)
    except Exception:
        log.exception("a done-callback of a producer's message future raised")


class MessageFuture:
    """The outcome of one :meth:`Producer.send`: the row's ``_seq`` once its batch is durable.

    Shaped like :class:`concurrent.futures.Future` (``result``, ``exception``, ``done``,
    ``add_done_callback``) but resolved once per batch: a future is two slots, so that ``send``
    stays cheap. Cannot be cancelled. Do not wait on a future from one of its producer's
    done-callbacks: they run on the sender thread, which is then blocked.
    """

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: _Batch, index: int) -> None:
        self._batch = batch
        self._index = index

    def __repr__(self) -> str:
        if not self.done():
            return "<MessageFuture pending>"
        o = self._batch.outcome(self._index)
        return f"<MessageFuture {'seq=' + str(o) if isinstance(o, int) else repr(o)}>"

    def done(self) -> bool:
        return self._batch._done.is_set()

    def _wait(self, timeout: float | None) -> int | BaseException:
        b = self._batch
        if not b._done.is_set() and not b._done.wait(timeout):
            raise TimeoutError(f"the message's batch was not stored within {timeout} s")
        return b.outcome(self._index)

    def result(self, timeout: float | None = None) -> int:
        """The row's ``_seq``, once its batch is durable.

        Raises
        ------
        TimeoutError
            Not resolved within ``timeout`` seconds (``None``: wait as long as it takes).
        SchemaMismatchError, InvalidMessageError
            The row does not fit the address schema or does not convert to Arrow.
        AddressFullError
            FAIL policy, or BLOCK waited ``block_timeout_ms``; :class:`MessageDroppedError`
            (a subclass) when the DROP policy dropped it.
        DurableQueueError
            Another failure of the commit (a ``StorageError``...); the row may or may not have
            been stored (nothing is retried).
        """
        o = self._wait(timeout)
        if isinstance(o, BaseException):
            # One exception is shared by the futures of a batch: raised as it is, each raise
            # would add this frame to its traceback, which would grow without bound.
            raise o.with_traceback(self._batch.tracebacks.get(id(o)))
        return o

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error that :meth:`result` raises, or ``None`` when the row was stored."""
        o = self._wait(timeout)
        return o if isinstance(o, BaseException) else None

    def add_done_callback(self, fn: Callable[[MessageFuture], Any]) -> None:
        """Call ``fn(future)`` once the row's outcome is known: on the producer's sender thread,
        or at once in this thread when it is known already. Exceptions are logged."""
        b = self._batch
        with b._cb_lock:
            if b._callbacks is not None:
                b._callbacks.append((fn, self._index))
                return
        _call(fn, self)


class Producer:
    """Sends single rows to an address in batches (see the module docstring). Obtain one with
    :meth:`Address.producer`; use it as a context manager, or call :meth:`close`.

    Parameters
    ----------
    linger_ms : float, default 5
        How long a batch waits for more rows after its first one (Kafka's ``linger.ms``).
    max_batch_messages : int, default 50,000
    max_batch_bytes : int, default 8 MiB
        A batch is sent as soon as it holds this many rows, or this many estimated bytes.
    max_buffer_bytes : int, default 32 MiB
        Estimated bytes of rows sent but not yet stored, at most (Kafka's ``buffer.memory``).
    max_block_ms : float, default 60,000
        How long :meth:`send` waits for room in a full buffer before it raises
        :class:`BufferFullError` (Kafka's ``max.block.ms``).
    merge_schema : bool, default False
        Passed to :meth:`Address.send`: new columns are added to the schema as nullable.
    ttl_ms : int, optional
        Passed to :meth:`Address.send`: every message of this producer expires ``ttl_ms``
        milliseconds after it was stored (its batch's commit).

    Thread safety: any number of threads may call :meth:`send`, :meth:`flush` and :meth:`close`
    on one producer. ``_lock`` guards ``_open``, ``_ready``, ``_last``, ``_inflight``,
    ``_pending``, ``_closed``, ``_thread`` and the size estimates (``_row_bytes``,
    ``_measured``, ``_batch_rows``, ``_buffer_rows``); ``_work`` (the sender waits for a
    batch) and ``_space`` (senders wait for room) are conditions on it. The sender thread alone
    reads a batch's rows once it took the batch, and alone writes its outcome (see
    ``_Batch``). ``_address`` is used by the sender thread only (replaced in a forked child).

    A row is referenced, not copied, until its batch is converted: do not change a dict after
    sending it. After ``os.fork()`` the child's producer starts empty: the rows the parent had
    not stored yet are the parent's to store, and their futures in the child fail with
    :class:`ProducerClosedError`.
    """

    def __init__(self, address: ProducerAddress, *, linger_ms: float = 5,
                 max_batch_messages: int = 50_000, max_batch_bytes: int = 8 << 20,
                 max_buffer_bytes: int = 32 << 20, max_block_ms: float = 60_000,
                 merge_schema: bool = False, ttl_ms: int | None = None) -> None:
        for name, value, least in (("linger_ms", linger_ms, 0), ("max_block_ms", max_block_ms, 0),
                                   ("max_batch_messages", max_batch_messages, 1),
                                   ("max_batch_bytes", max_batch_bytes, 1),
                                   ("max_buffer_bytes", max_buffer_bytes, 1)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < least:
                raise InvalidOptionError(
                    f"producer option {name}={value!r}: expected a number >= {least}")
        self._address = address
        self.linger_s = linger_ms / 1000
        self.max_block_s = max_block_ms / 1000
        self.max_batch_messages = int(max_batch_messages)
        self.max_batch_bytes = int(max_batch_bytes)
        self.max_buffer_bytes = int(max_buffer_bytes)
        if ttl_ms is not None and (isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int)
                                   or ttl_ms <= 0):
            raise InvalidOptionError(f"producer option ttl_ms={ttl_ms!r}: expected an int > 0 "
                                     "(milliseconds)")
        self.merge_schema = merge_schema
        self.ttl_ms = ttl_ms
        self._reset()
        self._closed = False
        _LIVE.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._space = threading.Condition(self._lock)
        self._open: _Batch | None = None  # the batch send() appends to
        self._ready: deque[_Batch] = deque()  # full or flushed batches, oldest first
        self._last: _Batch | None = None  # the newest batch (flush waits for it)
        self._inflight: _Batch | None = None  # the batch the sender is storing
        self._pending = 0  # rows sent and not resolved yet
        self._thread: threading.Thread | None = None
        self._row_bytes = float(INITIAL_ROW_BYTES)
        self._measured = False
        self._set_limits()

    def _set_limits(self) -> None:
        buffer_rows = max(1, int(self.max_buffer_bytes / self._row_bytes))
        self._buffer_rows = buffer_rows
        self._batch_rows = max(1, min(self.max_batch_messages, buffer_rows,
                                      int(self.max_batch_bytes / self._row_bytes)))

    def __repr__(self) -> str:
        return f"Producer({self._address!r}, pending={self._pending}, closed={self._closed})"

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the caller's side ----------------------------------------------------------------------
    def send(self, row: dict[str, Any]) -> MessageFuture:
        """Queue one message (a dict of column -> value); returns its :class:`MessageFuture`.

        Returns at once unless the buffer is full.

        Raises
        ------
        InvalidMessageError
            ``row`` is not a dict.
        BufferFullError
            ``max_buffer_bytes`` of rows waited for ``max_block_ms`` and no room came free.
        ProducerClosedError
            The producer was closed.
        """
        if not isinstance(row, dict):
            raise InvalidMessageError(
                f"a producer sends one message at a time, a dict of column -> value, not a "
                f"{type(row).__name__}")
        with self._lock:
            b = self._open
            if b is None or self._pending >= self._buffer_rows:
                b = self._make_room()
            rows = b.rows
            index = len(rows)
            rows.append(row)
            self._pending += 1
            if index + 1 >= self._batch_rows:
                self._ready.append(b)
                self._open = None
                self._work.notify()
        return MessageFuture(b, index)

    def _make_room(self) -> _Batch:
        """Under ``_lock``: wait for room in the buffer, then return the open batch (opening
        one, and starting the sender thread, when there is none)."""
        deadline = None
        while True:
            if self._closed:
                raise ProducerClosedError(f"{self!r} is closed; open a new producer to send")
            if self._pending < self._buffer_rows:
                break
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.max_block_s
            if now >= deadline:
                raise BufferFullError(
                    f"the producer's buffer is full: {self._pending} messages (about "
                    f"{int(self._pending * self._row_bytes)} bytes) wait to be stored, "
                    f"max_buffer_bytes={self.max_buffer_bytes}; waited max_block_ms="
                    f"{self.max_block_s * 1000:g} for room. Sends come faster than the "
                    "address stores them: raise max_buffer_bytes or max_block_ms, or send "
                    "less")
            self._space.wait(deadline - now)
        b = self._open
        if b is None:
            b = self._open = self._last = _Batch()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"dq-producer-{self._address.name}", daemon=True)
                self._thread.start()
            else:
                self._work.notify()  # the sender waits without a deadline when nothing is open
        return b

    def flush(self, timeout: float | None = None) -> bool:
        """Send every row sent so far without waiting for ``linger_ms``, and wait until all of
        them are resolved (stored or failed: failures are in their futures, flush raises
        nothing). Returns ``False`` if ``timeout`` seconds passed first.

        Must not be called from a done-callback (the sender thread would wait for itself).
        """
        with self._lock:
            last = self._seal()
        # batches are resolved in the order they were opened: the newest is resolved last
        return last is None or last._done.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush, then stop the sender thread. Later sends raise :class:`ProducerClosedError`;
        closing again is harmless. Returns ``False`` if ``timeout`` seconds passed before
        everything was resolved."""
        with self._lock:
            self._closed = True  # with the seal, under one lock hold: no row slips in between
            last = self._seal()
            self._space.notify_all()  # blocked sends fail now
        done = last is None or last._done.wait(timeout)
        with self._lock:
            thread = self._thread
            self._work.notify()
        if thread is not None and done:
            thread.join(timeout)
        _LIVE.discard(self)
        return done

    def _seal(self) -> _Batch | None:
        """Under ``_lock``: hand the open batch to the sender now; the newest batch."""
        if self._thread is not None and self._thread is threading.current_thread():
            raise RuntimeError("a producer's flush() or close() called from one of its "
                               "done-callbacks, on its sender thread, would wait for itself")
        b = self._open
        if b is not None:
            self._ready.append(b)
            self._open = None
            self._work.notify()
        return self._last

    def __getstate__(self) -> None:
        raise TypeError(f"{self!r} cannot be pickled (it holds a thread and the rows it has not "
                        "stored yet); open a producer in each process with Address.producer()")

    @property
    def closed(self) -> bool:
        return self._closed

    def _forked(self) -> None:
        """In the child of a fork: start empty. The parent stores the rows it held (no thread
        was copied); the locks may have been copied while held."""
        for b in (self._open, *self._ready, self._inflight, self._last):
            if b is not None and not b._done.is_set():
                b.forget(ProducerClosedError(
                    "this message was sent before os.fork() by the parent process, whose "
                    "producer stores it; its outcome is known only there"))
        self._reset()
        # a copy rebuilds the address's commit log (and its lock), as unpickling does
        self._address = copy.copy(self._address)

    # -- the sender thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                batch = self._inflight = self._take()
                if batch is None:
                    return
            try:
                self._deliver(batch)
            finally:
                with self._lock:
                    self._pending -= len(batch.rows)
                    self._inflight = None
                    self._space.notify_all()
                batch.resolve()

    def _take(self) -> _Batch | None:
        """Under ``_lock``: the next batch to send, once there is one; ``None`` when the thread
        should exit (closed, or idle for ``_IDLE_EXIT_S``, with nothing left)."""
        idle_since = time.monotonic()
        while True:
            if self._ready:
                return self._ready.popleft()
            now = time.monotonic()
            b = self._open
            if b is not None:
                wait = b.created + self.linger_s - now
                if wait <= 0 or self._closed:
                    self._open = None
                    return b
                self._work.wait(wait)
                idle_since = time.monotonic()
            elif self._closed or now - idle_since >= _IDLE_EXIT_S:
                self._thread = None
                return None
            else:
                self._work.wait(_IDLE_EXIT_S - (now - idle_since))

    def _deliver(self, batch: _Batch) -> None:
        """Convert and store one batch and write its outcome (never raises)."""
        rows = batch.rows
        try:
            try:
                table = rows_to_table(rows)
                self._measure(table)
                result = self._address.send(table, merge_schema=self.merge_schema,
                                                   ttl_ms=self.ttl_ms)
                kept = None
            except _ROW_ERRORS:
                # Some rows do not convert or fit: store the others, fail those rows alone.
                kept, outcomes, table = self._split(rows)
                batch.outcomes = outcomes
                if table is None:
                    return
                result = self._address.send(table, merge_schema=self.merge_schema,
                                                   ttl_ms=self.ttl_ms)
            if result.dropped:
                error: BaseException | None = MessageDroppedError(
                    f"the address {self._address.name!r} was full and its "
                    "address_full_policy=DROP dropped the batch of "
                    f"{table.num_rows} messages holding this one; it was not stored")
                first = -1
            else:
                error, first = None, result.seq
        except Exception as exc:  # the outcome of every row still to be decided
            log.debug("producer: a batch of %d messages failed: %r", len(rows), exc)
            error, first = exc, -1
            kept = None if batch.outcomes is None else [
                i for i, o in enumerate(batch.outcomes) if o is _UNDECIDED]
        except BaseException as exc:
            batch.error = exc
            batch.outcomes = None
            raise
        if kept is None:
            batch.first_seq, batch.error = first, error
            return
        slots = batch.outcomes
        assert slots is not None
        for n, i in enumerate(kept):
            slots[i] = error if error is not None else first + n

    def _split(self, rows: list[dict[str, Any]]
               ) -> tuple[list[int], list[int | BaseException], pa.Table | None]:
        """Find the rows that do not convert or fit by bisection; returns the indices of the
        others, an outcome list (errors for the bad rows, ``_UNDECIDED`` for the others) and one
        table of the others (``None`` when there are none)."""
        outcomes: list[int | BaseException] = [_UNDECIDED] * len(rows)
        pieces: list[tuple[int, int, pa.Table]] = []
        schema = self._address.schema

        def visit(lo: int, hi: int) -> None:
            nonlocal schema
            try:
                table, grown = conform_schema(rows_to_table(rows[lo:hi]), schema,
                                              self.merge_schema)
            except _ROW_ERRORS as exc:
                if hi - lo == 1:
                    outcomes[lo] = exc
                    return
                mid = (lo + hi) // 2
                visit(lo, mid)
                visit(mid, hi)
                return
            schema = grown
            pieces.append((lo, hi, table))

        visit(0, len(rows))
        if not pieces:
            return [], outcomes, None
        assert schema is not None
        # pieces conformed before the schema grew (merge_schema) take its later columns as nulls
        tables = [t if t.schema == schema else conform_schema(t, schema, True)[0]
                  for _, _, t in pieces]
        kept = [i for lo, hi, _ in pieces for i in range(lo, hi)]
        return kept, outcomes, pa.concat_tables(tables)

    def _measure(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        size = max(1.0, table.nbytes / table.num_rows)
        with self._lock:
            # a moving average, but the initial guess is only a guess: the first batch replaces it
            self._row_bytes = size if not self._measured else (self._row_bytes + size) / 2
            self._measured = True
            self._set_limits()


class _Undecided(int):
    """The outcome slot of a row whose batch is still being stored (never seen by a future)."""


_UNDECIDED = _Undecided(-1)


# -- process lifetime ---------------------------------------------------------------------------
_LIVE: weakref.WeakSet[Producer] = weakref.WeakSet()


def _close_all() -> None:
    """At interpreter exit: store what every live producer still holds (the sender threads are
    daemons, alive while atexit handlers run)."""
    for p in list(_LIVE):
        try:
            p.close()
        except Exception:
            log.exception("closing %r at exit failed", p)


def _after_fork_in_child() -> None:
    for p in list(_LIVE):
        p._forked()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
