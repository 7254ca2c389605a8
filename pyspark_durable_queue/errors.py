"""Errors raised by pyspark-durable-queue.

Every error derives from :class:`DurableQueueError` and from the built-in exception a caller
would naturally catch (``ValueError`` for bad input, ``OSError`` for storage trouble, ...), so
``except ValueError`` keeps working for code that does not know this package.
"""

from __future__ import annotations

__all__ = [
    "AddressFullError",
    "AddressNotFoundError",
    "ConsumerInUseError",
    "ConsumerNotFoundError",
    "CorruptPageError",
    "DamagedLogError",
    "DataLossError",
    "DurableQueueError",
    "InvalidMessageError",
    "InvalidNameError",
    "InvalidOptionError",
    "NotFoundError",
    "SchemaMismatchError",
    "SelectorSyntaxError",
    "StorageError",
]


class DurableQueueError(Exception):
    """Base class of every error raised by this package."""


class InvalidOptionError(DurableQueueError, ValueError):
    """An option or setting is unknown or has a bad value."""


class InvalidNameError(DurableQueueError, ValueError):
    """An address or consumer name is not acceptable (path separators, ``..``, control chars)."""


class InvalidMessageError(DurableQueueError, TypeError):
    """Something sent is not a message (not a dict, a table or a DataFrame)."""


class SchemaMismatchError(DurableQueueError, ValueError):
    """Data sent to an address does not fit the address's schema."""


class AddressNotFoundError(DurableQueueError, LookupError):
    """The address does not exist (reading never creates one)."""


class ConsumerNotFoundError(DurableQueueError, LookupError):
    """The consumer does not exist or was deleted."""


class AddressFullError(DurableQueueError, RuntimeError):
    """The address backlog is at its limit and the full policy is FAIL (or BLOCK timed out).

    Nothing of the rejected send was stored.
    """


class ConsumerInUseError(DurableQueueError, RuntimeError):
    """Another running query owns this consumer."""


class DataLossError(DurableQueueError, RuntimeError):
    """Messages a consumer still needed are gone (page files deleted by hand)."""


class StorageError(DurableQueueError, OSError):
    """The underlying filesystem failed; the message names the path and the operation."""


class NotFoundError(StorageError, FileNotFoundError):
    """A file or folder of the store does not exist (``except FileNotFoundError`` catches it)."""


class DamagedLogError(StorageError):
    """A commit-log entry cannot be read, so the address cannot be opened.

    Attributes
    ----------
    path : str
        The entry's file.
    version : int
        The entry's number.
    partial : bool
        The entry does not parse: what a writer killed while writing it leaves where the
        filesystem has no hard links (entries are then created with ``O_EXCL``). It was never
        acknowledged to its writer, and ``Address.repair`` (``durablequeue ROOT repair ADDR``)
        sets it aside.
    """

    def __init__(self, path: str, version: int, reason: str, partial: bool) -> None:
        self.path = path
        self.version = version
        self.reason = reason
        self.partial = partial
        hint = ("; if a writer was killed while writing it, `durablequeue ROOT repair ADDRESS` "
                "(Address.repair) sets it aside" if partial else "")
        super().__init__(0, f"commit log entry {path} {reason}; the log is damaged{hint}")

    def __reduce__(self):  # keep picklable across Spark process boundaries
        return (type(self), (self.path, self.version, self.reason, self.partial))


class CorruptPageError(DurableQueueError, OSError):
    """A page file failed its checksum or framing checks.

    Attributes
    ----------
    path : str
        The page file.
    offset : int
        Byte offset of the damaged frame inside the file.
    """

    def __init__(self, path: str, offset: int, reason: str) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        super().__init__(f"corrupt page {path} at byte {offset}: {reason}")

    def __reduce__(self):  # keep picklable across Spark process boundaries
        return (type(self), (self.path, self.offset, self.reason))


class SelectorSyntaxError(DurableQueueError, ValueError):
    """A selector is not valid Jakarta Messaging selector syntax.

    The message shows the selector with a caret under the offending position.

    Attributes
    ----------
    selector : str
        The selector text.
    position : int
        0-based character offset of the problem.
    """

    def __init__(self, message: str, selector: str, position: int) -> None:
        self.selector = selector
        self.position = position
        self.reason = message
        caret = " " * max(0, position) + "^"
        super().__init__(
            f"{message} at position {position} of selector:\n  {selector}\n  {caret}"
        )

    def __reduce__(self):
        return (type(self), (self.reason, self.selector, self.position))
