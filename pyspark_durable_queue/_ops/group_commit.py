"""Group commit: concurrent sends to one address in a process share one commit.

Who calls it: ``Address.send``. Modelled on LevelDB's ``DBImpl::Write``: every send queues a
request on the address's :class:`SendQueue` (one per address per process, shared by every
``Address`` handle of it). The request at the front leads: it takes the requests queued behind
it into a group, and outside the lock converts them, writes one page (one file, one sync) and
publishes one commit-log entry. Then it hands each member its own outcome and wakes them; the
next request at the front leads the next group. Sends that arrive while a group commits wait
for the next one, which is how concurrency turns into larger commits instead of races.

Each member keeps its own outcome:

* its own ``_seq`` range (members' rows are contiguous in the group's page, in queue order);
* its own transaction: an entry of a group lists every member's ``(id, batch)`` (``txns``,
  on-disk format 2; a format-1 address takes one transaction per group); a member whose
  transaction is already in the log, or earlier in the group, is a duplicate;
* its own schema errors (it is checked alone; the others go on). A send with
  ``merge_schema`` commits in a group of its own;
* its own full-policy outcome: members are admitted in queue order while the backlog has room;
  each of the rest is dropped (DROP), fails (FAIL), or stays queued for a later group (BLOCK,
  until its own ``block_timeout_ms``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from .._format.page import FRAME_MAX_ROWS, FRAME_TARGET_BYTES, PageInfo, encode_frames, stream_frame
from .._format.schema import (
    arrow_table,
    as_rows,
    check_page_schema,
    conform_schema,
    nullable,
    rows_to_table,
    typed_stream,
    typed_table,
    with_ttl,
)
from .._log.commit_log import CommitLog, LogState
from .._log.journal import STATS_MIN_BYTES, unit_page
from .._log.state import append_entry
from .._log.txn import committed
from ..errors import InvalidMessageError, SchemaMismatchError
from .commit import BLOCK_POLL_S, CommitResult, Committer, full_error, over_limit, refusal

__all__ = ["SendQueue", "send_queue"]

log = logging.getLogger(__name__)

#: A group holds at most this many sends and about this many bytes of Arrow data: a larger
#: group would hold the senders behind it longer than the commit it saves.
GROUP_MAX_SENDS = 4096
GROUP_MAX_BYTES = 16 << 20
#: A send of at most this many dicts of scalars (about this many bytes at most) leaves them to
#: its group's leader, which converts the rows of the whole group in one call: a conversion
#: has a fixed cost however few rows it has (see docs/decisions.md, "group first, then
#: encode").
DEFERRED_ROWS = 64
DEFERRED_BYTES = 64 << 10
#: The Python types a deferred row's values may have. A column whose values all have one of
#: these types (or are None) is inferred the same, converted alone or with the rest of its
#: group; a mix is not (Arrow's inference lets the first value's type decide and coerces the
#: others: a float after a datetime becomes microseconds, True after 1.5 becomes 1.0).
_SCALARS = frozenset({int, float, str, bytes, bool})


class _Retry(Exception):
    """The freshest state no longer takes the group as built (a concurrent writer in another
    process took the room, committed a member's transaction, or changed the schema)."""


@dataclass(eq=False, slots=True)
class SendRequest:
    """One ``send`` call waiting in the queue. Fields after ``deadline`` are written by the
    leader of the group that settles it, before it opens the request's gate."""

    #: the messages as Arrow, or ``None`` while they are still the ``rows`` the caller sent
    #: (a few dicts: the leader converts a group's rows together, see :func:`_tables_of`)
    table: pa.Table | None
    txn: tuple[str, int] | None
    merge_schema: bool
    deadline: float  # monotonic; BLOCK waits until then
    fsync: str = "always"  # the sending handle's durability; a group has one
    rows: list[dict[str, Any]] | None = None
    #: the Arrow bytes of ``table``, or an estimate for ``rows`` (what bounds a group)
    nbytes: int = 0
    done: bool = False
    result: CommitResult | None = None
    error: BaseException | None = None
    #: what its sender waits on, a lock held while it may not go on: released (under the
    #: queue's lock, see :func:`_wake`) when the request is settled or reaches the
    #: front; its sender's ``acquire`` takes it back. A lock, not a condition: a settled
    #: sender leaves without taking the queue's lock again (senders woken from conditions
    #: queued for that lock, and ``notify`` held the GIL for much of the time).
    gate: threading.Lock | None = None
    #: the send's ``ttl_ms``: its rows' frames store it (``_format.schema.with_ttl``)
    ttl_ms: int | None = None

    @classmethod
    def of(cls, data: Any, txn: tuple[str, int] | None, merge_schema: bool, deadline: float,
           fsync: str, ttl_ms: int | None = None) -> SendRequest:
        """The request of one ``send(data)``. Checked here, in the sender's thread (a bad
        message fails its own send at once); a few dict rows are left for the leader to
        convert with the rest of its group."""
        rows = as_rows(data)
        if rows is not None and len(rows) <= DEFERRED_ROWS and not merge_schema:
            nbytes = _estimate(rows)
            if nbytes is not None and nbytes <= DEFERRED_BYTES:
                return cls(None, txn, merge_schema, deadline, fsync, rows=rows, nbytes=nbytes,
                           ttl_ms=ttl_ms)
        table = rows_to_table(rows) if rows is not None else arrow_table(data)
        return cls(table, txn, merge_schema, deadline, fsync, nbytes=table.nbytes,
                   ttl_ms=ttl_ms)

    @property
    def num_rows(self) -> int:
        return self.table.num_rows if self.table is not None else len(self.rows or ())

    def settle(self, result: CommitResult | None = None,
               error: BaseException | None = None) -> None:
        self.result, self.error, self.done = result, error, True

    def outcome(self) -> CommitResult:
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class SendQueue:
    """The sends of one address in one process, committed in groups.

    Concurrency guarantee: thread-safe. ``_lock`` guards ``_queue`` and each request's
    ``gate``; it is held only to queue, to take a group and to hand results back, never during
    I/O. Exactly one thread (the front request's) commits at a time; it settles its members
    (outside the lock, before their gates open: a sender reads its outcome only after).
    """

    def __init__(self) -> None:
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[SendRequest] = deque()
        #: The view of the log every group of this process builds on, whichever handle leads
        #: it (the first leader's): a leader from another handle would first have to read
        #: every entry the others published (an HTTP GET each on an object store).
        self._log: CommitLog | None = None

    def send(self, committer: Committer, request: SendRequest, *,
             many_txns: bool) -> CommitResult:
        """Queue ``request`` and return its outcome once a group settled it (this thread may be
        the one that commits it, and others with it).

        Parameters
        ----------
        committer : Committer
            The sending handle's commit path of the address (its log, storage and settings).
        many_txns : bool
            Whether an entry of the address may list several transactions (on-disk format 2
            and later); otherwise a group takes at most one.
        """
        with self._lock:
            self._queue.append(request)
            front = self._queue[0] is request
            # at the front at once (a lone sender): its group is taken under this same hold
            taken = self._take(committer, many_txns) if front else None
        while True:
            while not front:
                gate = request.gate
                if gate is None:  # made only to wait (a lone sender never does)
                    gate = threading.Lock()
                    gate.acquire()
                    with self._lock:
                        request.gate = gate
                        front = request.done or self._queue[0] is request
                    if front:
                        break
                gate.acquire()  # opened: settled, or at the front
                if request.done:
                    return request.outcome()
                with self._lock:
                    front = self._queue[0] is request
            # At the front. A request that leading left unsettled (BLOCK: the backlog is full,
            # consumers must ack; or a round to start again) is still the front: requests only
            # queue behind it.
            if not request.done and self.lead(committer, many_txns=many_txns, taken=taken) \
                    and not request.done:
                time.sleep(BLOCK_POLL_S)
            taken = None
            if request.done:
                return request.outcome()

    def lead(self, committer: Committer, *, many_txns: bool,
             taken: tuple[list[SendRequest], CommitLog] | None = None) -> bool:
        """Commit one group from the front of the queue (called by the front request's
        thread, with its handle's ``committer``) and settle what it can. Returns whether a
        BLOCK member waits for room. ``many_txns``: see :meth:`send`; ``taken``: the group
        and the log to publish it through, taken under the lock just before (:meth:`_take`)."""
        if taken is None:
            with self._lock:
                taken = self._take(committer, many_txns)
        group, commit_log = taken
        try:
            if len(group) == 1:
                waiting = _commit_lone(committer, commit_log, group[0])
                if waiting is not None:
                    return waiting
            return _commit_group(committer, commit_log, group)
        except BaseException as exc:
            with self._lock:
                for member in group:
                    if not member.done:
                        member.settle(error=exc)
            raise
        finally:
            with self._lock:
                queue = self._queue
                if len(group) == 1 and queue and queue[0] is group[0]:
                    # a group of one is the front of the queue: settled, it leaves it
                    if group[0].done:
                        queue.popleft()
                        _wake(group[0])
                else:
                    queue = self._queue = deque(r for r in queue if not r.done)
                    for member in group:
                        if member.done:
                            _wake(member)
                if queue:
                    _wake(queue[0])

    def _take(self, committer: Committer,
              many_txns: bool) -> tuple[list[SendRequest], CommitLog]:
        """The group to commit next and the log view to publish it through (under the
        lock)."""
        group = self._take_group(many_txns)
        if self._log is None:
            self._log = committer.log
        # The shared view's storage syncs as its first handle chose; a leader whose handle
        # syncs otherwise publishes through its own (a group has one fsync mode).
        commit_log = self._log if self._log.storage.fsync == committer.storage.fsync \
            else committer.log
        return group, commit_log

    def _take_group(self, many_txns: bool) -> list[SendRequest]:
        """The front request and the compatible ones behind it, in queue order (under the
        lock). A ``merge_schema`` send commits alone; a format-1 address takes one transaction
        per group; a group's sends share one ``fsync`` mode (the leader's handle writes it)."""
        first = self._queue[0]
        group = [first]
        if first.merge_schema:
            return group
        if len(self._queue) == 1:
            return group
        nbytes = first.nbytes
        txns = first.txn is not None
        for request in list(self._queue)[1:]:
            if request.merge_schema or len(group) >= GROUP_MAX_SENDS or \
                    request.fsync != first.fsync:
                break
            nbytes += request.nbytes
            if nbytes > GROUP_MAX_BYTES:
                break
            if request.txn is not None:
                if txns and not many_txns:
                    break
                txns = True
            group.append(request)
        return group


def _wake(request: SendRequest) -> None:
    """Let ``request``'s sender go on (under the queue's lock). Its gate is released only when
    held, so two wakes before the sender woke are one."""
    gate = request.gate
    if gate is not None and gate.locked():
        gate.release()


def _commit_group(committer: Committer, commit_log: CommitLog,
                  group: list[SendRequest]) -> bool:
    """Commit what ``group`` can take now and settle those members; members left unsettled
    go again in a later group. Returns whether a BLOCK member is waiting for room."""
    state, refreshed = _view(committer, commit_log)
    members = _fresh_members(state, group)
    if not members:
        return False
    staged = _stage(committer, commit_log, state, members, refreshed)
    if not staged.admitted:
        return staged.waiting
    published = _publish(committer, commit_log, state, staged)
    if published is None:
        return False  # the members are still queued: the next round starts afresh
    _settle(staged, *published)
    return staged.waiting


def _commit_lone(committer: Committer, commit_log: CommitLog,
                 request: SendRequest) -> bool | None:
    """The commit of a send that is alone in its group, when it is the plain case: a few dicts
    the address schema takes as they are (one small journal frame written without Arrow), no
    transaction, TTL, schema merge, limit or compression, and no other process writing (whose
    units would be read before the lock). Returns ``False`` once it is settled; ``None`` when
    it is not that case (or the freshest state under the lock no longer takes it: nothing was
    written), and :func:`_commit_group` commits it. The same frame bytes and entry as that
    path's ``_typed_group`` round, without staging a group (see docs/performance.md,
    "send-profile")."""
    rows = request.rows
    if rows is None or request.txn is not None or request.ttl_ms is not None or \
            request.merge_schema or commit_log.journal is None or commit_log.others_writing or \
            committer.limited:
        return None
    settings = committer.settings
    schema = commit_log.state.schema
    if schema is None or settings.compression != "none" or len(rows) > FRAME_MAX_ROWS:
        return None
    stream = typed_stream(rows, schema)
    if stream is None or \
            len(stream) > min(FRAME_TARGET_BYTES, settings.page_size_bytes // 2) // 4:
        return None
    frames = stream_frame(stream, len(rows))
    listed = [unit_page(len(rows), len(frames))]

    def build(fresh: LogState) -> dict[str, Any]:
        if fresh.schema is not schema and (fresh.schema is None or not fresh.schema.equals(schema)):
            raise _Retry  # another process changed the schema: the general path decides
        return append_entry(fresh.next_seq, listed)

    try:
        published = commit_log.publish(build, frames, spare=True)
    except _Retry:
        return None
    assert published is not None
    committer.published()
    version, entry = published
    request.settle(CommitResult(int(entry["seq"]), len(rows), version))
    return False


@dataclass(eq=False)
class _Staged:
    """What one round of a group publishes: its admitted members in queue order and their
    row counts, the schema their data has, and that data as written (not yet published):
    journal frames (with their statistics, for a large unit) or page files. No admitted
    member: nothing to publish, and ``waiting`` is the round's outcome."""

    admitted: list[SendRequest]
    counts: list[int]
    schema: pa.Schema | None
    #: a BLOCK member waits for room (it stays queued)
    waiting: bool = False
    frames: bytearray | None = None
    frame_index: list[dict[str, Any]] | None = None
    pages: list[PageInfo] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(self.counts)

    @property
    def nbytes(self) -> int:
        if self.frames is not None:
            return len(self.frames)
        return sum(p.bytes for p in self.pages)

    def listed(self) -> list[dict[str, Any]]:
        """The pages the entry lists: one journal unit carries the commit and its frames (no
        page file, see ``_log.journal``), else the page files."""
        if self.frames is not None:
            return [unit_page(self.rows, len(self.frames), self.frame_index)]
        return [p.to_dict() for p in self.pages]


def _view(committer: Committer, commit_log: CommitLog) -> tuple[LogState, bool]:
    """The state a round decides on, and whether it was read afresh.

    The publish builds the entry on the freshest state, under the publish lock, and starts the
    round again when what was decided here no longer holds (a transaction another process
    committed, a schema it changed, room it took): this view needs no read of the log first,
    unless the backlog can be full (admission then needs the others' commits) or other
    processes are writing (their units are best read before the lock, not under it)."""
    refreshed = committer.limited or commit_log.others_writing
    return (commit_log.refresh() if refreshed else commit_log.state), refreshed


def _stage(committer: Committer, commit_log: CommitLog, state: LogState,
           members: list[SendRequest], refreshed: bool) -> _Staged:
    """Convert, check and admit the members, and write the data of those admitted; members
    whose data does not fit the schema are settled with their error, and those the full
    policy refuses with their outcome."""
    target = min(FRAME_TARGET_BYTES, committer.settings.page_size_bytes // 2)
    staged = _typed_group(committer, commit_log, state, members, target)
    if staged is not None:
        return staged
    tables, schema, mismatched = _in_group_schema(state.schema,
                                                  _tables_of(state.schema, members))
    if mismatched:
        if not refreshed and _schema_moved(state.schema, commit_log.refresh().schema):
            return _Staged([], [], None)  # another process changed the schema: again, fresh
        for m, exc in mismatched.items():
            m.settle(error=exc)
    if schema is None or not tables:
        return _Staged([], [], None)
    admitted, waiting = _admit(committer, state, members, tables)
    staged = _Staged(admitted, [tables[m].num_rows for m in admitted], schema, waiting)
    if any(m.ttl_ms is not None for m in admitted):  # the frames store each row's TTL
        tables = {m: with_ttl(tables[m], m.ttl_ms) for m in admitted}
    if admitted:
        table = _one_chunk(pa.concat_tables([tables[m] for m in admitted])) \
            if len(admitted) > 1 else tables[admitted[0]]
        _write(committer, commit_log, table, target, staged)
    return staged


def _typed_group(committer: Committer, commit_log: CommitLog, state: LogState,
                 members: list[SendRequest], target: int) -> _Staged | None:
    """The group as one journal frame written without Arrow (:func:`_typed_frames`) when
    every member's dicts are what the address schema takes as they are: no conforming, no
    admission (no limit), no table; else ``None``."""
    if commit_log.journal is None or committer.limited or \
            committer.settings.compression != "none":
        return None
    frames = _typed_frames(state.schema, members, target)
    if frames is None:
        return None
    return _Staged(members, [m.num_rows for m in members], state.schema, frames=frames)


def _write(committer: Committer, commit_log: CommitLog, table: pa.Table, target: int,
           staged: _Staged) -> None:
    """Write the admitted members' ``table`` into ``staged``: as frames of one journal unit,
    or as page files (deleted again if writing fails)."""
    if commit_log.journal is not None:
        # a unit this large carries the statistics of its frames (page files do too), so
        # that selectors skip it, or its frames, without reading them
        staged.frame_index = [] if table.nbytes >= STATS_MIN_BYTES else None
        staged.frames = encode_frames(table, target=target,
                                      compression=committer.settings.compression,
                                      index=staged.frame_index)
        return
    # sends commit often: a group's page may be a file made ahead (``_storage._spares``)
    writer = committer.page_writer(make_folder=False, spare=True)
    try:
        writer.write(table)
        staged.pages = writer.close()
    except BaseException:
        writer.abort()
        raise


def _publish(committer: Committer, commit_log: CommitLog, state: LogState,
             staged: _Staged) -> tuple[int, dict[str, Any]] | None:
    """Publish the staged data as one entry; ``None`` when the freshest state no longer takes
    the group as built (its pages are then deleted and the members stay queued)."""
    build = _entry_builder(committer, state, staged)
    try:
        if staged.pages:
            committer.prepare(staged.pages, fresh=True)
        # so may its log entry be a file made ahead
        published = commit_log.publish(build, staged.frames, spare=True)
    except _Retry:
        committer.delete_unpublished(staged.pages)
        return None
    except BaseException:
        committer.delete_unpublished(staged.pages)
        raise
    assert published is not None
    committer.published()
    return published


def _entry_builder(committer: Committer, state: LogState,
                   staged: _Staged) -> Callable[[LogState], dict[str, Any]]:
    """The ``build`` of the group's publish: the ``append`` entry on the freshest state, or
    :class:`_Retry` when that state no longer takes what was decided on ``state``."""
    admitted_at = state.version  # the view admission decided on (a refresh moves it on)
    conformed_to = state.schema
    merge = staged.admitted[0].merge_schema
    rows, nbytes, listed = staged.rows, staged.nbytes, staged.listed()
    txns = [m.txn for m in staged.admitted if m.txn is not None]
    ttl = any(m.ttl_ms is not None for m in staged.admitted)
    limited = committer.limited

    def build(fresh: LogState) -> dict[str, Any]:
        if any(committed(fresh.txns, t) for t in txns):
            raise _Retry  # another process committed a member's transaction meanwhile
        # Room is checked again only when another writer committed since admission (which
        # estimated sizes from the Arrow tables; the stored bytes differ a little).
        if limited and fresh.version != admitted_at and \
                committer.over_limit(*committer.backlog_of(fresh), rows, nbytes):
            raise _Retry
        try:
            new_schema = check_page_schema(staged.schema, fresh.schema, merge)
        except SchemaMismatchError:
            if fresh.schema is not None and fresh.schema != conformed_to:
                raise _Retry from None  # grown by another writer: convert again
            raise
        return append_entry(fresh.next_seq, listed, schema=new_schema, txns=txns, ttl=ttl)

    return build


def _settle(staged: _Staged, version: int, entry: dict[str, Any]) -> None:
    """Hand each admitted member its own ``_seq`` range of the published entry."""
    seq = int(entry["seq"])
    for m, n in zip(staged.admitted, staged.counts, strict=True):
        m.settle(CommitResult(seq, n, version))
        seq += n


def _fresh_members(state: LogState, group: list[SendRequest]) -> list[SendRequest]:
    """Settle members whose transaction the log (or an earlier member) already holds."""
    members = []
    seen: dict[str, int] = {}
    for m in group:
        if m.txn is not None:
            if committed(state.txns, m.txn) or seen.get(m.txn[0], -1) >= m.txn[1]:
                log.info("txn %r was already committed; not stored again", m.txn)
                m.settle(CommitResult(-1, 0, -1, duplicate=True))
                continue
            seen[m.txn[0]] = m.txn[1]
        members.append(m)
    return members


def _typed_frames(schema: pa.Schema | None, members: list[SendRequest],
                  target: int) -> bytearray | None:
    """The frame of a group whose members all left a few dicts to their leader, written
    without Arrow (``_format.schema.typed_stream``: the same bytes) when the dicts are what the
    address schema takes as they are and make one small frame; else ``None``, and the group
    goes through Arrow (:func:`_tables_of`, conforming, ``encode_frames``)."""
    if schema is None or any(m.table is not None or m.merge_schema or m.ttl_ms is not None
                             for m in members):
        return None
    rows = (members[0].rows or []) if len(members) == 1 else \
        [row for m in members for row in m.rows or ()]
    if len(rows) > FRAME_MAX_ROWS:
        return None
    stream = typed_stream(rows, schema)
    # at most a quarter of a frame: encode_frames would not cut it either (byte for byte)
    if stream is None or len(stream) > target // 4:
        return None
    return stream_frame(stream, len(rows))


def _tables_of(schema: pa.Schema | None, members: list[SendRequest]) -> dict[
        SendRequest, pa.Table]:
    """Each member's messages as Arrow, in queue order; a member whose rows do not convert is
    settled with its own error.

    The rows of members that sent dicts are converted in one call when they all have the same
    columns, each column's values have one Python type (:func:`_uniform`), and the result has
    the address's schema as it is: then each member's rows are inferred exactly as they would
    be alone, and stored as converting them alone and conforming would store them. Otherwise
    each converts alone, so that one bad message fails only its own send."""
    deferred = [m for m in members if m.table is None]
    tables: dict[SendRequest, pa.Table] = {}
    if deferred and schema is not None:
        rows = (deferred[0].rows or []) if len(deferred) == 1 else \
            [row for m in deferred for row in m.rows or ()]
        table = typed_table(rows, schema)
        if table is None and len(deferred) > 1 and _uniform(rows):
            with contextlib.suppress(InvalidMessageError):
                table = rows_to_table(rows)
        if table is not None and table.schema.equals(schema):
            start = 0
            for m in deferred:
                tables[m] = table.slice(start, m.num_rows)
                start += m.num_rows
            deferred = []
    for m in deferred:
        try:
            tables[m] = rows_to_table(m.rows or [])
        except InvalidMessageError as exc:
            m.settle(error=exc)
    ordered = {}
    for m in members:
        table = m.table if m.table is not None else tables.get(m)
        if table is not None:
            ordered[m] = table
    return ordered


def _one_chunk(table: pa.Table) -> pa.Table:
    """A group's table of many small sends as one chunk: each chunk would become a frame of its
    own (a header, an IPC schema and a decode each)."""
    chunks = table.column(0).num_chunks if table.num_columns else 1
    if chunks > 1 and table.nbytes < chunks * (FRAME_TARGET_BYTES // 4):
        return table.combine_chunks()
    return table


def _in_group_schema(schema: pa.Schema | None, members: dict[SendRequest, pa.Table]) -> tuple[
        dict[SendRequest, pa.Table], pa.Schema | None, dict[SendRequest, SchemaMismatchError]]:
    """Each member's table in the group's schema, and the error of each member that does not
    fit (not settled yet: the schema may be older than the log's). Without an address schema
    the first member's fixes it (it commits first)."""
    tables: dict[SendRequest, pa.Table] = {}
    mismatched: dict[SendRequest, SchemaMismatchError] = {}
    target = schema
    # Most sends already have the address's schema (the same code sends the same dicts):
    # such a table needs no conversion when no column forbids nulls.
    as_is = schema is not None and nullable(schema)
    for m, given in members.items():
        if as_is and not m.merge_schema and given.schema.equals(schema):
            tables[m] = given
            continue
        try:
            table, new = conform_schema(given, target, m.merge_schema)
            if target is None:
                table, new = conform_schema(table, new.remove_metadata(), False)
        except SchemaMismatchError as exc:
            mismatched[m] = exc
            continue
        target = new
        tables[m] = table
    return tables, target, mismatched


def _schema_moved(before: pa.Schema | None, now: pa.Schema | None) -> bool:
    return (before is None) != (now is None) or (
        before is not None and now is not None and not before.equals(now))


def _admit(committer: Committer, state: LogState, members: list[SendRequest],
           tables: dict[SendRequest, pa.Table]) -> tuple[list[SendRequest], bool]:
    """Members admitted in queue order while the backlog has room; the rest get their policy's
    outcome. Returns the admitted members and whether a BLOCK member waits for room."""
    candidates = [m for m in members if m in tables]
    if not committer.limited:
        return candidates, False
    settings = committer.settings
    backlog_messages, backlog_bytes = committer.backlog_of(state)
    admitted: list[SendRequest] = []
    full = False
    now = time.monotonic()
    for m in candidates:
        rows, nbytes = tables[m].num_rows, tables[m].nbytes
        if not full and not over_limit(settings, backlog_messages, backlog_bytes, rows, nbytes):
            admitted.append(m)
            backlog_messages += rows
            backlog_bytes += nbytes
            continue
        full = True  # admission stops at the first member that does not fit
        verdict, what = refusal(committer.name, settings, backlog_messages, backlog_bytes, rows,
                                nbytes, m.deadline, now)
        if verdict == "drop":
            m.settle(committer.drop(what, rows, nbytes, m.txn))
        elif verdict == "fail":
            m.settle(error=full_error(settings, what))
        # "wait": BLOCK leaves it queued until its deadline
    blocked = any(not m.done for m in candidates if m not in admitted)
    return admitted, blocked


# -- one queue per address per process ----------------------------------------------------------
_QUEUES: weakref.WeakValueDictionary[tuple[str, str], SendQueue] = weakref.WeakValueDictionary()
_QUEUES_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[SendQueue] = weakref.WeakSet()


def send_queue(storage_root: str, folder: str) -> SendQueue:
    """The send queue of the address at ``folder``, shared by every handle in this process."""
    key = (storage_root, folder)
    with _QUEUES_LOCK:
        queue = _QUEUES.get(key)
        if queue is None:
            queue = _QUEUES[key] = SendQueue()
        return queue


def _after_fork() -> None:
    # A forked child (gunicorn workers, Spark's Python workers) inherits the queues without the
    # threads that were committing them: its sends start afresh.
    global _QUEUES_LOCK
    _QUEUES_LOCK = threading.Lock()
    for queue in list(_LIVE):
        queue._reset()


os.register_at_fork(after_in_child=_after_fork)


def _estimate(rows: list[dict[str, Any]]) -> int | None:
    """At least the Arrow bytes of ``rows`` (a string's UTF-8 at most 4 bytes a character),
    or ``None`` when a value is not a scalar (a list, a dict, a datetime...: converted in the
    sender's thread, where its size is known)."""
    total = 0
    for row in rows:
        for v in row.values():
            kind = type(v)
            if kind is str:
                total += 4 * len(v)
            elif kind is bytes:
                total += len(v)
            elif kind in _SCALARS or v is None:
                total += 8
            else:
                return None
    return total


def _uniform(rows: list[dict[str, Any]]) -> bool:
    """Whether ``rows`` (deferred ones: their values are :data:`_SCALARS` or None, as
    :func:`_estimate` made sure) all have the first row's columns and each column's values
    one type: then converting them together infers what each row's own conversion would."""
    keys = rows[0].keys()
    kinds: dict[str, type] = {}
    for row in rows:
        if row.keys() != keys:
            return False
        for k, v in row.items():
            if v is None:
                continue
            kind = type(v)
            if kinds.setdefault(k, kind) is not kind:
                return False
    return True
