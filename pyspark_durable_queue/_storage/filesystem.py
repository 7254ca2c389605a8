"""What every fsspec-backed storage shares: connecting, reading, listing, deleting."""

from __future__ import annotations

import builtins
import contextlib
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import pyarrow as pa

from .base import Entry, Storage, translate_errors

__all__ = ["FsspecStorage"]


class FsspecStorage(Storage):
    """A root folder on an fsspec filesystem; subclasses decide how files are published.

    Concurrency guarantee: reads and listings never answer from a cache (listings caches are
    off), so they see what other processes wrote; publishing is the subclasses' business.
    The filesystem is made on first use (and again after unpickling). fsspec is imported only
    here, for non-local roots: importing it costs every Spark worker memory.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 fsync: bool = True) -> None:
        super().__init__(url, storage_options, fsync=fsync)
        self._fs: Any = None
        self._root: str | None = None

    def _connect(self) -> None:
        import fsspec

        # Other processes change the store: s3fs and its kin answer exists()/info() from the
        # listings they cache, which would let a commit publish a page another process deleted.
        options = {**self.storage_options, "use_listings_cache": False}
        with translate_errors("connect", self.url):
            fs, root = fsspec.core.url_to_fs(self.url, **options)
        self._fs = fs
        self._root = root.rstrip("/")

    @property
    def fs(self) -> Any:
        """The fsspec filesystem."""
        if self._fs is None:
            self._connect()
        return self._fs

    @property
    def root(self) -> str:
        if self._root is None:
            self._connect()
        assert self._root is not None
        return self._root

    # -- reading --------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        with translate_errors("read", path):
            return bytes(self.fs.cat_file(path))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with translate_errors("read", path):
            if end <= start:  # S3 answers an empty range with the whole object, Azure fails
                self.fs.size(path)  # NotFound all the same
                return b""
            return bytes(self.fs.cat_file(path, start=start, end=end))

    def map(self, path: str) -> tuple[pa.Buffer, Callable[[], None] | None]:
        """The whole file read into memory (nothing to give back early)."""
        with translate_errors("read", path):
            return pa.py_buffer(self.fs.cat_file(path)), None

    def exists(self, path: str) -> bool:
        with translate_errors("stat", path):
            return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        with translate_errors("stat", path):
            return int(self.fs.size(path))

    def touch(self, path: str) -> bool:
        return self.exists(path)  # an object's time is its upload's; it cannot be refreshed

    def list_detailed(self, folder: str) -> builtins.list[Entry]:
        with translate_errors("list", folder):
            try:
                infos = self.fs.ls(folder, detail=True, refresh=True)
            except FileNotFoundError:
                return []
        return [(info["name"].rstrip("/").rsplit("/", 1)[-1], int(info.get("size") or 0),
                 _mtime(info)) for info in infos]

    # -- writing --------------------------------------------------------------------------------
    def begin_write(self, path: str, *, spare: bool = False) -> BinaryIO:
        """Open a new file; on object stores it appears only once :meth:`end_write` completes
        the upload."""
        with translate_errors("write", path):
            return self.fs.open(path, "wb")  # type: ignore[no-any-return]

    def end_write(self, f: BinaryIO, path: str) -> None:
        with translate_errors("write", path):
            f.close()

    def delete(self, path: str) -> None:
        with translate_errors("delete", path), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def delete_tree(self, folder: str) -> None:
        with translate_errors("delete", folder), contextlib.suppress(FileNotFoundError):
            self.fs.rm(folder, recursive=True)

    def move(self, src: str, dst: str) -> None:
        """Move a file; on object stores this is copy + delete."""
        with translate_errors("move", src):
            self.fs.mv(src, dst)


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
