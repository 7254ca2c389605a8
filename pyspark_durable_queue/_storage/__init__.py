"""The one boundary between the store and a filesystem.

Everything the store does to files goes through :class:`Storage`, a root folder; this package
is the only code that catches ``OSError`` and fsspec errors (see :func:`base._translate`).
``Storage(url, storage_options, fsync=...)`` returns the backend that serves the URL:

========================  ==============================================================
module                    backend
========================  ==============================================================
``base.py``               the interface, :class:`Capabilities`, the error translation
``local.py``              :class:`LocalStorage` (hard links), :class:`NoLinksLocalStorage`
``memory.py``             :class:`MemoryStorage` (``memory://``, one process)
``objectstore.py``        :class:`ObjectStoreStorage` (conditional PUTs: S3, GCS, Azure)
``filesystem.py``         what the fsspec-backed storages share
========================  ==============================================================

Two primitives carry the store's guarantees: :meth:`Storage.create` publishes a small file
atomically and exclusively (two writers can never both create commit-log entry N), and
:meth:`Storage.replace` overwrites one atomically. Each backend's docstring says how.
"""

from __future__ import annotations

from .base import (
    HEADROOM_BYTES,
    TEMP_FOLDER,
    AppendFile,
    Capabilities,
    InPlaceFile,
    KeptLock,
    NotFound,
    RangeReader,
    Storage,
)
from .local import LocalStorage, NoLinksLocalStorage
from .memory import MemoryStorage
from .objectstore import ObjectStoreStorage

__all__ = [
    "HEADROOM_BYTES",
    "TEMP_FOLDER",
    "AppendFile",
    "KeptLock",
    "RangeReader",
    "Capabilities",
    "InPlaceFile",
    "LocalStorage",
    "MemoryStorage",
    "NoLinksLocalStorage",
    "NotFound",
    "ObjectStoreStorage",
    "Storage",
    "backend_class",
]

_LOCAL_PROTOCOLS = ("file", "local")


def backend_class(url: str) -> type[Storage]:
    """The backend that serves ``url``: local for a path or a ``file://`` (``local://``) URL,
    memory for ``memory://``, the object-store backend for every other fsspec URL (chained
    URLs such as ``simplecache::s3://...`` included)."""
    if "://" not in url:
        return LocalStorage
    protocol = url.split("://", 1)[0]
    if protocol in _LOCAL_PROTOCOLS:
        return LocalStorage
    if protocol == "memory":
        return MemoryStorage
    return ObjectStoreStorage
