"""Cleanup: pages every consumer has passed, orphans of dead writers, and expired log entries.

Who calls it: ``Address.cleanup`` (the client, the CLI's ``cleanup``), and ``maybe_cleanup``
after an acknowledgement (``Consumer.ack``, the Spark source's ``commit``) or a Spark sink commit,
at most every ``cleanup_interval_ms`` across all processes (the time of the last cleanup is kept
in the address folder, since Spark runs commits in short-lived processes).

A page goes once every consumer's watermark is past it, or the consumer's selector provably
cannot match it (so middle pages go too). Cleanup publishes a ``remove`` entry first and deletes
(or, with ``archive_data_logs``, archives) the files after, so a crash in between leaves files
the log no longer lists: the next cleanup finishes their retirement. Page files no entry ever
published (a writer died) are orphans once older than ``orphan_grace_ms``.

Retention (``retention_ms``, ``retention_bytes``; Kafka's ``retention.ms`` / ``retention.bytes``)
goes further, whatever the consumers: the oldest whole pages go, read or not, while the address
holds more than ``retention_bytes`` without them, and while their newest message is older than
``retention_ms`` (:func:`retention_cut`). A page file is a unit; a journal segment is one (its
rows go together, and never the segment being written), so the bytes bound is met to within
one page. The ``remove`` entry says which messages retention took before every consumer had
passed them (``retention``: their ranges, which a consumer behind them reports as lost, and
counts that ``stats()`` adds up).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._format import checked
from .._format.schema import TTL, compile_selector
from .._log.commit_log import LogState
from .._log.journal import is_segment, segment_name, segment_number
from .._log.state import merge_ranges, remove_entry
from .._storage import TEMP_FOLDER, NotFound
from ..errors import DurableQueueError
from ..settings import AddressSettings
from .context import AddressContext, OnAddress
from .expiry import cursor as expiry_cursor

__all__ = ["CleanupReport", "Cleaner"]

log = logging.getLogger(__name__)

@dataclass
class CleanupReport:
    """Pages cleanup removed (or would remove, in a dry run)."""

    dry_run: bool
    pages: list[str] = field(default_factory=list)
    bytes: int = 0
    orphans: list[str] = field(default_factory=list)
    archived: bool = False
    #: commit-log entries and checkpoints past ``log_retention_ms`` that a checkpoint covers
    log_files: list[str] = field(default_factory=list)
    #: of ``pages``, what retention removed before every consumer had passed it: the ``_seq``
    #: ranges, messages and bytes
    retention_lost: list[tuple[int, int]] = field(default_factory=list)
    retention_messages: int = 0
    retention_bytes: int = 0
    #: of ``pages``, those whose messages all expired before every consumer had passed them
    #: (settled for all: not lost): the ``_seq`` ranges and messages
    expired: list[tuple[int, int]] = field(default_factory=list)
    expired_messages: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "pages": self.pages, "bytes": self.bytes,
                "orphans": self.orphans, "archived": self.archived,
                "log_files": self.log_files,
                "retention_lost": [list(r) for r in self.retention_lost],
                "retention_messages": self.retention_messages,
                "retention_bytes": self.retention_bytes,
                "expired": [list(r) for r in self.expired],
                "expired_messages": self.expired_messages}


class Cleaner(OnAddress):
    """Cleanup of one address (see the module docstring).

    Concurrency guarantee: cleanups in several processes may overlap; each decides on the
    freshest log and re-reads the consumers right before publishing its ``remove`` entry, so a
    consumer created (or moved back) meanwhile keeps the pages it was promised.
    """

    def __init__(self, ctx: AddressContext) -> None:
        super().__init__(ctx)
        self.last = 0.0  # when this process last knew a cleanup to have run
        self.retention_checked = 0.0  # when a send last looked for pages past retention
        self.background: threading.Thread | None = None  # a send's cleanup (one at a time)
        #: called before a cleanup that is not a dry run plans (``Address``: the expiry moves
        #: of an address with an ``expiry_address``, ``_ops.expiry``)
        self.before: Callable[[], None] | None = None

    def cleanup(self, *, dry_run: bool = True, orphans: bool = True, now: float | None = None,
                progress: Callable[[int, int], None] | None = None) -> CleanupReport:
        """Remove (or, in a dry run, report) what no consumer needs any more.

        ``progress``, when given, is called with ``(files retired, files to retire)`` before
        the first page or orphan file is deleted (or archived) and after each."""
        now = time.time() if now is None else now
        if not dry_run and self.before is not None:
            self.before()
        listed = self.storage.list_detailed(self.layout.pages) if orphans else []
        state = self.log.refresh()
        report = CleanupReport(dry_run=dry_run, archived=self.settings.archive_data_logs)
        self._plan(state, report, now)
        live = set(state.pages.names)
        # Files a compaction swapped out stay for readers that planned on them before
        # (compactGraceMs) while their messages are retained, then go whatever their age.
        retired = {n: now - t / 1e6 < self.settings.compact_grace_ms / 1000
                   and end > state.first_seq for n, t, end in state.retired}
        grace = self.settings.orphan_grace_ms / 1000
        for fname, _size, mtime in listed:
            if fname.endswith(".page") and fname not in live and not retired.get(fname) and \
                    (fname in retired or now - mtime >= grace):
                report.orphans.append(fname)
        report.orphans += [fname for fname in self._spent_segments(state, listed, live,
                                                                    dry_run=dry_run)
                           if not retired.get(fname)]
        if orphans:  # temp files of processes killed mid-write
            report.orphans += [name for name, _size, mtime in self.storage.temp_files()
                               if now - mtime >= grace]
        retention = self.settings.log_retention_ms / 1000
        if dry_run:
            report.log_files = self.log.expire(retention, now=now, dry_run=True)
            return report
        if report.pages:
            self._remove(report, now)
            if any(is_segment(fname) for fname in report.pages):
                # segments retention (or consumers) just took out go now, not at the next
                # cleanup: an address bounded by retention must be bounded on disk too
                fresh = self.log.refresh()
                gone = set(report.orphans)
                report.orphans += [fname for fname in self._spent_segments(
                    fresh, listed, set(fresh.pages.names), dry_run=False)
                    if fname not in gone and not retired.get(fname)]
        total = len(report.pages) + len(report.orphans)
        if progress is not None:
            progress(0, total)
        for done, fname in enumerate(report.pages, 1):
            if not is_segment(fname):  # a segment goes once no checkpoint needs it (below)
                self._retire(fname, archive=self.settings.archive_data_logs)
            if progress is not None:
                progress(done, total)
        interrupted = set(self.log.refresh().removed)
        for done, fname in enumerate(report.orphans, len(report.pages) + 1):
            # A page the log removed but a crash left behind finishes its retirement; a page
            # that was never published (maybe half written) has nothing worth archiving.
            self._retire(fname, archive=self.settings.archive_data_logs and fname in interrupted)
            if progress is not None:
                progress(done, total)
        report.log_files = self.log.expire(retention, now=now)
        self.last = time.time()
        marker = {"time": self.last}
        self.storage.replace(self.layout.cleanup_marker, checked.dumps(marker)
                             if self.log.checksums else json.dumps(marker).encode())
        return report

    def _spent_segments(self, state: LogState, listed: list[tuple[str, int, float]],
                        live: set[str], *, dry_run: bool) -> list[str]:
        """Journal segments whose messages were removed and whose units no reader needs: before
        the segment being written and before the one the newest checkpoint ends in (opening
        replays from there). When only the lack of a newer checkpoint keeps some, one is
        written first (unless ``dry_run``): else an address whose units are few and small
        (a small disk, nearly full) would keep every consumed segment until its 1,000th
        commit, and cleanup would free nothing."""
        if self.log.journal is None or state.journal is None:
            return []
        spent = sorted(fname for fname, _size, _mtime in listed
                       if is_segment(fname) and fname not in live
                       and segment_number(fname) < state.journal.segment)
        checkpoint = self.log.checkpoint_position()
        bound = 0 if checkpoint is None else checkpoint.segment
        if spent and segment_number(spent[-1]) >= bound:
            if dry_run:
                bound = state.journal.segment
            else:
                written = self.log.checkpoint_now()
                bound = state.journal.segment if written is None else written.segment
        return [fname for fname in spent if segment_number(fname) < bound]

    def _plan(self, state: LogState, report: CleanupReport, now: float) -> None:
        """Fill ``report`` with the pages to remove from ``state``: those every consumer has
        passed, and those past a retention bound (see :func:`retention_cut`)."""
        idx = state.pages
        consumers = list(self.consumers.all().values())
        moving = expiry_cursor(self)
        if moving is not None and consumers:  # the moves read from their cursor on
            consumers.append({"position": moving})
        gone = set(consumed(state, consumers))
        cut = retention_cut(state, self.settings, now)
        expired = set(expired_rows(state, self.settings, now, moving)) - gone - set(range(cut))
        if expired and state.journal is not None:
            # a segment goes whole: only when no row of it is still needed
            kept = {idx.names[i] for i in range(len(idx))
                    if i not in gone and i not in expired and i >= cut}
            kept.add(segment_name(state.journal.segment))
            expired = {i for i in expired if idx.names[i] not in kept}
        taken = sorted(gone | set(range(cut)) | expired)
        report.pages = list(dict.fromkeys(idx.names[i] for i in taken))
        report.bytes = sum(idx.bytes[i] for i in taken)
        unread = [i for i in range(cut) if i not in gone]
        report.retention_lost = merge_ranges([], ((idx.seq[i], idx.ends[i]) for i in unread),
                                             len(unread) + 1)
        report.retention_messages = sum(idx.rows[i] for i in unread)
        report.retention_bytes = sum(idx.bytes[i] for i in unread)
        report.expired = merge_ranges([], ((idx.seq[i], idx.ends[i]) for i in sorted(expired)),
                                      len(expired) + 1)
        report.expired_messages = sum(idx.rows[i] for i in expired)

    def _remove(self, report: CleanupReport, now: float | None = None) -> None:
        now = time.time() if now is None else now
        planned = CleanupReport(dry_run=False)

        def build(st: LogState) -> dict[str, Any] | None:
            # Decided again on the freshest log, right before publishing: consumers created at
            # "earliest" (or seeking back) since planning keep the pages they were promised,
            # and pages a compaction swapped in since go with the rows around them (taking
            # only the planned names would leave a hole in the retained range).
            nonlocal planned
            planned = CleanupReport(dry_run=False)
            self._plan(st, planned, now)
            if not planned.pages:
                return None
            retention = None
            if planned.retention_messages:
                retention = (planned.retention_lost, planned.retention_messages,
                             planned.retention_bytes)
            expired = None
            if planned.expired_messages:
                expired = (planned.expired, planned.expired_messages)
            return remove_entry(list(planned.pages), retention=retention, expired=expired)

        self.log.publish(build)
        report.pages = planned.pages
        report.bytes = planned.bytes
        report.retention_lost = planned.retention_lost
        report.retention_messages = planned.retention_messages
        report.retention_bytes = planned.retention_bytes
        report.expired = planned.expired
        report.expired_messages = planned.expired_messages

    def retention_due(self) -> bool:
        """Whether a send should run cleanup because the address is over its retention: at
        most once per ``cleanup_interval_ms`` of this process's clock it looks (the look costs
        a pass over the page index; a send between looks costs a clock read)."""
        if not self.settings.retained:
            return False
        now = time.time()
        interval = self.settings.cleanup_interval_ms / 1000
        if now - self.last < interval or now - self.retention_checked < interval:
            return False
        self.retention_checked = now
        return retention_cut(self.log.refresh(), self.settings, now) > 0

    def maybe_cleanup_in_background(self) -> bool:
        """:meth:`maybe_cleanup` on a daemon thread, unless this cleaner's previous one still
        runs; whether it started. A send over its retention calls it: deleting a segment's
        worth of files must not lengthen the send that happened to notice (a process that exits
        meanwhile leaves what a crash leaves, which the next cleanup finishes)."""
        if self.background is not None and self.background.is_alive():
            return False
        self.background = threading.Thread(target=self.maybe_cleanup, daemon=True,
                                           name=f"dq-retention {self.name}")
        self.background.start()
        return True

    def maybe_cleanup(self) -> CleanupReport | None:
        """Run cleanup if ``cleanup_interval_ms`` has passed since any process last did (the
        marker file is read only when this process's own clock says one may be due). Best
        effort: a failure is logged, never raised (the acknowledgement or commit that
        triggered it succeeded, and a caller must not retry it)."""
        interval = self.settings.cleanup_interval_ms / 1000
        if time.time() - self.last < interval:
            return None
        try:
            last = float(checked.loads(self.storage.read(self.layout.cleanup_marker),
                                       required=self.log.checksums)["time"])
        except NotFound:
            last = 0.0
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("cleanup marker %s is damaged (%s); cleaning up now",
                        self.layout.cleanup_marker, exc)
            last = 0.0  # a damaged marker only costs one early cleanup
        self.last = max(self.last, last)
        if time.time() - self.last < interval:
            return None
        self.last = time.time()
        try:
            return self.cleanup(dry_run=False)
        except DurableQueueError as exc:
            log.warning("address %s: cleanup failed and will be retried later: %s",
                        self.name, exc)
            return None

    def _retire(self, fname: str, *, archive: bool) -> None:
        if fname.startswith(f"{TEMP_FOLDER}/"):
            self.storage.delete(self.storage.join(fname))
            return
        src = self.layout.page(fname)
        if archive:
            try:
                self.storage.move(src, self.layout.archived_page(
                    self.settings.directory_archive, fname))
            except NotFound:
                pass
        else:
            self.storage.delete(src)


def retention_cut(state: LogState, settings: AddressSettings, now: float) -> int:
    """How many of the oldest pages (rows of the page index) retention removes: a prefix of
    whole units (a page file; a journal segment's rows, never the segment being written),
    taken while the address holds more than ``retention_bytes`` without the unit (Kafka's
    rule: it keeps at least the bound, at most the bound and one page), and while the unit's
    newest message is older than ``retention_ms``. ``0`` without retention."""
    idx = state.pages
    if not settings.retained or not len(idx):
        return 0
    n = len(idx)
    last = {name: i for i, name in enumerate(idx.names)}  # a unit's last row
    barrier = n
    if state.journal is not None:
        writing = segment_name(state.journal.segment)
        barrier = next((i for i, name in enumerate(idx.names) if name == writing), n)
    left = sum(idx.bytes)
    old_us = (now - settings.retention_ms / 1000) * 1e6 if settings.retention_ms > 0 else None
    cut = 0
    i = 0
    while i < barrier:
        # the unit starting at row i ends after the last row of every name it holds
        end, size, newest = i, 0, 0
        j = i
        while j <= end:
            end = max(end, last[idx.names[j]])
            size += idx.bytes[j]
            newest = max(newest, idx.ts_last[j])
            j += 1
        if j > barrier:
            break
        by_bytes = 0 < settings.retention_bytes <= left - size
        by_time = old_us is not None and newest < old_us
        if not (by_bytes or by_time):
            break
        left -= size
        cut = i = j
    return cut


def expired_rows(state: LogState, settings: AddressSettings, now: float,
                 moved_to: int | None) -> list[int]:
    """Indices of the pages (rows of the page index) whose every message expired by ``now``
    (epoch seconds), told from the index without reading: the row's newest ``_timestamp``
    before ``now - expiry_delay_ms``, or, where every message has a ``ttl_ms`` (its statistics
    count no null TTL), its newest ``_timestamp`` plus the longest TTL before ``now``.
    ``moved_to``: the expiry cursor of an address with an ``expiry_address`` (pages from it on
    still have messages to move), ``None`` without one."""
    idx = state.pages
    expire_before = settings.expire_before(now)
    if expire_before is None and not state.ttl:
        return []
    now_us = now * 1e6  # a float: verify plans at now=inf (every page expired)
    out = []
    for i in range(len(idx)):
        if moved_to is not None and idx.ends[i] > moved_to:
            break
        if expire_before is not None and idx.ts_last[i] < expire_before:
            out.append(i)
            continue
        if state.ttl:
            ttl = ((idx.stats(i) or {}).get("columns") or {}).get(TTL) or {}
            longest = ttl.get("max")
            if ttl.get("null_count") == 0 and isinstance(longest, int) and \
                    idx.ts_last[i] + longest * 1000 < now_us:
                out.append(i)
    return out


def consumed(state: LogState, consumers: list[dict[str, Any]]) -> list[int]:
    """Indices of the pages no consumer needs: every watermark is past the page, or the
    consumer's selector provably cannot match it. None without consumers."""
    if not consumers:
        return []
    from .._read.scan import page_may_match

    selectors = [(int(c["position"]),
                  compile_selector(c["selector"], state.schema) if c.get("selector") else None)
                 for c in consumers]
    idx = state.pages
    out = []
    for i in range(len(idx)):
        end = idx.ends[i]
        needed = False
        for position, sel in selectors:
            if end <= position:
                continue
            if sel is not None and not page_may_match(sel, idx.stats(i), idx.ref(i)):
                continue
            needed = True
            break
        if not needed:
            out.append(i)
    if state.journal is not None:
        # A journal segment goes whole, once no row of it is needed and it is not the one
        # being written (its next units will be appended to it).
        needed_segments = {idx.names[i] for i in set(range(len(idx))) - set(out)}
        needed_segments.add(segment_name(state.journal.segment))
        out = [i for i in out if idx.names[i] not in needed_segments]
    return out
