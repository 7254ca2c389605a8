"""Hostile input: bad names, non-messages, bad settings, reserved columns, damaged store files.

Nothing a caller passes may create a file outside the store root, and every refusal is a
``DurableQueueError`` subclass that says what was wrong.
"""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import pandas as pd
import pyarrow as pa
import pytest
from conftest import raw_write

from pyspark_durable_queue import (
    DurableQueue,
    DurableQueueError,
    InvalidMessageError,
    InvalidNameError,
    InvalidOptionError,
    SchemaMismatchError,
    StorageError,
)
from pyspark_durable_queue._log.commit_log import entry_name

BAD_NAMES = [
    "", "/", "a/b", "/abs", "..", "../x", "x/..", "a..b", ".", ".hidden", "_reserved",
    "\x00", "a\x00b", "nul\x00", "\n", "a\nb", "tab\there", "\x1b[31m", "\x7f", "a\u200bb",
    " ", "a b", "a\\b", "C:", "c:\\win", "a*", "a?", "a|b", "a<b>", 'a"b', "\u2028",
    "x" * 201, "é" * 101, "日" * 67, "\ud800",
]
BAD_NAME_IDS = [repr(n)[:24] for n in BAD_NAMES]
GOOD_NAMES = ["orders", "a.b-c_d", "x@y+z=1~2", "日本語", "Ünïcödé", "x" * 200, "0", "a.b"]


def _memory_keys() -> set[str]:
    fs = fsspec.filesystem("memory")
    return set(fs.store) | set(fs.pseudo_dirs)


@pytest.fixture
def jail(request, tmp_path):
    """A store root nested in a folder we can watch for escapes, on disk or in memory."""
    kind = request.param
    if kind == "file":
        outer = tmp_path / "outer"
        outer.mkdir()
        root = str(outer / "dq")

        def outside() -> set[str]:
            found = set()
            for dirpath, dirnames, filenames in os.walk(tmp_path):
                for n in dirnames + filenames:
                    p = os.path.join(dirpath, n)
                    if not (p == str(outer) or p.startswith(root)):
                        found.add(p)
            return found

        yield root, outside
    else:
        root = f"memory://outer-{uuid.uuid4().hex}/dq"
        prefix = root.replace("memory://", "/")
        before = _memory_keys()

        def outside() -> set[str]:
            return {k for k in _memory_keys() - before if not k.startswith(prefix)
                    and not prefix.startswith(k.rstrip("/") + "/")}

        yield root, outside
        fs = fsspec.filesystem("memory")
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)


jail_params = pytest.mark.parametrize("jail", ["file", "memory"], indirect=True)


# -- names --------------------------------------------------------------------------------------
@jail_params
@pytest.mark.parametrize("name", BAD_NAMES, ids=BAD_NAME_IDS)
def test_bad_address_names(jail, name):
    root, outside = jail
    q = DurableQueue(root)
    with pytest.raises(InvalidNameError) as info:
        q.address(name)
    assert "name" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidNameError):
        q.address(name, create=False)
    with pytest.raises(InvalidNameError):
        q.delete_address(name)
    assert q.addresses() == []
    assert outside() == set()


@jail_params
@pytest.mark.parametrize("name", BAD_NAMES, ids=BAD_NAME_IDS)
def test_bad_consumer_names(jail, name):
    root, outside = jail
    a = DurableQueue(root).address("orders")
    a.send({"i": 1})
    before = set(a.storage.list(a.consumers_folder))
    with pytest.raises(InvalidNameError):
        a.consumer(name)
    with pytest.raises(InvalidNameError):
        a.consumer(name, create=False)
    assert set(a.storage.list(a.consumers_folder)) == before
    assert a.consumers() == {}
    assert outside() == set()


@pytest.mark.parametrize("name", [None, 5, b"orders", ["a"], 1.5], ids=repr)
def test_non_string_names(root, name):
    q = DurableQueue(root)
    with pytest.raises(InvalidNameError, match="string"):
        q.address(name)
    a = q.address("ok")
    with pytest.raises(InvalidNameError, match="string"):
        a.consumer(name)


@pytest.mark.parametrize("name", GOOD_NAMES, ids=lambda n: n[:12])
def test_good_names_round_trip(root, name):
    q = DurableQueue(root)
    a = q.address(name)
    a.send({"i": 1})
    c = a.consumer(name)
    c.ack(c.receive())
    assert name in DurableQueue(root).addresses()
    b = DurableQueue(root).address(name, create=False)
    assert b.consumers()[name]["position"] == 1


def test_long_name_error_is_shortened(tmp_path):
    with pytest.raises(InvalidNameError) as info:
        DurableQueue(str(tmp_path)).address("y" * 5000)
    assert len(str(info.value)) < 400
    assert "200 bytes" in str(info.value)


# -- messages -----------------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    42, "text", b"bytes", None, 3.5, object(), {1, 2},
    [1, 2], ["a"], [{"i": 1}, "x"], [{"i": 1}, None], [[("i", 1)]], [{1: "int key"}],
    [{("t",): 1}],
], ids=lambda d: type(d).__name__ + "-" + repr(d)[:16])
def test_non_messages_rejected(root, data):
    a = DurableQueue(root).address("orders")
    a.send({"i": 1})
    with pytest.raises(InvalidMessageError) as info:
        a.send(data)
    assert isinstance(info.value, TypeError)
    b = DurableQueue(root).address("orders")
    assert b.state.next_seq == 1
    assert set(b.storage.list(b.pages_folder)) == set(b.state.pages.names)


@pytest.mark.parametrize("data", [
    [{"i": object()}],
    [{"i": 1}, {"i": "mixed"}],
    [{"i": 2 ** 70}],
], ids=["object", "mixed-types", "int-overflow"])
def test_unconvertible_values_rejected(root, data):
    a = DurableQueue(root).address("orders")
    with pytest.raises(InvalidMessageError, match="Arrow"):
        a.send(data)
    assert DurableQueue(root).address("orders").state.next_seq == 0
    assert DurableQueue(root).address("orders").schema is None


@pytest.mark.parametrize("column", ["_seq", "_timestamp"])
@pytest.mark.parametrize("form", ["dicts", "table", "pandas"])
def test_reserved_columns_rejected(root, column, form):
    data = {"dicts": [{column: 1, "v": "a"}],
            "table": pa.table({column: [1], "v": ["a"]}),
            "pandas": pd.DataFrame({column: [1], "v": ["a"]})}[form]
    a = DurableQueue(root).address("orders")
    with pytest.raises(SchemaMismatchError, match=column):
        a.send(data)
    assert a.schema is None
    a.send({"v": "ok"})
    with pytest.raises(SchemaMismatchError, match=column):
        a.send(data, merge_schema=True)
    assert DurableQueue(root).address("orders").schema.names == ["v"]


def test_reserved_columns_rejected_at_commit(root):
    """Pages written by hand (a Spark task) with a system column are refused at commit."""
    a = DurableQueue(root).address("orders")
    bad = pa.table({"_seq": [5], "v": ["a"]})
    w = a.page_writer()
    w.write(bad)
    pages = w.close()
    with pytest.raises(SchemaMismatchError, match="_seq"):
        a.commit(pages, bad.schema)
    b = DurableQueue(root).address("orders")
    assert b.state.next_seq == 0
    assert b.storage.list(b.pages_folder) == []


def test_duplicate_columns_rejected(root):
    t = pa.Table.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"])
    with pytest.raises(SchemaMismatchError, match="duplicate"):
        DurableQueue(root).address("orders").send(t)


# -- settings and options -----------------------------------------------------------------------
@pytest.mark.parametrize("settings, option", [
    ({"page_size_bytes": -1}, "pageSizeBytes"),
    ({"page_size_bytes": 0}, "pageSizeBytes"),
    ({"page_size_bytes": "lots"}, "pageSizeBytes"),
    ({"page_size_bytes": True}, "pageSizeBytes"),
    ({"page_size_bytes": 10}, "pageSizeBytes"),
    ({"address_full_policy": "SOMETIMES"}, "addressFullPolicy"),
    ({"address_full_policy": ""}, "addressFullPolicy"),
    ({"compression": "gzip"}, "compression"),
    ({"max_size_bytes": 0}, "maxSizeBytes"),
    ({"max_size_messages": -7}, "maxSizeMessages"),
    ({"block_timeout_ms": -5}, "blockTimeoutMs"),
    ({"cleanup_interval_ms": "soon"}, "cleanupIntervalMs"),
    ({"fsync": "maybe"}, "fsync"),
    ({"no_such_setting": 1}, "no_such_setting"),
    ({"selector": "a = 1"}, "selector"),  # a reader option, not an address setting
], ids=lambda v: str(v)[:30] if isinstance(v, dict) else None)
def test_bad_settings_rejected(root, settings, option):
    q = DurableQueue(root)
    with pytest.raises(InvalidOptionError, match=option) as info:
        q.address("orders", **settings)
    assert isinstance(info.value, ValueError)
    assert q.addresses() == []  # nothing created
    # an existing address keeps its settings
    a = q.address("orders", page_size_bytes=4096)
    with pytest.raises(InvalidOptionError, match=option):
        DurableQueue(root).address("orders", **settings)
    assert DurableQueue(root).address("orders").settings == a.settings


def test_bad_settings_all_reported(tmp_path):
    with pytest.raises(InvalidOptionError) as info:
        DurableQueue(str(tmp_path)).address("orders", page_size_bytes=-1,
                                   address_full_policy="SOMETIMES", bogus=1)
    text = str(info.value)
    for part in ("pageSizeBytes", "addressFullPolicy", "bogus", "PAGE, DROP, FAIL, BLOCK"):
        assert part in text


def test_settings_accept_sizes_and_case(root):
    a = DurableQueue(root).address("orders", page_size_bytes="4 KiB",
                                   address_full_policy="fail", compression="ZSTD",
                                   max_size_bytes="1_000_000", fsync="off")
    assert a.settings.fsync == "never"  # "off": a boolean's spelling of never
    s = DurableQueue(root).address("orders").settings
    assert (s.page_size_bytes, s.address_full_policy, s.compression, s.max_size_bytes,
            s.fsync) == (4096, "FAIL", "zstd", 1_000_000, "always")  # fsync: not persisted
    assert a.settings.to_json() == s.to_json()


@pytest.mark.parametrize("start", ["bogus", -1, "-3", "", 1.5], ids=repr)
def test_bad_start_positions(root, start):
    a = DurableQueue(root).address("orders")
    with pytest.raises(InvalidOptionError):
        a.consumer("c", start=start)
    assert a.consumers() == {}


def test_bad_receive_and_ack_arguments(root):
    a = DurableQueue(root).address("orders")
    a.send({"i": 1})
    c = a.consumer("c")
    for kwargs in ({"max_messages": 0}, {"max_messages": -1}, {"max_bytes": 0}):
        with pytest.raises(InvalidOptionError):
            c.receive(**kwargs)
    for bad in ("3", 2.0, [1], object()):
        with pytest.raises(TypeError):
            c.ack(bad)
    assert DurableQueue(root).address("orders").consumers()["c"]["position"] == 0


# -- damaged store files ------------------------------------------------------------------------
def _put(addr, path: str, data: bytes) -> None:
    raw_write(addr.storage, path, data)


@pytest.mark.parametrize("payload", [
    b"{not json", b"[]", b'{"op": "append"}', b'{"op": "explode", "ts": 1}',
    b'{"op": "append", "seq": 0, "ts": 1, "pages": "nope"}',
    b'{"op": "append", "seq": 0, "ts": 1, "pages": [], "schema": "!!notbase64!!"}',
    b'{"op": "remove", "ts": 1}', b"\xff\xfe\x00garbage",
], ids=["bad-json", "list", "no-fields", "unknown-op", "pages-not-list", "bad-schema",
        "remove-no-pages", "binary"])
def test_damaged_log_entry(root, payload):
    a = DurableQueue(root).address("orders", journal=False)  # log entries are files
    a.send({"i": 1})
    _put(a, f"{a.folder}/log/{entry_name(2)}", payload)
    with pytest.raises(StorageError) as info:
        DurableQueue(root).address("orders").state  # noqa: B018
    assert entry_name(2) in str(info.value) or "entry 2" in str(info.value)


def test_damaged_address_json(root):
    a = DurableQueue(root).address("orders")
    _put(a, f"{a.folder}/address.json", b"{oops")
    with pytest.raises(StorageError, match=r"address\.json"):
        DurableQueue(root).address("orders")


def test_damaged_consumer_state(root):
    a = DurableQueue(root).address("orders")
    a.consumer("c")
    _put(a, f"{a.consumers_folder}/c.json", b"{oops")
    with pytest.raises(DurableQueueError, match=r"c\.json|consumer"):
        DurableQueue(root).address("orders").consumers()


def test_settings_in_address_json_are_validated(root):
    a = DurableQueue(root).address("orders")
    path = f"{a.folder}/address.json"
    meta = json.loads(a.storage.read(path))
    meta["settings"]["address_full_policy"] = "SOMETIMES"
    _put(a, path, json.dumps(meta).encode())
    with pytest.raises(InvalidOptionError, match="addressFullPolicy"):
        DurableQueue(root).address("orders")


def test_foreign_files_are_ignored(root):
    """Stray files in the store (an editor's backup, a README) do not break anything."""
    a = DurableQueue(root).address("orders")
    a.send({"i": 1})
    c = a.consumer("c")
    _put(a, f"{a.folder}/log/notes.txt", b"hello")
    _put(a, f"{a.consumers_folder}/README", b"hello")
    _put(a, f"{a.pages_folder}/readme.txt", b"hello")
    _put(a, a.storage.join("stray.txt"), b"hello")
    b = DurableQueue(root).address("orders")
    assert b.state.next_seq == 1
    assert list(b.consumers()) == ["c"]
    assert DurableQueue(root).addresses() == ["orders"]
    report = b.cleanup(dry_run=False, now=10 ** 12)
    assert report.orphans == []
    c.ack(c.receive())
    assert b.storage.exists(f"{b.pages_folder}/readme.txt")


def test_settings_by_alias(root):
    """camelCase and Artemis names are accepted by the client as by Spark."""
    DurableQueue(root).address("orders", pageSizeBytes=4096,
                               **{"address-full-policy": "drop", "maxSizeMessages": 3})
    s = DurableQueue(root).address("orders").settings
    assert (s.page_size_bytes, s.address_full_policy, s.max_size_messages) == (4096, "DROP", 3)
    DurableQueue(root).address("orders", PAGESIZEBYTES=8192)
    assert DurableQueue(root).address("orders").settings.page_size_bytes == 8192
