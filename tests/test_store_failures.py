"""Failure paths around publishing and cleanup: no committed message may be lost, and a commit
that succeeded must not be reported as failed."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue, StorageError
from pyspark_durable_queue._log.commit_log import CHECKPOINT_EVERY, CommitLog, checkpoint_name


def table(start: int, n: int) -> pa.Table:
    return pa.table({"i": pa.array(range(start, start + n), pa.int64())})


def test_deleting_pages_of_a_failed_commit_spares_published_ones(tmp_path):
    # Spark calls abort() after a commit that failed late, in a fresh process: the pages the
    # entry names must survive.
    a = DurableQueue(str(tmp_path)).address("a")
    w = a.page_writer()
    w.write(table(0, 5))
    pages = w.close()
    a.commit(pages, pages and table(0, 0).schema)
    fresh = pickle.loads(pickle.dumps(a))
    fresh.discard(pages)
    c = DurableQueue(str(tmp_path)).address("a").consumer("c")
    assert c.receive().column("i").to_pylist() == [0, 1, 2, 3, 4]


def test_a_page_taken_for_an_orphan_is_never_published(tmp_path):
    a = DurableQueue(str(tmp_path)).address("a", orphan_grace_ms=3_600_000)
    a.send(table(0, 1))
    w = a.page_writer()
    w.write(table(1, 3))
    pages = w.close()
    # a slow batch: another process's cleanup sees the page older than the grace period
    report = DurableQueue(str(tmp_path)).address("a").cleanup(dry_run=False,
                                                              now=time.time() + 3601)
    assert report.orphans == [pages[0].name]
    with pytest.raises(StorageError, match="are gone"):
        a.commit(pages, table(0, 0).schema)
    assert DurableQueue(str(tmp_path)).address("a").state.next_seq == 1


_SWEEP_ORPHANS = """
import sys, time
from pyspark_durable_queue import DurableQueue
report = DurableQueue(sys.argv[1]).address("a").cleanup(dry_run=False, now=time.time() + 7200)
# the page; with two hours skipped, also the empty spare files the other process made ahead
pages = [o for o in report.orphans if o.endswith(".page")]
assert len(pages) == 1 and all(o.endswith(".spare") for o in report.orphans if o not in pages)
"""


def test_a_page_another_process_removed_is_never_published(shared_root):
    # This process has listed the pages folder since writing its page (on S3, s3fs keeps
    # listings and answers exists() from them): the check before publishing must still ask
    # the store, not a listing taken before another process removed the page.
    a = DurableQueue(shared_root).address("a")
    a.send(table(0, 1))
    w = a.page_writer()
    w.write(table(1, 3))
    pages = w.close()
    assert a.cleanup(dry_run=True).orphans == []  # lists the folder, page included
    subprocess.run([sys.executable, "-c", _SWEEP_ORPHANS, shared_root], check=True)
    with pytest.raises(StorageError, match="are gone"):
        a.commit(pages, table(0, 0).schema)
    assert DurableQueue(shared_root).address("a").state.next_seq == 1


def test_commit_renews_the_age_of_its_pages(tmp_path):
    a = DurableQueue(str(tmp_path)).address("a")
    w = a.page_writer()
    w.write(table(0, 3))
    pages = w.close()
    path = os.path.join(a.pages_folder, pages[0].name)
    os.utime(path, (time.time() - 7200, time.time() - 7200))
    a.commit(pages, table(0, 0).schema)
    assert time.time() - os.stat(path).st_mtime < 60


def test_a_failed_checkpoint_does_not_fail_the_send(tmp_path, monkeypatch):
    def broken(self, state, **kwargs):
        raise StorageError(28, "no space left on device")

    monkeypatch.setattr(CommitLog, "write_checkpoint", broken)
    a = DurableQueue(str(tmp_path)).address("a", fsync=False)
    for i in range(CHECKPOINT_EVERY + 5):
        a.send(table(i, 1))  # the 100th publishes, then its checkpoint fails: no error
    monkeypatch.undo()
    assert DurableQueue(str(tmp_path)).address("a").state.next_seq == CHECKPOINT_EVERY + 5


def test_an_unreadable_checkpoint_falls_back_to_the_log(tmp_path):
    # log entry files and their checkpoints (journal=False)
    a = DurableQueue(str(tmp_path)).address("a", fsync=False, journal=False)
    for i in range(CHECKPOINT_EVERY + 7):
        a.send(table(i, 1))
    ckpt = os.path.join(a.folder, "log", checkpoint_name(CHECKPOINT_EVERY))
    with open(ckpt, "r+b") as f:
        f.truncate(os.path.getsize(ckpt) // 2)  # torn, as on a filesystem without links
    state = DurableQueue(str(tmp_path)).address("a").state
    assert state.next_seq == CHECKPOINT_EVERY + 7
    assert len(state.pages) == CHECKPOINT_EVERY + 7


def test_cleanup_keeps_pages_promised_to_a_consumer_created_meanwhile(tmp_path, monkeypatch):
    # a page per send (journal=False), so that cleanup has pages to plan to remove
    a = DurableQueue(str(tmp_path)).address("a", cleanup_interval_ms=3_600_000, journal=False)
    for i in range(4):
        a.send(table(i * 10, 10))
    a.cleanup(dry_run=False)  # recorded: the acknowledgement below runs no cleanup of its own
    done = a.consumer("done")
    done.receive(max_messages=100)
    done.ack()

    planner = DurableQueue(str(tmp_path)).address("a")
    registry = type(planner.registry)
    real = registry.all
    calls = {"n": 0}

    def consumers(self):
        calls["n"] += 1
        if calls["n"] == 2:  # between planning and publishing, a consumer at "earliest"
            DurableQueue(str(tmp_path)).address("a").consumer("late", start="earliest")
        return real(self)

    monkeypatch.setattr(registry, "all", consumers)
    report = planner.cleanup(dry_run=False)
    monkeypatch.undo()
    assert calls["n"] >= 2 and report.pages == []
    late = DurableQueue(str(tmp_path)).address("a").consumer("late")
    got = late.receive(max_messages=100)
    assert got.column("i").to_pylist() == list(range(40))


def test_a_damaged_consumer_file_is_a_storage_error(tmp_path):
    a = DurableQueue(str(tmp_path)).address("a")
    a.consumer("c")
    with open(os.path.join(a.consumers_folder, "c.json"), "w") as f:
        f.write('{"name": "c", "posit')
    with pytest.raises(StorageError, match="damaged"):
        a.consumer("c")
    with pytest.raises(StorageError, match=r"c\.json"):
        a.consumers()
