"""Verifying and repairing an address (``durablequeue verify`` / ``repair``).

Repair handles the kinds of damage the store can meet, only when asked (``dry_run=False``),
and records what they cost (messages given up as lost). It never deletes: what it takes out is
moved to ``<address>/damaged/`` for inspection.

* **A last commit-log entry that does not parse**, older than ``grace_ms``. Where a local
  filesystem has no hard links (some FUSE volumes), entries are created with ``O_EXCL`` and are
  visible while being written; a writer killed then leaves a short entry, which stops every
  reader. Its writer never got an answer, so nothing acknowledged is in it. A writer still
  alive when its entry is set aside notices (``Storage.create``) and fails instead of
  reporting success. Only the last entry qualifies: nothing can be published after an entry
  that does not parse, so a damaged entry with successors is not a crash and is left alone.
* **Damage in a journal** (format 4): bytes where the next unit should be that no crash
  explains (the torn-tail rule, ``_format/unit.py``), which stop every reader and writer at
  them. Repair copies them to ``damaged/`` and puts a ``lost`` entry in the damaged unit's
  place, recording the ``_seq`` range it held as lost (consumers report it; ``stats()``
  counts it): written in the damaged unit's own bytes with the crc the unit after it chains
  to when units follow it (they read on unchanged), else published there after the damaged
  bytes are zeroed.
* **Live pages that are missing or fail verification** (checksums, framing, row counts). They
  cannot be read anyway; a ``remove`` entry takes them out of the log and records the ``_seq``
  ranges they held as lost, so that the rest of the address can be consumed and consumers still
  report the loss (the Spark source fails with ``DataLossError`` unless
  ``failOnDataLoss=false``; the Python consumer logs a warning).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from .._format import checked
from .._format.layout import DAMAGED, LEASES, AddressLayout
from .._format.page import read_page
from .._format.watermark import inspect as inspect_watermark
from .._log.commit_log import (
    CHECKPOINT_SUFFIX,
    LOG_HINT,
    CommitLog,
    LogState,
    checkpoint_table,
    entry_name,
    seq_ranges_text,
)
from .._log.journal import is_segment, read_units
from .._log.state import lost_entry, remove_entry
from .._storage import NotFound, Storage
from ..errors import CorruptPageError, DamagedLogError
from .window import decode as decode_window

__all__ = ["JournalDamage", "PageProblem", "RepairReport", "journal_damage", "repair",
           "verify_pages"]

log = logging.getLogger(__name__)

#: How old a damaged last entry must be before repair takes it for abandoned.
DEFAULT_GRACE_MS = 600_000


@dataclass
class PageProblem:
    """A live page that cannot be read as the log describes it."""

    page: str
    problem: str  # "missing", "corrupt" or "row count"
    first_seq: int
    messages: int
    detail: str = ""


@dataclass
class JournalDamage:
    """Damage in a journal that no crash explains (see ``_format/unit.py``), as repair found
    it: where (``segment@offset``), the version of the unit that should be there, why it is
    damage, how many bytes repair sets aside, the ``_seq`` range ``[first, end)`` it loses
    (``known``: whether that count could be told; if not, ``end == first``), and whether
    units follow it, which repair keeps (``units_after``)."""

    where: str
    version: int
    reason: str
    bytes: int
    lost: tuple[int, int]
    known: bool
    units_after: bool


def journal_damage(commit_log: CommitLog, state: LogState,
                   positions: Iterable[int] = ()) -> JournalDamage | None:
    """The damage the journal's readable part ends at, as :class:`JournalDamage` (``None``
    without any): what verify reports and repair takes out. ``positions``: where consumers
    are; when the damaged unit's record cannot tell how many messages it held, one past the
    readable part shows how many were committed at least (they are lost, and their ``_seq``
    must not be given again: that consumer would skip new messages under them)."""
    damage, journal = commit_log.damage, commit_log.journal
    if damage is None or journal is None:
        return None
    path, _, offset = damage.path.rpartition("@")
    name = path.rsplit("/", 1)[-1]
    unit = journal.damaged_unit(int(name.split(".", 1)[0]), int(offset), damage.version)
    first, end, known = state.next_seq, state.next_seq, False
    if unit.mark:  # a roll mark: it holds nothing
        known = True
    elif unit.next_seq is not None and unit.next_seq >= first:
        end, known = unit.next_seq, True
    elif unit.entry is not None:
        try:
            if unit.entry.get("op") != "append":
                known = True
            elif int(unit.entry["seq"]) == first:
                end = first + sum(int(p["rows"]) for p in unit.entry["pages"])
                known = True
        except (KeyError, TypeError, ValueError):
            pass
    if not known:
        # A consumer past the damage read messages the damaged unit held (or later ones):
        # as many were committed (a consumer made to start past the end is the exception:
        # then a range that never held messages is reported lost too).
        end = max([end, *positions])
    return JournalDamage(f"{name}@{unit.offset}", damage.version,
                         damage.reason.split(". Readers stop", 1)[0], unit.extent - unit.offset,
                         (first, end), known, unit.units_after)


@dataclass
class RepairReport:
    """What :func:`repair` found and did (or would do, in a dry run)."""

    dry_run: bool
    #: the damaged last log entry set aside (or that would be)
    log_entry: str | None = None
    #: a damaged last log entry younger than the grace period: maybe still being written
    waiting: str | None = None
    pages_checked: int = 0
    pages: list[PageProblem] = field(default_factory=list)
    #: bytes of an unfinished unit after a journal's last commit (a writer killed while writing
    #: it; readers never read it and the next commit writes over it): reported, and zeroed by
    #: a repair that is not a dry run. Not damage: ``clean`` does not count it.
    journal_tail: int = 0
    #: damage in the journal (the torn-tail rule): what it is and what it loses, set aside
    #: (copied to ``damaged/``) and replaced by a ``lost`` entry by a repair that is not a dry
    #: run
    journal_damage: JournalDamage | None = None
    #: ``[first, end)`` ``_seq`` ranges removed with the damaged pages
    lost: list[tuple[int, int]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.log_entry is None and self.waiting is None and not self.pages and \
            self.journal_damage is None

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "log_entry": self.log_entry, "waiting": self.waiting,
                "pages_checked": self.pages_checked,
                "pages": [asdict(p) for p in self.pages],
                "lost": [list(r) for r in self.lost], "journal_tail": self.journal_tail,
                "journal_damage": None if self.journal_damage is None
                else asdict(self.journal_damage),
                "clean": self.clean}


def verify_pages(storage: Storage, layout: AddressLayout, state: LogState, *,
                 progress: Callable[[int, int], None] | None = None,
                 ) -> tuple[int, list[PageProblem]]:
    """Read every live page of ``state`` and check every frame; returns ``(pages that
    verified, problems)``. ``progress``, when given, is called with ``(bytes done, bytes in
    all)`` before the first page and after each (the CLI draws a bar with it)."""
    idx = state.pages
    problems: list[PageProblem] = []
    total, done = sum(idx.bytes), 0
    for i in range(len(idx)):
        if progress is not None:
            progress(done, total)
            done += idx.bytes[i]
        name, first, rows = idx.names[i], idx.seq[i], idx.rows[i]
        span = idx.spans[i]
        if span is not None:  # a run of journal units: read them back, frame by frame
            problem = _verify_units(storage, layout.page(name), span, first, rows)
            if problem is not None:
                problems.append(problem)
            continue
        try:
            page = read_page(storage, layout.page(name))
        except NotFound:
            problems.append(PageProblem(name, "missing", first, rows))
            continue
        except CorruptPageError as exc:
            problems.append(PageProblem(name, "corrupt", first, rows,
                                        f"at byte {exc.offset}: {exc.reason}"))
            continue
        if page.rows != rows:
            problems.append(PageProblem(name, "row count", first, rows,
                                        f"the log says {rows} messages, the page holds "
                                        f"{page.rows}"))
    if progress is not None:
        progress(done, total)
    return len(idx) - len(problems), problems


def _verify_units(storage: Storage, path: str, span: tuple[int, int], first: int,
                  rows: int) -> PageProblem | None:
    name = path.rsplit("/", 1)[-1]
    try:
        held = sum(b.num_rows for unit in read_units(storage, path, span, first, first + rows)
                   for b in unit.batches)
    except NotFound:
        return PageProblem(name, "missing", first, rows)
    except CorruptPageError as exc:
        return PageProblem(name, "corrupt", first, rows, f"at byte {exc.offset}: {exc.reason}")
    if held != rows:
        return PageProblem(name, "row count", first, rows,
                           f"the log says {rows} messages, the journal range holds {held}")
    return None


def repair(storage: Storage, layout: AddressLayout, commit_log: CommitLog, *,
           dry_run: bool = True, grace_ms: int = DEFAULT_GRACE_MS, now: float | None = None,
           address: str = "", positions: Iterable[int] = (),
           progress: Callable[[int, int], None] | None = None) -> RepairReport:
    """Find (and unless ``dry_run``, set aside) a damaged last log entry and damaged pages.

    See the module docstring. Run it while no writer is stuck in the middle of a commit for
    longer than ``grace_ms``. ``progress``: as in `verify_pages`. ``positions``: the
    consumers' positions (see :func:`journal_damage`).

    Raises
    ------
    DamagedLogError
        The log is damaged in a way no crash explains (an entry that parses but is malformed,
        or a damaged entry with entries after it): that needs a person, not a tool.
    """
    now = time.time() if now is None else now
    report = RepairReport(dry_run=dry_run)
    try:
        state = commit_log.refresh()
    except DamagedLogError as exc:
        if not exc.partial or storage.exists(f"{layout.log}/{entry_name(exc.version + 1)}"):
            raise  # nothing is published after a killed writer's entry: not a crash
        name = entry_name(exc.version)
        ages = {n: now - mtime for n, _, mtime in storage.list_detailed(layout.log)}
        if ages.get(name, 0.0) * 1000 < grace_ms:
            report.waiting = name
            return report
        report.log_entry = name
        if dry_run:
            return report  # the pages can be checked once the log opens again
        storage.move(exc.path, layout.quarantined(f"log-{name}", now))
        log.warning("address %s: set aside the damaged last commit-log entry %s (a writer "
                    "killed while writing it); it is in %s/", address, name, DAMAGED)
        commit_log.forget()
        state = commit_log.refresh()
    report.journal_damage = journal_damage(commit_log, state, positions)
    if report.journal_damage is not None and not dry_run:
        found = report.journal_damage

        def keep(segment: str, offset: int, data: bytes) -> None:
            storage.makedirs(layout.damaged)
            storage.replace(layout.quarantined(f"{segment}@{offset}.damaged", now), data)

        entry = lost_entry(*found.lost, found.where, found.reason)  # (not for a roll mark)
        commit_log.take_out_damage(entry, keep)
        commit_log.forget()
        state = commit_log.refresh()
        log.warning("address %s: took out damage in the journal at %s (%s): %s; the bytes are "
                    "in %s/", address, found.where, found.reason,
                    f"_seq {found.lost[0]}..{found.lost[1] - 1} are lost" if
                    found.lost[1] > found.lost[0] else "no messages lost" if found.known else
                    "an unknown number of messages lost", DAMAGED)
    report.pages_checked, report.pages = verify_pages(storage, layout, state,
                                                      progress=progress)
    # (after damage that a dry run left, what follows is the damage, not a torn tail)
    if commit_log.damage is None and commit_log.journal is not None and \
            state.journal is not None:
        def set_aside(segment: str, offset: int, data: bytes) -> None:
            storage.makedirs(layout.damaged)
            storage.replace(layout.quarantined(f"{segment}@{offset}.tail", now), data)

        # outside the lock a unit being written looks the same: a dry run only reports
        report.journal_tail = commit_log.clear_journal_tail(set_aside) if not dry_run \
            else len(commit_log.journal.tail(state.journal))
    if not report.pages:
        return report
    damaged = {p.page for p in report.pages}
    if dry_run:
        report.lost = _ranges(state, damaged)
        return report

    def build(st: LogState) -> dict[str, Any] | None:
        names = [n for n in st.pages.names if n in damaged]  # still live on a fresh view
        report.lost = _ranges(st, set(names))
        return remove_entry(names, report.lost) if names else None

    commit_log.publish(build)
    for p in report.pages:
        # a journal segment stays where it is (its writer may append to it): cleanup
        # removes it with the other spent segments
        if p.problem != "missing" and not is_segment(p.page):
            try:
                storage.move(layout.page(p.page), layout.quarantined(p.page, now))
            except NotFound:
                pass
    log.warning("address %s: removed %d damaged pages holding _seq %s; the files are in %s/",
                address, len(damaged), seq_ranges_text(report.lost), DAMAGED)
    return report


def _ranges(state: LogState, names: set[str]) -> list[tuple[int, int]]:
    """The ``_seq`` ranges of pages ``names``, adjacent ones merged."""
    idx = state.pages
    out: list[tuple[int, int]] = []
    for i in range(len(idx)):
        if idx.names[i] not in names:
            continue
        if out and out[-1][1] == idx.seq[i]:
            out[-1] = (out[-1][0], idx.ends[i])
        else:
            out.append((idx.seq[i], idx.ends[i]))
    return out


def _watermark_slots(data: bytes) -> None:
    _, damaged = inspect_watermark(data)
    if damaged:
        raise ValueError(f"watermark slot {damaged[0]} fails its checksum (readers use the "
                         "other slot: messages acknowledged since are delivered again)")


def verify_metadata(storage: Storage, layout: AddressLayout, log: CommitLog, *,
                    checksums: bool) -> tuple[int, list[PageProblem]]:
    """Read every metadata file of the address (``address.json``, the log's entry files,
    checkpoints and hint, consumer state and watermarks, lease claims, the cleanup marker) and
    check each
    one's checksum; returns ``(files checked, problems)``. With ``checksums`` false (formats
    1-4, written without them) a file is checked only for reading as JSON."""
    problems: list[PageProblem] = []

    def check(path: str, read: Callable[[bytes], object]) -> int:
        try:
            read(storage.read(path))
        except NotFound:
            return 0  # deleted while listing (expired, pruned)
        except (ValueError, TypeError) as exc:
            problems.append(PageProblem(path, "corrupt", -1, 0, str(exc)))
        return 1

    def json_file(data: bytes) -> object:
        return checked.loads(data, required=checksums)

    checked_files = check(layout.meta, json_file)
    for name in sorted(storage.list(log.folder)):
        path = f"{log.folder}/{name}"
        if name.endswith(".json") or name == LOG_HINT:
            checked_files += check(path, json_file)
        elif name.endswith(CHECKPOINT_SUFFIX):
            checked_files += check(path, lambda data: checkpoint_table(
                data, required=checksums))
    if storage.exists(layout.cleanup_marker):
        checked_files += check(layout.cleanup_marker, json_file)
    for name in sorted(storage.list(layout.consumers)):
        if name.endswith(".json") and not name.startswith((".", "_")):
            checked_files += check(f"{layout.consumers}/{name}", json_file)
        elif name.endswith(".wm"):  # checksummed in every format that has them
            checked_files += check(f"{layout.consumers}/{name}", _watermark_slots)
        elif name.endswith(".window"):  # a delivery window: checksummed in every format
            checked_files += check(f"{layout.consumers}/{name}", decode_window)
    leases = f"{layout.consumers}/{LEASES}"
    for consumer in sorted(storage.list(leases)) if storage.exists(leases) else ():
        folder = f"{leases}/{consumer}"
        for name in sorted(storage.list(folder)):
            if name.endswith(".json"):
                checked_files += check(f"{folder}/{name}", json_file)
    return checked_files, problems
