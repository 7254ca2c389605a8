"""Durable consumers: a name, an optional selector, and an acknowledged watermark.

A consumer's state (see ``_registry``) holds ``position``: every ``_seq`` below it is
acknowledged. Messages are delivered in ``_seq`` order from an in-memory cursor; ``ack`` moves
the durable watermark up to what was delivered. After a crash the consumer resumes at its
watermark, so unacknowledged messages are delivered again (at-least-once for the Python client;
Spark's checkpoint makes the source exactly-once).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from ._cache import page_cache
from ._log import seq_ranges_text, subtract_ranges
from ._positions import EARLIEST, parse_position
from ._scan import Snapshot
from ._schema import compile_selector, with_system_schema
from .errors import ConsumerNotFoundError, InvalidOptionError
from .settings import validate_name

if TYPE_CHECKING:
    from .address import Address
    from .selector import Selector

__all__ = ["Consumer", "resolve_start"]

log = logging.getLogger(__name__)

POSITION_KEY = b"dq.position"


def resolve_start(address: Address, start: Any) -> int:
    """The ``_seq`` a position names now: ``earliest`` (first retained), ``latest`` (next to
    be written), a ``_seq``, a Spark offset ``{"seq": N}`` or a time (``datetime``; see
    :mod:`._positions`)."""
    return parse_position(start).resolve(address.log.refresh())


_F = TypeVar("_F", bound=Callable[..., Any])


def _serialised(method: _F) -> _F:
    """Run ``method`` holding the consumer's lock."""
    @functools.wraps(method)
    def locked(self: Consumer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


class Consumer:
    """A durable consumer of an address. Obtain one with :meth:`Address.consumer`.

    A consumer is one reader: its acknowledgement is a cumulative watermark (everything before
    it is done), so it cannot track messages handed to several workers independently. Its
    methods may be called from several threads (``_lock`` serialises ``receive``, ``ack``,
    ``seek`` and ``delete``, and guards ``position``, ``cursor`` and the persisted state), but
    competing readers need separate consumers, each with its own watermark.

    Concurrency guarantee: the watermark file is replaced atomically; a consumer is meant to
    have one owner at a time (the Spark source enforces it with a lease).
    """

    def __init__(self, address: Address, state: dict[str, Any]) -> None:
        self.address = address
        self.name: str = state["name"]
        self._state = state
        self.position: int = int(state["position"])
        self.cursor: int = self.position
        self._selector: Selector | None = None
        self._selector_schema: pa.Schema | None = None
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return (f"Consumer({self.address.name!r}, {self.name!r}, position={self.position}, "
                f"selector={self.selector_text!r})")

    @property
    def path(self) -> str:
        return self.address.layout.consumer_state(self.name)

    @property
    def selector_text(self) -> str | None:
        return self._state.get("selector") or None

    @property
    def selector(self) -> Selector | None:
        """The compiled selector, for the address's current schema: compiled again when the
        schema grows (mergeSchema), or a newly added column it names would stay NULL and its
        pages would be skipped."""
        if not self.selector_text:
            return None
        schema = self.address.schema
        if self._selector is None or self._selector_schema != schema:
            self._selector = compile_selector(self.selector_text, schema)
            self._selector_schema = schema
        return self._selector

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    def open(cls, address: Address, name: str, *, selector: str | None = None,
             start: Any = None, create: bool = True) -> Consumer:
        """Open (or create) a consumer; see :meth:`Address.consumer`.

        ``start`` applies to a new consumer only (default ``earliest``); given for one that
        exists, it is ignored with a warning saying where the consumer resumes. A ``selector``
        that differs from the stored one replaces it (see :meth:`_change_selector`).
        """
        validate_name(name, "consumer")
        if selector:
            from .selector import Selector

            Selector(selector)  # a syntax error must surface before anything is persisted
        position = None if start is None else parse_position(start, "start")
        registry = address.registry
        created = False
        try:
            state = registry.load(name)
        except ConsumerNotFoundError:
            if not create:
                raise
            now = time.time()
            first = (position or EARLIEST).resolve(address.log.refresh())
            state = {"name": name, "selector": selector or None, "position": first,
                     "created": now, "updated": now}
            created = registry.create(name, state)
            if not created:
                state = registry.load(name)
        if position is not None and not created:
            log.warning("consumer %s of %s already exists: it resumes at its watermark _seq %d "
                        "and start=%s is ignored (it applies to new consumers only); move it "
                        "with Consumer.seek(...), or use a new consumer name", name,
                        address.name, int(state["position"]), position)
        consumer = cls(address, state)
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
        state = self.address.log.refresh()
        # repair's own losses (state.lost) are reported anyway, with their own reason
        lost = [] if not old else subtract_ranges(
            state.pages.gaps(self.position, state.next_seq), state.lost)
        log.warning("consumer %s of %s: selector changed from %r to %r%s", self.name,
                    self.address.name, old, selector,
                    f"; messages _seq {seq_ranges_text(lost)} were removed by cleanup because "
                    "the old selector could not match them, and are lost to the new one"
                    if lost else "")
        reason = f"selector changed from {old!r} to {selector!r}"
        self._state = dict(self._state, selector=selector, updated=time.time(),
                           lost=[*self._lost, *([a, b, reason] for a, b in lost)])
        self._selector = None
        self.address.registry.save(self.name, self._state)

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
        self.address.registry.delete(self.name)

    def _persist(self) -> None:
        self._state = dict(self._state, position=self.position, updated=time.time())
        if self._lost:  # ranges passed for good are forgotten
            self._state["lost"] = [r for r in self._lost if int(r[1]) > self.position]
        self.address.registry.save(self.name, self._state)

    # -- consuming ------------------------------------------------------------------------------
    @_serialised
    def receive(self, max_messages: int = 1000, max_bytes: int = 16 << 20) -> pa.Table:
        """The next messages after the cursor, in ``_seq`` order, as a ``pyarrow.Table``.

        Includes ``_seq`` and ``_timestamp``. Not acknowledged until :meth:`ack`. Returns an empty
        table when nothing (matching) is available. At least one message is returned when one is
        available, even if it alone exceeds ``max_bytes``.
        """
        if max_messages < 1 or max_bytes < 1:
            raise InvalidOptionError("max_messages and max_bytes must be positive")
        address = self.address
        state = address.log.refresh()
        full = with_system_schema(state.schema)
        if state.schema is None:
            return full.empty_table()
        selector = self.selector
        cache = page_cache()
        cache.limit(address.layout.pages, address.settings.page_max_cache_size)
        batches: list[pa.RecordBatch] = []
        count = 0
        size = 0
        position = self.cursor
        snapshot = Snapshot(address.storage, address.layout, state)
        for batch, after in snapshot.messages(self.cursor, selector=selector, cache=cache):
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
                    position = part.column("_seq")[take - 1].as_py() + 1
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
        for a, b in state.lost_in(self.cursor, position):
            log.warning("consumer %s of %s: messages _seq %d..%d are lost (their pages were "
                        "damaged and removed by repair); skipping them", self.name,
                        address.name, a, b - 1)
        for a, b, why in self.lost_in(self.cursor, position):
            log.warning("consumer %s of %s: messages _seq %d..%d are lost to this consumer "
                        "(%s; cleanup had removed them as unmatched by the old selector); "
                        "skipping them", self.name, address.name, a, b - 1, why)
        self.cursor = position
        table = pa.Table.from_batches(batches, schema=full) if batches else full.empty_table()
        return table.replace_schema_metadata({POSITION_KEY: str(position).encode()})

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

    @_serialised
    def ack(self, batch: pa.Table | int | None = None) -> None:
        """Acknowledge messages: everything received so far (no argument), everything up to
        and including a received table (and the non-matching messages skipped before it), or
        up to and including a ``_seq``. The watermark never moves backwards (see :meth:`seek`).
        Cleanup may run afterwards (at most every ``cleanup_interval_ms``).
        """
        if batch is None:
            new = self.cursor
        elif isinstance(batch, int) and not isinstance(batch, bool):
            new = batch + 1
        elif isinstance(batch, pa.Table):
            meta = batch.schema.metadata or {}
            if POSITION_KEY in meta:
                new = int(meta[POSITION_KEY])
            elif batch.num_rows:
                import pyarrow.compute as pc

                new = int(pc.max(batch.column("_seq")).as_py()) + 1
            else:
                return
        else:
            raise TypeError(f"ack() takes a received table, a _seq or nothing, not "
                            f"{type(batch).__name__}")
        if new <= self.position:
            return
        self.position = new
        self.cursor = max(self.cursor, new)
        self._persist()
        self.address.maybe_cleanup()

    @_serialised
    def seek(self, start: Any) -> None:
        """Move the watermark and cursor (also back) to ``earliest``, ``latest``, a ``_seq``,
        or a time (a ``datetime``: the first message committed at or after it; naive means
        UTC)."""
        self.position = resolve_start(self.address, start)
        self.cursor = self.position
        self._persist()

    def backlog(self) -> tuple[int, int]:
        """``(messages, bytes)`` retained at or after this consumer's watermark (selector not
        applied)."""
        return self.address.backlog(self.position)
