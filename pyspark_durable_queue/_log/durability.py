"""``fsync=periodic``: commits are written at once and synced in the background.

Who calls it: the group commit (``_ops.group_commit``) after each commit of a handle opened with
``fsync="periodic"``. One daemon thread per process syncs every store root that such commits
wrote to, at most every ``fsync_interval_ms`` (KahaDB's ``journalDiskSyncStrategy=periodic``),
with :meth:`Storage.sync_all` (``syncfs`` of the root's filesystem on Linux). Until then a
committed send lives in the OS's page cache: a killed process loses nothing, a power failure
can lose up to one interval of commits. A process that exits normally syncs first (``atexit``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass

from .._storage import Storage
from ..errors import StorageError

__all__ = ["written"]

log = logging.getLogger(__name__)


@dataclass
class _Root:
    storage: Storage
    interval_s: float
    dirty_since: float | None = None  # monotonic time of the first unsynced commit


class _Syncer:
    """The process's background syncer. ``_lock`` guards ``_roots`` and ``_thread``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._roots: dict[str, _Root] = {}
        self._thread: threading.Thread | None = None

    def written(self, storage: Storage, interval_ms: int) -> None:
        with self._lock:
            root = self._roots.get(storage.root)
            if root is None:
                root = self._roots[storage.root] = _Root(storage, interval_ms / 1000)
            root.interval_s = min(root.interval_s, interval_ms / 1000)
            if root.dirty_since is None:
                root.dirty_since = time.monotonic()
                self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dq-periodic-sync",
                                                daemon=True)
                self._thread.start()

    def _due(self, now: float) -> tuple[list[_Root], float | None]:
        due, next_at = [], None
        for root in self._roots.values():
            if root.dirty_since is None:
                continue
            at = root.dirty_since + root.interval_s
            if at <= now:
                due.append(root)
                root.dirty_since = None
            else:
                next_at = at if next_at is None else min(next_at, at)
        return due, next_at

    def _run(self) -> None:
        while True:
            with self._lock:
                due, next_at = self._due(time.monotonic())
                if not due:
                    self._wake.wait(None if next_at is None else next_at - time.monotonic())
                    continue
            _sync(due)

    def sync_now(self) -> None:
        with self._lock:
            due = [r for r in self._roots.values() if r.dirty_since is not None]
            for root in due:
                root.dirty_since = None
        _sync(due)


def _sync(roots: list[_Root]) -> None:
    for root in roots:
        try:
            root.storage.sync_all()
        except StorageError as exc:  # the next commit marks the root again
            log.warning("periodic sync of %s failed: %s", root.storage.url, exc)


_SYNCER = _Syncer()


def written(storage: Storage, interval_ms: int) -> None:
    """A commit with ``fsync=periodic`` wrote to ``storage``: sync it within ``interval_ms``."""
    _SYNCER.written(storage, interval_ms)


def _after_fork() -> None:
    global _SYNCER
    _SYNCER = _Syncer()  # the parent's thread is not in the child; its roots are the parent's


atexit.register(lambda: _SYNCER.sync_now())
os.register_at_fork(after_in_child=_after_fork)
