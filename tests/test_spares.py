"""Spare files: empty files made ahead so that a commit renames one instead of creating it.

Only the file-per-commit send takes spares: addresses here are created with ``journal=False``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pyarrow as pa

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._storage import _spares, open_storage
from pyspark_durable_queue._storage._spares import (
    DEMAND_TAKES,
    DEMAND_WINDOW_S,
    PER_FOLDER,
    SPARE_SUFFIX,
    Spares,
    held,
)


def _wait_for(predicate, timeout=30.0):  # the spare-making thread, on a busy machine
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_takes_are_served_from_files_made_ahead_up_to_a_bound(tmp_path):
    spares = Spares()
    folder = str(tmp_path)
    for _ in range(DEMAND_TAKES - 1):  # one send's worth of takes is no demand: none made
        assert spares.take(folder) is None
    time.sleep(DEMAND_WINDOW_S * 3)
    assert spares.held() == set()
    for _ in range(DEMAND_TAKES):  # takes in quick succession: spares are made
        assert spares.take(folder) is None
    assert _wait_for(lambda: bool(spares._ready.get(folder)))  # made, not being made
    path = spares.take(folder)
    assert path is not None and path.endswith(SPARE_SUFFIX)
    assert os.path.getsize(path) == 0 and path not in spares.held()  # the caller's now
    for _ in range(3 * PER_FOLDER):
        spares.take(folder)
    time.sleep(0.3)
    held = spares.held()
    assert 0 < len(held) <= PER_FOLDER
    spares.remove_all()
    assert spares.held() == set() and not any(os.path.exists(p) for p in held)
    assert os.path.exists(path)  # a taken spare is its taker's, not removed


def test_a_process_that_sends_once_makes_no_spares(tmp_path):
    code = ("import sys, time; from pyspark_durable_queue import DurableQueue\n"
            "DurableQueue(sys.argv[1]).address('a', journal=False).send([{'i': 1}])\n"
            "time.sleep(0.3)\n"
            "import os; os._exit(0)\n")  # no atexit: what a killed process would leave
    root = str(tmp_path / "dq")
    subprocess.run([sys.executable, "-c", code, root], check=True, timeout=120)
    assert not any(n.endswith(SPARE_SUFFIX) for n in os.listdir(os.path.join(root, ".tmp")))


def test_a_process_leaves_no_spares_when_it_exits(tmp_path):
    root = str(tmp_path / "dq")
    code = ("import sys; from pyspark_durable_queue import DurableQueue\n"
            "a = DurableQueue(sys.argv[1]).address('a', journal=False)\n"
            "for i in range(20): a.send([{'i': i}])\n")
    subprocess.run([sys.executable, "-c", code, root], check=True, timeout=120)
    staged = os.listdir(os.path.join(root, ".tmp"))
    assert [n for n in staged if n.endswith(SPARE_SUFFIX)] == []
    assert DurableQueue(root).address("a").state.next_seq == 20


def test_spares_of_this_process_are_not_leftovers_but_another_processs_are(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False)  # a journal send takes no spares
    for i in range(5):
        a.send([{"i": i}])
    assert _wait_for(lambda: any(n.endswith(SPARE_SUFFIX)
                                 for n in os.listdir(os.path.join(root, ".tmp"))))
    assert a.storage.temp_files() == []  # ours: in use, not for cleanup
    code = ("import sys; from pyspark_durable_queue import DurableQueue\n"
            "print(len(DurableQueue(sys.argv[1]).storage.temp_files()))\n")
    out = subprocess.run([sys.executable, "-c", code, root], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    assert int(out) >= 1  # to another process they are staged files; cleanup ages them out


def _held_in(folder: str) -> set[str]:
    return {p for p in held() if os.path.dirname(p) == folder}


def test_only_a_write_that_asks_for_a_spare_takes_one(tmp_path, monkeypatch):
    # the takes below are "in quick succession" however busy the machine (4 creates took
    # longer than the 0.1 s window under a load of 13, and no spare was ever made)
    monkeypatch.setattr(_spares, "DEMAND_WINDOW_S", 30.0)
    s = open_storage(str(tmp_path / "dq"))
    staging = s.join(".tmp")
    for k in range(DEMAND_TAKES):  # takes in quick succession: spares are made
        assert s.create(s.join(f"warm-{k}"), b"x", spare=True)
    assert _wait_for(lambda: bool(_held_in(staging)))
    before = _held_in(staging)
    assert s.create(s.join("plain"), b"x")  # spare=False: the default
    f = s.begin_write(s.join("page"))
    s.end_write(f, s.join("page"))
    assert before <= _held_in(staging)  # none taken (the thread may have made more)
    assert s.create(s.join("asked"), b"x", spare=True)
    assert len(before - _held_in(staging)) == 1  # exactly one taken, by the write that asked


def test_a_handle_that_sends_lends_no_spares_to_its_other_writes(tmp_path, monkeypatch):
    # The group commit asks for spares for its own page and log entry only: the same handle's
    # other writes (a consumer's state file, a Spark task's page) create their files.
    # The sends are "in quick succession" however busy the machine (under a load of 15 the
    # last send came after the 0.1 s window and took no spare)
    monkeypatch.setattr(_spares, "DEMAND_WINDOW_S", 30.0)
    a = DurableQueue(str(tmp_path / "dq")).address("a", journal=False)
    staging = a.storage.join(".tmp")
    for i in range(5):
        a.send([{"i": i}])
    assert _wait_for(lambda: bool(_held_in(staging)))
    before = _held_in(staging)
    a.consumer("c")
    writer = a.page_writer()
    writer.write(pa.table({"i": [1]}))
    a.discard(writer.close())
    assert before <= _held_in(staging)
    a.send([{"i": 5}])
    assert before - _held_in(staging)  # while a send still takes them
