"""Object stores through fsspec: S3 (s3fs), Google Cloud Storage (gcsfs), Azure (adlfs)...

There is no rename and no link: a commit is published by a conditional PUT that the server
decides (``If-None-Match: *``), which fsspec exposes as ``pipe_file(..., mode="create")``.
"""

from __future__ import annotations

import dataclasses
import errno
import time

from ..errors import StorageError
from .base import Capabilities, translate_errors
from .filesystem import FsspecStorage

__all__ = ["ObjectStoreStorage"]

# fsspec backends whose pipe_file(mode="create") is a conditional write decided by the server:
# s3fs sends If-None-Match: *, gcsfs ifGenerationMatch=0, adlfs overwrite=False. Every other
# backend inherits fsspec's default, which checks exists() and then writes: two writers could
# both publish commit-log entry N.
_EXCLUSIVE_BACKENDS = frozenset({"s3fs", "gcsfs", "adlfs"})
_CONFLICT_RETRIES = 5


class ObjectStoreStorage(FsspecStorage):
    """A root folder (a key prefix) on an object store, or on any other fsspec filesystem.

    Concurrency guarantee: on s3fs, gcsfs and adlfs, :meth:`create` is one conditional PUT: of
    any number of concurrent callers, processes or machines, exactly one gets ``True``, and the
    object appears whole or not at all. :meth:`replace` is one plain PUT (last writer wins,
    never a mix). Any other fsspec filesystem has no exclusive create: :meth:`create` refuses,
    and the store can only be read through it.
    """

    CAPABILITIES = Capabilities(exclusive_create=True)

    @property
    def capabilities(self) -> Capabilities:
        if self._exclusive_backend():
            return self.CAPABILITIES
        return dataclasses.replace(self.CAPABILITIES, exclusive_create=False)

    def _exclusive_backend(self) -> bool:
        fs = self.fs
        while type(fs).__name__ == "DirFileSystem":  # fsspec's prefix wrapper delegates
            fs = fs.fs
        return type(fs).__module__.split(".")[0] in _EXCLUSIVE_BACKENDS

    def makedirs(self, folder: str) -> None:
        """Nothing to do: object stores have no folders."""

    def create(self, path: str, data: bytes, *, spare: bool = False) -> bool:
        """Publish ``data`` with a conditional PUT.

        Notes
        -----
        A client may retry a conditional PUT whose response was lost; the retry is refused
        because the object now exists. Then the object is read back, and an object holding
        exactly ``data`` counts as created by this call (callers make ``data`` unique). S3
        answers a PUT racing another one still in flight with 409 ConditionalRequestConflict;
        it is retried, and the other PUT decides.
        """
        with translate_errors("create", path):
            if not self._exclusive_backend():
                fs = self.fs
                raise StorageError(errno.ENOTSUP, (
                    f"cannot publish {path}: {type(fs).__module__}.{type(fs).__name__} "
                    f"({self.url}) has no exclusive create (its pipe_file(mode='create') "
                    "checks, then writes), so two writers could both publish the same "
                    "commit-log entry and lose messages. Use a local or mounted path, s3://, "
                    "gs:// or abfs://; browsing an existing store works on any fsspec "
                    "filesystem"))
            for attempt in range(_CONFLICT_RETRIES + 1):
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except FileExistsError:
                    try:
                        return bytes(self.fs.cat_file(path)) == data
                    except FileNotFoundError:
                        return False
                except OSError as exc:
                    if attempt == _CONFLICT_RETRIES or not _conflicting_create(exc):
                        raise
                    time.sleep(0.05 * (attempt + 1))
                    continue
                return True
            raise AssertionError("unreachable")

    def replace(self, path: str, data: bytes) -> None:
        with translate_errors("write", path):
            self.fs.pipe_file(path, data)


def _conflicting_create(exc: BaseException) -> bool:
    """S3 answers a conditional PUT that races another one still in flight with 409
    ConditionalRequestConflict ("retry"); s3fs passes it on as a plain OSError."""
    response = getattr(exc.__cause__, "response", None)
    return isinstance(response, dict) and \
        response.get("Error", {}).get("Code") == "ConditionalRequestConflict"
