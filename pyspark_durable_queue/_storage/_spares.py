"""Empty files made ahead of need, so that a commit does not wait for a file creation.

Creating a file costs more than the write and the sync that follow it, and creations do not
overlap (figures in ``docs/decisions.md``). A send creates two (its page and its log entry's
staging file). :class:`Spares` keeps a few empty files in the root's staging folder
(``.tmp/<uuid>.spare``), made by a background thread while commits wait for their syncs;
:meth:`LocalStorage.begin_write` and the staging of log entries rename one to the name they
need, far cheaper, instead of creating it.

Made on demand only: only writers that opt in use spares (the group commit of sends, which
passes ``spare=True`` to ``Storage.create`` and ``Storage.begin_write``), a folder gets spares
once takes come in quick succession (``DEMAND_TAKES`` within ``DEMAND_WINDOW_S``: a send
takes two), and its pool grows to at most ``PER_FOLDER`` while they keep coming. A process
that commits now and then (a Spark driver's commit, a script sending once) makes none.
Spares left at exit are removed (``atexit``); a killed process's spares are staged files like
any other, which cleanup removes after ``orphanGraceMs``. A forked child forgets its parent's
spares (both would take the same files).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import uuid

__all__ = ["SPARE_SUFFIX", "held", "take"]

SPARE_SUFFIX = ".spare"
#: Spares kept per staging folder at most (a group commit needs two per commit).
PER_FOLDER = 4
#: This many takes within this window make spares (two sends, each a page and a log entry).
DEMAND_TAKES = 4
DEMAND_WINDOW_S = 0.1


class Spares:
    """The process's spare files, by staging folder.

    Concurrency guarantee: thread-safe; ``_lock`` guards ``_ready``, ``_wanted``, ``_making``,
    ``_recent`` and ``_closed``. Each spare is handed to one taker; creating them happens
    outside the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ready: dict[str, list[str]] = {}
        self._wanted: dict[str, int] = {}
        self._making: str | None = None
        #: by folder: when the current demand window began, and the takes in it
        self._recent: dict[str, tuple[float, int]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False  # the process is exiting: no more spares

    def take(self, folder: str) -> str | None:
        """The path of an empty file in ``folder`` that is now the caller's, or ``None``. When
        takes come quickly, one more is made in the background (up to ``PER_FOLDER``)."""
        now = time.monotonic()
        with self._lock:
            ready = self._ready.setdefault(folder, [])
            spare = ready.pop() if ready else None
            began, takes = self._recent.get(folder, (now, 0))
            if now - began > DEMAND_WINDOW_S:
                began, takes = now, 0
            self._recent[folder] = (began, takes + 1)
            busy = spare is not None or takes + 1 >= DEMAND_TAKES
            making = self._making is not None and os.path.dirname(self._making) == folder
            if busy and not self._closed and \
                    len(ready) + self._wanted.get(folder, 0) + making < PER_FOLDER:
                self._wanted[folder] = self._wanted.get(folder, 0) + 1
                self._wake.notify()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="dq-spare-files",
                                                    daemon=True)
                    self._thread.start()
        return spare

    def _run(self) -> None:
        while True:
            with self._lock:
                while not any(self._wanted.values()):
                    self._wake.wait()
                folder = next(f for f, n in self._wanted.items() if n)
                self._wanted[folder] -= 1
                path = os.path.join(folder, uuid.uuid4().hex + SPARE_SUFFIX)
                self._making = path  # held from before it exists: never taken for a leftover
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except OSError:
                path = ""  # the folder is gone or full: takers create their own files
            with self._lock:
                if path:
                    self._ready.setdefault(folder, []).append(path)
                self._making = None
                self._wake.notify_all()  # remove_all may be waiting for this one

    def held(self) -> set[str]:
        """Paths of the spares this process holds (not orphans)."""
        with self._lock:
            held = {p for ready in self._ready.values() for p in ready}
            return held | {self._making} if self._making else held

    def remove_all(self) -> None:
        """At exit: no more spares; the one being made (if any) is waited for (a second at
        most), so that it is not left behind once this has removed the others."""
        with self._lock:
            self._closed = True
            self._wanted.clear()
            deadline = time.monotonic() + 1.0
            while self._making is not None and time.monotonic() < deadline:
                self._wake.wait(0.05)
            paths = [p for ready in self._ready.values() for p in ready]
            self._ready.clear()
            self._wanted.clear()
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


_SPARES = Spares()


def take(folder: str) -> str | None:
    """See :meth:`Spares.take`."""
    return _SPARES.take(folder)


def held() -> set[str]:
    """See :meth:`Spares.held`."""
    return _SPARES.held()


def _after_fork() -> None:
    global _SPARES
    _SPARES = Spares()


atexit.register(lambda: _SPARES.remove_all())
os.register_at_fork(after_in_child=_after_fork)
