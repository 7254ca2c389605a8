"""A shared consumer's state file, ``consumers/_shared/<name>/<epoch>``: its bytes (what the
state means and how the chain of epochs is written is ``_ops/shared.py``).

Each epoch is one write-once file, binary, checksummed, little-endian::

    offset 0   header, 32 bytes: magic "DQSH", u16 version (1), u16 flags (0),
               u32 leased rows n, u32 pending rows m, u32 tail bytes t, i64 cursor
    offset 32  i64[n] _seq of each leased row, strictly increasing
               i64[n] its holder (an index into the tail's holders)
               i64[n] its delivery count
               i64[n] when its lease expires (epoch ms)
               i64[m] _seq of each pending row, strictly increasing
               i64[m] its delivery count (0: returned by a handle before it was delivered)
               i64[m] when it is due (epoch ms)
    then       t bytes of JSON: {"holders": [[id, host, pid, pid start, seen ms,
                                              boot id, pid namespace], ...],
                                 (records of older releases lack the last two)
                                 "moving": null or {...}, "counters": {...}}
    last       u32 CRC32C of every byte before it

A reader checks the length the header announces and the checksum before it trusts anything
else; then what cannot be right (rows out of order, a holder index out of range, negative
numbers) is refused too.

On a local disk the states are appended to a log (``_ops/shared.py``, ``SharedLog``): a log
file starts with a whole state as above, and the states after it are written as the change
from the one before (a few rows), each framed as::

    magic "DQSD", u32 JSON bytes j, j bytes of JSON (the change: ``_ops/shared.py``, ``diff``),
    u32 CRC32C of every byte before it in the record

:func:`records` reads the whole, checksummed records of a log in order; a torn record at the
end (its writer was killed) and whatever follows it are not records.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
from crc32c import crc32c

from . import checked

__all__ = ["CHANGE_MAGIC", "MAGIC", "decode", "encode", "encode_change", "records",
           "state_length"]

MAGIC = b"DQSH"
CHANGE_MAGIC = b"DQSD"
_CHANGE_HEAD = struct.Struct("<4sI")
_VERSION = 1
_HEAD = struct.Struct("<4sHHIIIq")  # magic, version, flags, n, m, tail, cursor
_CRC = struct.Struct("<I")
_I64 = np.dtype("<i8")


def encode(cursor: int, leases: dict[int, tuple[str, int, int]],
           pending: dict[int, tuple[int, int]], holders: list[list[Any]],
           tail: dict[str, Any]) -> bytes:
    """The file's bytes: ``leases`` ``{_seq: (holder id, count, expires ms)}``, ``pending``
    ``{_seq: (count, due ms)}``, ``holders`` ``[[id, host, pid, start, seen], ...]`` (every
    holder a lease names among them) and the rest of the ``tail`` (``moving``, ``counters``)."""
    index = {h[0]: i for i, h in enumerate(holders)}
    lseqs = sorted(leases)
    lvals = [leases[s] for s in lseqs]
    pseqs = sorted(pending)
    pvals = [pending[s] for s in pseqs]
    n, m = len(lseqs), len(pseqs)
    arrays = struct.pack(f"<{4 * n + 3 * m}q", *lseqs, *[index[h] for h, _, _ in lvals],
                         *[c for _, c, _ in lvals], *[e for _, _, e in lvals],
                         *pseqs, *[c for c, _ in pvals], *[d for _, d in pvals])
    text = json.dumps(dict(tail, holders=holders), separators=(",", ":")).encode()
    body = b"".join((_HEAD.pack(MAGIC, _VERSION, 0, n, m, len(text), cursor), arrays, text))
    return body + _CRC.pack(crc32c(body))


def decode(data: bytes) -> dict[str, Any]:
    """The state in a file's bytes: ``cursor``, ``leases``, ``pending``, ``holders`` (as
    :func:`encode` takes them), ``moving`` and ``counters``. ``ValueError`` when the bytes are
    damaged or not a shared consumer's state."""
    if len(data) < _HEAD.size + _CRC.size:
        raise ValueError(f"{len(data)} bytes: shorter than a shared consumer state's header")
    magic, version, flags, n, m, tail_len, cursor = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"starts with {magic!r}, not {MAGIC!r}")
    expected = _HEAD.size + (4 * n + 3 * m) * 8 + tail_len + _CRC.size
    checked.check_binary(data, expected,
                         f"{n} leased rows, {m} pending rows, a {tail_len}-byte tail",
                         version, flags, _VERSION)
    if cursor < 0:
        raise ValueError(f"cursor is {cursor}, not an integer >= 0")
    numbers = np.frombuffer(data, _I64, 4 * n + 3 * m, _HEAD.size)
    lease_rows = numbers[:4 * n].reshape(4, n)
    pending_rows = numbers[4 * n:].reshape(3, m)
    start = _HEAD.size + (4 * n + 3 * m) * 8
    tail = json.loads(data[start:start + tail_len])
    if not isinstance(tail, dict) or not isinstance(tail.get("holders"), list):
        raise ValueError(f"the tail is {tail!r}, not an object with holders")
    holders = tail.pop("holders")
    for what, rows in (("leased", lease_rows), ("pending", pending_rows)):
        _check_rows(what, rows)
    ids = [str(h[0]) for h in holders]
    if n and (int(lease_rows[1].min()) < 0 or int(lease_rows[1].max()) >= len(ids)):
        raise ValueError(f"a lease names holder {int(lease_rows[1].max())} of {len(ids)}")
    seq, who, count, expires = (a.tolist() for a in lease_rows)
    leases = {s: (ids[h], c, e) for s, h, c, e in zip(seq, who, count, expires, strict=True)}
    pseq, pcount, pdue = (a.tolist() for a in pending_rows)
    pending = {s: (c, d) for s, c, d in zip(pseq, pcount, pdue, strict=True)}
    return {"cursor": cursor, "leases": leases, "pending": pending, "holders": holders,
            "moving": tail.get("moving"), "counters": dict(tail.get("counters") or {})}


def state_length(data: bytes) -> int:
    """How many bytes the whole state at the start of ``data`` takes, as its header says.
    ``ValueError`` when ``data`` is shorter than a header or does not start with ``MAGIC``."""
    if len(data) < _HEAD.size + _CRC.size:
        raise ValueError(f"{len(data)} bytes: shorter than a shared consumer state's header")
    magic, _, _, n, m, tail_len, _ = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"starts with {magic!r}, not {MAGIC!r}")
    return _HEAD.size + (4 * n + 3 * m) * 8 + tail_len + _CRC.size


def encode_change(change: dict[str, Any]) -> bytes:
    """A change record's bytes (see the module docstring)."""
    text = json.dumps(change, separators=(",", ":")).encode()
    body = _CHANGE_HEAD.pack(CHANGE_MAGIC, len(text)) + text
    return body + _CRC.pack(crc32c(body))


def records(data: bytes) -> tuple[list[tuple[bool, bytes]], int]:
    """The whole, checksummed records at the start of ``data``, in order, each ``(is a whole
    state, its bytes)`` (a change's bytes are its JSON), and the offset after the last one."""
    at = 0
    out: list[tuple[bool, bytes]] = []
    view = memoryview(data)
    while len(data) - at >= _CHANGE_HEAD.size + _CRC.size:
        magic = bytes(view[at:at + 4])
        if magic == MAGIC and len(data) - at >= _HEAD.size + _CRC.size:
            _, _, _, n, m, tail_len, _ = _HEAD.unpack_from(data, at)
            end = at + _HEAD.size + (4 * n + 3 * m) * 8 + tail_len + _CRC.size
        elif magic == CHANGE_MAGIC:
            end = at + _CHANGE_HEAD.size + _CHANGE_HEAD.unpack_from(data, at)[1] + _CRC.size
        else:
            break
        if end > len(data):
            break
        (stated,) = _CRC.unpack_from(data, end - _CRC.size)
        if crc32c(view[at:end - _CRC.size]) != stated:
            break
        if magic == MAGIC:
            out.append((True, bytes(view[at:end])))
        else:
            out.append((False, bytes(view[at + _CHANGE_HEAD.size:end - _CRC.size])))
        at = end
    return out, at


def _check_rows(what: str, rows: np.ndarray) -> None:
    if not rows.shape[1]:
        return
    if int(rows.min()) < 0:
        raise ValueError(f"a {what} row has a negative number")
    steps = np.diff(rows[0])
    if len(steps) and int(steps.min()) <= 0:
        raise ValueError(f"{what} rows are not in increasing _seq order")
