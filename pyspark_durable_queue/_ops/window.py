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

    {"ack_point": 1200, "floor": 1187, "pending": [[1187, 1, 1732240060400], ...]}

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

__all__ = ["DeliveryWindow", "decode", "encode", "redelivery_delay_ms"]


class DeliveryWindow:
    """The in-memory window of one consumer (see the module docstring).

    Not thread-safe: the consumer's ``_lock`` guards it. ``out`` (rows of ``pending`` handed
    out again, by delivery count) lives in memory only: after a crash they are pending again,
    due at once.
    """

    __slots__ = ("ack_point", "out", "pending")

    def __init__(self, ack_point: int, pending: dict[int, tuple[int, int]] | None = None) -> None:
        self.ack_point = ack_point
        self.pending: dict[int, tuple[int, int]] = dict(pending or {})
        self.out: dict[int, int] = {}

    def __repr__(self) -> str:
        return (f"DeliveryWindow(ack_point={self.ack_point}, pending={len(self.pending)}, "
                f"out={len(self.out)})")

    @property
    def watermark(self) -> int:
        """Every row below it is settled: ``min(pending)``, or the ack point without any."""
        if not self.pending:
            return self.ack_point
        return min(self.ack_point, min(self.pending))

    def waiting(self) -> int:
        """Rows waiting for redelivery (pending and not handed out again)."""
        return len(self.pending) - len(self.out)

    def in_flight(self, cursor: int) -> int:
        """Rows delivered and not settled, with the consumer's cursor at ``cursor``: those
        between the ack point and the cursor, less the pending ones there that wait for
        redelivery, plus those handed out again below the ack point. With a selector the
        cursor passes rows it did not match too, so this is then an upper bound.

        Safe to call from another thread (the lease's heartbeat): it reads copies, made
        without the consumer's lock (one C-level copy each)."""
        pending, out, ack_point = dict(self.pending), set(self.out), self.ack_point
        waiting = sum(1 for s in pending if s >= ack_point and s not in out)
        again = sum(1 for s in out if s < ack_point)
        return max(0, cursor - ack_point - waiting + again)

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

    def restore_after_crash(self) -> None:
        """Forget what was handed out again (it is pending, due as it was)."""
        self.out.clear()

    @classmethod
    def restore(cls, watermark: int, record: dict[str, Any] | None) -> DeliveryWindow:
        """The window from the ``.wm`` position and the window file's record (or ``None``)."""
        if record is None or watermark < record["floor"]:
            return cls(watermark)
        pending = {s: v for s, v in record["pending"].items() if s >= watermark}
        return cls(max(record["ack_point"], watermark), pending)

    def record(self, floor: int) -> dict[str, Any]:
        """What the window file holds, written over a ``.wm`` at ``floor``."""
        return {"ack_point": self.ack_point, "floor": floor,
                "pending": {s: self.pending[s] for s in sorted(self.pending)}}


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
    return checked.dumps({"ack_point": record["ack_point"], "floor": record["floor"],
                          "pending": [[s, c, d] for s, (c, d) in record["pending"].items()]})


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
    return {"ack_point": ack_point, "floor": floor, "pending": pending}


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is {value!r}, not an integer >= 0")
    return value
