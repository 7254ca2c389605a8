"""A consumer's watermark in a file of its own, rewritten in place (on-disk format 3).

An acknowledgement that replaces the consumer's state file costs a temporary file, a sync, a
rename and a folder sync, which bound how many a disk takes a second. From format 3 an
address keeps each consumer's ``position`` in ``consumers/<name>.wm`` instead, two slots of
which a write replaces the older one::

    offset 0     slot 0  magic "DQWM", version, generation, position, time (us), crc32
    offset 4096  slot 1  the same; each slot in a block of its own

A write reads both slots, writes ``generation + 1`` into the slot with the older generation
and syncs the data (``fdatasync``: the file's size never changes, so that is one sync into
space the file already has). A crash tears at most the slot being written; its checksum fails
and the other slot, the previous watermark, holds. A reader takes the valid slot with the
higher generation.

A record is 36 bytes at the start of a 4 KiB block: a power cut persists the block or not
(docs/architecture.md, "Damage and torn writes"), so a slot that is not all zeros and fails its
checksum was damaged after it was written. Readers still take the other slot (the consumer
goes on from the previous watermark: what it acknowledged since is delivered again, the
at-least-once contract), but never silently: the read logs a warning naming the file,
``verify`` reports it, and the next write replaces the damaged slot.

Where a storage cannot rewrite a file in place (object stores, FUSE mounts), the same file is
replaced whole, so an address keeps one layout wherever its files are copied. The state file
(``<name>.json``) keeps the rest (selector, lost ranges) and the position the consumer was
created at, which holds until the first watermark write creates ``<name>.wm``.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import zlib
from collections.abc import Callable

from .._storage import InPlaceFile, NotFound, Storage

__all__ = ["SLOT_BYTES", "Watermark", "WatermarkFile", "decode", "initial", "inspect"]

log = logging.getLogger(__name__)

SLOT_BYTES = 4096
_MAGIC = b"DQWM"
_VERSION = 1
_SLOT = struct.Struct("<4sHHQqQ")  # magic, version, reserved, generation, position, time us
_CRC = struct.Struct("<I")
_RECORD = _SLOT.size + _CRC.size


class Watermark:
    """A decoded slot: the watermark ``position`` written at ``time_us``."""

    __slots__ = ("generation", "position", "time_us")

    def __init__(self, generation: int, position: int, time_us: int) -> None:
        self.generation = generation
        self.position = position
        self.time_us = time_us


def _record(generation: int, position: int, time_us: int) -> bytes:
    body = _SLOT.pack(_MAGIC, _VERSION, 0, generation, position, time_us)
    return body + _CRC.pack(zlib.crc32(body))


def _slot(data: bytes) -> Watermark | None:
    if len(data) < _RECORD:
        return None
    body = data[:_SLOT.size]
    (crc,) = _CRC.unpack_from(data, _SLOT.size)
    if zlib.crc32(body) != crc:
        return None
    magic, version, _, generation, position, time_us = _SLOT.unpack(body)
    if magic != _MAGIC or version != _VERSION:
        return None
    return Watermark(generation, position, time_us)


def decode(data: bytes) -> Watermark | None:
    """The newer valid slot of a watermark file's bytes; ``None`` when neither is valid."""
    return inspect(data)[0]


def inspect(data: bytes) -> tuple[Watermark | None, list[int]]:
    """The newer valid slot of a watermark file's bytes, and the slots that are damaged (hold
    bytes, but not a valid record)."""
    found, damaged = [], []
    for i in (0, 1):
        raw = data[i * SLOT_BYTES:(i + 1) * SLOT_BYTES]
        slot = _slot(raw)
        if slot is not None:
            found.append(slot)
        elif raw.strip(b"\0"):
            damaged.append(i)
    return max(found, key=lambda s: s.generation, default=None), damaged


def initial(position: int, generation: int = 1, time_us: int | None = None) -> bytes:
    """A whole watermark file holding ``position`` (slot ``generation % 2``; the other empty)."""
    record = _record(generation, position, time_us or int(time.time() * 1e6))
    slots = [b"\0" * SLOT_BYTES, b"\0" * SLOT_BYTES]
    slots[generation % 2] = record.ljust(SLOT_BYTES, b"\0")
    return b"".join(slots)


class WatermarkFile:
    """Writes one consumer's watermark file (see the module docstring).

    Concurrency guarantee: writes of one object are serialised (a lock); a consumer has one
    owner at a time, and a write reads the slots first, so a second writer's watermark is not
    hidden behind a stale generation. Raises :class:`NotFound` when the file was deleted (the
    consumer with it) after it was opened: ``write`` asks its caller whether the consumer
    still exists before it makes the file again.
    """

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage = storage
        self.path = path
        self._file: InPlaceFile | None = None
        self._lock = threading.Lock()

    def read(self) -> Watermark | None:
        """The watermark on disk; ``None`` when the file does not exist or holds none."""
        try:
            data = self.storage.read(self.path)
        except NotFound:
            return None
        mark, damaged = inspect(data)
        if damaged:
            log.warning(
                "consumer watermark %s: slot %s is damaged (fails its checksum); %s. Messages "
                "acknowledged after it are delivered again; the next acknowledgement rewrites "
                "the slot (`durablequeue ROOT verify ADDRESS` lists damaged files)",
                self.path, damaged[0], "no other slot holds a watermark: the consumer state's "
                "position holds" if mark is None else f"using the other one (position "
                f"{mark.position})")
        return mark

    def write(self, position: int, exists: Callable[[], bool]) -> bool:
        """Make ``position`` the durable watermark, creating the file on first use; ``False``
        (nothing written) when the file must be opened again and ``exists()`` says the
        consumer is gone."""
        now = int(time.time() * 1e6)
        with self._lock:
            if not self.storage.capabilities.overwrite:
                if not exists():
                    return False
                current = self.read()
                generation = (current.generation if current else 0) + 1
                self.storage.replace(self.path, initial(position, generation, now))
                return True
            # poisoned: a sync failed; a new descriptor writes the next generation
            stale = self._file is None or self._file.poisoned or self._file.gone()
            if stale and not exists():
                self.close()
                return False
            f = self._open(position, now) if stale else self._file
            if f is None:
                return True  # created holding position
            current = decode(f.read(2 * SLOT_BYTES, 0))
            generation = (current.generation if current else 0) + 1
            f.write(_record(generation, position, now), (generation % 2) * SLOT_BYTES)
            f.sync()
            return True

    def _open(self, position: int, now: int) -> InPlaceFile | None:
        """The file opened afresh, or ``None`` after creating it with ``position`` in it."""
        self.close()
        try:
            self._file = self.storage.open_inplace(self.path)
        except NotFound:
            if self.storage.create(self.path, initial(position, 1, now)):
                return None
            self._file = self.storage.open_inplace(self.path)
        return self._file

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()
