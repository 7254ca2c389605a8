"""The state of an address: the fold of its commit-log entries (see :mod:`.commit_log`).

Kinds of entries (``op``):

* ``append``: publishes pages; ``seq`` is the first ``_seq``; may carry ``schema`` (base64 Arrow
  IPC schema, when the address's schema is set or grows) and ``txn`` (``{"id", "batch"}``, for
  exactly-once Spark batches and idempotent sends; the keys are described in ``_log.txn``) or,
  for a group commit of several idempotent sends, ``txns`` (a list of them; format 2).
* ``drop``: a send refused by the DROP policy; counts only.
* ``remove``: pages removed by cleanup (the files are deleted after the entry is published);
  written by ``Address.repair`` for pages that were missing or damaged, it also carries
  ``lost``: the ``_seq`` ranges ``[first, end)`` those pages held, which consumers report as
  data loss. Cleanup's removals by retention (``retentionMs`` / ``retentionBytes``) carry
  ``retention``: ``{"lost": ranges, "messages": n, "bytes": n}``, the pages no consumer had
  passed yet (releases before it ignore the key and remove the pages all the same). Its
  removals of pages whose messages all expired (``expiry_delay_ms``, ``ttl_ms``) carry
  ``expired``: ``{"ranges": ranges, "messages": n}``, settled for every consumer: not lost.
* ``lost`` (a journal only): ``Address.repair`` took out a unit that was damaged on disk,
  written in its place (``where``: ``segment@offset``): the messages ``[seq, end)`` it held
  are lost (``lost``, reported by consumers as data loss) and ``next_seq`` moves to ``end``.
  Releases before it refuse the entry (an unknown op) instead of misreading the address.
* ``compact``: compaction's swap (``_ops.compact``). The live rows holding ``[first, end)``,
  listed in ``replaced`` (``[name, seq]`` each, as the log held them), are replaced by
  ``pages``: new page files holding the same messages (``_seq`` and ``_timestamp`` unchanged;
  each page has ``ts`` and ``ts_last``), and, when the last replaced row is a journal row that
  grew past ``end`` since compaction read it, a row for the rest of it. The replaced files
  stay readable for ``compactGraceMs`` (``retired``), then cleanup collects them.

An ``append`` may carry ``ttl: true``: some of its messages were sent with a time to live
(``send(rows, ttl_ms=N)``), stored in their frames (``_format.schema.TTL``). The state keeps
that any append did (``LogState.ttl``), so that a Spark plan records the time its TTLs are
judged at only for addresses that have them; releases before it ignore the key (and the TTLs).

An ``append`` may carry ``sealed``: statistics for runs of small journal units in rolled
segments (``_ops.seal``), ``[segment name, first _seq, messages, statistics]`` each; a run that is
no longer live as named (compacted, removed) is passed over. Maintenance publishes them in an
append of no pages, which versions before it read as the empty append it is.

A checkpoint stores the state as an Arrow table (one row per live page) with the rest of the
state as JSON in its schema metadata.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from .index import PageIndex
from .journal import JournalPosition
from .txn import REMEMBER_SCHEDULED, SCHEDULED_PREFIX

__all__ = ["LogState", "schema_from_text", "schema_to_text", "seq_ranges_text",
           "subtract_ranges"]

REMEMBER_REMOVED = 10_000
REMEMBER_LOST = 10_000
REMEMBER_RETIRED = 10_000


def seq_ranges_text(ranges: Iterable[tuple[int, int]]) -> str:
    """``[first, end)`` ``_seq`` ranges as people read them: ``"100..199, 300..349"``."""
    return ", ".join(f"{a}..{b - 1}" for a, b in ranges)


def subtract_ranges(ranges: Iterable[tuple[int, int]],
                    minus: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[first, end)`` ranges with the parts covered by ``minus`` taken out."""
    out = list(ranges)
    for a, b in minus:
        out = [piece for lo, hi in out
               for piece in ((lo, min(hi, a)), (max(lo, b), hi)) if piece[0] < piece[1]]
    return out


def schema_to_text(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


def schema_from_text(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))



# -- entries: built here, beside the fold that reads them (LogState.apply) ----------------------
Txn = tuple[str, int]


def _txn(txn: Txn) -> dict[str, Any]:
    return {"id": txn[0], "batch": txn[1]}


def append_entry(seq: int, pages: list[dict[str, Any]], *, schema: pa.Schema | None = None,
                 txns: Sequence[Txn] = (), sealed: list[list[Any]] | None = None,
                 ttl: bool = False) -> dict[str, Any]:
    """An ``append`` publishing ``pages`` from ``_seq`` ``seq``: with the address schema when
    it is set or grows, the transactions of its sends (one: ``txn``; a group's: ``txns``,
    format 2), statistics of sealed runs (``sealed``, see ``_ops.seal``), and whether some of
    its messages have a TTL (``ttl``)."""
    entry: dict[str, Any] = {"op": "append", "seq": seq, "pages": pages}
    if schema is not None:
        entry["schema"] = schema_to_text(schema)
    if len(txns) == 1:
        entry["txn"] = _txn(txns[0])
    elif txns:
        entry["txns"] = [_txn(t) for t in txns]
    if sealed:
        entry["sealed"] = sealed
    if ttl:
        entry["ttl"] = True
    return entry


def drop_entry(rows: int, nbytes: int, txn: Txn | None = None) -> dict[str, Any]:
    """A ``drop``: a send of ``rows`` / ``nbytes`` the DROP policy refused (and its
    transaction, so that a retry is a duplicate)."""
    entry: dict[str, Any] = {"op": "drop", "dropped": {"messages": rows, "bytes": nbytes}}
    if txn is not None:
        entry["txn"] = _txn(txn)
    return entry


def remove_entry(pages: list[str], lost: list[tuple[int, int]] | None = None, *,
                 retention: tuple[list[tuple[int, int]], int, int] | None = None,
                 expired: tuple[list[tuple[int, int]], int] | None = None,
                 ) -> dict[str, Any]:
    """A ``remove`` of ``pages`` (cleanup); ``lost``: the ``_seq`` ranges repair gave up;
    ``retention``: ``(ranges, messages, bytes)`` of the pages among them that retention
    removed before every consumer had passed them; ``expired``: ``(ranges, messages)`` of
    the pages among them whose messages all expired before every consumer had passed them."""
    entry: dict[str, Any] = {"op": "remove", "pages": pages}
    if expired is not None:
        entry["expired"] = {"ranges": [list(r) for r in expired[0]], "messages": expired[1]}
    if lost is not None:
        entry["lost"] = lost
    if retention is not None:
        ranges, messages, nbytes = retention
        entry["retention"] = {"lost": [list(r) for r in ranges], "messages": messages,
                              "bytes": nbytes}
    return entry


def merge_ranges(ranges: list[tuple[int, int]], new: Iterable[tuple[int, int]],
                 keep: int) -> list[tuple[int, int]]:
    """``ranges`` with ``new`` appended, a range that starts where the last ends joined to it
    (retention removes the oldest pages, so its ranges mostly follow each other); the last
    ``keep``."""
    out = list(ranges)
    for a, b in new:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out[-keep:]


def lost_entry(first: int, end: int, where: str, reason: str) -> dict[str, Any]:
    """A ``lost``: repair took damage out of a journal at ``where`` (``segment@offset``); the
    messages ``[first, end)`` it held are gone (``end == first``: none, or how many could not
    be told). Its ``_seq`` range is not used again."""
    return {"op": "lost", "seq": first, "end": end, "where": where, "reason": reason}


def compact_entry(first: int, end: int, replaced: list[list[Any]],
                  pages: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``compact``: the rows ``replaced`` (``[name, seq]`` each), which hold ``[first,
    end)``, swapped for ``pages``."""
    return {"op": "compact", "first": first, "end": end, "replaced": replaced, "pages": pages}

@dataclass
class LogState:
    """The fold of an address's log up to ``version``."""

    version: int = 0
    next_seq: int = 0
    last_ts: int = 0  # microseconds; commit timestamps never go backwards
    last_id: str | None = None  # id of the entry this view ends with (None: legacy or empty)
    schema: pa.Schema | None = None
    pages: PageIndex = field(default_factory=PageIndex)
    txns: dict[str, int] = field(default_factory=dict)
    dropped_messages: int = 0
    dropped_bytes: int = 0
    dropped_sends: int = 0
    # Names of the last REMEMBER_REMOVED pages removed by cleanup: a page found on disk that the
    # log removed is a retirement a crash interrupted (archive it), not an orphan (delete it).
    removed: list[str] = field(default_factory=list)
    #: ``[first, end)`` ranges of messages that repair removed because their pages were
    #: missing or damaged (the last REMEMBER_LOST ranges).
    lost: list[tuple[int, int]] = field(default_factory=list)
    #: ``(name, time in epoch microseconds, end)`` of files that compaction's swaps took out
    #: of the log (the last REMEMBER_RETIRED), ``end`` the ``_seq`` after the messages they
    #: held: cleanup leaves them for ``compactGraceMs`` to readers that planned on them before
    #: the swap, unless those messages are no longer retained (no reader needs them then).
    retired: list[tuple[str, int, int]] = field(default_factory=list)
    #: ``[first, end)`` ranges of messages that retention removed before every consumer had
    #: passed them (the last REMEMBER_LOST ranges, joined where they follow each other);
    #: consumers whose watermark was before them report them as lost.
    retention_lost: list[tuple[int, int]] = field(default_factory=list)
    retention_removed_messages: int = 0
    retention_removed_bytes: int = 0
    #: ``[first, end)`` ranges of pages cleanup removed because every message in them expired,
    #: before every consumer had passed them (the last REMEMBER_LOST, joined): settled for
    #: every consumer, never reported as lost; and how many messages they held.
    expired_removed: list[tuple[int, int]] = field(default_factory=list)
    expired_removed_messages: int = 0
    #: Whether an append ever stored messages with a TTL (its ``ttl`` key).
    ttl: bool = False
    #: How many release keys of scheduled files ``txns`` may hold (an upper bound, for
    #: trimming them); not persisted.
    _scheduled_keys: int = 1 << 62
    #: The checkpoint this view was loaded from (0: none); not persisted.
    checkpoint: int = 0
    #: Where the last unit applied ends, for an address with a journal (format 4); ``None``
    #: for one that publishes a file per entry.
    journal: JournalPosition | None = None
    #: Bytes of journal units this view applied since it was loaded or last wrote a
    #: checkpoint; not persisted (what opening would replay after the newest checkpoint).
    unit_bytes: int = 0

    def lost_in(self, begin: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[begin, end)`` that repair removed as damaged or retention removed
        unread (see ``lost``, ``retention_lost``)."""
        return sorted((max(a, begin), min(b, end)) for a, b in (*self.lost,
                                                                  *self.retention_lost)
                      if a < end and b > begin)

    def seek_time(self, ts_us: int) -> int:
        """The first ``_seq`` committed at or after ``ts_us`` (microseconds), ``next_seq``
        when none is retained."""
        return self.pages.seek_time(ts_us, self.next_seq)

    @property
    def first_seq(self) -> int:
        """The lowest retained ``_seq`` (``next_seq`` when nothing is retained)."""
        return self.pages.seq[0] if len(self.pages) else self.next_seq

    def apply(self, version: int, entry: dict[str, Any]) -> None:
        """Fold entry ``version`` in; ``ValueError`` (or a ``KeyError``/``TypeError``) when
        it is malformed, which the log reports as a :class:`DamagedLogError`."""
        op = entry.get("op")
        if op == "append":
            if "schema" in entry:
                self.schema = schema_from_text(entry["schema"])
            seq = int(entry["seq"])
            if seq != self.next_seq:
                raise ValueError(f"it starts at _seq {seq}, expected {self.next_seq}")
            ts = int(entry["ts"])
            for page in entry["pages"]:
                rows = int(page["rows"])
                span = page.get("span")  # a journal unit's range (filled in by the journal)
                self.pages.add(page["name"], seq, rows, int(page["bytes"]), ts, page["stats"],
                               None if span is None else (int(span[0]), int(span[1])))
                seq += rows
            self.next_seq = seq
            if entry.get("ttl"):
                self.ttl = True
            for k, (name, first, rows, stats) in enumerate(entry.get("sealed", ())):
                self.pages.add_stats(str(name), int(first), int(rows),
                                     {**stats, "id": f"{entry.get('id')}/{k}"})
        elif op == "drop":
            self.dropped_messages += int(entry["dropped"]["messages"])
            self.dropped_bytes += int(entry["dropped"]["bytes"])
            self.dropped_sends += 1
        elif op == "remove":
            self.pages = self.pages.without(entry["pages"])
            self.removed = [*self.removed, *entry["pages"]][-REMEMBER_REMOVED:]
            if entry.get("lost"):
                lost = [(int(a), int(b)) for a, b in entry["lost"]]
                self.lost = [*self.lost, *lost][-REMEMBER_LOST:]
            retention = entry.get("retention")
            if retention:
                self.retention_lost = merge_ranges(
                    self.retention_lost, ((int(a), int(b)) for a, b in retention["lost"]),
                    REMEMBER_LOST)
                self.retention_removed_messages += int(retention["messages"])
                self.retention_removed_bytes += int(retention["bytes"])
            expired = entry.get("expired")
            if expired:
                self.expired_removed = merge_ranges(
                    self.expired_removed, ((int(a), int(b)) for a, b in expired["ranges"]),
                    REMEMBER_LOST)
                self.expired_removed_messages += int(expired["messages"])
        elif op == "lost":  # damage repair took out of a journal (issue 38)
            first, end = int(entry["seq"]), int(entry["end"])
            if first != self.next_seq or end < first:
                raise ValueError(f"it loses _seq {first}..{end}, after {self.next_seq}")
            if end > first:
                self.lost = [*self.lost, (first, end)][-REMEMBER_LOST:]
            self.next_seq = end
        elif op == "compact":
            self._swap(entry)
        else:
            raise ValueError(f"unknown op {op!r}: written by a newer version of "
                             "pyspark-durable-queue?")
        self.last_ts = max(self.last_ts, int(entry.get("ts", 0)))
        self.last_id = entry.get("id")
        txns = entry.get("txns") or []  # a group commit's members (format 2)
        if entry.get("txn"):
            txns = [entry["txn"], *txns]
        for txn in txns:
            key = str(txn["id"])
            if key.startswith(SCHEDULED_PREFIX) and key not in self.txns:
                self._forget_old_releases()
            self.txns[key] = max(int(txn["batch"]), self.txns.get(key, -1))
        self.version = version

    def _forget_old_releases(self) -> None:
        # the release keys of scheduled files are needed only until their files are deleted
        # (``_log/txn.py``): keep the newest REMEMBER_SCHEDULED, trimmed in batches of as many
        self._scheduled_keys += 1
        if self._scheduled_keys <= 2 * REMEMBER_SCHEDULED:
            return
        keys = [k for k in self.txns if k.startswith(SCHEDULED_PREFIX)]
        gone = set(keys[:max(0, len(keys) - REMEMBER_SCHEDULED + 1)])
        if gone:
            self.txns = {k: v for k, v in self.txns.items() if k not in gone}
        self._scheduled_keys = len(keys) - len(gone) + 1

    def _swap(self, entry: dict[str, Any]) -> None:
        first, end = int(entry["first"]), int(entry["end"])
        lo, hi = self.pages.covering(first, end)
        held = [(self.pages.names[i], self.pages.seq[i]) for i in range(lo, hi)]
        if held != [(str(n), int(s)) for n, s in entry["replaced"]] or hi == lo \
                or self.pages.seq[lo] != first:
            raise ValueError(f"its compaction of _seq {first}..{end - 1} replaces pages "
                             "the log does not hold there")
        rows = entry["pages"]
        at = first
        for row in rows:
            if int(row["seq"]) != at or int(row["rows"]) <= 0:
                raise ValueError(f"its compacted pages do not hold _seq {first}.. in order")
            at += int(row["rows"])
        if at != self.pages.ends[hi - 1]:
            raise ValueError(f"its compacted pages end at _seq {at}, the pages they replace "
                             f"at {self.pages.ends[hi - 1]}")
        self.pages = self.pages.replaced(first, end, rows)
        kept = {str(row["name"]) for row in rows}
        ts = int(entry["ts"])
        gone = [(name, ts, end) for name in dict.fromkeys(n for n, _ in held)
                if name not in kept]
        self.retired = [*self.retired, *gone][-REMEMBER_RETIRED:]

    def header(self) -> dict[str, Any]:
        return {
            "version": self.version, "next_seq": self.next_seq, "last_ts": self.last_ts,
            "last_id": self.last_id,
            "schema": schema_to_text(self.schema) if self.schema is not None else None,
            "txns": self.txns, "dropped_messages": self.dropped_messages,
            "dropped_bytes": self.dropped_bytes, "dropped_sends": self.dropped_sends,
            "removed": self.removed, "lost": [list(r) for r in self.lost],
            "retired": [list(r) for r in self.retired],
            "retention_lost": [list(r) for r in self.retention_lost],
            "retention_removed_messages": self.retention_removed_messages,
            "retention_removed_bytes": self.retention_removed_bytes,
            "journal": None if self.journal is None else self.journal.to_list(),
            "ttl": self.ttl,
            "expired_removed": [list(r) for r in self.expired_removed],
            "expired_removed_messages": self.expired_removed_messages,
        }

    @classmethod
    def from_checkpoint(cls, table: pa.Table) -> LogState:
        meta = json.loads((table.schema.metadata or {})[b"dq.state"])
        state = cls(
            version=int(meta["version"]), next_seq=int(meta["next_seq"]),
            last_ts=int(meta["last_ts"]), last_id=meta.get("last_id"),
            schema=schema_from_text(meta["schema"]) if meta.get("schema") else None,
            txns={str(k): int(v) for k, v in meta["txns"].items()},
            dropped_messages=int(meta["dropped_messages"]),
            dropped_bytes=int(meta["dropped_bytes"]),
            dropped_sends=int(meta.get("dropped_sends", 0)),
            removed=[str(n) for n in meta.get("removed", [])],
            lost=[(int(a), int(b)) for a, b in meta.get("lost", [])],
            retired=[(str(r[0]), int(r[1]), int(r[2]) if len(r) > 2 else 1 << 62)
                     for r in meta.get("retired", [])],
            retention_lost=[(int(a), int(b)) for a, b in meta.get("retention_lost", [])],
            retention_removed_messages=int(meta.get("retention_removed_messages", 0)),
            retention_removed_bytes=int(meta.get("retention_removed_bytes", 0)),
            ttl=bool(meta.get("ttl", False)),
            expired_removed=[(int(a), int(b)) for a, b in meta.get("expired_removed", [])],
            expired_removed_messages=int(meta.get("expired_removed_messages", 0)),
            checkpoint=int(meta["version"]),
            journal=None if meta.get("journal") is None
            else JournalPosition.from_list(meta["journal"]),
        )
        state.pages = PageIndex.from_table(table)
        return state
