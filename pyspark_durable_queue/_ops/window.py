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

The window is kept in ``consumers/<name>.window`` (:func:`encode`, :func:`decode`; the bytes
are ``_format/window.py``: binary, checksummed, the pending rows as int64 arrays; windows
written as checked JSON by earlier releases of format 5 are still read) replaced atomically.
Its record holds::

    ack_point, floor, pending        as above; ``floor`` is the ``.wm`` it was written over
    moves, dead_lettered, dropped    counters
    settled, moving                  rows settled one by one above the ack point, a move begun

The last five are there while the consumer has dead-lettered a row (``_ops/dead_letter.py``),
or has rows settled one by one above its ack point (a window that never dead-lettered drops
them again once its ack point passes those rows): ``moves`` numbers its dead-letter moves (the
transaction version of each), the two counters add up what went to the dead-letter address and
what was dropped for want of one, ``settled`` holds the rows at or above the ack point settled
one by one (skipped when read again, forgotten once the ack point passes them): dead-lettered
rows, and rows handed out again above the cursor of a consumer reopened at its ack point and
then acknowledged (:meth:`DeliveryWindow.settle_out`), and ``moving`` is a move begun and not
finished: its rows are neither pending nor settled, and hold the watermark until the move is
finished (by the next receive after a crash).

It is O(window): at most ``max_in_flight`` rows are between the watermark and the cursor, so
the file never holds more pending rows. Opening a consumer reads the pending rows as arrays
(``PendingRows``) and answers the open's questions (the watermark is the lowest row, how many
wait, which are due) on them; the ``{_seq: (count, due)}`` dict is built the first time the
consumer changes the rows (:attr:`DeliveryWindow.pending`). The file is written only while
pending rows exist (or when the last one is settled); the fast path (no nacks) writes only the
``.wm``.

Writes go window first, then ``.wm``: the ``.wm`` only rises (``floor`` is the ``.wm`` the
window was written over), so a crash between the two leaves a ``.wm`` at or below the window's
rows. Reading both back (:meth:`DeliveryWindow.restore`): the ack point is the higher of the
two, pending rows below the ``.wm`` are settled (an older release acknowledged past them), and
a ``.wm`` below ``floor`` was moved back by a seek, which abandons the window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .._format import window as window_file
from .._format.window import PendingRows

__all__ = ["DeliveryWindow", "Move", "PendingRows", "decode", "encode", "redelivery_delay_ms"]


class DeliveryWindow:
    """The in-memory window of one consumer (see the module docstring).

    Not thread-safe: the consumer's ``_lock`` guards it. ``out`` (rows of ``pending`` handed
    out again, by delivery count) lives in memory only: after a crash they are pending again,
    due at once.

    The pending rows are either ``_rows`` (read-only arrays, as a window file is decoded) or
    ``_pending`` (a dict, built from ``_rows`` by the first access to :attr:`pending`, which
    every change goes through); ``out`` is empty while they are arrays (:meth:`hand_out`
    reads ``pending``).
    """

    __slots__ = ("_pending", "_rows", "_top", "ack_point", "dead_lettered", "dropped", "moves",
                 "moving", "out", "settled")

    def __init__(self, ack_point: int, pending: Mapping[int, tuple[int, int]] | None = None, *,
                 moves: int = 0, dead_lettered: int = 0, dropped: int = 0,
                 moving: Move | None = None, settled: set[int] | None = None) -> None:
        self.ack_point = ack_point
        self._rows: PendingRows | None = None
        self._pending: dict[int, tuple[int, int]] | None = None
        if isinstance(pending, PendingRows):
            self._rows = pending
            self._top = int(pending.seq[-1]) if len(pending) else -1
        else:
            self._pending = dict(pending or {})
            self._top = max(self._pending, default=-1)
        #: the highest row pending when the window was made: a nack is of a row below the
        #: cursor, so only rows restored with the window can be at or above it (a consumer
        #: reopened at its ack point), and only up to this one (see pending_from)
        self.out: dict[int, int] = {}
        #: rows at or above the ack point settled one by one (dead-lettered, or handed out
        #: again above the cursor after a reopen and acknowledged): never delivered
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
        return (f"DeliveryWindow(ack_point={self.ack_point}, pending={self.pending_count()}, "
                f"out={len(self.out)})")

    @property
    def pending(self) -> dict[int, tuple[int, int]]:
        """``{_seq: (delivery count, due epoch ms)}`` of the rows waiting for redelivery or
        handed out again (built from the arrays on first use)."""
        pending = self._pending
        if pending is None:
            assert self._rows is not None
            pending = self._pending = self._rows.to_dict()
            self._rows = None  # after _pending is set: see _view
        return pending

    def _view(self) -> Mapping[int, tuple[int, int]]:
        """The pending rows as they are, arrays or dict, without building the dict (another
        thread may build it meanwhile: ``_pending`` is set before ``_rows`` is cleared)."""
        pending = self._pending
        if pending is not None:
            return pending
        rows = self._rows
        if rows is not None:
            return rows
        pending = self._pending
        assert pending is not None
        return pending

    def pending_count(self) -> int:
        """How many rows are pending (``len(pending)``, without building it)."""
        return len(self._view())

    @property
    def watermark(self) -> int:
        """Every row below it is settled: ``min(pending)``, or the ack point without any."""
        low = self.ack_point
        pending = self._lowest_pending()
        if pending is not None:
            low = min(low, pending)
        if self.moving is not None:
            low = min(low, min(self.moving.rows))
        return low

    def _lowest_pending(self) -> int | None:
        """The lowest pending row, ``None`` without any."""
        view = self._view()
        if not view:
            return None
        return int(view.seq[0]) if isinstance(view, PendingRows) else min(view)

    @property
    def in_use(self) -> bool:
        """Whether the window file has anything to keep (else it is removed)."""
        return bool(self.pending_count() or self.moving or self.moves or self.settled)

    def waiting(self) -> int:
        """Rows waiting for redelivery (pending and not handed out again)."""
        return self.pending_count() - len(self.out)

    def summary(self, now_ms: int) -> tuple[int, int, int]:
        """``(pending, not due at now_ms, highest delivery count)`` of the pending rows."""
        view = self._view()
        if isinstance(view, PendingRows):
            return len(view), view.delayed(now_ms), view.max_count()
        values = list(view.values())
        return (len(values), sum(1 for _, due in values if due > now_ms),
                max((count for count, _ in values), default=0))

    def in_flight(self, cursor: int) -> int:
        """Rows delivered and not settled, with the consumer's cursor at ``cursor``: those
        between the ack point and the cursor, less the pending ones there that wait for
        redelivery and those settled one by one, plus those handed out again outside that
        range (below the ack point, or above the cursor of a consumer reopened at its ack
        point). With a selector the cursor passes rows it did not match too, so this is then
        an upper bound.

        Safe to call from another thread (the lease's heartbeat): it reads copies, made
        without the consumer's lock (one C-level copy each)."""
        out, ack_point, view = set(self.out), self.ack_point, self._view()
        if isinstance(view, PendingRows):
            waiting = max(0, view.count_from(ack_point) - view.count_from(cursor)) - sum(
                1 for s in out if ack_point <= s < cursor and s in view)
        else:
            pending = dict(view)
            waiting = sum(1 for s in pending if ack_point <= s < cursor and s not in out)
        done = sum(1 for s in set(self.settled) if ack_point <= s < cursor)
        again = sum(1 for s in out if s < ack_point or s >= cursor)
        return max(0, cursor - ack_point - waiting - done + again)

    def due(self, now_ms: int, limit: int) -> list[int]:
        """Up to ``limit`` pending rows due at ``now_ms`` and not handed out, lowest first."""
        rows = self._rows if self._pending is None else None
        if rows is not None:  # nothing is handed out (see the class docstring)
            return rows.due_by(now_ms, limit)
        if len(self.out) == len(self.pending):
            return []
        ready = [s for s, (_, due) in self.pending.items() if due <= now_ms and s not in self.out]
        ready.sort()
        return ready[:limit]

    def next_due_ms(self) -> int | None:
        """When the next waiting row is due (epoch ms), ``None`` without any."""
        rows = self._rows if self._pending is None else None
        if rows is not None:
            return rows.next_due_ms()
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
        """Acknowledge cumulatively up to ``point`` (exclusive): the ack point rises (and on
        past the rows settled one by one it reaches), and rows handed out again below it are
        settled; rows waiting for redelivery are not. Whether the durable window changed."""
        changed = False
        if point > self.ack_point:
            self.ack_point = point
            changed = self.pending_count() > 0
            if self.settled:
                self.settled = {s for s in self.settled if s >= point}
                self._pass_settled()
                changed = True
        for s in [s for s in self.out if s < point]:
            del self.out[s]
            del self.pending[s]
            changed = True
        return changed

    def settle_below(self, point: int) -> bool:
        """Settle every row below ``point`` (exclusive), whatever the window holds there: as
        :meth:`settle`, and the rows waiting for redelivery below it too (a reader of the
        whole range delivered them: the Spark source's commit). The rows of a move in
        progress are not touched (finish it first). Whether the durable window changed."""
        changed = self.settle(point)
        low = self._lowest_pending()
        if low is not None and low < point:
            self.settle_rows([s for s in self.pending if s < point])
            changed = True
        return changed

    def unsettled(self, begin: int, end: int) -> list[tuple[int, int]]:
        """The rows of ``[begin, end)`` not settled, as sorted disjoint ``[lo, hi)`` runs:
        below the ack point the pending ones, from it on every row but those settled one by
        one; never the rows of a move in progress (they go to the dead letters). What the
        Spark source reads of a range (``[(begin, end)]`` for a window without any of them)."""
        if begin >= end:
            return []
        skip = set(self.settled)
        if self.moving is not None:
            skip.update(self.moving.rows)
        if begin >= self.ack_point and not skip:
            return [(begin, end)]
        rows: list[int] = []
        below = min(end, self.ack_point)
        if begin < below:
            view = self._view()
            if isinstance(view, PendingRows):
                rows = [s for s in view.since(begin).seq.tolist() if s < below]
            else:
                rows = sorted(s for s in view if begin <= s < below)
        runs: list[tuple[int, int]] = []
        for s in rows:
            if s not in skip:
                _add_run(runs, s, s + 1)
        lo = max(begin, self.ack_point)
        for s in sorted(x for x in skip if lo <= x < end):
            _add_run(runs, lo, s)
            lo = s + 1
        _add_run(runs, lo, end)
        return runs

    def settle_out(self, seqs: list[int]) -> bool:
        """Settle rows handed out again one by one, whatever the ack point (rows of ``seqs``
        that are not handed out again are left as they are): a consumer reopened at its ack
        point hands out the rows its window kept above it before the rows below them, and
        acknowledging those must not settle the rows below, which it has not handed out yet.
        The rows at or above the ack point are kept in ``settled`` (skipped when read again,
        forgotten once the ack point passes them). Whether the window changed."""
        taken = [s for s in seqs if s in self.out]
        self.settle_rows(taken)
        self.settled.update(s for s in taken if s >= self.ack_point)
        self._pass_settled()
        return bool(taken)

    def _pass_settled(self) -> None:
        """Move the ack point past the rows settled one by one that it reaches (settled in
        order after all)."""
        while self.ack_point in self.settled:
            self.settled.remove(self.ack_point)
            self.ack_point += 1

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
        self._pass_settled()

    def pending_from(self, cursor: int) -> list[int]:
        """The pending rows at or above ``cursor`` (waiting or handed out again), lowest
        first: a consumer reopened at its ack point reads them again and must not deliver
        them as new (they come back through :meth:`due`, counted). Cheap once the cursor is
        past the rows the window was restored with."""
        if cursor > self._top:
            return []
        view = self._view()
        if isinstance(view, PendingRows):
            return view.since(cursor).seq.tolist()
        return sorted(s for s in view if s >= cursor)

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
        pending: Mapping[int, tuple[int, int]] = record["pending"]
        if isinstance(pending, PendingRows):
            pending = pending.since(watermark)
        else:
            pending = {s: v for s, v in pending.items() if s >= watermark}
        ack_point = max(record["ack_point"], watermark)
        settled = {s for s in record.get("settled", ()) if s >= ack_point}
        return cls(ack_point, pending, moving=record.get("moving"), settled=settled, **counters)

    def abandon(self, ack_point: int) -> DeliveryWindow:
        """A window at ``ack_point`` with nothing pending, keeping the counters (a seek)."""
        return DeliveryWindow(ack_point, moves=self.moves, dead_lettered=self.dead_lettered,
                              dropped=self.dropped)

    def record(self, floor: int) -> dict[str, Any]:
        """What the window file holds, written over a ``.wm`` at ``floor`` (``pending`` as it
        is: the arrays of a window nobody changed, written and compared as they are, or a copy
        of the dict)."""
        view = self._view()
        record: dict[str, Any] = {
            "ack_point": self.ack_point, "floor": floor,
            "pending": view if isinstance(view, PendingRows) else dict(view)}
        if self.moves or self.settled:
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


def _add_run(runs: list[tuple[int, int]], lo: int, hi: int) -> None:
    """Append ``[lo, hi)`` to sorted runs, joined to the last one when they touch."""
    if lo >= hi:
        return
    if runs and runs[-1][1] == lo:
        runs[-1] = (runs[-1][0], hi)
    else:
        runs.append((lo, hi))


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
    """The window file's bytes (``_format/window.py``)."""
    moving = record.get("moving")
    if isinstance(moving, Move):
        record = dict(record, moving=moving.json())
    return window_file.encode(record)


def decode(data: bytes) -> dict[str, Any]:
    """A window file's record (binary, or checked JSON as written before), ``moving`` as a
    :class:`Move`; ``ValueError`` (or ``KeyError``/``TypeError``) when it is damaged or not a
    window."""
    record = window_file.decode(data)
    if record.get("moving") is not None:
        record["moving"] = Move.from_json(record["moving"])
    return record


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is {value!r}, not an integer >= 0")
    return value
