"""The storage boundary's publishing primitive: exclusive, atomic ``create``.

Also on local filesystems without hard links (cloud FUSE mounts such as Databricks volumes),
where it falls back to ``O_EXCL``.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from pyspark_durable_queue import DurableQueue, StorageError
from pyspark_durable_queue._storage import NotFound, Storage


def _race(args: tuple[str, bool, int]) -> int:
    root, links, me = args
    s = Storage(root)
    s._links = links
    won = 0
    for n in range(200):
        won += s.create(s.join(f"{n:05d}"), f"{me}:{n}".encode() * 50)
    return won


@pytest.mark.parametrize("links", [True, False], ids=["link", "o_excl"])
def test_exactly_one_creator_wins_each_name(tmp_path, links):
    root = str(tmp_path)
    Storage(root).makedirs(root)
    with mp.get_context("spawn").Pool(4) as pool:
        wins = pool.map(_race, [(root, links, i) for i in range(4)])
    assert sum(wins) == 200
    s = Storage(root)
    for n in range(200):  # each file is one writer's complete content
        assert s.read(s.join(f"{n:05d}")) in {f"{me}:{n}".encode() * 50 for me in range(4)}
    if links:  # losers' temp files are gone too
        assert os.listdir(os.path.join(root, ".tmp")) == []


def test_store_works_without_hard_links(tmp_path, monkeypatch):
    monkeypatch.setattr(Storage, "_links", False, raising=False)
    original = Storage.__init__

    def init(self, *a, **kw):
        original(self, *a, **kw)
        self._links = False

    monkeypatch.setattr(Storage, "__init__", init)
    a = DurableQueue(str(tmp_path)).address("x")
    for i in range(150):  # past a checkpoint
        a.send({"i": i})
    c = a.consumer("c")
    got = c.receive(max_messages=1000)
    assert got.column("i").to_pylist() == list(range(150))
    c.ack(got)
    assert DurableQueue(str(tmp_path)).address("x").state.next_seq == 150


def test_missing_file_is_not_found(tmp_path):
    s = Storage(str(tmp_path))
    with pytest.raises(NotFound):
        s.read(s.join("nope"))
    with pytest.raises(FileNotFoundError):
        s.read_buffer(s.join("nope"))


def test_publishing_on_a_filesystem_without_exclusive_create_is_refused(tmp_path):
    # fsspec's DirFileSystem over the local disk inherits the default pipe_file(mode="create"),
    # an exists() check followed by a write: two writers could both publish entry N.
    base = tmp_path / "base"
    base.mkdir()
    opts = {"path": str(base), "target_protocol": "file"}
    with pytest.raises(StorageError, match="no exclusive create") as err:
        DurableQueue("dir://dq", storage_options=opts).address("orders")
    assert "s3://" in str(err.value)
    # reading a store written elsewhere still works through such a filesystem
    DurableQueue(str(base / "dq")).address("orders").send([{"i": 1}, {"i": 2}])
    a = DurableQueue("dir://dq", storage_options=opts).address("orders", create=False)
    assert a.stats()["messages"] == 2
    with pytest.raises(StorageError, match="no exclusive create"):
        a.send([{"i": 3}])
    assert DurableQueue(str(base / "dq")).address("orders").stats()["messages"] == 2
    pages = [p for p in (base / "dq" / "orders" / "pages").iterdir() if p.suffix == ".page"]
    assert len(pages) == 1  # the refused send left no page behind


def test_a_retried_create_on_s3_finds_its_own_object(s3_endpoint):
    # An S3 client retries a conditional PUT whose response was lost; the retry is refused
    # (the object exists) although it was this writer's. Same bytes: ours; other bytes: lost.
    from conftest import new_s3_root

    s = Storage(new_s3_root(s3_endpoint))
    path = s.join("log", "00000000000000000001.json")
    mine = b'{"id": "4f1c", "op": "append"}'
    s.fs.pipe_file(path, mine, mode="create")  # the first attempt: stored, answer lost
    assert s.create(path, mine) is True
    assert s.create(path, b'{"id": "77aa", "op": "append"}') is False
    assert s.read(path) == mine


def test_s3_conflict_answers_are_told_from_other_failures():
    # S3 answers a conditional PUT racing another one in flight with 409
    # ConditionalRequestConflict: create() retries it (moto never sends it, so the error is
    # built here and passed through s3fs's own translation, as a PUT would raise it).
    from conftest import require_backend_module

    botocore = require_backend_module("botocore.exceptions")
    s3errors = require_backend_module("s3fs.errors")
    from pyspark_durable_queue._storage import _conflicting_create

    def raised(code: str, **extra: str) -> BaseException:
        error = botocore.ClientError({"Error": {"Code": code, "Message": code, **extra}},
                                     "PutObject")
        return s3errors.translate_boto_error(error)

    conflict = raised("ConditionalRequestConflict")
    assert isinstance(conflict, OSError) and _conflicting_create(conflict)
    assert isinstance(raised("PreconditionFailed", Condition="If-None-Match"),
                      FileExistsError)  # a lost race: create() returns False
    assert not _conflicting_create(raised("SlowDown"))
    assert not _conflicting_create(raised("AccessDenied"))
    assert not _conflicting_create(OSError(5, "plain I/O error"))
