"""Metrics of an address and its consumers for monitoring: what ``Address.stats`` adds to its
counts, and what the Prometheus collector (``pyspark_durable_queue.metrics``) exports.

Who calls it: ``Address.stats``, in whatever process asks (the CLI, a collector's scrape).

Cheap by design: nothing here reads the backlog. Per consumer:

* ``oldest_unsettled_seq``, ``oldest_unsettled_timestamp_ms``, ``oldest_unsettled_age_ms``:
  the first unsettled message is the one at the consumer's watermark (or the first retained
  one, when retention removed messages below it; or the first that has not expired, since an
  expired message counts as settled), *whatever its selector*: a consumer with a
  selector may not want that message, but it holds the watermark, and so its page, until the
  consumer acknowledges past it. Its commit time comes from the page index
  (:func:`message_time_us`): exact when the message starts an index row or the row was one
  commit (a page file of one send, a large journal unit); inside a compacted page, the first
  time of its frame (the footer's frame statistics; a frame is ~1 MiB of messages, so the age
  may be that much too high); inside a run of small journal units, its unit's time from the
  segment's unit directory (listing it reads the run's unit heads once a process, at most one
  segment, then only new units). The answers are kept in :data:`_TIMES` (they never change).
* ``in_flight``: messages delivered and not settled, as the owner's lease claim last said
  (``_ops.lease``: the owner writes it with each renewal, every third of the lease: a client
  consumer's process every 20 s, from its cursor; a Spark query's driver, the batch it planned
  and Spark has not committed), lowered by what was acknowledged since; 0 when no process owns
  the consumer (what a dead owner had in flight is delivered again).

Per address: ``oldest_message_age_ms``, the age of the first retained message (the row's
commit time, exact).
"""

from __future__ import annotations

from typing import Any

from .._bounded import BoundedLRU
from .._format.layout import LEASES, AddressLayout
from .._format.page import read_footer
from .._format.schema import TIMESTAMP
from .._log.index import PageIndex, PageRef
from .._log.journal import seek_units, unit_time
from .._log.state import LogState
from .._read.cache import page_cache
from .._storage import NotFound, Storage
from .lease import live_claim

__all__ = ["Backlogs", "address_metrics", "consumer_metrics", "leased", "message_time_us",
           "oldest_unsettled"]

#: Commit times of messages looked up inside index rows, per process: ``(pages folder, row's
#: file, row's first _seq, row's first time, _seq)`` to epoch microseconds. A message's time never
#: changes, so an idle consumer's answer is read once.
_TIMES: BoundedLRU[tuple[str, str, int, int, int], int] = BoundedLRU(
    "message times looked up for stats", 16_384)


class Backlogs:
    """``_ops.commit.backlog_after`` of many positions over one state (every consumer of
    ``stats()``): sums over the page index once, then each position costs a binary search, so
    a scrape does not grow with consumers x pages.

    Bytes of a partly consumed page count its remaining share, as ``backlog_after`` counts
    them (the page's share rounded down, then the whole pages after it)."""

    __slots__ = ("_bytes_after", "_idx", "_rows_after")

    def __init__(self, state: LogState) -> None:
        idx = self._idx = state.pages
        n = len(idx)
        rows_after, bytes_after = [0] * (n + 1), [0] * (n + 1)
        for j in range(n - 1, -1, -1):
            rows_after[j] = rows_after[j + 1] + idx.rows[j]
            bytes_after[j] = bytes_after[j + 1] + idx.bytes[j]
        self._rows_after, self._bytes_after = rows_after, bytes_after

    def after(self, position: int) -> tuple[int, int]:
        """``(messages, bytes)`` retained at ``_seq >= position``."""
        idx = self._idx
        i = idx.find(position)
        if i >= len(self._rows_after) - 1:
            return 0, 0
        rows = idx.rows[i]
        take = min(rows, idx.ends[i] - max(position, idx.seq[i]))
        return (take + self._rows_after[i + 1],
                idx.bytes[i] * take // max(1, rows) + self._bytes_after[i + 1])


def message_time_us(storage: Storage, pages_folder: str, idx: PageIndex, i: int,
                    seq: int) -> int:
    """The commit time (epoch microseconds) of the live message ``seq`` of index row ``i``
    (see the module docstring for how exact it is)."""
    first, ts = idx.seq[i], idx.ts[i]
    if seq <= first or ts == idx.ts_last[i]:
        return ts
    name, span = idx.names[i], idx.spans[i]
    path = f"{pages_folder}/{name}"

    def load() -> int:
        if span is not None:  # a run of small journal units: its unit directory
            found = unit_time(storage, path, span, seq)
            return ts if found is None else found
        # a compacted page: its frames' statistics hold their messages' times
        footer = page_cache().footer(path, lambda: read_footer(storage, path, idx.bytes[i]))
        at = first
        for frame in footer["frames"]:
            rows = int(frame["rows"])
            if at + rows > seq:
                low = frame.get("stats", {}).get("columns", {}).get(TIMESTAMP, {}).get("min")
                return ts if low is None else max(ts, int(low) * 1000)
            at += rows
        return ts

    try:
        return _TIMES.get_or_load((pages_folder, name, first, ts, seq), load)
    except NotFound:  # removed meanwhile (cleanup, compaction): the row's first time
        return ts


def oldest_unsettled(storage: Storage, layout: AddressLayout, state: LogState,
                     position: int, expire_before: int | None = None
                     ) -> tuple[int | None, int | None]:
    """``(_seq, commit time in epoch ms)`` of the first retained message at or after
    ``position`` (a consumer's watermark) that has not expired (committed at or after
    ``expire_before``, epoch microseconds: an expired message counts as settled), ``(None,
    None)`` when there is none."""
    idx = state.pages
    i = idx.find(position)
    if i >= len(idx):
        return None, None
    seq = max(position, idx.seq[i])
    ts = message_time_us(storage, layout.pages, idx, i, seq)
    if expire_before is not None and ts < expire_before:
        # commit times never go backwards: the first unexpired message is found by time (in
        # a run of journal units by its unit directory; in a compacted page, the page's start:
        # a message that may have expired)
        def refine(ref: PageRef, ts_us: int) -> int | None:
            if ref.span is None:
                return None
            return seek_units(storage, f"{layout.pages}/{ref.name}", ref.span, ts_us)

        seq = max(seq, idx.seek_time(expire_before, state.next_seq, refine))
        i = idx.find(seq)
        if i >= len(idx):
            return None, None
        seq = max(seq, idx.seq[i])
        ts = message_time_us(storage, layout.pages, idx, i, seq)
    return seq, ts // 1000


def leased(storage: Storage, layout: AddressLayout) -> set[str]:
    """The consumers that ever had an owner (a lease folder): one listing, so that
    :func:`consumer_metrics` looks for no claim of the others."""
    return set(storage.list(f"{layout.consumers}/{LEASES}"))


def consumer_metrics(storage: Storage, layout: AddressLayout, state: LogState, name: str,
                     row: dict[str, Any], *, checksums: bool, now_ms: int,
                     expire_before: int | None = None,
                     owned: set[str] | None = None) -> dict[str, Any]:
    """What a consumer's stats row gains (``row``: its ``position``, ``ack_point`` and
    ``redelivery_pending``, as ``Address.stats`` built them; ``expire_before``: the address's
    expiry, see ``AddressSettings.expire_before``; ``owned``: :func:`leased`, else each
    consumer's lease folder is looked at). JSON-safe."""
    seq, ts_ms = oldest_unsettled(storage, layout, state, int(row["position"]), expire_before)
    claim = None
    if owned is None or name in owned:
        claim = live_claim(storage, layout.leases(name), checksums=checksums,
                           now=now_ms / 1000)
    status = (claim or {}).get("status") or {}
    in_flight = 0
    if isinstance(status.get("in_flight"), int) and isinstance(status.get("cursor"), int):
        # what was acknowledged since the claim was written is no longer in flight
        in_flight = max(0, min(status["in_flight"], status["cursor"] - int(row["ack_point"])
                               + int(row["redelivery_pending"])))
    return {"oldest_unsettled_seq": seq, "oldest_unsettled_timestamp_ms": ts_ms,
            "oldest_unsettled_age_ms": 0 if ts_ms is None else max(0, now_ms - ts_ms),
            "in_flight": in_flight}


def address_metrics(state: LogState, *, now_ms: int) -> dict[str, Any]:
    """What an address's stats gain: the age of its first retained message (0 without any)."""
    idx = state.pages
    if not len(idx):
        return {"oldest_message_age_ms": 0}
    return {"oldest_message_age_ms": max(0, now_ms - idx.ts[0] // 1000)}
