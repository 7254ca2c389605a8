"""Publishing written pages: one commit-log entry per commit, exactly-once keys, the full policy.

Who calls it: ``Address.send`` (the client, after writing pages) and the Spark sink's
driver-side ``commit`` (pages written by tasks). A commit

1. drops out early when its transaction is already in the log (a retried send or Spark batch);
2. renews its pages (``touch``: a page older than ``orphanGraceMs`` must not be taken for an
   orphan meanwhile) and makes their directory entries durable;
3. applies the address-full policy against the backlog (PAGE accepts; DROP publishes a ``drop``
   entry; FAIL raises; BLOCK waits up to ``blockTimeoutMs``);
4. publishes the ``append`` entry on the freshest state, checking the policy and the schema
   again there (a concurrent writer may have taken the room or grown the schema).

On any refusal or failure the pages are deleted, unless the log lists them (a commit can fail
after its entry was published).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .._format.page import PageInfo, PageWriter
from .._format.schema import check_page_schema
from .._log.commit_log import LogState
from .._log.durability import written
from .._log.state import append_entry, drop_entry
from .._log.txn import committed
from ..errors import AddressFullError, DurableQueueError, StorageError
from ..settings import AddressSettings
from .context import OnAddress

__all__ = ["BLOCK_POLL_S", "CommitResult", "Committer", "backlog_after", "full_error",
           "full_message", "over_limit", "refusal"]

log = logging.getLogger(__name__)

#: How often a send that BLOCK holds looks again for room (consumers acknowledging).
BLOCK_POLL_S = 0.05


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
    scheduled : str or None
        A send with ``deliver_at`` or ``delay_ms``: the schedule's id (nothing appended yet).
    """

    seq: int
    count: int
    version: int
    dropped: bool = False
    duplicate: bool = False
    scheduled: str | None = None


class _RoomTaken(Exception):
    """Raised inside a publish: the commit no longer fits the limits on the freshest state."""


def backlog_after(state: LogState, position: int) -> tuple[int, int]:
    """``(messages, bytes)`` retained at ``_seq >= position``; a partly consumed page counts
    its remaining share of bytes."""
    idx = state.pages
    messages = 0
    nbytes = 0.0
    for j in range(idx.find(position), len(idx)):
        rows = idx.rows[j]
        take = min(rows, idx.ends[j] - max(position, idx.seq[j]))
        messages += take
        nbytes += idx.bytes[j] * take / rows
    return messages, int(nbytes)


def over_limit(settings: AddressSettings, backlog_messages: int, backlog_bytes: int, rows: int,
               nbytes: int) -> bool:
    """Whether a commit of ``rows``/``nbytes`` on top of the backlog passes a limit."""
    # A commit that alone exceeds the limit is accepted into an empty backlog; otherwise
    # BLOCK could never succeed for it.
    if backlog_messages == 0:
        return False
    s = settings
    return (0 < s.max_size_messages < backlog_messages + rows) or \
        (0 < s.max_size_bytes < backlog_bytes + nbytes)


def full_message(name: str, s: AddressSettings, backlog_messages: int, backlog_bytes: int,
                 rows: int, nbytes: int) -> str:
    return (f"address {name!r} is full: backlog {backlog_messages} messages / "
            f"{backlog_bytes} bytes, send of {rows} messages / {nbytes} bytes, limits "
            f"maxSizeMessages={s.max_size_messages} maxSizeBytes={s.max_size_bytes}")


def refusal(name: str, s: AddressSettings, backlog_messages: int, backlog_bytes: int,
            rows: int, nbytes: int, deadline: float, now: float) -> tuple[str, str]:
    """What the full policy does with a commit of ``rows`` / ``nbytes`` that the backlog has
    no room for (:func:`over_limit`): ``("wait", what)`` (BLOCK before ``deadline``),
    ``("drop", what)`` (DROP) or ``("fail", what)`` (FAIL, or BLOCK once the deadline
    passed); ``what`` says why. The one place the policy is decided: a single commit
    (:meth:`Committer.commit`) and a group commit (``_ops.group_commit``) both ask it."""
    what = full_message(name, s, backlog_messages, backlog_bytes, rows, nbytes)
    policy = s.address_full_policy
    if policy == "DROP":
        return "drop", what
    if policy == "BLOCK" and now < deadline:
        return "wait", what
    return "fail", what


def full_error(s: AddressSettings, what: str) -> AddressFullError:
    """The error of a send refused by FAIL, or by BLOCK once ``blockTimeoutMs`` passed."""
    if s.address_full_policy == "BLOCK":
        return AddressFullError(f"{what}; waited blockTimeoutMs={s.block_timeout_ms} for "
                                "consumers to acknowledge; nothing was stored")
    return AddressFullError(f"{what}; addressFullPolicy=FAIL, nothing was stored")


class Committer(OnAddress):
    """Publishes pages to one address's commit log.

    Concurrency guarantee: any number of committers, in any processes, may commit to one
    address at once; the log admits one entry per number, losers rebuild on top, so ``_seq``
    stays dense. Limits are checked on the state an entry extends, so concurrent commits never
    overshoot ``maxSizeMessages`` / ``maxSizeBytes`` together.
    """


    def commit(self, pages: Sequence[PageInfo], schema: pa.Schema, *,
               txn: tuple[str, int] | None = None, merge_schema: bool = False,
               ttl: bool = False) -> CommitResult:
        """Publish ``pages`` (written with ``schema``) as one entry; see the module docstring.

        Parameters
        ----------
        txn : (key, version), optional
            Exactly-once key, already namespaced (see :mod:`.._log.txn`).
        ttl : bool
            The pages' frames store the hidden TTL column: the entry says so (``ttl: true``).
        """
        pages = [p for p in pages if p.rows > 0]
        rows = sum(p.rows for p in pages)
        nbytes = sum(p.bytes for p in pages)
        try:
            if txn is not None and committed(self.log.refresh().txns, txn):
                self.delete_unpublished(pages)
                return CommitResult(-1, 0, -1, duplicate=True)
            if not pages:
                return CommitResult(-1, 0, -1)
            limited = self.limited
            deadline = time.monotonic() + self.settings.block_timeout_ms / 1000

            def build(state: LogState) -> dict[str, Any] | None:
                if txn is not None and committed(state.txns, txn):
                    return None
                if limited and self.over_limit(*self.backlog_of(state), rows, nbytes):
                    raise _RoomTaken
                new_schema = check_page_schema(schema, state.schema, merge_schema)
                return append_entry(state.next_seq, [p.to_dict() for p in pages],
                                    schema=new_schema, txns=[] if txn is None else [txn],
                                    ttl=ttl)

            self.prepare(pages)
            while True:
                if limited:
                    refused = self._admit(rows, nbytes, txn, deadline)
                    if refused is not None:
                        self.delete_unpublished(pages)
                        return refused
                try:
                    published = self.log.publish(build)
                except _RoomTaken:
                    continue  # the policy decides again: wait (BLOCK), drop or fail
                break
        except BaseException:
            self.delete_unpublished(pages)
            raise
        if published is None:
            self.delete_unpublished(pages)
            return CommitResult(-1, 0, -1, duplicate=True)
        self.published()
        version, entry = published
        return CommitResult(int(entry["seq"]), rows, version)

    def page_writer(self, *, make_folder: bool = True, spare: bool = False) -> PageWriter:
        """A writer of new (unpublished) pages of the address, in its page size and
        compression; ``make_folder=False`` when the pages folder is known to exist, ``spare``
        when its pages may be files made ahead (see ``Storage.begin_write``)."""
        return PageWriter(self.storage, self.layout.pages,
                          page_size_bytes=self.settings.page_size_bytes,
                          compression=self.settings.compression, make_folder=make_folder,
                          spare=spare)

    def prepare(self, pages: Sequence[PageInfo], *, fresh: bool = False) -> None:
        """Make written pages ready to publish. ``fresh``: this process wrote them just now
        (a send), so they are younger than any orphan grace period."""
        # A page older than orphanGraceMs (a long Spark batch) could be taken for an orphan by
        # another process's cleanup: renew it, and never publish a missing one.
        missing = [] if fresh else [
            p.name for p in pages if not self.storage.touch(self.layout.page(p.name))]
        if missing:
            raise StorageError(errno.ENOENT, (
                f"address {self.name!r}: pages {missing} written for this commit are gone "
                f"(removed as orphans after orphanGraceMs={self.settings.orphan_grace_ms}?); "
                "nothing was published"))
        # The pages' directory entries must be durable before an entry names them (each page
        # file was synced when written; one folder sync covers them all).
        self.storage.sync_folder(self.layout.pages)

    def delete_unpublished(self, pages: Iterable[PageInfo]) -> None:
        """Delete pages a refused or failed commit wrote, but never a page the log lists.

        The log is read afresh: a commit can fail after its entry was published (the folder
        sync after ``link`` failed, a PUT timed out after the server stored it, Spark aborts
        after a failed commit in a fresh process), and then the pages are live. If the log
        cannot be read, nothing is deleted: the orphan sweep decides later.
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
                self.storage.delete(self.layout.page(p.name))

    # -- the full policy ------------------------------------------------------------------------
    def drop(self, what: str, rows: int, nbytes: int,
             txn: tuple[str, int] | None) -> CommitResult:
        """Record a send the DROP policy refused (a ``drop`` entry: counters, and its
        transaction, so that a retry is a duplicate)."""
        log.warning("%s; dropping the send (addressFullPolicy=DROP)", what)
        entry = drop_entry(rows, nbytes, txn)
        published = self.log.publish(lambda state: entry)
        assert published is not None
        self.published()
        return CommitResult(-1, 0, published[0], dropped=True)

    def published(self) -> None:
        """An entry was published through this committer's storage: with ``fsync=periodic``
        nothing in the commit synced it, so the background syncer must (see ``_log.durability``)."""
        if self.settings.fsync == "periodic":
            written(self.storage, self.settings.fsync_interval_ms)

    def backlog_of(self, state: LogState, position: int | None = None) -> tuple[int, int]:
        """``(messages, bytes)`` not yet acknowledged by every consumer (or after
        ``position``). Without consumers, every retained message counts."""
        if position is None:
            positions = [int(c["position"]) for c in self.consumers.all().values()]
            position = min(positions) if positions else state.first_seq
        return backlog_after(state, position)

    @property
    def limited(self) -> bool:
        """Whether commits can be refused for want of room (a limit and a policy but PAGE)."""
        return self.settings.limited and self.settings.address_full_policy != "PAGE"

    def over_limit(self, backlog_messages: int, backlog_bytes: int, rows: int,
                   nbytes: int) -> bool:
        return over_limit(self.settings, backlog_messages, backlog_bytes, rows, nbytes)

    def _admit(self, rows: int, nbytes: int, txn: tuple[str, int] | None,
               deadline: float) -> CommitResult | None:
        """Apply DROP/FAIL/BLOCK (:func:`refusal`); ``None`` means the commit may go
        ahead."""
        while True:
            backlog = self.backlog_of(self.log.refresh())
            if not self.over_limit(*backlog, rows, nbytes):
                return None
            verdict, what = refusal(self.name, self.settings, *backlog, rows, nbytes,
                                    deadline, time.monotonic())
            if verdict == "wait":
                time.sleep(BLOCK_POLL_S)
                continue
            if verdict == "drop":
                return self.drop(what, rows, nbytes, txn)
            raise full_error(self.settings, what)
