"""Page files: immutable runs of messages as checksummed Arrow IPC frames.

Layout of one page file::

    b"DQPAGE01"                                       8-byte magic
    frame*                                             the messages, in order
    footer frame                                       JSON: frame index and statistics
    u64 footer offset, b"DQPGEND1"                     16-byte trailer

    frame (see ``frame``): b"DQFR" | u64 payload length | u32 rows | u32 crc32c | payload

A message frame's payload is an Arrow IPC stream (schema + one record batch, optionally with
lz4/zstd body compression), so every frame decodes on its own and old frames keep their own
schema after the address's schema grew. The footer repeats what a reader needs to jump to a
frame without scanning: offsets, lengths, row counts and per-frame statistics.

A page file is written once by one writer and never modified. It is invisible until a commit-log
entry names it; a writer that dies before that leaves an orphan that cleanup removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import pyarrow as pa

from .._storage import Storage
from ..errors import CorruptPageError
from .frame import (
    FRAME_HEAD,
    FRAME_MAGIC,
    check,
    decode_batch,
    encode_frame,
    frame_of,
    read_frame,
)
from .ipc import IPC_EOS

__all__ = ["DecodedPage", "PageInfo", "PageWriter", "encode_frames", "frame_batches", "read_footer",
           "read_frames", "read_page", "stream_frame"]

MAGIC = b"DQPAGE01"
TRAILER_MAGIC = b"DQPGEND1"
FOOTER_MAGIC = b"DQFT"
_TRAILER = struct.Struct("<Q8s")
FRAME_TARGET_BYTES = 1 << 20
FRAME_MAX_ROWS = 16384


@dataclass
class PageInfo:
    """What a commit needs to know about a written page (small, JSON-safe, picklable)."""

    name: str
    rows: int
    bytes: int
    stats: dict[str, Any] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "bytes": self.bytes, "stats": self.stats}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PageInfo:
        return cls(name=str(d["name"]), rows=int(d["rows"]), bytes=int(d["bytes"]),
                   stats=d.get("stats") or {"rows": int(d["rows"]), "columns": {}})


def _stats() -> Any:
    # imported on first write: statistics need pyarrow.compute (a large import), which readers that
    # use no selector never load
    from . import stats as module

    return module


def new_page_name() -> str:
    return f"{uuid.uuid4().hex}.page"


def frame_batches(data: pa.RecordBatch | pa.Table, target: int) -> list[pa.RecordBatch]:
    """``data`` cut into the record batches of frames of about ``target`` bytes (at most
    ``FRAME_MAX_ROWS`` rows), zero-copy slices."""
    out = []
    for batch in data.to_batches() if isinstance(data, pa.Table) else [data]:
        n = batch.num_rows
        if n <= 1:  # a single send's message: nothing to cut (nor to measure)
            if n:
                out.append(batch)
            continue
        # Equal frames of roughly the target size: a 1.2 MiB batch is one frame, not a full
        # frame and a sliver (each frame costs a header, statistics and a decode).
        parts = max(1, round(batch.nbytes / max(1, target)), -(-n // FRAME_MAX_ROWS))
        step = -(-n // parts)
        out.extend(batch.slice(start, step) for start in range(0, n, step))
    return out


class _SchemaMessage:
    """The IPC schema message of the last schema framed, kept: sends repeat one schema, and
    writing it with ``new_stream`` for every frame is most of a small frame's cost."""

    __slots__ = ("data", "schema")

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.data = schema.serialize().to_pybytes()


_LAST_SCHEMA: _SchemaMessage | None = None


def _plain(schema: pa.Schema | pa.DataType) -> bool:
    """No dictionary type anywhere in it, extension types' storage included (a stream would
    carry dictionary batches)."""
    if isinstance(schema, pa.Schema):
        return all(_plain(f.type) for f in schema)
    if isinstance(schema, pa.BaseExtensionType):
        return _plain(schema.storage_type)
    if pa.types.is_dictionary(schema):
        return False
    return all(_plain(schema.field(i).type) for i in range(schema.num_fields))


def _ipc_stream(batch: pa.RecordBatch, options: pa.ipc.IpcWriteOptions) -> pa.Buffer | bytes:
    """``batch`` as a complete Arrow IPC stream (schema, batch, end of stream)."""
    global _LAST_SCHEMA
    if options.compression is None:
        # Byte for byte what new_stream writes (tests/test_page_writer.py checks it), in a third of
        # the time: the schema message is serialised once per schema.
        message = _LAST_SCHEMA
        if message is None or not message.schema.equals(batch.schema, check_metadata=True):
            if not _plain(batch.schema):
                message = None
            else:
                message = _LAST_SCHEMA = _SchemaMessage(batch.schema)
        if message is not None:
            return b"".join((message.data, batch.serialize(), IPC_EOS))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=options) as w:
        w.write_batch(batch)
    return sink.getvalue()


_OPTIONS: dict[str, pa.ipc.IpcWriteOptions] = {}


def encode_frames(data: pa.RecordBatch | pa.Table, *, target: int,
                  compression: str = "none",
                  index: list[dict[str, Any]] | None = None) -> bytearray:
    """Messages as consecutive frames (the bytes a page file holds between its magic and its
    footer), for a journal unit (``_log.journal``); frames of about ``target`` bytes.

    ``index``: a list that gets each frame's ``{"rows", "length", "stats"}`` appended (its
    statistics, as a page footer lists them), for a unit that carries statistics."""
    options = _OPTIONS.get(compression)
    if options is None:
        options = _OPTIONS[compression] = pa.ipc.IpcWriteOptions(
            compression=None if compression == "none" else compression)
    out = bytearray()
    for batch in frame_batches(data, target):
        head, body = encode_frame(FRAME_MAGIC, _ipc_stream(batch, options), batch.num_rows)
        out += head
        out += body
        if index is not None:
            index.append({"rows": batch.num_rows, "length": len(head) + len(body),
                          "stats": _stats().batch_stats(batch)})
    return out


def stream_frame(stream: bytes, rows: int) -> bytearray:
    """An Arrow IPC stream of ``rows`` messages as one frame, for a journal unit (what
    :func:`encode_frames` gives for a batch that is one frame)."""
    return frame_of(FRAME_MAGIC, stream, rows)


class PageWriter:
    """Writes messages into new page files under ``folder``, rolling at ``page_size_bytes``.

    Used by the Python client's ``send`` and by Spark write tasks (one writer per task). A
    message larger than a page gets a page of its own.

    Concurrency: each writer creates only files with fresh random names; nothing is shared.
    """

    def __init__(self, storage: Storage, folder: str, *, page_size_bytes: int,
                 compression: str = "none", make_folder: bool = True,
                 spare: bool = False) -> None:
        self.storage = storage
        #: pages may be files made ahead (the group commit of sends: see ``Storage.begin_write``)
        self.spare = spare
        self.folder = folder
        self.page_size_bytes = page_size_bytes
        self._options = pa.ipc.IpcWriteOptions(
            compression=None if compression == "none" else compression)
        self.pages: list[PageInfo] = []
        self._file: BinaryIO | None = None
        self._pending: list[Future[None]] = []
        self._name = ""
        self._offset = 0
        self._frames: list[dict[str, Any]] = []
        self._frame_stats: list[dict[str, Any]] = []
        self._rows = 0
        if make_folder:  # a send's folder exists: made with its address
            storage.makedirs(folder)

    # -- public ---------------------------------------------------------------------------------
    @property
    def frame_bytes(self) -> int:
        """The size a frame aims at: about 1 MiB, at most half a page. A caller with many small
        batches (a Spark task) gathers them to this size before :meth:`write`: fewer, larger
        frames cost less per row to write and to read."""
        return min(FRAME_TARGET_BYTES, self.page_size_bytes // 2)

    def write(self, data: pa.RecordBatch | pa.Table) -> None:
        """Append messages; frames of about :attr:`frame_bytes`, pages rolled at
        ``page_size_bytes``."""
        for batch in frame_batches(data, self.frame_bytes):
            self._write_frame(batch)

    def close(self) -> list[PageInfo]:
        """Finish the open page and wait until every page is durable; returns every page this
        writer wrote, in order."""
        self._finish_page(background=False)
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            try:
                future.result()
            except BaseException as exc:  # the first failure is reported, all are awaited
                error = error or exc
        if error is not None:
            raise error
        return self.pages

    def abort(self) -> None:
        """Delete everything this writer wrote (pages are not visible anyway)."""
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(Exception):
                file.close()
            self.pages.append(PageInfo(self._name, 0, 0, {}))
        pending, self._pending = self._pending, []
        for future in pending:
            with contextlib.suppress(BaseException):
                future.result()
        for page in self.pages:
            self.storage.delete(f"{self.folder}/{page.name}")
        self.pages = []

    # -- internals ------------------------------------------------------------------------------
    def _write_frame(self, batch: pa.RecordBatch) -> None:
        payload = _ipc_stream(batch, self._options)
        size = FRAME_HEAD.size + len(payload)
        if self._file is not None and self._offset + size > self.page_size_bytes \
                and self._frames:
            self._finish_page(background=True)
        if self._file is None:
            self._start_page()
        head, body = encode_frame(FRAME_MAGIC, payload, batch.num_rows)
        assert self._file is not None
        self._file.write(head)
        self._file.write(body)
        self._frames.append({"offset": self._offset, "length": size, "rows": batch.num_rows})
        self._frame_stats.append(_stats().batch_stats(batch))
        self._offset += size
        self._rows += batch.num_rows

    def _start_page(self) -> None:
        self._name = new_page_name()
        self._file = self.storage.begin_write(f"{self.folder}/{self._name}", spare=self.spare)
        self._file.write(MAGIC)
        self._offset = len(MAGIC)
        self._frames = []
        self._frame_stats = []
        self._rows = 0

    def _finish_page(self, *, background: bool) -> None:
        if self._file is None:
            return
        if background:
            # At most _IN_FLIGHT pages waiting for their fsync or upload (each holds a file
            # descriptor, and on object stores its buffered bytes); an error surfaces here.
            in_flight = [f for f in self._pending if not f.done()]
            if len(in_flight) >= _IN_FLIGHT:
                in_flight[0].result()
        stats = _stats().merge_stats(self._frame_stats)
        frames = [dict(f, stats=s) for f, s in zip(self._frames, self._frame_stats, strict=True)]
        footer = json.dumps({"version": 1, "rows": self._rows, "frames": frames,
                             "stats": stats}, separators=(",", ":")).encode()
        head, body = encode_frame(FOOTER_MAGIC, footer, 0)
        footer_offset = self._offset
        file, self._file = self._file, None
        path = f"{self.folder}/{self._name}"
        # The page is listed before it is durable: close() waits for it, and abort() deletes it.
        self.pages.append(PageInfo(self._name, self._rows,
                                   footer_offset + len(head) + len(footer) + _TRAILER.size, stats))
        try:
            file.write(head)
            file.write(body)
            file.write(_TRAILER.pack(footer_offset, TRAILER_MAGIC))
        except BaseException:
            with contextlib.suppress(Exception):
                file.close()
            raise
        if background:
            # A rolled page's fsync (or upload) overlaps with writing the next one.
            self._pending.append(_sync_pool().submit(self.storage.end_write, file, path))
        else:
            self.storage.end_write(file, path)


_IN_FLIGHT = 2
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _sync_pool() -> ThreadPoolExecutor:
    """Threads that finish rolled pages (fsync or upload) while the writer goes on."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dq-page-sync")
        return _POOL


def _forget_pool() -> None:
    # A forked child (Spark forks its Python workers) inherits the pool without its threads.
    global _POOL, _POOL_LOCK
    _POOL = None
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


@dataclass
class DecodedPage:
    """A page read into memory: its record batches (views into one buffer) and footer."""

    name: str
    batches: list[pa.RecordBatch]
    frames: list[dict[str, Any]]
    nbytes: int
    #: gives the process's resident copy of a memory-mapped page back to the kernel
    release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def release_memory(self) -> None:
        """Readers call this when done with the page: it stays cached and valid."""
        if self.release is not None:
            self.release()

    @property
    def rows(self) -> int:
        return sum(b.num_rows for b in self.batches)


def decode_page(data: bytes | pa.Buffer, path: str, name: str | None = None) -> DecodedPage:
    """Decode and verify a whole page file held in memory.

    Raises
    ------
    CorruptPageError
        Naming the file and the byte offset of the first damaged frame.
    """
    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    check(buf.size >= len(MAGIC) + _TRAILER.size, path, 0, "file too short to be a page")
    check(buf.slice(0, len(MAGIC)).to_pybytes() == MAGIC, path, 0, "not a page file (magic)")
    trailer_at = buf.size - _TRAILER.size
    footer_offset, tmagic = _TRAILER.unpack_from(buf, trailer_at)
    check(tmagic == TRAILER_MAGIC, path, trailer_at, "missing trailer (truncated file?)")
    check(len(MAGIC) <= footer_offset < trailer_at, path, trailer_at, "bad footer offset")
    payload, _, end = read_frame(buf, footer_offset, path, FOOTER_MAGIC)
    check(end == trailer_at, path, footer_offset, "footer length does not reach the trailer")
    try:
        footer = json.loads(payload.to_pybytes())
        frames = footer["frames"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptPageError(path, footer_offset, f"unreadable footer: {exc}") from exc
    batches = []
    expected = len(MAGIC)
    for frame in frames:
        offset = int(frame["offset"])
        check(offset == expected, path, offset, "frame index does not match the file")
        body, rows, expected = read_frame(buf, offset, path, FRAME_MAGIC)
        batches.append(decode_batch(body, rows, path, offset))
    check(expected == footer_offset, path, expected, "data between frames and footer")
    return DecodedPage(name or path.rsplit("/", 1)[-1], batches, frames, buf.size)


def read_page(storage: Storage, path: str) -> DecodedPage:
    """Read a whole page file (one request), verify and decode it; a memory-mapped page gives
    its resident memory back right after verification (readers fault in what they use)."""
    data, release = storage.map(path)
    page = decode_page(data, path)
    page.release = release
    page.release_memory()
    return page


TAIL_GUESS = 64 * 1024


def read_footer(storage: Storage, path: str, size: int | None = None) -> dict[str, Any]:
    """Only the footer of a page: one range read of the file's tail when the footer fits in
    64 KiB (it holds a few hundred bytes per frame), two otherwise."""
    size = storage.size(path) if size is None else size
    lo = max(0, size - TAIL_GUESS)
    tail = pa.py_buffer(storage.read_range(path, lo, size))
    check(tail.size == size - lo and tail.size >= _TRAILER.size, path, lo,
           "file shorter than recorded (truncated?)")
    footer_offset, tmagic = _TRAILER.unpack_from(tail, tail.size - _TRAILER.size)
    check(tmagic == TRAILER_MAGIC, path, size - _TRAILER.size,
           "missing trailer (truncated file?)")
    check(len(MAGIC) <= footer_offset < size - _TRAILER.size, path, size - _TRAILER.size,
           "bad footer offset")
    if footer_offset < lo:
        lo = footer_offset
        tail = pa.py_buffer(storage.read_range(path, lo, size))
    payload, _, _ = read_frame(tail, footer_offset - lo, path, FOOTER_MAGIC, base=lo)
    try:
        footer = json.loads(payload.to_pybytes())
        footer["frames"]  # the one key every reader needs
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptPageError(path, footer_offset, f"unreadable footer: {exc}") from exc
    return footer


def read_frames(storage: Storage, path: str, frames: list[dict[str, Any]],
                wanted: list[int]) -> dict[int, pa.RecordBatch]:
    """Read and verify only the frames ``wanted`` (indices into ``frames``), with one range
    read per run of adjacent frames. For selectors that match a few frames of a big page."""
    out: dict[int, pa.RecordBatch] = {}
    runs: list[list[int]] = []
    for i in sorted(wanted):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in runs:
        lo = int(frames[run[0]]["offset"])
        hi = int(frames[run[-1]]["offset"]) + int(frames[run[-1]]["length"])
        buf = pa.py_buffer(storage.read_range(path, lo, hi))
        check(buf.size == hi - lo, path, lo, "file shorter than its frame index")
        for i in run:
            at = int(frames[i]["offset"])
            payload, rows, _ = read_frame(buf, at - lo, path, FRAME_MAGIC, base=lo)
            out[i] = decode_batch(payload, rows, path, at)
    return out
