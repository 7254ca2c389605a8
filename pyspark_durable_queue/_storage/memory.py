"""fsspec's ``memory://`` filesystem: one dict per process, for tests and demos."""

from __future__ import annotations

import builtins
import threading

from .base import Capabilities, Entry, translate_errors
from .filesystem import FsspecStorage

__all__ = ["MemoryStorage"]

# memory:// is one dict per process without any locking; serialise our writes on it.
_MEMORY_LOCK = threading.Lock()


class MemoryStorage(FsspecStorage):
    """A root folder in fsspec's in-memory filesystem.

    Concurrency guarantee: the filesystem lives in one process, and :meth:`create` and
    :meth:`replace` hold a process-wide lock, so of concurrent threads creating one path exactly
    one gets ``True`` and readers see whole files. Other processes see nothing of it. It cannot
    append in place, like the object stores it stands in for in tests.
    """

    CAPABILITIES = Capabilities(exclusive_create=True, folders=True)

    def makedirs(self, folder: str) -> None:
        with translate_errors("mkdir", folder):
            self.fs.makedirs(folder, exist_ok=True)

    def create(self, path: str, data: bytes, *, spare: bool = False) -> bool:
        with translate_errors("create", path), _MEMORY_LOCK:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

    # a listing iterates the filesystem's dict: a deletion by another thread meanwhile made
    # fsspec raise KeyError (a shared consumer's handles prune epochs as others list them)
    def list_detailed(self, folder: str) -> builtins.list[Entry]:
        with _MEMORY_LOCK:
            return super().list_detailed(folder)

    def delete(self, path: str) -> None:
        with _MEMORY_LOCK:
            super().delete(path)

    def delete_tree(self, folder: str) -> None:
        with _MEMORY_LOCK:
            super().delete_tree(folder)

    def replace(self, path: str, data: bytes) -> None:
        with translate_errors("write", path), _MEMORY_LOCK:
            self.fs.pipe_file(path, data)
