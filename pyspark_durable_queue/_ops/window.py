"""A consumer's delivery window: the rows above its watermark that are not settled in order.

A consumer's durable watermark (``position``, in ``consumers/<name>.wm``) means "every row
below it is settled". Rows settled out of order and rows waiting for redelivery live above it,
in this window (Kafka's share-partition state, Artemis' delivering list)::

    ack_point      every row below it that is not pending is settled
    pending        {_seq: (delivery count, due time in epoch ms)}: rows nacked, waiting to be
                   delivered again (or handed out again and not settled yet)

The watermark written to the ``.wm`` file is ``min(pending)`` (or ``ack_point`` without
pending rows), so cleanup keeps the pages of pending rows, and a release that knows nothing of
the window reads a watermark that redelivers them (never one that skips them).

The window is kept in ``consumers/<name>.window`` (:func:`encode`, :func:`decode`), checked
JSON (``_format/checked.py``, whatever the address's format) replaced atomically::

    {"ack_point": 1200, "floor": 1187, "pending": [[1187, 1, 1732240060400], ...],
     "moves": 3, "dead_lettered": 5, "dropped": 0, "settled": [1201],
     "moving": {"target": "DLQ", "reason": "...", "rows": [[1190, 10], ...]}}

The last five are there once the consumer dead-lettered a row (``_ops/dead_letter.py``):
``moves`` numbers its dead-letter moves (the transaction version of each), the two counters add
up what went to the dead-letter address and what was dropped for want of one, ``settled`` holds
the dead-lettered rows at or above the ack point (skipped when read again, forgotten once the
ack point passes them), and ``moving`` is a move begun and not finished: its rows are neither
pending nor settled, and hold the watermark until the move is finished (by the next receive
after a crash).

It is O(window): at most ``max_in_flight`` rows are between the watermark and the cursor, so
the file never holds more pending rows. The file is written only while pending rows exist (or
when the last one is settled); the fast path (no nacks) writes only the ``.wm``.

Writes go window first, then ``.wm``: the ``.wm`` only rises (``floor`` is the ``.wm`` the
window was written over), so a crash between the two leaves a ``.wm`` at or below the window's
rows. Reading both back (:meth:`DeliveryWindow.restore`): the ack point is the higher of the
two, pending rows below the ``.wm`` are settled (an older release acknowledged past them), and
a ``.wm`` below ``floor`` was moved back by a seek, which abandons the window.
"""

from __future__ import annotations

import math
from typing import Any

from .._format import checked

__all__ = ["DeliveryWindow", "Move", "decode", "encode", "redelivery_delay_ms"]


class DeliveryWindow:
    """The in-memory window of one consumer (see the module docstring).

    Not thread-safe: the consumer's ``_lock`` guards it. ``out`` (rows of ``pending`` handed
    out again, by delivery count) lives in memory only: after a crash they are pending again,
    due at once.
    """

    __slots__ = ("ack_point", "dead_lettered", "dropped", "moves", "moving", "out", "pending",
                 "settled")

    def __init__(self, ack_point: int, pending: dict[int, tuple[int, int]] | None = None, *,
                 moves: int = 0, dead_lettered: int = 0, dropped: int = 0,
                 moving: Move | None = None, settled: set[int] | None = None) -> None:
        self.ack_point = ack_point
        self.pending: dict[int, tuple[int, int]] = dict(pending or {})
        self.out: dict[int, int] = {}
        #: rows at or above the ack point settled one by one (dead-lettered): never delivered
        #: again, forgotten once the ack point passes them
        self.settled: set[int] = set(settled or ())
        #: dead-letter moves begun so far (the number of the last one)
        self.moves = moves
        #: rows moved to the dead-letter address, and rows dropped for want of one
        self.dead_lettered = dead_lettered
        self.dropped = dropped
        #: the dead-letter move begun and not finished, if any
        self.moving = moving

    def __repr__(self) -> str:
        return (f"DeliveryWindow(ack_point={self.ack_point}, pending={len(self.pending)}, "
                f"out={len(self.out)})")

    @property
    def watermark(self) -> int:
        """Every row below it is settled: ``min(pending)``, or the ack point without any."""
        low = self.ack_point
        if self.pending:
            low = min(low, min(self.pending))
        if self.moving is not None:
            low = min(low, min(self.moving.rows))
        return low

    @property
    def in_use(self) -> bool:
        """Whether the window file has anything to keep (else it is removed)."""
        return bool(self.pending or self.moving or self.moves or self.settled)

    def waiting(self) -> int:
        """Rows waiting for redelivery (pending and not handed out again)."""
        return len(self.pending) - len(self.out)

    def in_flight(self, cursor: int) -> int:
        """Rows delivered and not settled, with the consumer's cursor at ``cursor``: those
        between the ack point and the cursor, less the pending ones there that wait for
        redelivery and those settled one by one (dead-lettered), plus those handed out again
        below the ack point. With a selector the cursor passes rows it did not match too, so
        this is then an upper bound.

        Safe to call from another thread (the lease's heartbeat): it reads copies, made
        without the consumer's lock (one C-level copy each)."""
        pending, out, ack_point = dict(self.pending), set(self.out), self.ack_point
        waiting = sum(1 for s in pending if s >= ack_point and s not in out)
        done = sum(1 for s in set(self.settled) if ack_point <= s < cursor)
        again = sum(1 for s in out if s < ack_point)
        return max(0, cursor - ack_point - waiting - done + again)

    def due(self, now_ms: int, limit: int) -> list[int]:
        """Up to ``limit`` pending rows due at ``now_ms`` and not handed out, lowest first."""
        if len(self.out) == len(self.pending):
            return []
        ready = [s for s, (_, due) in self.pending.items() if due <= now_ms and s not in self.out]
        ready.sort()
        return ready[:limit]

    def next_due_ms(self) -> int | None:
        """When the next waiting row is due (epoch ms), ``None`` without any."""
        dues = [due for s, (_, due) in self.pending.items() if s not in self.out]
        return min(dues) if dues else None

    def hand_out(self, seqs: list[int]) -> list[int]:
        """Mark pending rows as delivered again; their delivery counts."""
        counts = []
        for s in seqs:
            count = self.pending[s][0] + 1
            self.out[s] = count
            counts.append(count)
        return counts

    def settle(self, point: int) -> bool:
        """Acknowledge cumulatively up to ``point`` (exclusive): the ack point rises, and rows
        handed out again below it are settled; rows waiting for redelivery are not. Whether
        the durable window changed."""
        changed = False
        if point > self.ack_point:
            self.ack_point = point
            changed = bool(self.pending)
            if self.settled:
                self.settled = {s for s in self.settled if s >= point}
                changed = True
        for s in [s for s in self.out if s < point]:
            del self.out[s]
            del self.pending[s]
            changed = True
        return changed

    def settle_rows(self, seqs: list[int]) -> None:
        """Settle rows of ``pending`` one by one (whatever the ack point)."""
        for s in seqs:
            self.out.pop(s, None)
            self.pending.pop(s, None)

    def nack(self, seq: int, count: int, due_ms: int) -> None:
        """Make ``seq`` (delivered ``count`` times) deliverable again at ``due_ms``."""
        self.out.pop(seq, None)
        self.pending[seq] = (count, due_ms)

    def begin_move(self, rows: dict[int, int], target: str | None, reason: str) -> Move:
        """Take ``rows`` ({_seq: delivery count}) out of delivery for a dead-letter move, the
        next one by number."""
        self.settle_rows(list(rows))
        self.moves += 1
        self.moving = Move(self.moves, target, reason, dict(rows))
        return self.moving

    def finish_move(self) -> None:
        """The move's dead letters are stored (or dropped): its rows are settled."""
        move = self.moving
        assert move is not None
        if move.target is None:
            self.dropped += len(move.rows)
        else:
            self.dead_lettered += len(move.rows)
        self.settled.update(s for s in move.rows if s >= self.ack_point)
        self.moving = None
        while self.ack_point in self.settled:  # settled in order after all
            self.settled.remove(self.ack_point)
            self.ack_point += 1

    def restore_after_crash(self) -> None:
        """Forget what was handed out again (it is pending, due as it was)."""
        self.out.clear()

    @classmethod
    def restore(cls, watermark: int, record: dict[str, Any] | None) -> DeliveryWindow:
        """The window from the ``.wm`` position and the window file's record (or ``None``)."""
        if record is None:
            return cls(watermark)
        counters = {"moves": record.get("moves", 0),
                    "dead_lettered": record.get("dead_lettered", 0),
                    "dropped": record.get("dropped", 0)}
        if watermark < record["floor"]:  # a seek abandoned the rows, not the counts
            return cls(watermark, **counters)
        pending = {s: v for s, v in record["pending"].items() if s >= watermark}
        ack_point = max(record["ack_point"], watermark)
        settled = {s for s in record.get("settled", ()) if s >= ack_point}
        return cls(ack_point, pending, moving=record.get("moving"), settled=settled, **counters)

    def abandon(self, ack_point: int) -> DeliveryWindow:
        """A window at ``ack_point`` with nothing pending, keeping the counters (a seek)."""
        return DeliveryWindow(ack_point, moves=self.moves, dead_lettered=self.dead_lettered,
                              dropped=self.dropped)

    def record(self, floor: int) -> dict[str, Any]:
        """What the window file holds, written over a ``.wm`` at ``floor``."""
        record: dict[str, Any] = {
            "ack_point": self.ack_point, "floor": floor,
            "pending": {s: self.pending[s] for s in sorted(self.pending)}}
        if self.moves:
            record.update(moves=self.moves, dead_lettered=self.dead_lettered,
                          dropped=self.dropped, moving=self.moving,
                          settled=sorted(self.settled))
        return record


class Move:
    """A dead-letter move: its number (the transaction version, see ``_ops/dead_letter.py``),
    the dead-letter address (``None``: the rows are dropped), why, and the rows
    ({_seq: delivery count})."""

    __slots__ = ("number", "reason", "rows", "target")

    def __init__(self, number: int, target: str | None, reason: str,
                 rows: dict[int, int]) -> None:
        self.number = number
        self.target = target
        self.reason = reason
        self.rows = rows

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Move) and self.json() == other.json()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Move({self.number}, {self.target!r}, {len(self.rows)} rows)"

    def json(self) -> dict[str, Any]:
        return {"number": self.number, "target": self.target, "reason": self.reason,
                "rows": [[s, self.rows[s]] for s in sorted(self.rows)]}

    @classmethod
    def from_json(cls, obj: Any) -> Move:
        if not isinstance(obj, dict):
            raise ValueError(f"moving is {obj!r}, not an object")
        target = obj["target"]
        if target is not None and not isinstance(target, str):
            raise ValueError(f"the target of a move is {target!r}, not a name")
        if not isinstance(obj["reason"], str):
            raise ValueError(f"the reason of a move is {obj['reason']!r}, not a string")
        rows = {_int(s, "a moving _seq"): _int(c, "a delivery count") for s, c in obj["rows"]}
        if not rows:
            raise ValueError("a move without rows")
        return cls(_int(obj["number"], "a move number"), target, obj["reason"], rows)


def redelivery_delay_ms(count: int, delay_ms: int, multiplier: float,
                        max_delay_ms: int | None) -> int:
    """Artemis' redelivery delay after the ``count``-th delivery: ``delay_ms`` x
    ``multiplier`` ** (count - 1), at most ``max_delay_ms`` (``None``: 10 x ``delay_ms``)."""
    cap = 10 * delay_ms if max_delay_ms is None else max_delay_ms
    if delay_ms <= 0:
        return 0
    try:
        delay = delay_ms * multiplier ** max(0, count - 1)
    except OverflowError:
        delay = math.inf
    return int(min(delay, cap))


def encode(record: dict[str, Any]) -> bytes:
    """The window file's bytes (checked JSON)."""
    obj: dict[str, Any] = {
        "ack_point": record["ack_point"], "floor": record["floor"],
        "pending": [[s, c, d] for s, (c, d) in record["pending"].items()]}
    if record.get("moves"):
        moving = record["moving"]
        obj.update(moves=record["moves"], dead_lettered=record["dead_lettered"],
                   dropped=record["dropped"], moving=None if moving is None else moving.json(),
                   settled=record["settled"])
    return checked.dumps(obj)


def decode(data: bytes) -> dict[str, Any]:
    """A window file's record; ``ValueError`` (or ``KeyError``/``TypeError``) when it is
    damaged or not a window."""
    obj = checked.loads(data, required=True)
    ack_point = _int(obj["ack_point"], "ack_point")
    floor = _int(obj["floor"], "floor")
    pending: dict[int, tuple[int, int]] = {}
    for item in obj["pending"]:
        seq, count, due = item
        pending[_int(seq, "a pending _seq")] = (_int(count, "a delivery count"),
                                               _int(due, "a due time"))
    if floor > ack_point:
        raise ValueError(f"floor {floor} is above ack_point {ack_point}")
    below = [s for s in pending if s < floor]
    if below:
        raise ValueError(f"pending _seq {below[0]} is below floor {floor}")
    record: dict[str, Any] = {"ack_point": ack_point, "floor": floor, "pending": pending}
    if "moves" in obj:
        moving = obj["moving"]
        record.update(moves=_int(obj["moves"], "moves"),
                      dead_lettered=_int(obj["dead_lettered"], "dead_lettered"),
                      dropped=_int(obj["dropped"], "dropped"),
                      moving=None if moving is None else Move.from_json(moving),
                      settled=[_int(s, "a settled _seq") for s in obj["settled"]])
    return record


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is {value!r}, not an integer >= 0")
    return value
