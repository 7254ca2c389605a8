"""Moving expired messages to the address's ``expiry_address`` (Artemis' ``expiry-address``).

Who calls it: ``Address.move_expired`` (on demand), and ``Address.maybe_cleanup`` /
``Address.cleanup`` before they remove pages, when the address has an ``expiry_address``.
Consumers go on skipping expired messages as before (``expiry_delay_ms``, ``ttl_ms``); this
module moves each of them once per address, not once per consumer, as a row of the expiry
address with its origin (the dead-letter columns of ``_ops/dead_letter.py``, ``reason``
``"expired"``, ``origin_consumer`` empty, ``delivery_count`` 0).

An address-level cursor walks the messages in ``_seq`` order. For each message from it, as of
the pass's time ``now`` and the lowest consumer watermark ``W`` (no consumer: nothing is
consumed):

* expired (``_timestamp`` before ``now - expiry_delay_ms``, or ``_timestamp + ttl_ms`` before
  ``now``): moved, unless the previous pass (its time ``t0`` and lowest watermark ``W0``)
  proves every consumer had taken it while it was alive (``_seq < W0`` and its deadline at or
  after ``t0``);
* never expires (no delay, no TTL): passed;
* not expired yet, but every consumer has passed it (``_seq < W``): consumed, passed;
* otherwise: the cursor stops there (it may still expire while a consumer needs it).

A message that every consumer acknowledged between two passes and that expired in that same
interval cannot be told from one that expired unread and was skipped: it is moved (the safe
side: nothing expired is lost, and the interval is ``cleanup_interval_ms``).

The move is the dead letters' idempotent two-step, with write-once numbered files
``expiry/<N>.json`` (checked JSON) as its record:

1. intent: ``{"cursor": C, "moving": {"end": E, "now": T, "expire_before": X, "watermark": W,
   "before": [W0, t0]}}`` created as file ``N`` (exclusively: of processes racing, one wins;
   the others finish the winner's move);
2. the rows of ``[C, E)`` that the rule above moves, judged with the recorded values (so a
   repeat picks the same rows), sent to the expiry address under the transaction key
   :func:`move_key` ``(origin, N)``: a repeat after a crash is a duplicate;
3. settled: ``{"cursor": E, "seen": [W, T], "moved": M}`` created as file ``N + 1`` (``M``:
   the messages every move so far stored, carried by each intent and settle: ``stats()``'s
   ``expired_moved_messages``).

Cleanup keeps the pages from the cursor on (:func:`cursor` is a position as a consumer's is),
so what a move will read is still there; retention may still remove them (lost, as for
consumers). Older record files are deleted after each settle (the last two stay).

Concurrency guarantee: any number of processes and threads may run passes at once; each record
number is created once, and a move's rows are stored once in the expiry address.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .._format import checked
from .._format.layout import is_numbered, numbered
from .._format.schema import SEQ, TIMESTAMP, TTL, TTL_FIELD
from .._read.scan import Scan
from .._storage import NotFound
from ..errors import DamagedMetadataError
from .commit import CommitResult
from .context import OnAddress
from .dead_letter import letters

__all__ = ["ExpiryMover", "ExpiryReport", "cursor", "move_key"]

log = logging.getLogger(__name__)

#: The namespace of expiry moves among the commit log's transaction keys (``_log/txn.py``).
KEY_PREFIX = "expiry:"
#: Messages one move examines at most (its rows are held in memory once).
MOVE_ROWS = 10_000
REASON = "expired"

#: What a pass sends with: ``send(target address, rows, transaction key)``.
Send = Callable[[str, pa.Table, tuple[str, int]], CommitResult]


def move_key(origin: str, number: int) -> tuple[str, int]:
    """The transaction key of ``origin``'s expiry move recorded as file ``number``, in the
    expiry address's log (versions only rise: records are numbered in order, and a move is
    settled before the next starts)."""
    return f"{KEY_PREFIX}{origin}", number


@dataclass
class ExpiryReport:
    """What a pass did: ``moves`` finished (each one transaction in the expiry address),
    ``moved`` messages stored there, and the cursor after it."""

    moves: int = 0
    moved: int = 0
    cursor: int = 0


def cursor(ctx: OnAddress) -> int | None:
    """Where the address's expiry cursor is (the ``_seq`` before which every message was
    moved or passed), ``None`` when the address has no ``expiry_address``. Cleanup keeps the
    pages from it on."""
    if not ctx.settings.expiry_address:
        return None
    latest = _latest(ctx)
    return 0 if latest is None else int(latest[1]["cursor"])


def _latest(ctx: OnAddress) -> tuple[int, dict[str, Any]] | None:
    """The newest record file ``(number, record)``, ``None`` before the first pass."""
    folder = ctx.layout.expiry
    numbers = sorted((int(n[:-5]) for n in ctx.storage.list(folder)
                      if n.endswith(".json") and is_numbered(n[:-5])), reverse=True)
    for number in numbers:
        path = f"{folder}/{numbered(number)}.json"
        try:
            return number, checked.loads(ctx.storage.read(path), required=True)
        except NotFound:
            continue  # pruned by another process meanwhile: a newer one exists
        except (ValueError, TypeError) as exc:
            raise DamagedMetadataError(
                path, str(exc), f"expiry record {path} is damaged ({exc}); move it aside and "
                "run cleanup again (moves already made stay duplicates)") from exc
    return None


class ExpiryMover(OnAddress):
    """One address's expiry moves (see the module docstring)."""

    def move(self, send: Send, *, now: float | None = None,
             max_moves: int | None = None) -> ExpiryReport:
        """Move what expired by ``now`` (epoch seconds, default the clock), move by move,
        until the cursor stops or reaches the log's end; at most ``max_moves`` moves."""
        report = ExpiryReport()
        target = self.settings.expiry_address
        if not target:
            return report
        if target == self.name:
            from ..errors import InvalidOptionError

            raise InvalidOptionError(
                f"address {self.name!r} names itself as its expiry_address; expired messages "
                "must go elsewhere (e.g. expiry_address='ExpiryQueue')")
        now = time.time() if now is None else now
        self.storage.makedirs(self.layout.expiry)
        while max_moves is None or report.moves < max_moves:
            latest = _latest(self)
            number, record = (0, {"cursor": 0}) if latest is None else latest
            report.cursor = int(record["cursor"])
            if record.get("moving"):
                report.moved += self._finish(number, record, target, send)
                report.moves += 1
                continue
            intent = self._plan(record, now)
            if intent is None:
                break
            self.storage.create(self._path(number + 1), checked.dumps(intent))
            # won or lost, the newest record is now an intent: the next round finishes it
        return report

    def moved(self) -> int:
        """Messages the address's expiry moves stored in its ``expiry_address`` so far (0
        before the first move, or for records written before the count was kept)."""
        if not self.settings.expiry_address:
            return 0
        latest = _latest(self)
        if latest is None:
            return 0
        record = latest[1]  # a settle, or an intent (which carries the count before it)
        return int(record.get("moved", (record.get("moving") or {}).get("moved", 0)))

    def _path(self, number: int) -> str:
        return f"{self.layout.expiry}/{numbered(number)}.json"

    def _plan(self, record: dict[str, Any], now: float) -> dict[str, Any] | None:
        """The next move's intent from a settled ``record``, ``None`` when the cursor cannot
        move (nothing after it, or its first message may still expire and is needed)."""
        state = self.log.refresh()
        start = max(int(record["cursor"]), state.first_seq)
        if start >= state.next_seq or state.schema is None:
            return None
        delay = self.settings.expiry_delay_ms
        if delay <= 0 and not state.ttl:
            # nothing can expire: the cursor follows the log (a move of no rows)
            return {"cursor": start, "moving": {
                "end": state.next_seq, "now": int(now * 1e6), "moved": int(record.get("moved", 0)),
                "expire_before": None,
                "watermark": -1, "before": [-1, 0], "none": True}}
        positions = [int(c["position"]) for c in self.consumers.all().values()]
        intent = {"end": 0, "now": int(now * 1e6), "moved": int(record.get("moved", 0)),
                  "expire_before": self.settings.expire_before(now),
                  "watermark": min(positions) if positions else -1,
                  "before": list(record.get("seen") or [-1, 0])}
        end, _rows = self._judge(start, min(state.next_seq, start + MOVE_ROWS), intent)
        if end <= start:
            return None
        intent["end"] = end
        return {"cursor": start, "moving": intent}

    def _judge(self, start: int, stop: int,
               intent: dict[str, Any]) -> tuple[int, pa.Table | None]:
        """Walk ``[start, stop)`` by the rule of the module docstring with the intent's
        values: ``(where the cursor stops, the rows to move)``."""
        state = self.log.state
        assert state.schema is not None
        schema = state.schema.append(TTL_FIELD)  # the hidden column read through
        now, expire_before = int(intent["now"]), intent["expire_before"]
        watermark = int(intent["watermark"])
        before_w, before_t = (int(v) for v in intent["before"])
        # the recorded cutoff, not the settings: a repeat judges as the first attempt did
        delay_us = None if expire_before is None else now - int(expire_before)
        moving: list[pa.RecordBatch] = []
        end = start
        for batch, after in Scan(self.storage, self.layout.pages, state.pages.refs(start, stop),
                                 start, stop, schema=schema, fail_on_data_loss=False):
            if batch is None or not batch.num_rows:
                end = after
                continue
            seqs = batch.column(SEQ).to_numpy()
            ts = batch.column(TIMESTAMP).cast(pa.int64()).to_numpy()
            ttl = batch.column(TTL)
            has_ttl = ~np.asarray(ttl.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            ttl_us = np.where(has_ttl, ttl.fill_null(0).to_numpy() * 1000, 0)
            never = np.iinfo(np.int64).max
            deadline = np.full(len(seqs), never, dtype=np.int64)
            if delay_us is not None:
                deadline = np.minimum(deadline, ts + delay_us)
            deadline = np.where(has_ttl, np.minimum(deadline, ts + ttl_us), deadline)
            expired = deadline < now
            taken_alive = (seqs < before_w) & (deadline >= before_t)
            move = expired & ~taken_alive
            blocked = ~expired & (deadline != never) & (seqs >= watermark)
            if blocked.any():
                first = int(np.argmax(blocked))
                move[first:] = False
                end = int(seqs[first])
                if move.any():
                    moving.append(batch.filter(pa.array(move)))
                break
            if move.any():
                moving.append(batch.filter(pa.array(move)))
            end = after
        rows = pa.Table.from_batches(moving) if moving else None
        return end, rows

    def _finish(self, number: int, record: dict[str, Any], target: str, send: Send) -> int:
        """Send the rows of the intent recorded as file ``number`` and settle it; the rows
        sent (0 when they were sent before: a duplicate)."""
        start, intent = int(record["cursor"]), record["moving"]
        end = int(intent["end"])
        sent = judged = 0
        if not intent.get("none"):
            self.log.refresh()
            _end, rows = self._judge(start, end, intent)
            if rows is not None and rows.num_rows:
                judged = rows.num_rows
                table = letters(self.name, "", rows, dict.fromkeys(
                    rows.column(SEQ).to_pylist(), 0), REASON)
                result = send(target, table, move_key(self.name, number))
                if not result.duplicate:
                    sent = rows.num_rows
                    log.info("address %s: %d expired messages (_seq %d..%d) moved to %s",
                             self.name, sent, start, end - 1, target)
        settled = {"cursor": end, "seen": [int(intent["watermark"]), int(intent["now"])],
                   "moved": int(intent.get("moved", 0)) + judged}
        self.storage.create(self._path(number + 1), checked.dumps(settled))
        for old in range(max(0, number - 3), number):
            try:
                self.storage.delete(self._path(old))
            except NotFound:
                pass
        return sent
