"""Arrow IPC streams of a few plain rows, written without Arrow.

Who calls it: :func:`.schema.typed_stream`, for the dicts of one group commit's sends (the
single ``send([row])`` of a web service or a worker). Converting one small dict with Arrow and
serialising it is a dozen calls into Arrow's C++ (a struct conversion, a table, its batches,
``serialize``), a good share of what a durable single send costs on a local journal. This
writes the same bytes with ``struct``.

How: a record batch message's metadata (a flatbuffer) has the same layout for every batch of
one schema; only numbers differ: the row count, the body's length, each column's length and
null count, each buffer's offset and length. :class:`BatchEncoder` has Arrow serialise one
batch when it is made, keeps that as its template, and writes a batch as the template with its
own numbers in, followed by a body laid out as Arrow's writer lays it out (each buffer padded
to 8 bytes, no validity bitmap for a column without nulls, zeros under nulls). It checks its
output against Arrow's when it is made (the template's row, and that row with a row of nulls)
and stays off if they differ (another Arrow version may lay batches out otherwise);
``tests/test_ipc.py`` compares its bytes with Arrow's for random rows of every type it takes.

It takes nullable int64, double, string, binary and bool columns, and values of exactly the
column's Python type (or None): what converting with the column's type and inferring would
both give (see :func:`.schema.typed_table`). Anything else is ``None``, and the caller uses
Arrow.
"""

from __future__ import annotations

import struct
from itertools import accumulate
from typing import Any, cast

import pyarrow as pa

__all__ = ["IPC_EOS", "KINDS", "BatchEncoder"]

#: The end-of-stream marker of an Arrow IPC stream (a continuation token and a zero length).
IPC_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"

#: The column types it writes: (kind, the one Python type their values have, a value for the
#: template batch). ``_format.schema`` takes the same types for its typed conversion.
KINDS: dict[pa.DataType, tuple[str, type, Any]] = {
    pa.int64(): ("q", int, 0), pa.float64(): ("d", float, 0.0), pa.string(): ("s", str, ""),
    pa.binary(): ("b", bytes, b""), pa.bool_(): ("?", bool, False)}

#: Buffers a column of each kind has in a record batch: validity, then values (and offsets
#: first for variable-length kinds).
_BUFFERS = {"q": 2, "d": 2, "?": 2, "s": 3, "b": 3}

_ZEROS = bytes(8)
_TRUE = b"\x01" + bytes(7)  # a one-row bool column's values bitmap, padded
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_OFFSETS = struct.Struct("<ii")  # a one-row string or binary column's offsets
_PACK = {"q": _I64.pack, "d": struct.Struct("<d").pack}


def _bits(flags: list[bool], n: int) -> bytes:
    """A little-endian bitmap of ``flags``, ``ceil(n / 8)`` bytes (Arrow's bit order)."""
    value = 0
    for i, flag in enumerate(flags):
        if flag:
            value |= 1 << i
    return value.to_bytes((n + 7) >> 3, "little")


class _Layout:
    """Where the numbers of a record batch message sit in its bytes (found by reading the
    flatbuffer: root table, vtables, the ``nodes`` and ``buffers`` vectors of structs)."""

    def __init__(self, message: bytes) -> None:
        if message[:4] != b"\xff\xff\xff\xff":
            raise ValueError("not an IPC message with a continuation token")
        meta_len = _I32.unpack_from(message, 4)[0]
        base = 8  # the metadata starts after the continuation token and its length
        self.meta_end = base + meta_len

        def fields(table: int) -> list[int]:
            vtable = table - _I32.unpack_from(message, table)[0]
            vsize = struct.unpack_from("<H", message, vtable)[0]
            return [struct.unpack_from("<H", message, vtable + 4 + 2 * i)[0]
                    for i in range((vsize - 4) // 2)]

        def target(at: int) -> int:
            return at + _U32.unpack_from(message, at)[0]

        root = target(base)
        msg = fields(root)  # Message: version, header_type, header, bodyLength, ...
        if len(msg) < 4 or not all(msg[1:4]) or message[root + msg[1]] != 3:  # RecordBatch
            raise ValueError("not a record batch message")
        self.body_length = root + msg[3]
        batch = target(root + msg[2])
        rb = fields(batch)  # RecordBatch: length, nodes, buffers, compression, ...
        if len(rb) < 3 or not all(rb[:3]) or (len(rb) > 3 and any(rb[3:])):
            raise ValueError("a record batch with fields this encoder does not write")
        self.length = batch + rb[0]
        nodes, buffers = target(batch + rb[1]), target(batch + rb[2])
        self.nodes = _U32.unpack_from(message, nodes)[0]
        self.buffers = _U32.unpack_from(message, buffers)[0]
        self.nodes_at, self.buffers_at = nodes + 4, buffers + 4


class BatchEncoder:
    """Writes rows of one schema (given as its struct type) as a complete Arrow IPC stream:
    the schema message, one record batch message, the end of stream, byte for byte what
    ``new_stream`` writes for the batch that ``pa.array(rows, type=struct)`` gives.

    Concurrency guarantee: thread-safe (``encode`` writes only into bytes of its own).
    """

    __slots__ = ("_columns", "_formats", "_schema", "_template", "_width", "layout", "ok")

    def __init__(self, struct_type: pa.StructType) -> None:
        self.ok = False
        fields = [struct_type.field(i) for i in range(struct_type.num_fields)]
        columns = []
        sample = {}
        for f in fields:
            kind = KINDS.get(f.type)
            if kind is None or not f.nullable:
                return
            columns.append((f.name, kind[0], kind[1]))
            sample[f.name] = kind[2]
        if not columns or len(sample) != len(columns):  # none, or a name twice
            return
        self._columns = columns
        self._width = len(columns)
        batch = pa.Table.from_struct_array(pa.array([sample], type=struct_type)).to_batches()[0]
        self._schema = batch.schema.serialize().to_pybytes()
        message = batch.serialize().to_pybytes()
        try:
            self.layout = _Layout(message)
        except (ValueError, struct.error, IndexError):
            return
        if self.layout.nodes != self._width or \
                self.layout.buffers != sum(_BUFFERS[c] for _n, c, _t in self._columns):
            return
        self._template = bytes(message[:self.layout.meta_end])
        layout = self.layout
        self._formats = (struct.Struct(f"<{2 * layout.nodes}q"),
                         struct.Struct(f"<{2 * layout.buffers}q"))
        # the template's own row, and a row of nulls (validity bitmaps, values under nulls:
        # a row without nulls lays out neither)
        rows = [sample, dict.fromkeys(sample)]
        check = pa.Table.from_struct_array(pa.array(rows, type=struct_type)).to_batches()[0]
        self.ok = self.encode([sample]) == self._schema + message + IPC_EOS and \
            self.encode(rows) == self._schema + check.serialize().to_pybytes() + IPC_EOS
        # the one-row path lays the same row out on its own
        self.ok = self.ok and self.encode_one(sample) == self._schema + message + IPC_EOS

    def encode_one(self, row: dict[str, Any]) -> bytes | None:
        """``[row]`` as an IPC stream: what :meth:`encode` gives, for one row (a single send).

        A row without nulls has a fixed layout (one node ``(1, 0)`` a column, which the
        template has already: it is a row without nulls; no validity bitmaps), so only the
        buffers' offsets and lengths and the body are written; a row with a null goes to
        :meth:`encode`."""
        if type(row) is not dict or len(row) != self._width:
            return None
        buffers: list[int] = []
        body: list[bytes] = []
        offset = 0
        try:
            for name, code, kind in self._columns:
                v = row[name]
                if type(v) is not kind:
                    return None if v is not None else self.encode([row])
                if code == "s" or code == "b":
                    data = cast(str, v).encode() if code == "s" else cast(bytes, v)
                    size = len(data)
                    # validity (none), offsets (0, size), the value's bytes padded to 8
                    buffers += (offset, 0, offset, 8, offset + 8, size)
                    body.append(_OFFSETS.pack(0, size))
                    offset += 8
                    if size:
                        pad = -size & 7
                        body.append(data)
                        if pad:
                            body.append(_ZEROS[:pad])
                        offset += size + pad
                else:
                    # validity (none), the value: 8 bytes, or a bool's 1 padded to 8
                    buffers += (offset, 0, offset, 1 if code == "?" else 8)
                    body.append((_TRUE if v else _ZEROS) if code == "?" else _PACK[code](v))
                    offset += 8
        except (KeyError, struct.error, UnicodeEncodeError):
            return None
        layout = self.layout
        meta = bytearray(self._template)
        _I64.pack_into(meta, layout.body_length, offset)
        self._formats[1].pack_into(meta, layout.buffers_at, *buffers)
        return b"".join((self._schema, meta, *body, IPC_EOS))

    def encode(self, rows: list[dict[str, Any]]) -> bytes | None:
        """``rows`` as an IPC stream, or ``None`` when one is not a plain dict with exactly the
        schema's columns, a value is not exactly its column's Python type (nor None), or does
        not fit it (an int beyond int64, a str that is not valid Unicode)."""
        n = len(rows)
        width = self._width
        for row in rows:
            if type(row) is not dict or len(row) != width:
                return None
        nodes: list[int] = []
        buffers: list[int] = []
        body: list[bytes] = []
        offset = 0
        try:
            for name, code, kind in self._columns:
                values = [row[name] for row in rows]
                nulls = 0
                for v in values:
                    if type(v) is not kind:
                        if v is not None:
                            return None
                        nulls += 1
                nodes += (n, nulls)
                parts: list[bytes]
                if nulls:
                    parts = [_bits([v is not None for v in values], n)]
                else:
                    parts = [b""]
                if code == "q" or code == "d":
                    parts.append(struct.pack(f"<{n}{code}", *(
                        [0 if v is None else v for v in values] if nulls else values)))
                elif code == "?":
                    parts.append(_bits([bool(v) for v in values], n))
                else:
                    data = [b"" if v is None else v.encode() for v in values] if code == "s" \
                        else [b"" if v is None else v for v in values]
                    parts.append(struct.pack(f"<{n + 1}i", 0, *accumulate(map(len, data))))
                    parts.append(b"".join(data))
                for part in parts:
                    size = len(part)
                    buffers += (offset, size)
                    if size:
                        body.append(part)
                        pad = -size & 7
                        if pad:
                            body.append(_ZEROS[:pad])
                        offset += size + pad
        except (KeyError, struct.error, UnicodeEncodeError):
            return None
        layout = self.layout
        meta = bytearray(self._template)
        struct.pack_into("<q", meta, layout.length, n)
        struct.pack_into("<q", meta, layout.body_length, offset)
        self._formats[0].pack_into(meta, layout.nodes_at, *nodes)
        self._formats[1].pack_into(meta, layout.buffers_at, *buffers)
        return b"".join((self._schema, meta, *body, IPC_EOS))
