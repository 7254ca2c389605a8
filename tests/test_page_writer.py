"""The page writer: frame sizing, pages rolled while earlier ones are still being synced, and
what close/abort guarantee about them (on a local folder and memory://)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pyarrow as pa
import pytest

from pyspark_durable_queue._format.page import (
    FRAME_TARGET_BYTES,
    PageWriter,
    read_footer,
    read_page,
)
from pyspark_durable_queue._storage import Storage, open_storage


def _rows(n: int, start: int = 0, width: int = 100) -> pa.Table:
    return pa.table({"id": pa.array(range(start, start + n), pa.int64()),
                     "body": pa.array([f"{i:0{width}d}" for i in range(start, start + n)])})


def _writer(storage: Storage, folder: str, page_size: int = 200_000) -> PageWriter:
    return PageWriter(storage, folder, page_size_bytes=page_size, compression="none")


def test_many_rolled_pages_are_complete_after_close(root):
    storage = open_storage(root)
    folder = storage.join("pages")
    writer = _writer(storage, folder)
    for start in range(0, 20_000, 2_000):
        writer.write(_rows(2_000, start))
    pages = writer.close()
    assert len(pages) > 5
    ids: list[int] = []
    for page in pages:
        path = f"{folder}/{page.name}"
        assert storage.size(path) == page.bytes
        decoded = read_page(storage, path)
        assert decoded.rows == page.rows
        for batch in decoded.batches:
            ids.extend(batch.column(0).to_pylist())
    assert ids == list(range(20_000))


def test_abort_deletes_rolled_pages_and_the_open_one(root):
    storage = open_storage(root)
    folder = storage.join("pages")
    writer = _writer(storage, folder)
    for start in range(0, 10_000, 1_000):
        writer.write(_rows(1_000, start))
    assert writer._file is not None and len(writer.pages) > 2  # rolled, one still open
    writer.abort()
    assert storage.list(folder) == []
    assert writer.pages == []


def test_a_failed_background_sync_fails_close(tmp_path):
    storage = open_storage(str(tmp_path))
    folder = storage.join("pages")
    writer = _writer(storage, folder)
    writer.write(_rows(1_000))
    writer.write(_rows(4_000, 1_000))  # rolls at least once
    assert writer._pending
    original = storage.end_write

    def broken(f, path):
        original(f, path)
        raise OSError(5, "simulated fsync failure")

    storage.end_write = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="simulated fsync failure"):
        # The next roll's sync fails. It surfaces from close(), or already from a write()
        # that waits for room among the syncs in flight (on a slow machine): either way
        # before the writer has reported a page as durable.
        writer.write(_rows(4_000, 5_000))
        writer.close()
    writer.abort()
    assert storage.list(folder) == []


def test_frames_are_even_not_a_full_one_and_a_sliver(tmp_path):
    storage = open_storage(str(tmp_path))
    folder = storage.join("pages")
    writer = _writer(storage, folder, page_size=64 << 20)
    batch = _rows(12_000, width=100)  # ~1.3 MiB: one frame
    assert FRAME_TARGET_BYTES < batch.nbytes < 1.5 * FRAME_TARGET_BYTES
    writer.write(batch)
    big = _rows(30_000, 12_000, width=100)  # ~3.3 MiB: three equal frames
    writer.write(big)
    (page,) = writer.close()
    frames = read_footer(storage, f"{folder}/{page.name}")["frames"]
    assert [f["rows"] for f in frames] == [12_000, 10_000, 10_000, 10_000]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_roll_pages(tmp_path):
    # Spark forks its Python workers from a daemon: a child must not inherit a thread pool
    # whose threads do not exist there (it would wait forever for the first rolled page).
    storage = open_storage(str(tmp_path))
    folder = storage.join("pages")
    parent = _writer(storage, folder)
    parent.write(_rows(5_000))  # starts the pool in the parent
    assert parent._pending
    parent.close()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            child = _writer(storage, storage.join("child"))
            child.write(_rows(5_000))
            code = 0 if len(child.close()) > 1 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung writing pages")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_pages_waiting_for_their_sync_are_bounded(tmp_path):
    # A slow disk or object store must not let a writer queue up its whole output.
    storage = open_storage(str(tmp_path))
    folder = storage.join("pages")
    original = storage.end_write
    active, peak = [0], [0]
    lock = threading.Lock()

    def slow(f, path):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        try:
            original(f, path)
        finally:
            with lock:
                active[0] -= 1

    storage.end_write = slow  # type: ignore[method-assign]
    writer = _writer(storage, folder, page_size=100_000)
    for start in range(0, 20_000, 1_000):
        writer.write(_rows(1_000, start))
        assert sum(not f.done() for f in writer._pending) <= 2
    pages = writer.close()
    assert len(pages) > 10 and peak[0] <= 3  # two in the pool, the last page inline


@pytest.mark.parametrize("batch", [
    pytest.param(pa.record_batch({"id": [1, None, 3], "body": ["a", None, "ccc"]}), id="scalars"),
    pytest.param(pa.record_batch({"id": [1, 2, 3, 4]}).slice(1, 2), id="a-slice"),
    pytest.param(pa.record_batch({"s": pa.array([{"a": 1, "b": [1, 2]}, None])}), id="nested"),
    pytest.param(pa.record_batch({"t": pa.array([0, None], pa.timestamp("us", tz="UTC")),
                                  "d": pa.array(["1.5", None]).cast(pa.decimal128(5, 2))}),
                 id="time-and-decimal"),
    pytest.param(pa.record_batch({"x": [1]}).replace_schema_metadata({"k": "v"}), id="metadata"),
    pytest.param(pa.record_batch({"c": pa.array(["a", "b", "a"]).dictionary_encode()}),
                 id="dictionary"),
    pytest.param(pa.record_batch({"l": pa.array([["a"], ["b"]]).cast(
        pa.list_(pa.dictionary(pa.int8(), pa.string())))}), id="nested-dictionary"),
])
@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_frames_ipc_stream_is_what_arrows_stream_writer_writes(batch, compression):
    # _ipc_stream keeps the schema message of the last schema and writes schema + batch + end
    # of stream itself when it can (no compression, no dictionaries): it must stay byte for
    # byte what new_stream writes, and decode to the same batch.
    from pyspark_durable_queue._format.page import _ipc_stream

    options = pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=options) as w:
        w.write_batch(batch)
    expected = sink.getvalue().to_pybytes()
    for _ in range(2):  # the second time from the kept schema message
        data = bytes(_ipc_stream(batch, options))
        assert data == expected
        decoded = pa.ipc.open_stream(data).read_all()
        assert decoded.equals(pa.Table.from_batches([batch]))
        assert decoded.schema.metadata == batch.schema.metadata


def test_the_kept_schema_message_is_not_reused_for_the_same_columns_with_other_metadata():
    from pyspark_durable_queue._format.page import _ipc_stream

    options = pa.ipc.IpcWriteOptions()
    plain = pa.record_batch({"x": [1]})
    for batch in (plain, plain.replace_schema_metadata({"k": "v"}), plain):
        decoded = pa.ipc.open_stream(bytes(_ipc_stream(batch, options))).read_all()
        assert decoded.schema.metadata == batch.schema.metadata


class _DictExtension(pa.ExtensionType):
    """An extension type whose storage is a dictionary (a stream carries its dictionary)."""

    def __init__(self) -> None:
        super().__init__(pa.dictionary(pa.int8(), pa.string()), "test.dq.dict")

    def __arrow_ext_serialize__(self) -> bytes:
        return b""

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type, serialized):
        return cls()


def test_an_extension_type_over_a_dictionary_is_framed_by_arrows_stream_writer():
    from pyspark_durable_queue._format.page import _ipc_stream

    pa.register_extension_type(_DictExtension())
    try:
        storage = pa.array(["a", "b", "a"]).dictionary_encode().cast(
            pa.dictionary(pa.int8(), pa.string()))
        batch = pa.record_batch({"e": pa.ExtensionArray.from_storage(_DictExtension(), storage)})
        options = pa.ipc.IpcWriteOptions()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema, options=options) as w:
            w.write_batch(batch)
        data = bytes(_ipc_stream(batch, options))
        assert data == sink.getvalue().to_pybytes()
        assert pa.ipc.open_stream(data).read_all().column("e").type == _DictExtension()
    finally:
        pa.unregister_extension_type("test.dq.dict")
