"""Files on a local or mounted disk, through ``os`` calls (fsspec is not imported).

Nothing under the root is followed: the root itself may be a symbolic link, but a link where
the store keeps a file or a folder is refused with
:class:`~pyspark_durable_queue.errors.LinkRefusedError`. Files are opened with ``O_NOFOLLOW``
(free: the kernel refuses a link as the last part of the path), and before each operation by
path the folders between the root and the file are checked with ``lstat`` (one call per folder,
about a microsecond each; a handle kept open, such as a journal's segment or a watermark file,
is checked once, when opened). A link made between that check and the operation is not seen
(no ``openat2`` in Python): the check keeps out links that are there, not a race with someone
who may write the store's folders anyway.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import functools
import io
import mmap
import os
import shutil
import stat
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any, BinaryIO, cast

import pyarrow as pa

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

from ..errors import LinkRefusedError, StorageError, StoreFullError
from . import _spares
from .base import (
    HEADROOM_BYTES,
    TEMP_FOLDER,
    AppendFile,
    Capabilities,
    Entry,
    InPlaceFile,
    KeptLock,
    RangeReader,
    Storage,
    link_refused,
    translate_errors,
    translated_error,
)

__all__ = ["LocalStorage", "NoLinksLocalStorage"]

# errno values meaning "this filesystem cannot make hard links"
_NO_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV,
                       errno.EMLINK})

_fdatasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync

#: Opening flags: a link as the last part of a path is refused (``ELOOP``), descriptors are
#: not inherited by child processes.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_FOLDER = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW


def _opener(path: str, flags: int) -> int:
    """``open(..., opener=_opener)``: the file opened without following a link."""
    return os.open(path, flags | _NOFOLLOW, 0o644)


@functools.cache
def _syncfs() -> Callable[[int], int] | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).syncfs  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not Linux
        return None


class LocalStorage(Storage):
    """A root folder on a local or mounted disk.

    Concurrency guarantee: :meth:`create` writes a temp file, syncs it and hard-links it to its
    name (``link(2)`` fails with ``EEXIST``, never replaces): of any number of concurrent
    callers, threads or processes, exactly one gets ``True``, and readers see no file or the
    complete file. :meth:`replace` is temp file + ``rename(2)``: readers see the old or the new
    content.

    Where the filesystem refuses hard links (some FUSE mounts, e.g. cloud volumes), the first
    :meth:`create` finds out and turns this storage into a :class:`NoLinksLocalStorage`.
    """

    CAPABILITIES = Capabilities(exclusive_create=True, append=True, hard_links=True, touch=True,
                                folders=True, mmap=True, locks=fcntl is not None,
                                overwrite=True)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 fsync: bool = True) -> None:
        super().__init__(url, storage_options, fsync=fsync)
        self._root: str | None = None
        self._staging_made = False  # the staging folder exists (made on first use)

    @property
    def root(self) -> str:
        if self._root is None:  # resolved where it is used: a path relative to its cwd
            path = self.url
            for prefix in ("file://", "local://"):
                path = path.removeprefix(prefix)
            self._root = os.path.abspath(os.path.expanduser(path))
        return self._root

    def _inside(self, path: str) -> str:
        """``path``, once the folders between the root and it are found to be no links
        (see the module docstring); raises :class:`LinkRefusedError` for the first that is.
        The root itself may be a link; a path outside the root is not checked."""
        root = self.root
        folder = path.rpartition("/")[0]
        if len(folder) <= len(root) or not folder.startswith(root) or folder[len(root)] != "/":
            return path
        at = len(root)
        while at >= 0:
            at = folder.find("/", at + 1)
            part = folder if at < 0 else folder[:at]
            try:
                mode = os.lstat(part).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return path  # the operation itself finds out
            except OSError as exc:
                raise translated_error("stat", part, exc) from exc
            if stat.S_ISLNK(mode):
                raise _link(part)
        return path

    # -- reading --------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        with translate_errors("read", path), open(self._inside(path), "rb", opener=_opener) as f:
            return f.read()

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with translate_errors("read", path):
            fd = os.open(self._inside(path), os.O_RDONLY | _NOFOLLOW)
            try:
                return os.pread(fd, end - start, start)
            finally:
                os.close(fd)

    def open_reader(self, path: str) -> RangeReader:
        with translate_errors("open", path):
            return _LocalRangeReader(self, self._inside(path))

    def map(self, path: str) -> tuple[pa.Buffer, Callable[[], None] | None]:
        """The whole file memory-mapped (no copy), and a hook that gives its memory back.

        The hook tells the kernel the process no longer needs its resident copy
        (``MADV_DONTNEED``): the data stays in the page cache, so touching it again is a minor
        fault, not disk I/O, but it stops counting in this process's memory. A mapped file is
        never truncated here, only unlinked or renamed, which leaves the mapping valid.

        A file under :data:`MAP_MIN_BYTES` is read into memory instead: a mapping keeps a file
        descriptor open for as long as any slice of it lives, and a table received from
        thousands of small pages (one per send) would hold thousands of them (``EMFILE``).
        """
        with translate_errors("read", path), open(self._inside(path), "rb", opener=_opener) as f:
            size = os.fstat(f.fileno()).st_size
            if size < MAP_MIN_BYTES:
                return pa.py_buffer(f.read()), None
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return pa.py_buffer(mapped), functools.partial(_release, mapped)

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists; a link there is refused (:class:`LinkRefusedError`)."""
        with translate_errors("stat", path):
            try:
                mode = os.lstat(self._inside(path)).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return False
            if stat.S_ISLNK(mode) and path != self.root:
                raise _link(path)
            return True

    def size(self, path: str) -> int:
        with translate_errors("stat", path):
            st = os.lstat(self._inside(path))
            if stat.S_ISLNK(st.st_mode):
                raise _link(path)
            return st.st_size

    def touch(self, path: str) -> bool:
        with translate_errors("touch", path):
            try:
                os.utime(self._inside(path), follow_symlinks=False)
            except FileNotFoundError:
                return False
            return True

    def list_detailed(self, folder: str) -> builtins.list[Entry]:
        """Entries of ``folder``; a link among them is listed as itself (its own size and
        time), never followed."""
        out = []
        with translate_errors("list", folder):
            try:
                self._inside(f"{folder}/-")  # the folder itself too (unless it is the root)
                with os.scandir(folder) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:  # removed while we listed
                            continue
                        out.append((e.name, st.st_size, st.st_mtime))
            except FileNotFoundError:
                return []
        return out

    def free_bytes(self) -> int | None:
        with translate_errors("statvfs", self.root):
            st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def temp_files(self) -> builtins.list[Entry]:
        folder = self.join(TEMP_FOLDER)
        mine = _spares.held()  # this process's spares are not leftovers
        return [(f"{TEMP_FOLDER}/{name}", size, mtime)
                for name, size, mtime in self.list_detailed(folder)
                if name.endswith((".tmp", _spares.SPARE_SUFFIX))
                and os.path.join(folder, name) not in mine]

    # -- writing --------------------------------------------------------------------------------
    def makedirs(self, folder: str) -> None:
        """Make ``folder`` and its parents; the root may be a link, a link under it where a
        folder should be is refused."""
        with translate_errors("mkdir", folder):
            root = self.root
            if not folder.startswith(f"{root}/"):
                os.makedirs(folder, exist_ok=True)
                return
            try:
                self._inside(f"{folder}/-")
                if stat.S_ISDIR(os.lstat(folder).st_mode):
                    return  # there already (the common case: one lstat per folder)
            except FileNotFoundError:
                pass
            os.makedirs(root, exist_ok=True)
            at = len(root)
            while at >= 0:
                at = folder.find("/", at + 1)
                part = folder if at < 0 else folder[:at]
                try:
                    os.mkdir(part)
                except FileExistsError:
                    mode = os.lstat(part).st_mode
                    if stat.S_ISLNK(mode):
                        raise _link(part) from None
                    if not stat.S_ISDIR(mode):
                        raise
            self._inside(f"{folder}/-")  # made meanwhile by another process: no link either

    def create(self, path: str, data: bytes, *, spare: bool = False) -> bool:
        with translate_errors("create", path):
            self._inside(path)
            tmp = self._write_temp(data, spare=spare)
            try:
                os.link(tmp, path)
            except FileExistsError:
                if os.path.islink(path):
                    raise _link(path) from None
                return False
            except OSError as exc:
                if exc.errno not in _NO_LINKS:
                    raise
            else:
                self._sync_dir(path)
                return True
            finally:
                os.unlink(tmp)
        # This filesystem refuses hard links: from now on this storage publishes with O_EXCL.
        self.__class__ = NoLinksLocalStorage
        return self.create(path, data, spare=spare)

    def probe_hard_links(self) -> None:
        # A link of a staged file to a second staged name, both removed: the same test as the
        # first create makes, before anything is published (a FUSE mount must not get a journal).
        if not self.capabilities.hard_links:
            return
        with translate_errors("create", self._staging()):
            tmp = self._write_temp(b"")
            probe = f"{tmp}.link"
            try:
                os.link(tmp, probe)
            except OSError as exc:
                if exc.errno not in _NO_LINKS:
                    raise
                self.__class__ = NoLinksLocalStorage
            else:
                os.unlink(probe)
            finally:
                os.unlink(tmp)

    def replace(self, path: str, data: bytes) -> None:
        with translate_errors("write", path):
            if os.path.islink(self._inside(path)):  # a rename would replace it: refuse it
                raise _link(path)
            os.replace(self._write_temp(data), path)
            self._sync_dir(path)

    def begin_write(self, path: str, *, spare: bool = False) -> BinaryIO:
        """A new page file (messages: of a send, a Spark task, compaction): refused with
        :class:`StoreFullError` when less than :data:`HEADROOM_BYTES` are free (one
        ``statvfs``), so that acknowledgements and cleanup still find room. ``spare``: take a
        file made ahead (a group commit's leader)."""
        with translate_errors("write", path):
            self._inside(path)
            free = self.free_bytes()
            if free is not None and free < HEADROOM_BYTES:
                raise StoreFullError("write", path, headroom=HEADROOM_BYTES)
            made = self._spare() if spare else None
            if made is not None:
                with contextlib.suppress(FileNotFoundError):  # swept meanwhile: make one
                    os.rename(made, path)  # same filesystem: no file to create
            # closed by end_write (or the caller's abort)
            return cast(BinaryIO, _WriteFile(open(path, "wb", opener=_opener), path))

    def end_write(self, f: BinaryIO, path: str) -> None:
        with translate_errors("write", path):
            try:
                f.flush()
                if self.fsync:
                    _sync_hook(path)
                    os.fsync(f.fileno())
            finally:
                f.close()

    def open_append(self, path: str, *, at: int | None = None) -> AppendFile:
        with translate_errors("append", path):
            return _LocalAppendFile(self._inside(path), fsync=self.fsync, at=at)

    def open_shared(self, path: str, size: int) -> int:
        """A descriptor of a small file that the writer processes of this host read and write
        in place (``pread``/``pwrite``), created with mode 0600 (only the store's owner) and
        ``size`` zero bytes; a link there is refused. The caller closes it. (A journal's
        ``log/_synced``; not part of the :class:`Storage` interface: only a disk that keeps a
        journal has one.)"""
        with translate_errors("open", path):
            fd = os.open(self._inside(path), os.O_RDWR | os.O_CREAT | _NOFOLLOW,
                         0o600)
            try:
                if os.fstat(fd).st_size < size:
                    # allocated, not sparse: a mapping of a sparse file faults (SIGBUS) on a
                    # full disk; this fails with ENOSPC here instead
                    if hasattr(os, "posix_fallocate"):
                        os.posix_fallocate(fd, 0, size)
                    else:  # pragma: no cover - macOS
                        os.pwrite(fd, bytes(size), 0)
            except BaseException:
                os.close(fd)
                raise
            return fd

    def open_inplace(self, path: str) -> InPlaceFile:
        if not self.capabilities.overwrite:  # NoLinksLocalStorage
            return super().open_inplace(path)
        with translate_errors("open", path):
            return _LocalInPlaceFile(self._inside(path), fsync=self.fsync)

    def delete(self, path: str) -> None:
        """Remove a file (a link there is removed itself, never followed)."""
        with translate_errors("delete", path), contextlib.suppress(FileNotFoundError):
            os.unlink(self._inside(path))

    def delete_tree(self, folder: str) -> None:
        """Remove ``folder`` and everything under it; links under it are removed themselves,
        never followed, and ``folder`` itself must not be one."""
        with translate_errors("delete", folder), contextlib.suppress(FileNotFoundError):
            if os.path.islink(self._inside(folder)):
                raise _link(folder)
            shutil.rmtree(folder)

    def move(self, src: str, dst: str) -> None:
        with translate_errors("move", src):
            self._inside(src)
            self.makedirs(dst.rpartition("/")[0])
            os.replace(src, dst)

    def sync_all(self) -> None:
        """``syncfs(2)`` of the root's filesystem where the C library has it, else ``sync()``."""
        with translate_errors("sync", self.root):
            fd = os.open(self.root, os.O_RDONLY)  # the root may be a link
            try:
                _sync_hook(self.root)
                syncfs = _syncfs()
                if syncfs is None:
                    os.sync()
                elif syncfs(fd) != 0:
                    # a write-back error (Linux 5.8+ reports it here): never papered over by
                    # a sync() that reports nothing
                    import ctypes

                    code = ctypes.get_errno()
                    raise OSError(code, os.strerror(code))
            finally:
                os.close(fd)

    def lock(self, path: str) -> contextlib.AbstractContextManager[None]:
        """``flock`` on ``path``: a lock of its own open file, so threads of one process exclude
        each other too; the kernel drops it when a holder dies."""
        return _FileLock(self._inside(path)) if fcntl is not None else contextlib.nullcontext()

    def kept_lock(self, path: str) -> KeptLock:
        # its folder is checked once: the lock's file is opened again only when the path
        # names another file, which O_NOFOLLOW checks
        return _KeptFileLock(self, self._inside(path)) if fcntl is not None \
            else KeptLock(self, path)

    def sync_folder(self, folder: str) -> None:
        if self.fsync:
            with translate_errors("fsync", folder):
                self._inside(f"{folder}/-")  # the folder itself too
                _fsync_folder(folder)

    # -- helpers --------------------------------------------------------------------------------
    def _staging(self) -> str:
        folder = self.join(TEMP_FOLDER)
        if not self._staging_made:
            self.makedirs(folder)
            self._staging_made = True
        return folder

    def _spare(self) -> str | None:
        """An empty file in the staging folder that is now ours, if one was made ahead."""
        return _spares.take(self._staging())

    def _write_temp(self, data: bytes, *, spare: bool = False) -> str:
        # Staged on the root's filesystem, so that link and rename never cross filesystems.
        # Spares serve the creates of callers that ask (the group commit's log entries), not
        # state replaced in place (acks).
        tmp = (spare and self._spare()) or os.path.join(self._staging(),
                                                        f"{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb", opener=_opener) as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    _sync_hook(tmp)
                    os.fsync(f.fileno())
        except BaseException:
            # a full disk: what was staged goes at once, not after cleanup's grace period
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    def _sync_dir(self, path: str) -> None:
        if self.fsync:
            _fsync_folder(os.path.dirname(path))


class NoLinksLocalStorage(LocalStorage):
    """A root folder on a local filesystem without hard links (some FUSE mounts).

    Concurrency guarantee: :meth:`create` opens with ``O_CREAT|O_EXCL``: still exactly one
    winner, but the file is visible while it is written. A reader may briefly see a short file
    (the commit log's reader retries an entry that does not parse yet), and a writer killed
    mid-write leaves a cut-short file (``Address.repair`` sets it aside).
    """

    # FUSE mounts of cloud volumes without links also refuse or emulate writes in place
    CAPABILITIES = dataclasses.replace(LocalStorage.CAPABILITIES, hard_links=False,
                                       overwrite=False)

    def create(self, path: str, data: bytes, *, spare: bool = False) -> bool:
        with translate_errors("create", path):
            try:
                fd = os.open(self._inside(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW,
                             0o644)
            except FileExistsError:
                if os.path.islink(path):
                    raise _link(path) from None
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
                # A writer stalled past repair's grace period may find its file set aside
                # (see Address.repair). Then it did not publish.
                try:
                    still = os.lstat(path).st_ino == os.fstat(f.fileno()).st_ino
                except FileNotFoundError:
                    still = False
                if not still:
                    raise StorageError(errno.ESTALE, (
                        f"{path} was set aside while this process was writing it (by repair, "
                        "after its grace period); nothing was published"))
            self._sync_dir(path)
            return True


class _FileLock:
    """``flock`` of a file opened for the block (a class, not a generator: every commit of a
    journal takes it, and a generator's ``with`` costs several times the system calls)."""

    __slots__ = ("_fd", "_path")

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = -1

    def __enter__(self) -> None:
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError as exc:
            raise translated_error("lock", self._path, exc) from exc
        _LOCK_FDS.add(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException as exc:
            _LOCK_FDS.discard(fd)
            os.close(fd)
            if isinstance(exc, OSError):
                raise translated_error("lock", self._path, exc) from exc
            raise
        self._fd = fd

    def __exit__(self, *exc_info: object) -> None:
        fd, self._fd = self._fd, -1
        _LOCK_FDS.discard(fd)
        os.close(fd)  # releases the lock (once no forked child holds a copy of the fd)


class _KeptFileLock(KeptLock):
    """``flock`` of a file kept open between blocks (the publish lock of a commit log: an
    ``open`` and a ``close`` less a commit). A flock belongs to the open file, so the threads of
    this process take the object in turn, and a block nested in one of the same thread takes
    nothing more.

    After each ``flock`` a ``stat`` of the path tells whether it still names the open file: not
    when the file was deleted or its folder moved aside (an address deleted or set aside, and
    perhaps made again with a new lock file). Then the file is unlocked, closed and opened
    again by its path: ``renewed`` counts every opening after the first. (The lock file is
    never written: asking for its times makes no sync costlier, see :class:`_Named`.) A forked
    child closes its copy, which is the parent's open file and so its lock.
    """

    watched = True

    def __init__(self, storage: LocalStorage, path: str) -> None:
        super().__init__(storage, path)
        self._inside = storage._inside
        self._fd = -1
        self._id = (0, 0)  # the open file's (device, inode)
        self._opened = False
        self._depth = 0
        self._inherited = 0  # blocks the parent was inside when it forked this child
        self._mutex = threading.RLock()
        _KEPT_LOCKS.add(self)

    def __enter__(self) -> None:
        self._mutex.acquire()
        if self._depth:
            self._depth += 1
            return
        try:
            self._take()
        except BaseException:
            self._close()  # whatever was locked is let go with the file
            self._mutex.release()
            raise
        self._depth = 1

    def _take(self) -> None:
        while True:
            try:
                if self._fd < 0:
                    if self._opened:
                        self.renewed += 1
                    self._opened = True
                    self._inside(self._path)  # its folders may have changed too
                    self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
                    opened = os.fstat(self._fd)
                    self._id = (opened.st_dev, opened.st_ino)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    named = os.lstat(self._path)  # a link put there is another file
                except FileNotFoundError:
                    pass
                else:
                    if (named.st_dev, named.st_ino) == self._id:
                        return
            except StorageError:
                raise
            except OSError as exc:
                raise translated_error("lock", self._path, exc) from exc
            self._close()

    def __exit__(self, *exc_info: object) -> None:
        if not self._depth and self._inherited:
            self._inherited -= 1  # a block of the parent's, left in this child: nothing held
            return
        try:
            self._depth -= 1
            if not self._depth:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def after_fork(self) -> None:
        # The child's copy of the descriptor is the parent's open file: closing it leaves the
        # parent's lock be (unlocking it would not). The thread that forked may have been
        # inside blocks: leaving them here holds nothing to let go.
        self._close()
        self._inherited, self._depth = self._depth, 0
        self._mutex = threading.RLock()

    def __del__(self) -> None:
        self._close()


class _Named:
    """Whether a path still names the file a descriptor holds open (deleted, or replaced).

    On Linux by the name ``/proc`` gives the descriptor (``<path> (deleted)`` once unlinked,
    another path once moved), not by ``stat``: a ``stat`` asks for the file's times, and a
    kernel with fine-grained timestamps (ext4 since Linux 6.13) then stamps the next write with
    a new ctime, which the ``fdatasync`` after it then has to journal, on every commit
    (``docs/decisions.md``, "No stat of a file between its writes and their fdatasync").
    Elsewhere by the inode (the
    open descriptor keeps its number from being reused).
    """

    __slots__ = ("_ino", "_link", "_path", "_proc")

    def __init__(self, path: str, fd: int, ino: int | None = None) -> None:
        self._path = path
        self._ino = os.fstat(fd).st_ino if ino is None else ino
        self._proc = f"/proc/self/fd/{fd}"
        try:
            self._link: str | None = os.readlink(self._proc)
        except OSError:
            self._link = None  # no /proc: by the inode

    def gone(self, fd: int | None) -> bool:
        """``fd``: the descriptor, still open (``None`` once closed: then by the inode)."""
        if self._link is not None and fd is not None:
            with contextlib.suppress(OSError):
                return os.readlink(self._proc) != self._link
        try:
            return os.lstat(self._path).st_ino != self._ino
        except FileNotFoundError:
            return True
        except OSError as exc:
            raise translated_error("stat", self._path, exc) from exc


class _LocalAppendFile(AppendFile):
    """A local file open for ``pwrite`` at its logical end; :meth:`sync` is ``fdatasync``, plus
    one sync of the folder the first time (the file's directory entry must be durable too)."""

    def __init__(self, path: str, *, fsync: bool, at: int | None) -> None:
        super().__init__(path)
        self._fsync = fsync
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        opened = os.fstat(self._fd)
        self._named = _Named(path, self._fd, opened.st_ino)  # what ``path`` names (see gone)
        self._size = opened.st_size if at is None else at
        # posix_fallocate grows the size: a file's size is what it has allocated (without it,
        # space is made ahead as a sparse size, and nothing is known to be allocated)
        self._allocated = opened.st_size if hasattr(os, "posix_fallocate") else 0
        self._folder_synced = False
        self._dirty: tuple[int, int] | None = None  # written since the last good sync
        self._poison: str | None = None  # why nothing more is written (a sync failed)

    def _open_fd(self) -> int:
        if self._fd is None:
            raise StorageError(errno.EBADF, f"append to {self.path}: the file is closed")
        if self._poison is not None:
            raise StorageError(errno.EIO, f"append to {self.path}: {self._poison}")
        return self._fd

    @property
    def poisoned(self) -> bool:
        return self._poison is not None

    @property
    def allocated(self) -> int:
        return self._allocated

    def unsynced(self) -> tuple[int, int] | None:
        return self._dirty

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        fd = self._open_fd()
        start = self._size
        try:
            while view:
                n = os.pwrite(fd, view, self._size)
                self._size += n
                view = view[n:]
        except OSError as exc:
            raise translated_error("append", self.path, exc) from exc
        finally:
            if self._size > start:
                dirty = self._dirty
                self._dirty = (start, self._size) if dirty is None else \
                    (min(dirty[0], start), max(dirty[1], self._size))

    def preallocate(self, nbytes: int) -> None:
        end = self._size + nbytes
        if end <= self._allocated:
            return
        with translate_errors("allocate", self.path):
            fd = self._open_fd()
            allocate = getattr(os, "posix_fallocate", None)
            if allocate is not None:
                allocate(fd, self._size, nbytes)
            elif os.fstat(fd).st_size < end:
                os.truncate(fd, end)  # sparse: only the size is made ahead
        self._allocated = end

    def sync(self, *, force: bool = False) -> None:
        fd = self._open_fd()
        if not self._fsync and not force:
            return
        try:
            _sync_hook(self.path)
            _fdatasync(fd)
            if not self._folder_synced:
                _fsync_folder(os.path.dirname(self.path) or ".")
                self._folder_synced = True
        except OSError as exc:
            # Never retried into a success: the kernel reports a write-back error once and
            # may have dropped the pages, so a second fdatasync would say they are durable.
            self._poison = (f"a sync of this file failed ({exc}); what was written since the "
                            "last good sync may not be on disk, so nothing more is written "
                            "or synced through this descriptor: open the file again")
            raise translated_error("fsync", self.path, exc) from exc
        self._dirty = None

    def tell(self) -> int:
        return self._size

    def seek(self, offset: int) -> None:
        self._size = offset

    def gone(self) -> bool:
        return self._named.gone(self._open_fd())

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with translate_errors("close", self.path):
                os.close(fd)

    def __del__(self) -> None:
        # dropped without close(): an Address opened per request must not keep descriptors
        _close_quietly(self)


class _LocalRangeReader(RangeReader):
    """A descriptor kept open for ``pread``."""

    def __init__(self, storage: Storage, path: str) -> None:
        super().__init__(storage, path)
        self._fd: int | None = os.open(path, os.O_RDONLY | _NOFOLLOW)
        self._named: _Named | None = None  # made on the first gone()

    def gone(self) -> bool:
        # by /proc/self/fd, not a stat of the file: see _Named (its writers sync it)
        if self._fd is None:
            return True
        if self._named is None:
            self._named = _Named(self.path, self._fd)
        return self._named.gone(self._fd)

    def read(self, start: int, end: int) -> bytes:
        if self._fd is None:
            raise StorageError(errno.EBADF, f"read {self.path}: the file is closed")
        try:
            return os.pread(self._fd, end - start, start)
        except OSError as exc:
            raise translated_error("read", self.path, exc) from exc

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with translate_errors("close", self.path):
                os.close(fd)

    def __del__(self) -> None:
        # dropped without close(): an Address opened per request must not keep descriptors
        _close_quietly(self)


class _LocalInPlaceFile(InPlaceFile):
    """A local file open for ``pread``/``pwrite``; :meth:`sync` is ``fdatasync`` (the size does
    not change, so the data is all there is to sync)."""

    def __init__(self, path: str, *, fsync: bool) -> None:
        super().__init__(path)
        self._fsync = fsync
        self._fd: int | None = os.open(path, os.O_RDWR | _NOFOLLOW)
        self._named = _Named(path, self._fd)
        self._poison: str | None = None  # why nothing more is written (a sync failed)

    def _open_fd(self) -> int:
        if self._fd is None:
            raise StorageError(errno.EBADF, f"write {self.path}: the file is closed")
        if self._poison is not None:
            raise StorageError(errno.EIO, f"write {self.path}: {self._poison}")
        return self._fd

    @property
    def poisoned(self) -> bool:
        return self._poison is not None

    def read(self, size: int, offset: int) -> bytes:
        with translate_errors("read", self.path):
            return os.pread(self._open_fd(), size, offset)

    def write(self, data: bytes, offset: int) -> None:
        with translate_errors("write", self.path):
            fd = self._open_fd()
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n

    def sync(self, *, force: bool = False) -> None:
        fd = self._open_fd()
        if not self._fsync and not force:
            return
        try:
            _sync_hook(self.path)
            _fdatasync(fd)
        except OSError as exc:
            self._poison = (f"a sync of this file failed ({exc}); what was written since the "
                            "last good sync may not be on disk: open the file again")
            raise translated_error("fsync", self.path, exc) from exc

    def gone(self) -> bool:
        return self._named.gone(self._fd)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with translate_errors("close", self.path):
                os.close(fd)

    def __del__(self) -> None:
        # dropped without close(): an Address opened per request must not keep descriptors
        _close_quietly(self)


class _WriteFile(io.RawIOBase):
    """A new file of :meth:`LocalStorage.begin_write`: its writes fail with the store's errors
    (a full disk is :class:`~pyspark_durable_queue.errors.StoreFullError`), not ``OSError``."""

    def __init__(self, f: io.BufferedWriter, path: str) -> None:
        super().__init__()
        self._f = f
        self.path = path

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            raise translated_error("write", self.path, exc) from exc

    def flush(self) -> None:
        if not self._f.closed:
            try:
                self._f.flush()
            except OSError as exc:
                raise translated_error("write", self.path, exc) from exc

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        try:
            self._f.close()  # flushes: a full disk may surface here
        except OSError as exc:
            raise translated_error("write", self.path, exc) from exc
        finally:
            super().close()


#: Test seam for fault injection: when set, called with the path before every data sync of
#: this module (``fdatasync``/``fsync`` of a file), and raising ``OSError`` from it makes that
#: sync fail as a failing disk would (tests/test_full_disk.py arms it). ``None`` in use.
sync_fault: Callable[[str], None] | None = None


def _sync_hook(path: str) -> None:
    if sync_fault is not None:
        sync_fault(path)


#: Descriptors of the locks this process's threads hold (or wait for). A forked child closes its
#: copies: a flock belongs to the open file, which would stay locked while the child kept one.
_LOCK_FDS: set[int] = set()


def _close_quietly(file: _LocalAppendFile | _LocalRangeReader | _LocalInPlaceFile) -> None:
    with contextlib.suppress(Exception):
        file.close()


#: Every kept lock of this process (see :class:`_KeptFileLock`), for a forked child to close.
_KEPT_LOCKS: weakref.WeakSet[_KeptFileLock] = weakref.WeakSet()


def _close_lock_fds_in_child() -> None:
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    for kept in list(_KEPT_LOCKS):
        kept.after_fork()


os.register_at_fork(after_in_child=_close_lock_fds_in_child)


def _fsync_folder(folder: str) -> None:
    # a new directory entry is durable only once the directory itself is synced
    fd = os.open(folder, _FOLDER)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Files smaller than this are read, not mapped (see ``LocalStorage.map``).
MAP_MIN_BYTES = 1 << 20


def _link(path: str) -> LinkRefusedError:
    """The error for the link at ``path``."""
    return link_refused(path) or LinkRefusedError(path)


def _release(mapped: mmap.mmap) -> None:
    with contextlib.suppress(ValueError, OSError):  # closed, or madvise not supported
        mapped.madvise(mmap.MADV_DONTNEED)
