"""pyspark-durable-queue: durable, selectable, memory-bounded message queues in files.

The store and its Python client never import pyspark; ``DefaultSource`` (the Spark data source
registered as ``durablequeue``) is loaded lazily on first access, which is how Spark's automatic
registration of ``pyspark_*`` modules finds it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ._ops.repair import RepairReport
from .address import Address, CleanupReport, CommitResult
from .consumer import Consumer
from .errors import (
    AddressFullError,
    AddressNotFoundError,
    BufferFullError,
    ConsumerClosedError,
    ConsumerInUseError,
    ConsumerNotFoundError,
    CorruptPageError,
    DamagedLogError,
    DataLossError,
    DurableQueueError,
    InvalidMessageError,
    InvalidNameError,
    InvalidOptionError,
    LeaseExpiredError,
    LinkRefusedError,
    MessageDroppedError,
    NotFoundError,
    ProducerClosedError,
    SchemaMismatchError,
    SelectorSyntaxError,
    StorageError,
    StoreFullError,
    UnsupportedFormatError,
)
from .producer import MessageFuture, Producer
from .queue import DurableQueue
from .shared_consumer import SharedConsumer

__version__ = "0.1.0"

__all__ = [
    "Address",
    "AddressFullError",
    "AddressNotFoundError",
    "BufferFullError",
    "CleanupReport",
    "CommitResult",
    "Consumer",
    "ConsumerClosedError",
    "ConsumerInUseError",
    "ConsumerNotFoundError",
    "CorruptPageError",
    "DamagedLogError",
    "DataLossError",
    "DefaultSource",
    "DurableQueue",
    "DurableQueueError",
    "InvalidMessageError",
    "InvalidNameError",
    "InvalidOptionError",
    "LeaseExpiredError",
    "LinkRefusedError",
    "MessageDroppedError",
    "MessageFuture",
    "NotFoundError",
    "Producer",
    "ProducerClosedError",
    "RepairReport",
    "SchemaMismatchError",
    "Selector",
    "SelectorSyntaxError",
    "SharedConsumer",
    "StorageError",
    "StoreFullError",
    "UnsupportedFormatError",
]
if importlib.util.find_spec("pyspark") is None:
    # Installed without the [spark] extra: `from pyspark_durable_queue import *` must still work.
    __all__.remove("DefaultSource")


def __getattr__(name: str) -> Any:
    # Lazy: importing the package must not start importing pyspark (the client, the CLI and the
    # unit tests run without it).
    if name == "DefaultSource":
        try:
            from .spark import DurableQueueDataSource
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] != "pyspark":
                raise
            raise ModuleNotFoundError(
                "pyspark_durable_queue.DefaultSource (the Spark data source) needs pyspark: "
                'pip install "pyspark-durable-queue[spark]" (on Databricks pyspark comes with '
                "the runtime)", name=exc.name) from exc
        return DurableQueueDataSource
    if name == "Selector":
        from .selector import Selector

        return Selector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
