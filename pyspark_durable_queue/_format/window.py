"""A consumer's window file, ``consumers/<name>.window``: its bytes (the window itself, what it
means and when it is written, is ``_ops/window.py``).

The file is binary, checksummed, little-endian, and replaced whole (``storage.replace``)::

    offset 0   header, 56 bytes: magic "DQWN", u16 version (1), u16 flags (0),
               u32 pending rows n, u32 tail bytes t,
               i64 ack_point, floor, moves, dead_lettered, dropped
    offset 56  i64[n] _seq of each pending row, strictly increasing
               i64[n] its delivery count
               i64[n] when it is due (epoch ms)
    then       t bytes of JSON, only once the consumer dead-lettered a row or settled
               one above its ack point (t > 0):
               {"moving": null or {"number", "target", "reason", "rows": [[_seq, count]...]},
                "settled": [_seq, ...]}
    last       u32 CRC32C of every byte before it

A reader checks the length the header announces and the checksum before it trusts anything
else, so a flipped byte anywhere is found; then what cannot be right (a floor above the ack
point, rows out of order or below the floor, negative numbers) is refused too. The pending rows
are read as numpy arrays over the file's bytes (:class:`PendingRows`), with no Python object per
row: opening a consumer whose window holds 10,000 rows costs a read, a checksum and a few array
checks; the rows become a dict only when the consumer first changes them
(``DeliveryWindow.pending``).

Windows written before this layout (the first releases of format 5) are checked JSON
(``_format/checked.py``)::

    {"ack_point": 1200, "floor": 1187, "pending": [[1187, 1, 1732240060400], ...],
     "moves": 3, "dead_lettered": 5, "dropped": 0, "settled": [1201], "moving": {...}}

:func:`decode` reads both (a JSON window starts with ``{``, a binary one with the magic);
:func:`encode` writes the binary one, so such a window is rewritten in this layout the first
time the consumer changes it. A release that knows only the JSON window reports a binary one as
damaged; deleting it, as that error says, redelivers from the watermark (at-least-once holds).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from crc32c import crc32c

from . import checked

__all__ = ["MAGIC", "PendingRows", "decode", "encode"]

MAGIC = b"DQWN"
_VERSION = 1
_HEAD = struct.Struct("<4sHHIIqqqqq")  # magic, version, flags, n, tail, five counters
_CRC = struct.Struct("<I")
_I64 = np.dtype("<i8")
_ROW = 3 * _I64.itemsize


class PendingRows(Mapping[int, tuple[int, int]]):
    """Rows waiting for redelivery, ``{_seq: (delivery count, due epoch ms)}``, kept as three
    int64 arrays sorted by ``_seq`` (read-only; a view of a window file's bytes when decoded).

    A ``Mapping`` equal to the dict of the same rows; the questions a consumer asks of a window
    it did not change (the lowest row, how many, which are due, when the next is due) are
    answered on the arrays without building that dict.
    """

    __slots__ = ("count", "due", "seq")

    def __init__(self, seq: np.ndarray, count: np.ndarray, due: np.ndarray) -> None:
        self.seq = seq
        self.count = count
        self.due = due

    @classmethod
    def from_dict(cls, pending: Mapping[int, tuple[int, int]]) -> PendingRows:
        """The rows of a ``{_seq: (count, due)}`` mapping (any order)."""
        if isinstance(pending, PendingRows):
            return pending
        seqs = sorted(pending)
        values = [pending[s] for s in seqs]
        return cls(np.array(seqs, _I64), np.array([c for c, _ in values], _I64),
                   np.array([d for _, d in values], _I64))

    def to_dict(self) -> dict[int, tuple[int, int]]:
        return dict(zip(self.seq.tolist(), zip(self.count.tolist(), self.due.tolist(),
                                                strict=True), strict=True))

    def __len__(self) -> int:
        return len(self.seq)

    def __iter__(self) -> Iterator[int]:
        return iter(self.seq.tolist())

    def _index(self, seq: object) -> int:
        if not isinstance(seq, (int, np.integer)) or isinstance(seq, bool):
            return -1
        i = int(np.searchsorted(self.seq, seq))
        return i if i < len(self.seq) and int(self.seq[i]) == seq else -1

    def __contains__(self, seq: object) -> bool:
        return self._index(seq) >= 0

    def __getitem__(self, seq: int) -> tuple[int, int]:
        i = self._index(seq)
        if i < 0:
            raise KeyError(seq)
        return int(self.count[i]), int(self.due[i])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PendingRows):
            return (np.array_equal(self.seq, other.seq) and np.array_equal(self.count, other.count)
                    and np.array_equal(self.due, other.due))
        if isinstance(other, Mapping):
            return len(self) == len(other) and self.to_dict() == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PendingRows({len(self)} rows)"

    def since(self, seq: int) -> PendingRows:
        """The rows at or above ``seq`` (views, no copy)."""
        i = int(np.searchsorted(self.seq, seq))
        return self if i == 0 else PendingRows(self.seq[i:], self.count[i:], self.due[i:])

    def first(self) -> int | None:
        """The lowest ``_seq``, ``None`` without rows."""
        return int(self.seq[0]) if len(self.seq) else None

    def due_by(self, now_ms: int, limit: int) -> list[int]:
        """Up to ``limit`` rows due at ``now_ms``, lowest first."""
        return self.seq[self.due <= now_ms][:limit].tolist()

    def next_due_ms(self) -> int | None:
        """When the first row is due, ``None`` without rows."""
        return int(self.due.min()) if len(self.due) else None

    def delayed(self, now_ms: int) -> int:
        """How many rows are not due at ``now_ms``."""
        return int(np.count_nonzero(self.due > now_ms))

    def max_count(self) -> int:
        return int(self.count.max()) if len(self.count) else 0

    def count_from(self, seq: int) -> int:
        """How many rows are at or above ``seq``."""
        return len(self.seq) - int(np.searchsorted(self.seq, seq))


def encode(record: dict[str, Any]) -> bytes:
    """The window file's bytes for ``record`` (keys as :func:`decode` returns them; ``pending``
    any ``{_seq: (count, due)}`` mapping, ``moving`` a JSON object or ``None``)."""
    pending = record["pending"]
    if isinstance(pending, PendingRows):
        n = len(pending)
        arrays = b"".join(a.astype(_I64, copy=False).tobytes()
                          for a in (pending.seq, pending.count, pending.due))
    else:  # a consumer's dict, often of a few rows: no arrays to build
        seqs = sorted(pending)
        values = [pending[s] for s in seqs]
        n = len(seqs)
        arrays = struct.pack(f"<{3 * n}q", *seqs, *[c for c, _ in values],
                             *[d for _, d in values])
    tail = b""
    if record.get("moves") or record.get("settled"):
        tail = json.dumps({"moving": record["moving"], "settled": list(record["settled"])},
                          separators=(",", ":")).encode()
    body = b"".join((_HEAD.pack(MAGIC, _VERSION, 0, n, len(tail), record["ack_point"],
                                record["floor"], record.get("moves", 0),
                                record.get("dead_lettered", 0), record.get("dropped", 0)),
                     arrays, tail))
    return body + _CRC.pack(crc32c(body))


def decode(data: bytes) -> dict[str, Any]:
    """A window file's record: ``ack_point``, ``floor``, ``pending`` (:class:`PendingRows`)
    and, once the consumer dead-lettered a row or settled one above its ack point, ``moves``,
    ``dead_lettered``, ``dropped``, ``moving`` (a JSON object or ``None``) and ``settled`` (a
    list). ``ValueError`` (or ``KeyError``/``TypeError`` for a JSON window) when the bytes are
    damaged or not a window."""
    if data[:1] == b"{":
        return _decode_json(data)
    if len(data) < _HEAD.size + _CRC.size:
        raise ValueError(f"{len(data)} bytes: shorter than a window's header")
    magic, version, flags, n, tail_len, *numbers = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"starts with {magic!r}, neither {MAGIC!r} nor a JSON window")
    expected = _HEAD.size + n * _ROW + tail_len + _CRC.size
    checked.check_binary(data, expected, f"{n} pending rows, a {tail_len}-byte tail",
                         version, flags, _VERSION)
    ack_point, floor, moves, dead_lettered, dropped = numbers
    for what, value in zip(("ack_point", "floor", "moves", "dead_lettered", "dropped"),
                           numbers, strict=True):
        if value < 0:
            raise ValueError(f"{what} is {value}, not an integer >= 0")
    arrays = np.frombuffer(data, _I64, 3 * n, _HEAD.size).reshape(3, n)
    rows = PendingRows(arrays[0], arrays[1], arrays[2])
    _check(ack_point, floor, rows)
    record: dict[str, Any] = {"ack_point": ack_point, "floor": floor, "pending": rows}
    if tail_len:
        start = _HEAD.size + n * _ROW
        tail = json.loads(data[start:start + tail_len])
        if not isinstance(tail, dict):
            raise ValueError(f"the tail is {tail!r}, not an object")
        record.update(moves=moves, dead_lettered=dead_lettered, dropped=dropped,
                      moving=tail["moving"],
                      settled=[_int(s, "a settled _seq") for s in tail["settled"]])
    elif moves or dead_lettered or dropped:
        raise ValueError(f"counters (moves {moves}) without their tail")
    return record


def _check(ack_point: int, floor: int, rows: PendingRows) -> None:
    if floor > ack_point:
        raise ValueError(f"floor {floor} is above ack_point {ack_point}")
    if not len(rows):
        return
    if int(rows.seq[0]) < floor:
        raise ValueError(f"pending _seq {int(rows.seq[0])} is below floor {floor}")
    steps = np.diff(rows.seq)
    if len(steps) and int(steps.min()) <= 0:
        at = int(np.argmax(steps <= 0))
        raise ValueError(f"pending _seq {int(rows.seq[at + 1])} follows {int(rows.seq[at])}: "
                         "the rows are not in increasing order")
    for what, values in (("a delivery count", rows.count), ("a due time", rows.due)):
        low = int(values.min())
        if low < 0:
            raise ValueError(f"{what} is {low}, not an integer >= 0")


def _decode_json(data: bytes) -> dict[str, Any]:
    """A window written as checked JSON (before the binary layout)."""
    obj = checked.loads(data, required=True)
    ack_point = _int(obj["ack_point"], "ack_point")
    floor = _int(obj["floor"], "floor")
    pending: dict[int, tuple[int, int]] = {}
    for item in obj["pending"]:
        seq, count, due = item
        pending[_int(seq, "a pending _seq")] = (_int(count, "a delivery count"),
                                               _int(due, "a due time"))
    rows = PendingRows.from_dict(pending)
    _check(ack_point, floor, rows)
    record: dict[str, Any] = {"ack_point": ack_point, "floor": floor, "pending": rows}
    if "moves" in obj:
        record.update(moves=_int(obj["moves"], "moves"),
                      dead_lettered=_int(obj["dead_lettered"], "dead_lettered"),
                      dropped=_int(obj["dropped"], "dropped"), moving=obj["moving"],
                      settled=[_int(s, "a settled _seq") for s in obj["settled"]])
    return record


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is {value!r}, not an integer >= 0")
    return value
