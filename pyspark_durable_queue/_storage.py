"""The one boundary between the store and a filesystem.

Everything the store does to files goes through :class:`Storage`: a root folder on a local disk or
on any fsspec filesystem. This is the only module that catches ``OSError`` and fsspec errors;
it turns them into :class:`~pyspark_durable_queue.errors.StorageError` (or :class:`NotFound`)
naming the operation and the path, the way zarr translates its ``ALLOWED_EXCEPTIONS`` at one
place.

Two primitives carry the store's guarantees:

* :meth:`Storage.create` publishes a small file atomically and exclusively: of two concurrent
  callers creating the same path exactly one succeeds, and no reader ever sees a partial file.
  Locally this is write-to-temp, fsync, then ``link(2)`` (fails with ``EEXIST``, never replaces);
  on object stores it is a single conditional PUT (``If-None-Match: *``), which fsspec exposes as
  ``pipe_file(..., mode="create")``.
* :meth:`Storage.replace` overwrites a small file atomically (temp + ``rename(2)`` locally, a single
  PUT on object stores). Used only for state with a single owner (a consumer's watermark) and for
  hints that are checked before use.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import pyarrow as pa

from .errors import StorageError

__all__ = ["NotFound", "Storage"]


class NotFound(StorageError, FileNotFoundError):
    """The file or folder does not exist."""


# errno values meaning "this filesystem cannot make hard links"
_NO_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV,
                       errno.EMLINK})

# memory:// is one dict per process without any locking; serialise our exclusive creates on it.
_MEMORY_LOCK = threading.Lock()

# fsspec backends whose pipe_file(mode="create") is a conditional write decided by the server:
# s3fs sends If-None-Match: *, gcsfs ifGenerationMatch=0, adlfs overwrite=False. Every other
# backend inherits fsspec's default, which checks exists() and then writes: two writers could
# both publish commit-log entry N.
_EXCLUSIVE_BACKENDS = frozenset({"s3fs", "gcsfs", "adlfs"})
_CONFLICT_RETRIES = 5


@contextlib.contextmanager
def _translate(op: str, path: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as exc:
        raise NotFound(errno.ENOENT, f"{op}: no such file: {path}") from exc
    except (OSError, ValueError, RuntimeError) as exc:
        # fsspec backends raise a zoo of types (botocore errors derive from Exception, most
        # wrap into OSError); anything else is a programming error and must surface as is.
        raise StorageError(getattr(exc, "errno", None) or errno.EIO, f"{op} {path}: {exc}") from exc


class Storage:
    """A root folder on a local disk or an fsspec filesystem.

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
    Picklable: only the URL and options travel; the filesystem object is rebuilt on first use.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 fsync: bool = True) -> None:
        self.url = str(url)
        self.storage_options = dict(storage_options or {})
        self.fsync = fsync
        self._fs: Any = None
        self._root: str | None = None
        self._local: bool | None = None
        self._links = True

    # -- plumbing -------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None
        state["_root"] = None
        state["_local"] = None
        return state

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def _connect(self) -> None:
        url = self.url
        if "://" not in url or url.startswith("file://"):
            path = url[len("file://"):] if url.startswith("file://") else url
            self._root = os.path.abspath(os.path.expanduser(path))
            self._local = True
            return
        # fsspec is imported only for non-local roots: it costs 12 MB in every Spark worker
        import fsspec

        # Other processes change the store: s3fs and its kin answer exists()/info() from the
        # listings they cache, which would let a commit publish a page another process deleted.
        options = {**self.storage_options, "use_listings_cache": False}
        with _translate("connect", url):
            fs, root = fsspec.core.url_to_fs(url, **options)
        self._fs = fs
        self._root = root.rstrip("/")
        self._local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))

    def _check_exclusive(self, path: str) -> None:
        """Refuse to publish on a filesystem that cannot create a file exclusively."""
        fs = self.fs
        while type(fs).__name__ == "DirFileSystem":  # fsspec's prefix wrapper delegates
            fs = fs.fs
        if type(fs).__module__.split(".")[0] in _EXCLUSIVE_BACKENDS:
            return
        raise StorageError(errno.ENOTSUP, (
            f"cannot publish {path}: {type(fs).__module__}.{type(fs).__name__} "
            f"({self.url}) has no exclusive create (its pipe_file(mode='create') checks, then "
            "writes), so two writers could both publish the same commit-log entry and lose "
            "messages. Use a local or mounted path, s3://, gs:// or abfs://; browsing an "
            "existing store works on any fsspec filesystem"))

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (for a local root, fsspec's local one, made on demand)."""
        if self._fs is None:
            self._connect()
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem("file")
        return self._fs

    @property
    def root(self) -> str:
        if self._root is None:
            self._connect()
        assert self._root is not None
        return self._root

    @property
    def local(self) -> bool:
        if self._local is None:
            self._connect()
        return bool(self._local)

    @property
    def is_memory(self) -> bool:
        return not self.local and "memory" in str(self.fs.protocol)

    def join(self, *parts: str) -> str:
        """The full path of ``parts`` under the root."""
        return "/".join([self.root, *parts])

    # -- reading --------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        """The whole file."""
        with _translate("read", path):
            if self.local:
                with open(path, "rb") as f:
                    return f.read()
            return self.fs.cat_file(path)

    def read_buffer(self, path: str) -> pa.Buffer:
        """The whole file as an Arrow buffer (see :meth:`map`)."""
        return self.map(path)[0]

    def map(self, path: str) -> tuple[pa.Buffer, Callable[[], None] | None]:
        """The whole file as an Arrow buffer, and a hook that gives its memory back.

        On local disks the file is memory-mapped (no copy). The hook tells the kernel the
        process no longer needs its resident copy (``MADV_DONTNEED``): the data stays in the
        kernel's page cache, so touching it again is a minor fault, not disk I/O, but it stops
        counting in this process's memory. Elsewhere the file is read into memory and there is
        no hook. For immutable files only: a mapped file is never truncated here, only
        unlinked or renamed, which leaves the mapping valid.
        """
        with _translate("read", path):
            if self.local:
                with open(path, "rb") as f:
                    if os.fstat(f.fileno()).st_size == 0:
                        return pa.py_buffer(b""), None
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                return pa.py_buffer(mapped), functools.partial(_release, mapped)
            return pa.py_buffer(self.fs.cat_file(path)), None

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file (``start`` may be negative: from the end)."""
        with _translate("read", path):
            if self.local:
                with open(path, "rb") as f:
                    if start < 0:
                        f.seek(start, os.SEEK_END)
                    else:
                        f.seek(start)
                    return f.read(end - start if start >= 0 else -start)
            if start < 0:
                return self.fs.cat_file(path, start=start)
            return self.fs.cat_file(path, start=start, end=end)

    def exists(self, path: str) -> bool:
        with _translate("stat", path):
            if self.local:
                return os.path.exists(path)
            return bool(self.fs.exists(path))

    def touch(self, path: str) -> bool:
        """Mark a file as just written (its age decides when cleanup may call it an orphan);
        ``False`` when it does not exist. Object stores cannot touch: only existence is
        checked there."""
        with _translate("touch", path):
            if self.local:
                try:
                    os.utime(path)
                except FileNotFoundError:
                    return False
                return True
            return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        with _translate("stat", path):
            if self.local:
                return os.stat(path).st_size
            return int(self.fs.size(path))

    def list(self, folder: str) -> list[str]:
        """Names (not paths) of the entries of ``folder``; empty when it does not exist."""
        return [name for name, _, _ in self.list_detailed(folder)]

    def list_detailed(self, folder: str) -> builtins.list[tuple[str, int, float]]:
        """``(name, size, modified_epoch_seconds)`` of the entries of ``folder``."""
        with _translate("list", folder):
            if self.local:
                try:
                    with os.scandir(folder) as it:
                        out = []
                        for e in it:
                            try:
                                st = e.stat()
                            except FileNotFoundError:  # removed while we listed
                                continue
                            out.append((e.name, st.st_size, st.st_mtime))
                        return out
                except FileNotFoundError:
                    return []
            try:
                infos = self.fs.ls(folder, detail=True, refresh=True)
            except FileNotFoundError:
                return []
            out = []
            for info in infos:
                name = info["name"].rstrip("/").rsplit("/", 1)[-1]
                mtime = _mtime(info)
                out.append((name, int(info.get("size") or 0), mtime))
            return out

    # -- writing --------------------------------------------------------------------------------
    def makedirs(self, folder: str) -> None:
        with _translate("mkdir", folder):
            if self.local:
                os.makedirs(folder, exist_ok=True)
            elif not self.is_memory:
                # object stores have no folders; memory:// does, and needs them made
                return
            else:
                self.fs.makedirs(folder, exist_ok=True)

    def create(self, path: str, data: bytes) -> bool:
        """Publish ``data`` at ``path`` atomically and exclusively.

        Returns
        -------
        bool
            ``True`` if this call created the file, ``False`` if it already existed (then
            nothing was written).

        Notes
        -----
        Concurrency guarantee: of any number of concurrent callers, processes or machines,
        exactly one gets ``True``; readers see either no file or the complete file. On local
        filesystems without hard links (some FUSE mounts, e.g. cloud volumes) it falls back to
        ``O_CREAT|O_EXCL``: still exclusive, but a reader may briefly see a short file, which
        is why the commit log's reader retries an entry that does not parse yet.

        On object stores a client may retry a conditional PUT whose response was lost; the
        retry is refused because the object now exists. Then the object is read back, and a
        file holding exactly ``data`` counts as created by this call: callers make ``data``
        unique to themselves (commit-log entries carry a random id).
        """
        with _translate("create", path):
            if self.local:
                if self._links:
                    tmp = self._write_temp(path, data)
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        return False
                    except OSError as exc:
                        if exc.errno not in _NO_LINKS:
                            raise
                        self._links = False  # this filesystem has no hard links
                    else:
                        self._sync_dir(path)
                        return True
                    finally:
                        os.unlink(tmp)
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    if self.fsync:
                        os.fsync(f.fileno())
                    # Visible while being written: a writer stalled past repair's grace period
                    # may find its file set aside (see Address.repair). Then it did not publish.
                    try:
                        still = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
                    except FileNotFoundError:
                        still = False
                    if not still:
                        raise StorageError(errno.ESTALE, (
                            f"{path} was set aside while this process was writing it (by "
                            "repair, after its grace period); nothing was published"))
                self._sync_dir(path)
                return True
            if self.is_memory:
                with _MEMORY_LOCK:
                    if self.fs.exists(path):
                        return False
                    self.fs.pipe_file(path, data)
                    return True
            self._check_exclusive(path)
            for attempt in range(_CONFLICT_RETRIES + 1):
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except FileExistsError:
                    # The client retries a PUT whose response was lost (timeouts, resets): the
                    # retry then finds the object the first attempt stored. Callers write
                    # something unique (an entry id, a time, an owner), so our bytes are ours.
                    try:
                        return bytes(self.fs.cat_file(path)) == data
                    except FileNotFoundError:
                        return False
                except OSError as exc:
                    if attempt == _CONFLICT_RETRIES or not _conflicting_create(exc):
                        raise
                    # the other PUT decides: ours then fails (412) or, if it failed, wins
                    time.sleep(0.05 * (attempt + 1))
                    continue
                return True
            raise AssertionError("unreachable")

    def replace(self, path: str, data: bytes) -> None:
        """Overwrite ``path`` atomically (readers see the old or the new content, never a mix)."""
        with _translate("write", path):
            if self.local:
                tmp = self._write_temp(path, data)
                os.replace(tmp, path)
                self._sync_dir(path)
                return
            if self.is_memory:
                with _MEMORY_LOCK:
                    self.fs.pipe_file(path, data)
                return
            self.fs.pipe_file(path, data)

    def begin_write(self, path: str) -> BinaryIO:
        """Open a new immutable file for streaming writes; finish it with :meth:`end_write`.

        On object stores the file appears only when the upload completes in ``end_write``.
        """
        with _translate("write", path):
            if self.local:
                return open(path, "wb")  # closed by end_write (or the caller's abort)
            return self.fs.open(path, "wb")  # type: ignore[no-any-return]

    def end_write(self, f: BinaryIO, path: str) -> None:
        """Flush, fsync (when enabled) and close a file from :meth:`begin_write`.

        May run on another thread than the one that wrote the file.
        """
        with _translate("write", path):
            try:
                if self.local:
                    f.flush()
                    if self.fsync:
                        os.fsync(f.fileno())
            finally:
                f.close()

    def delete(self, path: str) -> None:
        """Remove a file; a file that is already gone is fine."""
        with _translate("delete", path):
            if self.local:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)

    def delete_tree(self, folder: str) -> None:
        with _translate("delete", folder):
            if self.local:
                import shutil

                shutil.rmtree(folder, ignore_errors=False)
                return
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(folder, recursive=True)

    def move(self, src: str, dst: str) -> None:
        """Move a file (archive); on object stores this is copy + delete."""
        with _translate("move", src):
            if self.local:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(src, dst)
                return
            self.fs.mv(src, dst)

    # -- helpers --------------------------------------------------------------------------------
    @property
    def temp_folder(self) -> str:
        """Where local temp files are staged before ``link``/``rename`` (same filesystem as
        the root; a process killed mid-write leaves its temp file here, for cleanup)."""
        return self.join(".tmp")

    def _write_temp(self, path: str, data: bytes) -> str:
        folder = self.temp_folder
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def _sync_dir(self, path: str) -> None:
        # a new directory entry is durable only once the directory itself is synced
        if not self.fsync:
            return
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_folder(self, folder: str) -> None:
        """Make new entries of a local folder durable (no-op elsewhere)."""
        if self.local and self.fsync:
            with _translate("fsync", folder):
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


def _conflicting_create(exc: BaseException) -> bool:
    """S3 answers a conditional PUT that races another one still in flight with 409
    ConditionalRequestConflict ("retry"); s3fs passes it on as a plain OSError."""
    response = getattr(exc.__cause__, "response", None)
    return isinstance(response, dict) and \
        response.get("Error", {}).get("Code") == "ConditionalRequestConflict"


def _release(mapped: mmap.mmap) -> None:
    with contextlib.suppress(ValueError, OSError):  # closed, or madvise not supported
        mapped.madvise(mmap.MADV_DONTNEED)


def _mtime(info: dict[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created", "modified"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, int | float):
            return float(value)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            from datetime import datetime

            return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return time.time()
