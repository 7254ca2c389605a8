"""An address: one folder, one schema, a commit log of pages, and its consumers.

Layout under ``<root>/<address>/``::

    address.json      settings (JSON), written at creation, updated when settings change
    log/              the commit log (see ``_log``)
    pages/            immutable page files (see ``_page``)
    consumers/        one JSON state file per durable consumer
    archive/          consumed pages, when ``archive_data_logs`` is on
    damaged/          what ``repair`` set aside (see ``_repair``)
    cleanup.json      when cleanup last ran (``cleanup_interval_ms`` spans processes)
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ._log import CommitLog, LogState, schema_to_text
from ._page import PageInfo, PageWriter
from ._storage import TEMP_FOLDER, NotFound, Storage
from ._txn import app_txn, committed
from .errors import (
    AddressFullError,
    AddressNotFoundError,
    DurableQueueError,
    InvalidMessageError,
    SchemaMismatchError,
    StorageError,
)
from .settings import AddressSettings, parse_options, validate_name

if TYPE_CHECKING:
    from ._repair import RepairReport
    from .consumer import Consumer

__all__ = ["Address", "CleanupReport", "CommitResult"]

log = logging.getLogger(__name__)

RESERVED_COLUMNS = frozenset({"_seq", "_timestamp"})
_BLOCK_POLL_S = 0.05
_LAST_CLEANUP = "cleanup.json"


@dataclass(frozen=True)
class CommitResult:
    """What a send or a Spark batch commit did.

    Attributes
    ----------
    seq : int
        First ``_seq`` assigned (``-1`` when nothing was appended).
    count : int
        Messages appended.
    version : int
        Commit log entry that published them (``-1`` when none).
    dropped : bool
        The DROP policy dropped the send.
    duplicate : bool
        The transaction (``txn``) was already committed, at this version or a later one (a
        retried send or Spark batch); nothing was appended.
    """

    seq: int
    count: int
    version: int
    dropped: bool = False
    duplicate: bool = False


class _RoomTaken(Exception):
    """Raised inside a publish: the send no longer fits the limits on the freshest state."""


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


class Address:
    """A durable address. Obtain one with :meth:`DurableQueue.address`.

    Concurrency guarantee: any number of processes may send to and consume from one address at
    the same time; commits are serialised by the commit log (exactly one writer wins each entry,
    losers retry on top), so ``_seq`` stays dense and in commit order.
    """

    def __init__(self, storage: Storage, name: str, settings: AddressSettings) -> None:
        self.name = validate_name(name)
        self.settings = settings
        self.storage = Storage(storage.url, storage.storage_options, fsync=settings.fsync)
        self.folder = self.storage.join(self.name)
        self.pages_folder = f"{self.folder}/pages"
        self.consumers_folder = f"{self.folder}/consumers"
        self.log = CommitLog(self.storage, f"{self.folder}/log")
        self._last_cleanup = 0.0

    def __repr__(self) -> str:
        return f"Address({self.storage.url!r}, {self.name!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["log"] = CommitLog(self.storage, f"{self.folder}/log")  # drop the cached fold
        return state

    # -- opening --------------------------------------------------------------------------------
    @classmethod
    def open(cls, storage: Storage, name: str, *, create: bool = True,
             **settings: Any) -> Address:
        """Open an address, creating it when ``create`` (settings persisted on creation).

        Settings given for an existing address that differ from the persisted ones are
        updated (and logged), so that changing an option and restarting takes effect.
        """
        validate_name(name)
        parsed = parse_options(settings, "address")  # validates even when the address exists
        given = AddressSettings(**parsed)
        explicit = {k: getattr(given, k) for k in parsed}  # by snake_case key, aliases resolved
        folder = storage.join(name)
        meta_path = f"{folder}/address.json"
        try:
            meta = json.loads(storage.read(meta_path))
        except NotFound:
            if not create:
                raise AddressNotFoundError(
                    f"address {name!r} does not exist under {storage.url}") from None
            for sub in ("", "/log", "/pages", "/consumers"):
                storage.makedirs(folder + sub)
            meta = {"format": 1, "name": name, "created": time.time(),
                    "settings": given.to_json()}
            if not storage.create(meta_path, json.dumps(meta, indent=1).encode()):
                meta = json.loads(storage.read(meta_path))  # created concurrently: theirs wins
        except ValueError as exc:
            raise StorageError(0, f"{meta_path} is not valid JSON: {exc}") from exc
        current = AddressSettings.from_json(meta.get("settings", {}))
        changed = {k: v for k, v in explicit.items() if getattr(current, k) != v}
        if changed:
            log.info("address %s: updating settings %s", name, changed)
            current = current.replace(**changed)
            meta["settings"] = current.to_json()
            storage.replace(meta_path, json.dumps(meta, indent=1).encode())
        return cls(storage, name, current)

    # -- schema ---------------------------------------------------------------------------------
    @property
    def schema(self) -> pa.Schema | None:
        """The address's user schema (``None`` before the first send)."""
        return self.log.refresh().schema

    @property
    def state(self) -> LogState:
        return self.log.refresh()

    # -- sending --------------------------------------------------------------------------------
    def send(self, data: Any, *, merge_schema: bool = False,
             txn: tuple[str, int] | None = None) -> CommitResult:
        """Append messages: a ``pyarrow.Table``/``RecordBatch``, a ``pandas.DataFrame``, a
        list of dicts, or one dict.

        Returns once the messages are durably published (or dropped by the DROP policy).

        Parameters
        ----------
        txn : (str, int), optional
            ``(app id, version)`` makes the send idempotent: when the address already holds
            this version (or a later one) of the app id, nothing is stored and the result has
            ``duplicate=True``. It is the same transaction as a Spark batch write with
            ``txnAppId``/``txnVersion`` of the same values. An empty send records nothing.

        Raises
        ------
        SchemaMismatchError
            The data does not fit the address's schema (names the columns).
        AddressFullError
            FAIL policy and the address is full, or BLOCK waited ``block_timeout_ms``.
        TypeError, InvalidOptionError
            ``txn`` is not a ``(str, int >= 0)`` pair.
        """
        key = app_txn(txn) if txn is not None else None
        table = to_table(data)
        if key is not None and committed(self.log.refresh().txns, key):
            # Checked before any page is written; commit checks again against a concurrent
            # sender of the same transaction.
            log.info("address %s: txn %r was already committed; not stored again",
                     self.name, txn)
            return CommitResult(-1, 0, -1, duplicate=True)
        if table.num_rows == 0:
            return CommitResult(-1, 0, -1)
        table, _ = conform_schema(table, self.schema, merge_schema)
        writer = self.page_writer()
        try:
            writer.write(table)
            pages = writer.close()
        except BaseException:
            writer.abort()
            raise
        return self.commit(pages, table.schema, txn=key, merge_schema=merge_schema)

    def page_writer(self) -> PageWriter:
        """A writer of new (unpublished) pages for this address; used by Spark tasks."""
        return PageWriter(self.storage, self.pages_folder,
                          page_size_bytes=self.settings.page_size_bytes,
                          compression=self.settings.compression)

    def commit(self, pages: Sequence[PageInfo], schema: pa.Schema, *,
               txn: tuple[str, int] | None = None, merge_schema: bool = False) -> CommitResult:
        """Publish written pages as one commit-log entry, applying the full policy.

        Used by :meth:`send` and by the Spark sink's driver-side commit. On any refusal (full,
        schema mismatch, duplicate transaction) the pages are deleted, so nothing leaks.

        Parameters
        ----------
        txn : (key, version), optional
            Exactly-once key, already namespaced (see :mod:`._txn`): if the log holds
            ``version`` (or a later one) for ``key``, nothing is appended and
            ``duplicate=True`` is returned.
        """
        pages = [p for p in pages if p.rows > 0]
        rows = sum(p.rows for p in pages)
        nbytes = sum(p.bytes for p in pages)
        try:
            if txn is not None and committed(self.log.refresh().txns, txn):
                self._delete_pages(pages)
                return CommitResult(-1, 0, -1, duplicate=True)
            if not pages:
                return CommitResult(-1, 0, -1)
            limited = self.settings.limited and self.settings.address_full_policy != "PAGE"
            deadline = time.monotonic() + self.settings.block_timeout_ms / 1000
            result: dict[str, Any] = {}

            def build(state: LogState) -> dict[str, Any] | None:
                if txn is not None and committed(state.txns, txn):
                    result["duplicate"] = True
                    return None
                if limited:
                    # Checked again on the state this entry extends: a concurrent writer may
                    # have taken the room since _admit looked.
                    backlog = backlog_after(state, self._min_position(state))
                    if self._over_limit(*backlog, rows, nbytes):
                        raise _RoomTaken
                new_schema = check_page_schema(schema, state.schema, merge_schema)
                entry: dict[str, Any] = {"op": "append", "seq": state.next_seq,
                                         "pages": [p.to_dict() for p in pages]}
                if new_schema is not None:
                    entry["schema"] = schema_to_text(new_schema)
                if txn is not None:
                    entry["txn"] = {"id": txn[0], "batch": txn[1]}
                return entry

            # A page older than orphanGraceMs (a long Spark batch) could be taken for an
            # orphan by another process's cleanup: renew it, and never publish a missing one.
            missing = [p.name for p in pages
                       if not self.storage.touch(f"{self.pages_folder}/{p.name}")]
            if missing:
                raise StorageError(errno.ENOENT, (
                    f"address {self.name!r}: pages {missing} written for this commit are gone "
                    f"(removed as orphans after orphanGraceMs={self.settings.orphan_grace_ms}?);"
                    " nothing was published"))
            # The pages' directory entries must be durable before an entry names them
            # (each page file was fsynced when written; one folder fsync covers them all).
            self.storage.sync_folder(self.pages_folder)
            while True:
                if limited:
                    refused = self._admit(rows, nbytes, txn, deadline)
                    if refused is not None:
                        self._delete_pages(pages)
                        return refused
                try:
                    published = self.log.publish(build)
                except _RoomTaken:
                    continue  # the policy decides again: wait (BLOCK), drop or fail
                break
        except BaseException:
            self._delete_pages(pages)
            raise
        if published is None:
            self._delete_pages(pages)
            return CommitResult(-1, 0, -1, duplicate=True)
        version, entry = published
        return CommitResult(int(entry["seq"]), rows, version)

    def _delete_pages(self, pages: Iterable[PageInfo]) -> None:
        """Delete pages a refused or failed commit wrote, but never a page the log lists.

        The log is read afresh: a commit can fail after its entry was published (the folder
        fsync after ``link`` failed, a PUT timed out after the server stored it, Spark aborts
        after a failed commit in a fresh process), and then the pages are live. If the log
        cannot be read, nothing is deleted: the orphan sweep will decide later.
        """
        pages = list(pages)
        if not pages:
            return
        try:
            live = set(self.log.refresh().pages.names)
        except DurableQueueError as exc:
            log.warning("address %s: not deleting %d pages of a failed commit, the log could "
                        "not be read (%s); cleanup removes them if they are orphans",
                        self.name, len(pages), exc)
            return
        for p in pages:
            if p.name not in live:
                self.storage.delete(f"{self.pages_folder}/{p.name}")

    def _admit(self, rows: int, nbytes: int, txn: tuple[str, int] | None,
               deadline: float) -> CommitResult | None:
        """Apply DROP/FAIL/BLOCK; ``None`` means the send may go ahead."""
        s = self.settings
        while True:
            backlog_messages, backlog_bytes = self.backlog()
            if not self._over_limit(backlog_messages, backlog_bytes, rows, nbytes):
                return None
            if s.address_full_policy == "BLOCK" and time.monotonic() < deadline:
                time.sleep(_BLOCK_POLL_S)
                continue
            break
        what = (f"address {self.name!r} is full: backlog {backlog_messages} messages / "
                f"{backlog_bytes} bytes, send of {rows} messages / {nbytes} bytes, limits "
                f"maxSizeMessages={s.max_size_messages} maxSizeBytes={s.max_size_bytes}")
        if s.address_full_policy == "DROP":
            log.warning("%s; dropping the send (addressFullPolicy=DROP)", what)
            entry: dict[str, Any] = {"op": "drop", "dropped": {"messages": rows, "bytes": nbytes}}
            if txn is not None:
                entry["txn"] = {"id": txn[0], "batch": txn[1]}
            published = self.log.publish(lambda state: entry)
            assert published is not None
            return CommitResult(-1, 0, published[0], dropped=True)
        if s.address_full_policy == "BLOCK":
            raise AddressFullError(f"{what}; waited blockTimeoutMs={s.block_timeout_ms} for "
                                   "consumers to acknowledge; nothing was stored")
        raise AddressFullError(f"{what}; addressFullPolicy=FAIL, nothing was stored")

    def _over_limit(self, backlog_messages: int, backlog_bytes: int, rows: int,
                    nbytes: int) -> bool:
        # A send that alone exceeds the limit is accepted into an empty backlog; otherwise
        # BLOCK could never succeed for it.
        if backlog_messages == 0:
            return False
        s = self.settings
        return (0 < s.max_size_messages < backlog_messages + rows) or \
            (0 < s.max_size_bytes < backlog_bytes + nbytes)

    # -- consumers ------------------------------------------------------------------------------
    def consumer(self, name: str, *, selector: str | None = None, start: Any = None,
                 create: bool = True) -> Consumer:
        """Open (or create) the durable consumer ``name``.

        A new consumer starts at ``start``: ``"earliest"`` (the default), ``"latest"``, a
        ``_seq``, or a ``datetime`` (the first message committed at or after it; naive means
        UTC). An existing one resumes from its acknowledged watermark (a ``start`` given for
        it is ignored with a warning; move it with :meth:`Consumer.seek`).
        """
        from .consumer import Consumer

        return Consumer.open(self, name, selector=selector, start=start, create=create)

    def consumers(self) -> dict[str, dict[str, Any]]:
        """Persisted state of every consumer, by name."""
        out = {}
        for fname in sorted(self.storage.list(self.consumers_folder)):
            if not fname.endswith(".json") or fname.startswith("."):
                continue
            try:
                data = json.loads(self.storage.read(f"{self.consumers_folder}/{fname}"))
            except NotFound:
                continue  # deleted while we listed
            except ValueError as exc:
                raise StorageError(0, f"consumer state {fname} of {self.name!r} is not valid "
                                      f"JSON: {exc}") from exc
            if not isinstance(data, dict) or "position" not in data:
                raise StorageError(0, f"consumer state {fname} of {self.name!r} is damaged; "
                                      "delete it to recreate the consumer")
            out[str(data.get("name", fname[:-len(".json")]))] = data
        return out

    def backlog(self, position: int | None = None) -> tuple[int, int]:
        """``(messages, bytes)`` not yet acknowledged by every consumer (or after
        ``position``). Without consumers, every retained message counts."""
        state = self.log.refresh()
        return backlog_after(state, self._min_position(state) if position is None else position)

    def _min_position(self, state: LogState) -> int:
        positions = [int(c["position"]) for c in self.consumers().values()]
        return min(positions) if positions else state.first_seq

    # -- maintenance ----------------------------------------------------------------------------
    def cleanup(self, *, dry_run: bool = True, orphans: bool = True,
                now: float | None = None) -> CleanupReport:
        """Remove pages every consumer has acknowledged, and orphan pages of dead writers.

        A page goes once every consumer's watermark is past its last message, or the
        consumer's selector provably cannot match it (so middle pages go too). With
        ``archive_data_logs`` pages are moved to the archive folder instead of deleted.
        Commit-log entries older than ``log_retention_ms`` that a checkpoint covers go too.
        Defaults to a dry run that only reports.
        """
        now = time.time() if now is None else now
        listed = self.storage.list_detailed(self.pages_folder) if orphans else []
        state = self.log.refresh()
        consumers = list(self.consumers().values())
        report = CleanupReport(dry_run=dry_run, archived=self.settings.archive_data_logs)
        for i in self._consumed(state, consumers):
            report.pages.append(state.pages.names[i])
            report.bytes += state.pages.bytes[i]
        live = set(state.pages.names)
        grace = self.settings.orphan_grace_ms / 1000
        for fname, _size, mtime in listed:
            if fname.endswith(".page") and fname not in live and now - mtime >= grace:
                report.orphans.append(fname)
        if orphans:  # temp files of processes killed mid-write
            report.orphans += [name for name, _size, mtime in self.storage.temp_files()
                               if now - mtime >= grace]
        if dry_run:
            report.log_files = self.log.expire(self.settings.log_retention_ms / 1000, now=now,
                                               dry_run=True)
            return report
        if report.pages:
            gone = set(report.pages)
            removed: list[str] = []

            def build(st: LogState) -> dict[str, Any] | None:
                # Consumers are read again right before publishing: one created at
                # "earliest" (or seeking back) since planning keeps the pages it was promised.
                still = self._consumed(st, list(self.consumers().values()))
                removed[:] = [st.pages.names[i] for i in still if st.pages.names[i] in gone]
                return {"op": "remove", "pages": list(removed)} if removed else None

            self.log.publish(build)
            kept = gone - set(removed)
            report.pages = list(removed)
            report.bytes -= sum(b for n, b in zip(state.pages.names, state.pages.bytes,
                                                  strict=True) if n in kept)
        for fname in report.pages:
            self._retire(fname, archive=self.settings.archive_data_logs)
        interrupted = set(state.removed)
        for fname in report.orphans:
            # A page the log removed but a crash left behind finishes its retirement; a page
            # that was never published (maybe half written) has nothing worth archiving.
            self._retire(fname, archive=self.settings.archive_data_logs and fname in interrupted)
        report.log_files = self.log.expire(self.settings.log_retention_ms / 1000, now=now)
        self._last_cleanup = time.time()
        self.storage.replace(f"{self.folder}/{_LAST_CLEANUP}",
                             json.dumps({"time": self._last_cleanup}).encode())
        return report

    def repair(self, *, dry_run: bool = True, grace_ms: int | None = None,
               now: float | None = None) -> RepairReport:
        """Set aside a damaged last commit-log entry left by a killed writer, and take pages
        that are missing or fail verification out of the log, recording the messages they
        held as lost. Defaults to a dry run; moves files to ``damaged/``, never deletes.

        ``grace_ms`` (default 10 minutes): how old a damaged last entry must be before it is
        taken for abandoned. See :mod:`pyspark_durable_queue._repair`.
        """
        from ._repair import DEFAULT_GRACE_MS, repair

        return repair(self, dry_run=dry_run, now=now,
                      grace_ms=DEFAULT_GRACE_MS if grace_ms is None else grace_ms)

    def _consumed(self, state: LogState, consumers: list[dict[str, Any]]) -> list[int]:
        """Indices of pages no consumer needs: every watermark is past the page, or the
        consumer's selector provably cannot match it. None without consumers."""
        if not consumers:
            return []
        from ._scan import PageRef, page_may_match, with_system_schema

        selectors = []
        for c in consumers:
            sel = None
            if c.get("selector"):
                from .selector import Selector

                # with the system columns, or a selector on _seq would see NULL everywhere
                sel = Selector(c["selector"], with_system_schema(state.schema))
            selectors.append((int(c["position"]), sel))
        idx = state.pages
        out = []
        for i in range(len(idx)):
            end = idx.ends[i]
            needed = False
            for position, sel in selectors:
                if end <= position:
                    continue
                if sel is not None and not page_may_match(sel, idx.stats(i), PageRef(
                        idx.names[i], idx.seq[i], idx.rows[i], idx.bytes[i], idx.ts[i])):
                    continue
                needed = True
                break
            if not needed:
                out.append(i)
        return out

    def maybe_cleanup(self) -> CleanupReport | None:
        """Run cleanup if ``cleanup_interval_ms`` has passed since any process last did.

        The time of the last cleanup is kept in the address folder, because Spark runs commits
        in short-lived Python processes; it is read only when this process's own clock says a
        cleanup may be due.
        """
        interval = self.settings.cleanup_interval_ms / 1000
        if time.time() - self._last_cleanup < interval:
            return None
        try:
            last = float(json.loads(self.storage.read(f"{self.folder}/{_LAST_CLEANUP}"))["time"])
        except NotFound:
            last = 0.0
        except (ValueError, KeyError, TypeError):
            last = 0.0  # a damaged marker only costs one early cleanup
        self._last_cleanup = max(self._last_cleanup, last)
        if time.time() - self._last_cleanup < interval:
            return None
        self._last_cleanup = time.time()
        try:
            return self.cleanup(dry_run=False)
        except DurableQueueError as exc:
            # Best effort: the acknowledgement or commit that triggered it already succeeded,
            # and must not be reported as failed (a caller would retry it).
            log.warning("address %s: cleanup failed and will be retried later: %s",
                        self.name, exc)
            return None

    def _retire(self, fname: str, *, archive: bool) -> None:
        if fname.startswith(f"{TEMP_FOLDER}/"):
            self.storage.delete(self.storage.join(fname))
            return
        src = f"{self.pages_folder}/{fname}"
        if archive:
            dst = f"{self.folder}/{self.settings.directory_archive}/{fname}"
            try:
                self.storage.move(src, dst)
            except NotFound:
                pass
        else:
            self.storage.delete(src)

    # -- reporting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Messages, bytes, pages, per-consumer backlog and drop counters (JSON-safe)."""
        state = self.log.refresh()
        consumers = self.consumers()
        idx = state.pages
        out: dict[str, Any] = {
            "address": self.name,
            "messages": sum(idx.rows),
            "bytes": sum(idx.bytes),
            "pages": len(idx),
            "first_seq": state.first_seq,
            "next_seq": state.next_seq,
            "commits": state.version,
            "dropped_messages": state.dropped_messages,
            "dropped_bytes": state.dropped_bytes,
            "dropped_sends": state.dropped_sends,
            "schema": None if state.schema is None else str(state.schema),
            "settings": self.settings.to_json(),
            "consumers": {},
        }
        for name, c in consumers.items():
            messages, nbytes = backlog_after(state, int(c["position"]))
            out["consumers"][name] = {"position": int(c["position"]),
                                      "selector": c.get("selector"),
                                      "backlog_messages": messages, "backlog_bytes": nbytes}
        return out


def backlog_after(state: LogState, position: int) -> tuple[int, int]:
    """``(messages, bytes)`` retained at ``_seq >= position``; a partly consumed page counts
    its remaining share of bytes."""
    idx = state.pages
    i = idx.find(position)
    messages = 0
    nbytes = 0.0
    for j in range(i, len(idx)):
        rows = idx.rows[j]
        take = min(rows, idx.ends[j] - max(position, idx.seq[j]))
        messages += take
        nbytes += idx.bytes[j] * take / rows
    return messages, int(nbytes)


# -- data conversion ----------------------------------------------------------------------------
def to_table(data: Any) -> pa.Table:
    """Turn what users send into a ``pyarrow.Table`` (no pickling, no per-value Python for
    Arrow or pandas input)."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if type(data).__module__.startswith("pandas") and hasattr(data, "columns"):
        return pa.Table.from_pandas(data, preserve_index=False).replace_schema_metadata(None)
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list | tuple):
        raise InvalidMessageError(
            f"cannot send a {type(data).__name__}; send a pyarrow.Table, a pandas.DataFrame, "
            "a list of dicts or one dict")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise InvalidMessageError(
                f"message {i} is a {type(row).__name__}, expected a dict of column -> value")
        for k in row:
            if not isinstance(k, str):
                raise InvalidMessageError(f"message {i} has a non-string column name {k!r}")
    try:
        # Infer, never coerce here: from_pylist(schema=...) would truncate 7.5 into an int64
        # column silently. conform_schema casts afterwards, safely.
        return pa.Table.from_pylist(list(data))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidMessageError(f"cannot convert messages to Arrow: {exc}") from exc


def _schema_text(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def conform_schema(table: pa.Table, schema: pa.Schema | None,
                   merge: bool) -> tuple[pa.Table, pa.Schema]:
    """Cast ``table`` to the address schema (adding nulls for missing nullable columns).

    Returns the table and the schema it now has (the address schema, grown by new nullable
    columns when ``merge``).
    """
    reserved = [n for n in table.schema.names if n in RESERVED_COLUMNS]
    if reserved:
        raise SchemaMismatchError(
            f"columns {reserved} are reserved for the store's system columns; rename them")
    if len(set(table.schema.names)) != len(table.schema.names):
        raise SchemaMismatchError(f"duplicate column names in {table.schema.names}")
    if schema is None:
        return table, table.schema
    extra = [f for f in table.schema if f.name not in schema.names]
    if extra and not merge:
        raise SchemaMismatchError(
            f"columns {[f.name for f in extra]} are not in the schema of the address "
            f"({_schema_text(schema)}); send with merge_schema=True (Spark: mergeSchema) to "
            "add them as nullable columns")
    target = pa.schema([*schema, *(f.with_nullable(True) for f in extra)])
    arrays = []
    problems = []
    for f in target:
        if f.name in table.schema.names:
            col = table.column(f.name)
            if col.type != f.type:
                if not _castable(col.type, f.type):
                    problems.append(f"column {f.name!r} is {col.type}, the address has {f.type}")
                    continue
                try:
                    col = col.cast(f.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                    problems.append(f"column {f.name!r} is {col.type}, the address has "
                                    f"{f.type} ({e})")
                    continue
            if not f.nullable and col.null_count:
                problems.append(f"column {f.name!r} is not nullable but has nulls")
            arrays.append(col)
        elif f.nullable:
            arrays.append(pa.nulls(table.num_rows, f.type))
        else:
            problems.append(f"column {f.name!r} is missing and is not nullable")
    if problems:
        raise SchemaMismatchError("; ".join(problems))
    return pa.Table.from_arrays(arrays, schema=target), target


def _kind(t: pa.DataType) -> str:
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_temporal(t):
        return "time"
    return "nested"


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Casts allowed when data meets the address schema: all-null columns, and within one kind
    (numbers, strings, ...); never parsing strings into numbers or the other way round."""
    a, b = _kind(src), _kind(dst)
    return a == "null" or a == b


def check_page_schema(page_schema: pa.Schema, current: pa.Schema | None,
                      merge: bool) -> pa.Schema | None:
    """Check pages written with ``page_schema`` against the address's ``current`` schema.

    Returns the new address schema to record, or ``None`` when it does not change.
    Raises :class:`SchemaMismatchError` naming the columns that do not fit.
    """
    page_schema = pa.schema([f for f in page_schema]).remove_metadata()
    reserved = [n for n in page_schema.names if n in RESERVED_COLUMNS]
    if reserved:  # pages written outside send() (Spark tasks) are checked here
        raise SchemaMismatchError(
            f"columns {reserved} are reserved for the store's system columns; rename them")
    if current is None:
        return page_schema
    problems = []
    extra = []
    for f in page_schema:
        if f.name not in current.names:
            extra.append(f)
            continue
        cf = current.field(f.name)
        if cf.type != f.type:
            problems.append(f"column {f.name!r} is {f.type}, the address has {cf.type}")
    for cf in current:
        if cf.name not in page_schema.names and not cf.nullable:
            problems.append(f"column {cf.name!r} is missing and is not nullable")
    if extra and not merge:
        problems.append(f"columns {[f.name for f in extra]} are not in the address schema "
                        f"({_schema_text(current)}); use mergeSchema to add them")
    if problems:
        raise SchemaMismatchError("schema mismatch: " + "; ".join(problems))
    if extra:
        return pa.schema([*current, *(f.with_nullable(True) for f in extra)])
    return None
