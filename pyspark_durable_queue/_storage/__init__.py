"""The one boundary between the store and a filesystem.

Everything the store does to files goes through :class:`Storage`, a root folder; this package
is the only code that catches ``OSError`` and fsspec errors (see :func:`base.translate_errors`).
:func:`open_storage` returns the backend that serves a URL, chosen by the URL's scheme in
:data:`BACKENDS` (fsspec's registry model: the interface in ``base.py`` imports no backend):

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

from typing import Any

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
    "BACKENDS",
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
    "open_storage",
]

#: The backend of each URL scheme that has its own; a path without a scheme is local, and every
#: other fsspec URL (``s3://``, ``abfs://``, ``gs://``, chained ones such as
#: ``simplecache::s3://...``) is served by :class:`ObjectStoreStorage`.
BACKENDS: dict[str, type[Storage]] = {
    "file": LocalStorage,
    "local": LocalStorage,
    "memory": MemoryStorage,
}


def backend_class(url: str) -> type[Storage]:
    """The backend that serves ``url`` (see :data:`BACKENDS`)."""
    if "://" not in url:
        return LocalStorage
    return BACKENDS.get(url.split("://", 1)[0], ObjectStoreStorage)


def open_storage(url: str, storage_options: dict[str, Any] | None = None, *,
                 fsync: bool = True) -> Storage:
    """The storage of the root folder ``url``, served by its backend (:func:`backend_class`);
    the parameters are :class:`Storage`'s. Connects to nothing yet."""
    url = str(url)
    return backend_class(url)(url, storage_options, fsync=fsync)
