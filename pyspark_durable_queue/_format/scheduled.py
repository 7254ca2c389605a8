"""Scheduled messages on disk: one file per scheduled send, outside the address's sequence.

Under ``<address>/scheduled/``, one file per ``send(rows, deliver_at=...)`` or
``send(rows, delay_ms=...)``::

    <due>-<stamp>-<rows>.arrow

    due    the time it is due, epoch milliseconds, 20 digits (``layout.numbered``: names
           sort by due time)
    stamp  the send's order: 16 hex digits of epoch microseconds, kept rising within a process,
           and 8 random hex digits (two processes never pick one name)
    rows   the number of messages it holds (``stats()`` counts them from names alone)

The name without ``.arrow`` is the schedule's id (``durablequeue ROOT scheduled ADDR``,
``--cancel ID``). The file is one frame (see :mod:`.frame`) of kind ``DQSC``: magic, payload
length, rows, CRC32C, then an Arrow IPC stream (schema + one record batch) of the rows as they
will be appended. It is written once, atomically and exclusively (``Storage.create``), and
deleted once its rows are in the log (see ``_ops/scheduled.py``). Never pickled.

Imported by ``_ops/scheduled.py``; needs only pyarrow.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import pyarrow as pa

from .frame import decode_batch, encode_frame, read_frame
from .layout import is_numbered, numbered

__all__ = ["SCHEDULED_MAGIC", "ScheduledName", "decode", "encode", "new_name"]

SCHEDULED_MAGIC = b"DQSC"
SUFFIX = ".arrow"

_stamp_lock = threading.Lock()
_last_stamp = 0


def _stamp() -> int:
    """Epoch microseconds, rising within the process (two sends of one microsecond keep their
    order)."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(_last_stamp + 1, time.time_ns() // 1000)
        return _last_stamp


@dataclass(frozen=True, order=True)
class ScheduledName:
    """A scheduled file's name, parsed; orders as the names sort (due time, then send order)."""

    due_ms: int
    stamp: str
    rows: int

    @property
    def id(self) -> str:
        """The schedule's id: the file name without its suffix."""
        return f"{numbered(self.due_ms)}-{self.stamp}-{self.rows}"

    @property
    def file(self) -> str:
        return self.id + SUFFIX

    @classmethod
    def parse(cls, name: str) -> ScheduledName | None:
        """The parts of a file name or id, ``None`` when it is not one (a temp file, a typo)."""
        stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else name
        parts = stem.split("-")
        if len(parts) != 3:
            return None
        due, stamp, rows = parts
        if not is_numbered(due) or not rows.isdigit() \
                or len(stamp) != 24 or any(c not in "0123456789abcdef" for c in stamp):
            return None
        return cls(int(due), stamp, int(rows))


def new_name(due_ms: int, rows: int) -> ScheduledName:
    """A fresh name for ``rows`` messages due at ``due_ms``."""
    return ScheduledName(due_ms, f"{_stamp():016x}{os.urandom(4).hex()}", rows)


def encode(table: pa.Table) -> bytes:
    """The bytes of a scheduled file holding ``table`` (one frame around an IPC stream)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_batch(table.combine_chunks().to_batches()[0] if table.num_rows
                           else pa.RecordBatch.from_pylist([], schema=table.schema))
    payload = sink.getvalue()
    head, body = encode_frame(SCHEDULED_MAGIC, payload, table.num_rows)
    return head + bytes(body)


def decode(data: bytes, path: str) -> pa.Table:
    """The rows of a scheduled file; :class:`CorruptPageError` naming ``path`` when its
    checksum or its Arrow stream is wrong."""
    payload, rows, _ = read_frame(pa.py_buffer(data), 0, path, SCHEDULED_MAGIC)
    return pa.Table.from_batches([decode_batch(payload, rows, path, 0)])
