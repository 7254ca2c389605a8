"""The frame codec: one checksummed run of messages, the unit of page files and journal units.

::

    frame = magic (4 bytes) | u64 payload length | u32 rows | u32 crc32c | payload

``crc32c`` covers the length and rows fields and the payload. A message frame's magic is
``FRAME_MAGIC`` and its payload an Arrow IPC stream (schema + one record batch), so every frame
decodes on its own; a page file's footer is a frame too (``page.FOOTER_MAGIC``, JSON).

Who uses it: page files (``page``) and the journal (``_log.journal``), which keeps page frames in
its units.
"""

from __future__ import annotations

import struct

import pyarrow as pa
from crc32c import crc32c

from ..errors import CorruptPageError

__all__ = ["FRAME_HEAD", "FRAME_MAGIC", "check", "decode_batch", "encode_frame", "frame_of",
           "read_frame"]

FRAME_MAGIC = b"DQFR"
FRAME_HEAD = struct.Struct("<4sQII")  # magic, payload length, rows, crc
_LENGTH_ROWS = struct.Struct("<QI")  # the fields of FRAME_HEAD that the crc covers
_CRC = struct.Struct("<I")


def encode_frame(kind: bytes, payload: bytes | pa.Buffer,
                 rows: int) -> tuple[bytes, memoryview]:
    """The head of a frame of ``kind`` around ``payload`` (``rows`` messages), and the payload
    as a view: written one after the other, they are the frame."""
    head_fields = struct.pack("<QI", len(payload), rows)
    crc = crc32c(memoryview(payload), crc32c(head_fields))
    return FRAME_HEAD.pack(kind, len(payload), rows, crc), memoryview(payload)


def frame_of(kind: bytes, payload: bytes, rows: int) -> bytearray:
    """The frame of ``kind`` around ``payload`` (``rows`` messages) in one buffer: the bytes of
    :func:`encode_frame`'s two parts, for a small payload (one send's), which is copied."""
    fields = _LENGTH_ROWS.pack(len(payload), rows)
    return bytearray(b"".join((kind, fields, _CRC.pack(crc32c(payload, crc32c(fields))),
                               payload)))


def check(cond: bool, path: str, offset: int, reason: str) -> None:
    """Raise :class:`CorruptPageError` (``path``, ``offset``, ``reason``) unless ``cond``."""
    if not cond:
        raise CorruptPageError(path, offset, reason)


def read_frame(buf: pa.Buffer, offset: int, path: str, expect: bytes,
               base: int = 0) -> tuple[pa.Buffer, int, int]:
    """Verify and return the frame at ``offset`` of ``buf`` (which starts at file offset
    ``base``): ``(payload, rows, offset after the frame)``."""
    at = base + offset
    check(offset + FRAME_HEAD.size <= buf.size, path, at, "frame header past end of file")
    magic, length, rows, crc = FRAME_HEAD.unpack_from(buf, offset)
    check(magic == expect, path, at, f"bad frame magic {magic!r}")
    start = offset + FRAME_HEAD.size
    check(start + length <= buf.size, path, at, "frame payload past end of file")
    payload = buf.slice(start, length)
    actual = crc32c(memoryview(payload), crc32c(struct.pack("<QI", length, rows)))
    check(actual == crc, path, at, f"checksum mismatch (stored {crc:#010x}, "
                                   f"computed {actual:#010x})")
    return payload, rows, start + length


def decode_batch(payload: pa.Buffer, rows: int, path: str, at: int) -> pa.RecordBatch:
    """The record batch of a message frame's payload, which must hold ``rows`` messages."""
    try:
        batch = pa.ipc.open_stream(payload).read_next_batch()
    except (pa.ArrowInvalid, StopIteration, OSError) as exc:
        raise CorruptPageError(path, at, f"undecodable Arrow frame: {exc}") from exc
    check(batch.num_rows == rows, path, at, "row count differs from the frame header")
    return batch
