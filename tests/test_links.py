"""Nothing outside the root: a symbolic link where a store keeps a folder or a file is refused,
never followed; the root itself may be a link (issue 38, "nothing outside the root").

Each test plants a link to a folder outside the root, then creates a consumer, sends,
receives and acknowledges, and checks that each operation that needs the linked folder or file
is refused with :class:`LinkRefusedError` naming it, and that nothing was written outside.
"""

from __future__ import annotations

import errno
import os
import pickle

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue, LinkRefusedError, StorageError
from pyspark_durable_queue._read.cache import page_cache
from pyspark_durable_queue._storage import LocalStorage

FORMATS = {"journal": {}, "page-files": {"journal": False}}


def table(start: int, n: int) -> pa.Table:
    return pa.table({"i": pa.array(range(start, start + n), pa.int64())})


def snapshot(folder) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (what must not change)."""
    out = {}
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


@pytest.fixture
def store(tmp_path):
    """The root of an address ``a`` with 10 messages, a folder ``outside`` next to it, and a
    consumer ``c`` that received 4 of them (not acknowledged)."""

    def make(**settings):
        root = tmp_path / "root"
        outside = tmp_path / "outside"
        outside.mkdir()
        a = DurableQueue(str(root)).address("a", **settings)
        a.send(table(0, 10))
        c = a.consumer("c")
        c.ack(c.receive(max_messages=2))  # the consumer has its state and watermark files
        assert c.receive(max_messages=4).column("i").to_pylist() == [2, 3, 4, 5]
        return root, outside, c

    return make


def plant_folder(root, outside, relative: str) -> None:
    """``root/relative`` becomes a link to the empty folder ``outside`` (the real folder is
    moved aside)."""
    path = root / relative
    os.rename(path, f"{path}.real")
    os.symlink(outside, path)


def plant_file(root, outside, relative: str) -> None:
    """``root/relative`` becomes a link to a copy of it in ``outside``."""
    path = root / relative
    copy = outside / path.name
    copy.write_bytes(path.read_bytes())
    path.unlink()
    os.symlink(copy, path)


def refused(what: str, call) -> LinkRefusedError:
    """``call()`` must be refused because of a link at ``what`` (a path's tail)."""
    with pytest.raises(LinkRefusedError) as info:
        call()
    error = info.value
    assert error.errno == errno.ELOOP and isinstance(error, StorageError)
    assert error.path.endswith(what), (error.path, what)
    assert "symbolic link" in str(error) and "links inside a store are refused" in str(error)
    assert error.path in str(error)
    return error


def operations(root, c):
    """Every operation of the test, each a fresh handle on the store (as another process
    would open it) except ``ack``, which acknowledges what ``c`` received before the link was
    planted."""

    def new_consumer():
        DurableQueue(str(root)).address("a").consumer("new")

    def send():
        DurableQueue(str(root)).address("a").send(table(10, 1))

    def receive():
        page_cache().clear()  # the process's decoded pages: as a process that read none
        DurableQueue(str(root)).address("a").consumer("c").receive(max_messages=100)

    def ack():
        c.ack()

    return {"create a consumer": new_consumer, "send": send, "receive": receive, "ack": ack}


ALL = {"create a consumer", "send", "receive", "ack"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("folder, refused_ops", [
    # a consumer's files
    ("consumers", {"page-files": {"create a consumer", "receive", "ack"},
                   "journal": {"create a consumer", "receive", "ack"}}),
    # the messages (in a journal's segments also the log: a new consumer reads it)
    ("pages", {"page-files": {"send", "receive"},
               "journal": {"create a consumer", "send", "receive"}}),
    # entries, checkpoints, the publish lock (an acknowledgement writes the watermark only)
    ("log", {"page-files": ALL - {"ack"}, "journal": ALL - {"ack"}}),
    ("", {"page-files": ALL, "journal": ALL}),  # the address's folder
], ids=["consumers", "pages", "log", "address"])
def test_a_linked_folder_is_refused_and_nothing_is_written_outside(store, fmt, folder,
                                                                   refused_ops):
    root, outside, c = store(**FORMATS[fmt])
    plant_folder(root, outside, f"a/{folder}".rstrip("/"))
    for name, call in operations(root, c).items():
        if name in refused_ops[fmt]:
            refused(f"a/{folder}".rstrip("/"), call)
        else:
            call()  # it does not need what the link stands for
    assert os.listdir(outside) == []


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("relative, refused_ops", [
    ("address.json", {"create a consumer", "send", "receive"}),
    ("consumers/c.json", {"receive", "ack"}),
    ("consumers/c.wm", {"receive", "ack"}),
], ids=["address.json", "consumer-json", "consumer-wm"])
def test_a_linked_metadata_file_is_refused_and_its_target_is_left_alone(store, fmt, relative,
                                                                       refused_ops):
    root, outside, c = store(**FORMATS[fmt])
    plant_file(root, outside, f"a/{relative}")
    before = snapshot(outside)
    for name, call in operations(root, c).items():
        if name in refused_ops:
            refused(f"a/{relative}", call)
        else:
            call()  # it does not need the file
    assert snapshot(outside) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_linked_page_or_segment_is_refused_and_its_target_is_left_alone(store, fmt):
    root, outside, c = store(**FORMATS[fmt])
    [page] = [n for n in os.listdir(root / "a" / "pages")]
    plant_file(root, outside, f"a/pages/{page}")
    before = snapshot(outside)
    refused(f"a/pages/{page}", operations(root, c)["receive"])
    if fmt == "journal":  # the next unit goes into that segment
        refused(f"a/pages/{page}", operations(root, c)["send"])
    assert snapshot(outside) == before


def test_a_linked_log_entry_is_refused(store):
    root, outside, c = store(journal=False)
    entries = sorted(n for n in os.listdir(root / "a" / "log") if n.endswith(".json"))
    plant_file(root, outside, f"a/log/{entries[-1]}")
    before = snapshot(outside)
    refused(f"a/log/{entries[-1]}", operations(root, c)["receive"])
    assert snapshot(outside) == before


def test_a_linked_staging_folder_is_refused(store):
    root, outside, c = store(journal=False)
    plant_folder(root, outside, ".tmp")
    refused(".tmp", operations(root, c)["send"])
    assert os.listdir(outside) == []


def test_the_root_may_be_a_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "root")
    for settings in FORMATS.values():
        q = DurableQueue(str(tmp_path / "root"))
        name = "j" if settings == {} else "p"
        a = q.address(name, **settings)
        a.send(table(0, 5))
        c = a.consumer("c")
        assert c.receive().column("i").to_pylist() == [0, 1, 2, 3, 4]
        c.ack()
        assert DurableQueue(str(tmp_path / "root")).address(name).consumer("c").receive(
            timeout_ms=0).num_rows == 0
        assert os.path.isfile(real / name / "address.json")
    assert DurableQueue(str(tmp_path / "root")).addresses() == ["j", "p"]


def test_a_linked_address_is_not_listed_and_cannot_be_opened(tmp_path):
    root = tmp_path / "root"
    elsewhere = tmp_path / "elsewhere"
    DurableQueue(str(elsewhere)).address("x").send(table(0, 1))
    DurableQueue(str(root)).address("a")
    os.symlink(elsewhere / "x", root / "x")
    before = snapshot(elsewhere)
    q = DurableQueue(str(root))
    assert q.addresses() == ["a"]
    refused("root/x", lambda: q.address("x"))
    refused("root/x", lambda: q.delete_address("x"))
    assert snapshot(elsewhere) == before


def test_deleting_an_address_removes_a_link_inside_it_not_its_target(store):
    root, outside, _ = store()
    (outside / "keep").write_bytes(b"not the store's")
    plant_folder(root, outside, "a/consumers")
    DurableQueue(str(root)).delete_address("a")
    assert not os.path.lexists(root / "a")
    assert snapshot(outside) == {"keep": b"not the store's"}


def test_storage_refuses_links_in_every_operation(tmp_path):
    # The storage itself, operation by operation: a linked folder and a linked file.
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"outside")
    s = LocalStorage(str(root))
    s.makedirs(s.join("d"))
    s.replace(s.join("d", "f"), b"inside")
    os.symlink(outside, root / "linked")
    os.symlink(outside / "f", root / "d" / "lf")
    in_folder, file = s.join("linked", "f"), s.join("d", "lf")
    for path in (in_folder, file):
        for call in (lambda p=path: s.read(p), lambda p=path: s.read_range(p, 0, 3),
                     lambda p=path: s.open_reader(p), lambda p=path: s.map(p),
                     lambda p=path: s.exists(p), lambda p=path: s.size(p),
                     lambda p=path: s.create(p, b"x"), lambda p=path: s.replace(p, b"x"),
                     lambda p=path: s.open_append(p), lambda p=path: s.open_inplace(p),
                     lambda p=path: s.lock(p).__enter__()):
            with pytest.raises(LinkRefusedError):
                call()
    with pytest.raises(LinkRefusedError):
        s.begin_write(s.join("linked", "g"))
    with pytest.raises(LinkRefusedError):
        s.move(s.join("d", "f"), s.join("linked", "g"))
    for folder in (s.join("linked"), s.join("linked", "sub")):
        with pytest.raises(LinkRefusedError):
            s.makedirs(folder)
        with pytest.raises(LinkRefusedError):
            s.list(folder)
        with pytest.raises(LinkRefusedError):
            s.sync_folder(folder)
    with pytest.raises(LinkRefusedError):
        s.delete_tree(s.join("linked"))
    with pytest.raises(LinkRefusedError):
        s.delete(s.join("linked", "f"))
    s.delete(file)  # a link itself may be deleted: the link goes, its target stays
    assert not os.path.lexists(root / "d" / "lf")
    assert snapshot(outside) == {"f": b"outside"}
    assert s.read(s.join("d", "f")) == b"inside"
    error = LinkRefusedError("/r/a/pages", "/elsewhere")
    assert pickle.loads(pickle.dumps(error)).path == "/r/a/pages"
    assert "/elsewhere" in str(pickle.loads(pickle.dumps(error)))
