"""The storage boundary's publishing primitive: exclusive, atomic ``create``.

Also on local filesystems without hard links (cloud FUSE mounts such as Databricks volumes),
where it falls back to ``O_EXCL``.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from pyspark_durable_queue import DurableQueue
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
