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
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._format import checked
from .._format.schema import compile_selector
from .._log.commit_log import LogState
from .._log.journal import is_segment, segment_name, segment_number
from .._log.state import remove_entry
from .._storage import TEMP_FOLDER, NotFound
from ..errors import DurableQueueError
from .context import AddressContext, OnAddress

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

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "pages": self.pages, "bytes": self.bytes,
                "orphans": self.orphans, "archived": self.archived,
                "log_files": self.log_files}


class Cleaner(OnAddress):
    """Cleanup of one address (see the module docstring).

    Concurrency guarantee: cleanups in several processes may overlap; each decides on the
    freshest log and re-reads the consumers right before publishing its ``remove`` entry, so a
    consumer created (or moved back) meanwhile keeps the pages it was promised.
    """

    def __init__(self, ctx: AddressContext) -> None:
        super().__init__(ctx)
        self.last = 0.0  # when this process last knew a cleanup to have run

    def cleanup(self, *, dry_run: bool = True, orphans: bool = True, now: float | None = None,
                progress: Callable[[int, int], None] | None = None) -> CleanupReport:
        """Remove (or, in a dry run, report) what no consumer needs any more.

        ``progress``, when given, is called with ``(files retired, files to retire)`` before
        the first page or orphan file is deleted (or archived) and after each."""
        now = time.time() if now is None else now
        listed = self.storage.list_detailed(self.layout.pages) if orphans else []
        state = self.log.refresh()
        report = CleanupReport(dry_run=dry_run, archived=self.settings.archive_data_logs)
        for i in consumed(state, list(self.consumers.all().values())):
            report.pages.append(state.pages.names[i])
            report.bytes += state.pages.bytes[i]
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
            self._remove(report)
        total = len(report.pages) + len(report.orphans)
        if progress is not None:
            progress(0, total)
        for done, fname in enumerate(report.pages, 1):
            if not is_segment(fname):  # a segment goes once no checkpoint needs it (below)
                self._retire(fname, archive=self.settings.archive_data_logs)
            if progress is not None:
                progress(done, total)
        interrupted = set(state.removed)
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

    def _remove(self, report: CleanupReport) -> None:
        removed: list[str] = []
        size = [0]

        def build(st: LogState) -> dict[str, Any] | None:
            # Decided again on the freshest log, right before publishing: consumers created at
            # "earliest" (or seeking back) since planning keep the pages they were promised,
            # and pages a compaction swapped in since go with the rows around them (taking
            # only the planned names would leave a hole in the retained range).
            still = consumed(st, list(self.consumers.all().values()))
            removed[:] = list(dict.fromkeys(st.pages.names[i] for i in still))
            size[0] = sum(st.pages.bytes[i] for i in still)
            return remove_entry(list(removed)) if removed else None

        self.log.publish(build)
        report.pages = list(removed)
        report.bytes = size[0]

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
