"""Errors raised by pyspark-durable-queue.

Every error derives from :class:`DurableQueueError` and from the built-in exception a caller
would naturally catch (``ValueError`` for bad input, ``OSError`` for storage trouble, ...), so
``except ValueError`` keeps working for code that does not know this package.
"""

from __future__ import annotations

import errno

__all__ = [
    "AddressFullError",
    "AddressNotFoundError",
    "BufferFullError",
    "ConsumerInUseError",
    "ConsumerNotFoundError",
    "CorruptPageError",
    "DamagedLogError",
    "DamagedMetadataError",
    "DamagedStoreError",
    "DataLossError",
    "DurableQueueError",
    "InvalidMessageError",
    "InvalidNameError",
    "InvalidOptionError",
    "LeaseExpiredError",
    "LinkRefusedError",
    "MessageDroppedError",
    "NotFoundError",
    "ProducerClosedError",
    "SchemaMismatchError",
    "SelectorSyntaxError",
    "StorageError",
    "StoreFullError",
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


class UnsupportedFormatError(DurableQueueError, RuntimeError):
    """The address was written in an on-disk format this release does not know (a newer
    release wrote it); upgrade pyspark-durable-queue to open it."""


class AddressNotFoundError(DurableQueueError, LookupError):
    """The address does not exist (reading never creates one)."""


class ConsumerNotFoundError(DurableQueueError, LookupError):
    """The consumer does not exist or was deleted."""


class AddressFullError(DurableQueueError, RuntimeError):
    """The address backlog is at its limit and the full policy is FAIL (or BLOCK timed out).

    Nothing of the rejected send was stored.
    """


class MessageDroppedError(AddressFullError):
    """A producer's message was not stored: the address was full and its policy is DROP.

    What a :class:`~pyspark_durable_queue.producer.MessageFuture` raises; ``Address.send``
    reports the same with ``CommitResult.dropped`` instead.
    """


class BufferFullError(DurableQueueError, TimeoutError):
    """A producer's buffer (``max_buffer_bytes``) stayed full for ``max_block_ms``; the message
    was not queued."""


class ProducerClosedError(DurableQueueError, RuntimeError):
    """The producer was closed (or the message belongs to the parent of a forked process)."""


class ConsumerClosedError(DurableQueueError, RuntimeError):
    """The consumer was closed (:meth:`Consumer.close`); open it again to go on."""


class ConsumerInUseError(DurableQueueError, RuntimeError):
    """Another running query owns this consumer."""


class LeaseExpiredError(DurableQueueError, RuntimeError):
    """A shared consumer's handle acknowledged, nacked or renewed a row whose lease ran out and
    passed to another handle (it held the row past ``lease_ms``): the other handle has it now,
    and the row is delivered again."""


class DataLossError(DurableQueueError, RuntimeError):
    """Messages a consumer still needed are gone (page files deleted by hand)."""


class StorageError(DurableQueueError, OSError):
    """The underlying filesystem failed; the message names the path and the operation.

    Constructed as ``StorageError(errno, message)``; ``errno`` is kept for callers, the
    message is what is shown.
    """

    def __str__(self) -> str:
        return str(self.strerror) if self.strerror is not None else super().__str__()


class NotFoundError(StorageError, FileNotFoundError):
    """A file or folder of the store does not exist (``except FileNotFoundError`` catches it)."""


class StoreFullError(StorageError):
    """The disk under the store is full (or the user's disk quota is used up): a write found
    no room (``ENOSPC``, ``EDQUOT``). ``errno`` is ``ENOSPC`` either way, so ``except OSError``
    code that checks for it keeps working.

    Nothing of the refused operation was stored or will be read: a send that fails with it was
    not committed (what it had written is never read, and the next send writes over it), an
    acknowledgement did not move. Sends and acknowledgements succeed again by themselves once
    there is room; no handle needs to be opened again.

    Attributes
    ----------
    path : str
        The file that could not be written (it names the address: ``<root>/<address>/...``).
    op : str
        What was being done (``append``, ``allocate``, ``write``, ``create``...).
    quota : bool
        The user's disk quota, not the disk, is full (``EDQUOT``).
    headroom : int
        Not the disk itself: writing these messages would have left less than this many bytes
        free, which are kept for acknowledgements and maintenance (0: the disk refused).
    """

    def __init__(self, op: str, path: str, quota: bool = False, headroom: int = 0) -> None:
        self.op = op
        self.path = path
        self.quota = quota
        self.headroom = headroom
        what = "the disk quota is used up" if quota else "no space left on the device"
        if headroom:
            what = (f"less than {headroom:,} bytes would be left on the device, which are kept "
                    "for acknowledgements and cleanup")
        super().__init__(errno.ENOSPC, (
            f"{op} {path}: the store is full ({what}); nothing of this operation was stored. "
            "To free space: acknowledge what consumers have read and run cleanup "
            "(Address.cleanup(dry_run=False), `durablequeue ROOT cleanup ADDRESS`), compact "
            "small pages (Address.compact()), delete consumers nobody reads any more (their "
            "backlog keeps pages), or give the disk more room. Sends and acknowledgements go on "
            "by themselves once there is room"))

    def __reduce__(self):  # keep picklable across Spark process boundaries
        return (type(self), (self.op, self.path, self.quota, self.headroom))


class LinkRefusedError(StorageError):
    """A symbolic link stands where the store keeps a file or a folder: links inside a store
    are refused (never followed), so that nothing is read or written outside its root. The
    root itself may be a link.

    Attributes
    ----------
    path : str
        The link.
    target : str
        Where it points (``""`` when it could not be read).
    """

    def __init__(self, path: str, target: str = "") -> None:
        self.path = path
        self.target = target
        to = f" (to {target})" if target else ""
        super().__init__(errno.ELOOP, (
            f"{path} is a symbolic link{to}: links inside a store are refused, nothing under "
            "the store's root is followed (so that no file is read or written outside it). "
            "Put the file or folder itself there, or make the store's root (which may be a "
            "link) the place to keep it"))

    def __reduce__(self):  # keep picklable across Spark process boundaries
        return (type(self), (self.path, self.target))


class DamagedStoreError(StorageError):
    """Something in the store does not read as the store wrote it: a page that fails its
    checksums, a commit-log entry that does not parse, malformed metadata.

    Attributes
    ----------
    path : str
        The damaged file.
    reason : str
        What is wrong with it.
    """

    def __init__(self, path: str, reason: str, message: str | None = None) -> None:
        self.path = path
        self.reason = reason
        super().__init__(errno.EIO, message or f"{path} is damaged: {reason}")

    def __reduce__(self):  # keep picklable across Spark process boundaries
        return (type(self), (self.path, self.reason, self.args[1]))


class DamagedMetadataError(DamagedStoreError):
    """A metadata file (``address.json``, a consumer's state) is not what the store wrote."""


class DamagedLogError(DamagedStoreError):
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
        self.version = version
        self.partial = partial
        hint = ("; if a writer was killed while writing it, `durablequeue ROOT repair ADDRESS` "
                "(Address.repair) sets it aside" if partial else "")
        super().__init__(path, reason,
                         f"commit log entry {path} {reason}; the log is damaged{hint}")

    def __reduce__(self):  # keep picklable across Spark process boundaries
        return (type(self), (self.path, self.version, self.reason, self.partial))


class CorruptPageError(DamagedStoreError):
    """A page file failed its checksum or framing checks.

    Attributes
    ----------
    path : str
        The page file.
    offset : int
        Byte offset of the damaged frame inside the file.
    """

    def __init__(self, path: str, offset: int, reason: str) -> None:
        self.offset = offset
        super().__init__(path, reason, f"corrupt page {path} at byte {offset}: {reason}")

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
