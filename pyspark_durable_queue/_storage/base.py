"""The storage interface every backend implements, its capabilities, and the error boundary.

:class:`Storage` is a root folder on some filesystem; the rest of the package touches files only
through it. ``open_storage(url)`` (in the package's ``__init__``, which maps URL schemes to
backends) returns the backend for the URL, so callers name the interface, never a backend, and
this module imports none. They ask :attr:`Storage.capabilities` what a backend can do instead of
asking which backend it is.

:func:`translate_errors` is the only place where ``OSError`` and fsspec errors are caught:
they become :class:`~pyspark_durable_queue.errors.StorageError` or
:class:`~pyspark_durable_queue.errors.NotFoundError` naming the operation and the path (zarr's
``ALLOWED_EXCEPTIONS`` pattern); the backends use it (and :func:`translated_error`, its error
for hot paths that catch ``OSError`` themselves).
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import dataclasses
import errno
import os
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, ClassVar

import pyarrow as pa

from ..errors import LinkRefusedError, NotFoundError, StorageError, StoreFullError

__all__ = ["HEADROOM_BYTES", "TEMP_FOLDER", "AppendFile", "Capabilities", "NotFound",
           "RangeReader", "Storage", "link_refused", "translate_errors", "translated_error"]

#: Inside the store package a missing file is ``NotFound``; users see the public name.
NotFound = NotFoundError

#: Folder under the root where a backend stages files before publishing them (local disks);
#: a process killed mid-write leaves its temp file there, for cleanup.
TEMP_FOLDER = ".tmp"

#: One directory entry: ``(name, size_bytes, modified_epoch_seconds)``.
Entry = tuple[str, int, float]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do; callers check these instead of the backend's type.

    Attributes
    ----------
    exclusive_create : bool
        :meth:`Storage.create` is atomic and exclusive, so commits can be published.
    append : bool
        A file can be appended to in place and synced (:meth:`Storage.open_append`).
    hard_links : bool
        Files are published with ``link(2)``: never visible half written.
    touch : bool
        :meth:`Storage.touch` refreshes a file's modification time.
    folders : bool
        Folders are real: they must be made before use, and synced for durability.
    mmap : bool
        :meth:`Storage.map` maps the file instead of reading it into memory.
    locks : bool
        :meth:`Storage.lock` excludes other processes (``flock``): writers can queue for the
        commit log instead of racing for it.
    overwrite : bool
        A file's bytes can be rewritten in place and synced (:meth:`Storage.open_inplace`): a
        small state written often (a consumer's watermark) costs one write and one data sync
        into space the file already has, not a new file.
    """

    exclusive_create: bool
    append: bool = False
    hard_links: bool = False
    touch: bool = False
    folders: bool = False
    mmap: bool = False
    locks: bool = False
    overwrite: bool = False


#: errno values of a full disk (or quota): :class:`StoreFullError`
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})

#: Writes of messages (page files, journal units that hold messages) leave at least this much
#: of a local disk free: what acknowledgements and maintenance need (a watermark file, a
#: ``remove`` entry, a checkpoint, the cleanup marker), so that a disk that sends filled can
#: still be emptied by acknowledging and cleaning up. See :meth:`Storage.free_bytes`.
HEADROOM_BYTES = 1 << 20


@contextlib.contextmanager
def translate_errors(op: str, path: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except (OSError, ValueError, RuntimeError) as exc:
        # fsspec backends raise a zoo of types (botocore errors derive from Exception, most
        # wrap into OSError); anything else is a programming error and must surface as is.
        raise translated_error(op, path, exc) from exc


def translated_error(op: str, path: str, exc: OSError | ValueError | RuntimeError) -> StorageError:
    """The error :func:`translate_errors` raises for ``exc`` (for hot paths that catch ``OSError``
    themselves: a ``with`` block costs microseconds a journal's commit counts)."""
    if isinstance(exc, FileNotFoundError):
        return NotFound(errno.ENOENT, f"{op}: no such file: {path}")
    if isinstance(exc, OSError) and exc.errno in _FULL:
        return StoreFullError(op, path, quota=exc.errno == errno.EDQUOT)
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        refused = link_refused(path)  # a local file opened with O_NOFOLLOW
        if refused is not None:
            return refused
    return StorageError(getattr(exc, "errno", None) or errno.EIO, f"{op} {path}: {exc}")


def link_refused(path: str) -> LinkRefusedError | None:
    """The error for ``path`` when it is a symbolic link (a local store follows none under its
    root), else ``None``."""
    try:
        if not os.path.islink(path):
            return None
        target = os.readlink(path)
    except OSError:
        target = ""
    return LinkRefusedError(path, target)


class AppendFile(abc.ABC):
    """A file open for appending in place, from :meth:`Storage.open_append`.

    Writes go to the file's logical end (:meth:`tell`), which starts where the caller says
    (a journal knows where its last valid record ends) or at the file's size; space past it may
    have been allocated ahead (:meth:`preallocate`) and reads as zeros until written.

    Concurrency guarantee: none between writers; callers give a file one writer at a time (a
    journal's writers hold its lock). Bytes written become durable at :meth:`sync`; which bytes
    past the last sync survive a crash is unknown, so readers read only ranges that a commit
    published, and records carry checksums.

    A :meth:`sync` that fails *poisons* the file (PostgreSQL's fsync lesson: the kernel may
    have dropped the unsynced pages, and reports the error once, so a later sync would succeed
    without them): that call and every later :meth:`write`, :meth:`preallocate` and
    :meth:`sync` of this object raise ``StorageError``, until the caller opens the file again
    and writes what :meth:`unsynced` covers again, if it must be durable, from its own copy:
    what the file reads back there after a failed sync may be zeros or older bytes (the
    journal keeps that copy: ``_log/journal.py``, "A sync that fails").
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @property
    def poisoned(self) -> bool:
        """A :meth:`sync` failed: this object writes nothing more (see the class docstring)."""
        return False

    @property
    def allocated(self) -> int:
        """The offset up to which space is known to be allocated (:meth:`preallocate`); 0
        when unknown."""
        return 0

    def unsynced(self) -> tuple[int, int] | None:
        """The byte range written through this object since its last successful
        :meth:`sync` (``None``: none)."""
        return None

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at the logical end, which moves past it."""

    @abc.abstractmethod
    def preallocate(self, nbytes: int) -> None:
        """Make sure ``nbytes`` past the logical end are allocated (the file may grow; the new
        space reads as zeros): a sync after writing into allocated space has no file size to
        commit, which makes it cheaper (``posix_fallocate``)."""

    @abc.abstractmethod
    def sync(self, *, force: bool = False) -> None:
        """Make everything written so far durable (``fdatasync`` when the storage syncs, or
        when ``force``)."""

    @abc.abstractmethod
    def tell(self) -> int:
        """The logical end: the offset the next :meth:`write` starts at."""

    @abc.abstractmethod
    def gone(self) -> bool:
        """Whether ``path`` no longer names this file (deleted, or replaced by another)."""

    @abc.abstractmethod
    def seek(self, offset: int) -> None:
        """Move the logical end to ``offset`` (another writer appended meanwhile, or a
        record written there is to be overwritten)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the file (without syncing); closing twice is fine."""

    def __enter__(self) -> AppendFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RangeReader:
    """A file open for range reads, from :meth:`Storage.open_reader` (this one reads through
    :meth:`Storage.read_range`; local disks keep a descriptor)."""

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage = storage
        self.path = path

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; fewer at the end of the file where the backend can
        append (a journal reads past its last record)."""
        return self.storage.read_range(self.path, start, end)

    def gone(self) -> bool:
        """Whether ``path`` no longer names the file this reader reads (deleted, or replaced:
        a reader that keeps a descriptor reads the old file's bytes)."""
        return not self.storage.exists(self.path)

    def close(self) -> None:
        """Close it; closing twice is fine."""


class InPlaceFile(abc.ABC):
    """A file open for rewriting its bytes in place, from :meth:`Storage.open_inplace`.

    Concurrency guarantee: none between writers; callers give a file one writer at a time and
    make their records self-validating (a checksum), since a crash may tear a write.

    A :meth:`sync` that fails poisons the object as :class:`AppendFile`'s does: every later
    :meth:`write` and :meth:`sync` raises until the file is opened again.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @property
    def poisoned(self) -> bool:
        """A :meth:`sync` failed: this object writes nothing more."""
        return False

    @abc.abstractmethod
    def read(self, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset``."""

    @abc.abstractmethod
    def write(self, data: bytes, offset: int) -> None:
        """Write ``data`` at ``offset`` (inside the file: its size does not change)."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make the writes durable (``fdatasync`` when the storage syncs)."""

    @abc.abstractmethod
    def gone(self) -> bool:
        """Whether ``path`` no longer names this file (deleted, or replaced by another)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the file (without syncing); closing twice is fine."""


class KeptLock:
    """:meth:`Storage.lock` of one path, taken for each ``with`` block by one object.

    Where ``watched``, the backend keeps the lock's file open and ``renewed`` counts the times
    it had to open it again: the path no longer named it (deleted or moved aside with its
    folder, as an address deleted and made again), a lock failed, or this is a forked child.
    Then what the holder keeps open under that folder may not be the folder's files any more.
    Here (not ``watched``) every block takes :meth:`Storage.lock` afresh; blocks of several
    threads may interleave only where that lock is a no-op or the caller serialises them.
    """

    watched: ClassVar[bool] = False

    def __init__(self, storage: Storage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._held: list[contextlib.AbstractContextManager[None]] = []
        self.renewed = 0

    def __enter__(self) -> None:
        held = self._storage.lock(self._path)
        held.__enter__()
        self._held.append(held)

    def __exit__(self, *exc_info: Any) -> None:
        self._held.pop().__exit__(*exc_info)


class Storage:
    """A root folder on a local disk or an fsspec filesystem.

    The interface: ``open_storage(url, ...)`` of the ``_storage`` package returns the backend
    that serves ``url`` (``LocalStorage`` for a path or ``file://`` URL, ``MemoryStorage`` for
    ``memory://``, ``ObjectStoreStorage`` for any other fsspec URL); ``Storage(...)`` itself
    refuses to construct.

    Parameters
    ----------
    url : str
        A local path, a ``file://`` URL, or any fsspec URL (``s3://bucket/dq``, ``memory://dq``).
    storage_options : dict, optional
        Passed to the fsspec filesystem (credentials, endpoint...).
    fsync : bool
        Flush file contents and directory entries to stable storage before a write returns
        (local disks only; object stores are durable once a PUT returns).

    Notes
    -----
    Picklable: only ``url``, ``storage_options`` and ``fsync`` travel (Spark ships storages to
    executors); filesystem objects are rebuilt on first use. Paths given to the methods are full
    paths, made with :meth:`join`.

    The interface's methods raise ``NotImplementedError`` (as fsspec's ``AbstractFileSystem``
    does) instead of being ``abc`` abstract; the contract tests check that every backend
    implements them all.
    """

    CAPABILITIES: ClassVar[Capabilities]

    def __new__(cls, *args: Any, **kwargs: Any) -> Storage:
        if cls is Storage:
            raise TypeError(
                "Storage is the storage interface, not a backend: open_storage(url, "
                "storage_options, fsync=...) of pyspark_durable_queue._storage returns the "
                "backend that serves a URL")
        return super().__new__(cls)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 fsync: bool = True) -> None:
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        self.fsync = fsync

    # -- plumbing -------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options, "fsync": self.fsync}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["url"], state["storage_options"], fsync=state["fsync"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def capabilities(self) -> Capabilities:
        """What this backend can do."""
        return self.CAPABILITIES

    def probe_hard_links(self) -> None:
        """Find out now whether hard links work, where a backend learns it only by trying
        (:class:`LocalStorage`, whose first :meth:`create` would); a no-op elsewhere. Called
        before a choice that depends on ``capabilities.hard_links`` (an address's format)."""

    @property
    def root(self) -> str:
        """The root folder's path, as the methods take it."""
        raise NotImplementedError

    def join(self, *parts: str) -> str:
        """The full path of ``parts`` under the root."""
        return "/".join([self.root, *parts])

    # -- reading --------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        """The whole file."""
        raise NotImplementedError

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file (``0 <= start <= end``; Azure has no suffix ranges)."""
        raise NotImplementedError

    def open_reader(self, path: str) -> RangeReader:
        """``path`` kept open for many range reads (a journal's reader reads the end of its
        segment on every look); ``NotFound`` when it does not exist."""
        if not self.exists(path):
            raise NotFound(errno.ENOENT, f"open: no such file: {path}")
        return RangeReader(self, path)

    def map(self, path: str) -> tuple[pa.Buffer, Callable[[], None] | None]:
        """The whole file as an Arrow buffer, and a hook that gives its memory back (or ``None``).

        For immutable files only.
        """
        raise NotImplementedError

    def read_buffer(self, path: str) -> pa.Buffer:
        """The whole file as an Arrow buffer (see :meth:`map`)."""
        return self.map(path)[0]

    def exists(self, path: str) -> bool:
        """Whether a file or folder exists."""
        raise NotImplementedError

    def size(self, path: str) -> int:
        """A file's size in bytes."""
        raise NotImplementedError

    def touch(self, path: str) -> bool:
        """Mark a file as just written (its age decides when cleanup may call it an orphan);
        ``False`` when it does not exist. Without the ``touch`` capability only existence is
        checked."""
        raise NotImplementedError

    def list_detailed(self, folder: str) -> builtins.list[Entry]:
        """``(name, size, modified_epoch_seconds)`` of the entries of ``folder``; empty when it
        does not exist."""
        raise NotImplementedError

    def list(self, folder: str) -> builtins.list[str]:
        """Names (not paths) of the entries of ``folder``; empty when it does not exist."""
        return [name for name, _, _ in self.list_detailed(folder)]

    def free_bytes(self) -> int | None:
        """Bytes free for this process on the root's filesystem, ``None`` where unknown (object
        stores). A write of messages leaves :data:`HEADROOM_BYTES` of them free."""
        return None

    def temp_files(self) -> builtins.list[Entry]:
        """Staged files under :data:`TEMP_FOLDER` (names relative to the root) that a process
        killed mid-write may have left; none where the backend stages nothing."""
        return []

    # -- writing --------------------------------------------------------------------------------
    def makedirs(self, folder: str) -> None:
        """Make ``folder`` and its parents (a no-op without the ``folders`` capability)."""
        raise NotImplementedError

    def create(self, path: str, data: bytes, *, spare: bool = False) -> bool:
        """Publish ``data`` at ``path`` atomically and exclusively.

        ``spare``: the caller commits often (the group commit of sends) and may stage the file
        in one made ahead instead of creating it (local disks, see ``_spares``; ignored
        elsewhere).

        Returns
        -------
        bool
            ``True`` if this call created the file, ``False`` if it already existed (then
            nothing was written).

        Notes
        -----
        Concurrency guarantee: of any number of concurrent callers sharing the storage, exactly
        one gets ``True``. Callers make ``data`` unique to themselves (commit-log entries carry a
        random id), which lets object stores recognise their own retried PUT. Backends without
        the ``exclusive_create`` capability refuse with :class:`StorageError`.
        """
        raise NotImplementedError

    def replace(self, path: str, data: bytes) -> None:
        """Overwrite ``path`` atomically (readers see the old or the new content, never a mix).

        For state with a single owner (a consumer's watermark) and for hints checked before use.
        """
        raise NotImplementedError

    def begin_write(self, path: str, *, spare: bool = False) -> BinaryIO:
        """Open a new immutable file for streaming writes; finish it with :meth:`end_write`.
        ``spare``: as for :meth:`create`."""
        raise NotImplementedError

    def end_write(self, f: BinaryIO, path: str) -> None:
        """Flush, sync (when enabled) and close a file from :meth:`begin_write`.

        May run on another thread than the one that wrote the file.
        """
        raise NotImplementedError

    def open_append(self, path: str, *, at: int | None = None) -> AppendFile:
        """Open ``path`` for appending in place, creating it if needed; writes start at ``at``
        (bytes after it are overwritten) or, by default, at the file's size.

        Only with the ``append`` capability; callers check it first.
        """
        raise StorageError(errno.ENOTSUP, (
            f"cannot append to {path}: {type(self).__name__} ({self.url}) cannot append to a "
            "file in place (check storage.capabilities.append; write one file per commit)"))

    def open_inplace(self, path: str) -> InPlaceFile:
        """Open the existing file ``path`` to rewrite its bytes in place.

        Only with the ``overwrite`` capability; callers check it first.
        """
        raise StorageError(errno.ENOTSUP, (
            f"cannot write {path} in place: {type(self).__name__} ({self.url}) cannot rewrite "
            "a file in place (check storage.capabilities.overwrite; replace the file)"))

    def delete(self, path: str) -> None:
        """Remove a file; a file that is already gone is fine."""
        raise NotImplementedError

    def delete_tree(self, folder: str) -> None:
        """Remove a folder and everything under it; a folder that is already gone is fine."""
        raise NotImplementedError

    def move(self, src: str, dst: str) -> None:
        """Move a file (archive), making ``dst``'s folder if needed."""
        raise NotImplementedError

    def sync_all(self) -> None:
        """Make everything written under the root so far durable, at once (``fsync=periodic``).
        A no-op where writes are durable when they return (object stores)."""

    def lock(self, path: str) -> contextlib.AbstractContextManager[None]:
        """An exclusive lock named by the file ``path`` (created if needed), held for the
        block, between threads and processes of this host. Only an optimisation: writers
        that queue do not race; correctness never depends on it (without the ``locks``
        capability it locks nothing)."""
        return contextlib.nullcontext()

    def kept_lock(self, path: str) -> KeptLock:
        """The lock of :meth:`lock` on ``path`` as one object taken for many blocks (a commit
        log's publish lock): a backend may keep what it locks open between them."""
        return KeptLock(self, path)

    def sync_folder(self, folder: str) -> None:
        """Make new entries of ``folder`` durable (a no-op where folders need no sync)."""
