"""Commit-log retention: cleanup deletes entries a checkpoint covers once they are older than
``log_retention_ms``, and processes whose view of the log is older than that never take a
deleted entry's number for a new commit, nor keep reading a log that moved on without them.

The subject is the file-per-commit log (``log/<N>.json``): every address here is created with
``journal=False`` (a journal address keeps its entries in segments, see test_journal.py)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import pyarrow as pa
import pytest
from conftest import older_format

from pyspark_durable_queue import DurableQueue, InvalidOptionError, StorageError
from pyspark_durable_queue._log import commit_log as _log
from pyspark_durable_queue._log.commit_log import MIN_RETENTION_S, checkpoint_name, entry_name
from pyspark_durable_queue._ops.group_commit import SendQueue
from pyspark_durable_queue._storage import KeptLock

LATER = 7200  # seconds: past the default retention of one hour

#: The log's checkpoint interval in these tests, instead of the package's 100: retention works
#: the same at any interval, and crossing two checkpoints then takes 80 commits instead of 200,
#: each several round trips on S3 and Azure Blob storage (the [s3] and [abfs] cases took 20 to
#: 40 s apiece). Larger than every tail the tests add after a checkpoint (at most 30 commits).
#: The log reads the interval when it publishes, so setting it here is enough.
CHECKPOINT_EVERY = 40


@pytest.fixture(autouse=True)
def _checkpoint_every(monkeypatch):
    assert _log.CHECKPOINT_EVERY > CHECKPOINT_EVERY  # the package's own is larger
    monkeypatch.setattr(_log, "CHECKPOINT_EVERY", CHECKPOINT_EVERY)


def _address(root, name: str = "orders", **settings):
    return DurableQueue(str(root)).address(name, journal=False, **settings)


def _expire(address, dry_run: bool = False):
    return address.cleanup(dry_run=dry_run, now=time.time() + LATER)


def _send(address, start: int, n: int = 1) -> None:
    address.send(pa.table({"id": pa.array(range(start, start + n), pa.int64())}))


def _log_files(address) -> list[str]:
    return sorted(address.storage.list(f"{address.folder}/log"))


def _ids(address) -> list[int]:
    c = address.consumer(f"check-{os.urandom(4).hex()}", start="earliest")
    ids = c.receive(max_messages=10**9).column("id").to_pylist()
    c.delete()
    return ids


def test_cleanup_expires_entries_a_checkpoint_covers(root):
    a = _address(root, fsync=False)
    for i in range(2 * CHECKPOINT_EVERY + 30):
        _send(a, i)
    dry = _expire(a, dry_run=True)
    # entries 1..2N-1 and the checkpoint at N; the newest checkpoint (2N), its own entry and
    # everything after stay
    assert len(dry.log_files) == 2 * CHECKPOINT_EVERY
    assert checkpoint_name(CHECKPOINT_EVERY) in dry.log_files
    assert entry_name(2 * CHECKPOINT_EVERY - 1) in dry.log_files
    assert len(_log_files(a)) > 2 * CHECKPOINT_EVERY  # a dry run deletes nothing
    report = _expire(a)
    assert report.log_files == dry.log_files
    left = _log_files(a)
    assert entry_name(2 * CHECKPOINT_EVERY) in left
    assert checkpoint_name(2 * CHECKPOINT_EVERY) in left
    assert entry_name(2 * CHECKPOINT_EVERY - 1) not in left
    # a fresh process opens the address from the checkpoint and sees everything
    again = _address(root)
    assert again.stats()["messages"] == 2 * CHECKPOINT_EVERY + 30
    assert _ids(again) == list(range(2 * CHECKPOINT_EVERY + 30))
    _send(again, 10_000)
    assert _ids(_address(root))[-1] == 10_000


def test_retention_has_a_floor():
    with pytest.raises(InvalidOptionError, match="logRetentionMs"):
        _address("memory://floor", log_retention_ms=1000)


def test_young_entries_are_kept(tmp_path):
    a = _address(tmp_path, fsync=False)  # one hour by default
    for i in range(CHECKPOINT_EVERY + 5):
        _send(a, i)
    assert a.cleanup(dry_run=False).log_files == []
    report = a.cleanup(dry_run=True, now=a.log.state.last_ts / 1e6 + LATER)
    assert len(report.log_files) == CHECKPOINT_EVERY - 1


def test_a_stale_writer_never_reuses_an_expired_number(root):
    stale = _address(root, fsync=False)
    _send(stale, 0)  # this handle's view ends at entry 1
    busy = _address(root)
    for i in range(1, 2 * CHECKPOINT_EVERY + 10):
        _send(busy, i)
    _expire(busy)
    assert entry_name(2) not in _log_files(busy)
    # Expiring entries takes logRetentionMs (at least MIN_RETENTION_S) of real time, which
    # this test skips with `now=`: the stale view's last check ages by as much.
    stale.log._verified -= MIN_RETENTION_S
    # entry 2's name is free again, but the stale handle must not publish there
    _send(stale, 5_000)
    ids = _ids(_address(root))
    assert ids == [*range(2 * CHECKPOINT_EVERY + 10), 5_000]
    state = _address(root).log.refresh()
    assert state.next_seq == 2 * CHECKPOINT_EVERY + 11  # _seq stays dense
    assert entry_name(2) not in _log_files(busy)


def test_a_stale_reader_reloads_instead_of_waiting_forever(root, monkeypatch):
    monkeypatch.setattr(_log, "VERIFY_EVERY_S", 0.0)
    reader = _address(root, fsync=False)
    _send(reader, 0)
    consumer = reader.consumer("c", start="earliest")
    assert consumer.receive().column("id").to_pylist() == [0]
    consumer.ack()
    busy = _address(root)
    for i in range(1, 2 * CHECKPOINT_EVERY + 10):
        _send(busy, i)
    _expire(busy)
    got = consumer.receive(max_messages=10**9).column("id").to_pylist()
    assert got == list(range(1, 2 * CHECKPOINT_EVERY + 10))


def test_a_partly_expired_log_opens(tmp_path):
    # cleanup killed half way: the oldest checkpoint and entries are gone, the rest is there
    a = _address(tmp_path, fsync=False)
    for i in range(2 * CHECKPOINT_EVERY + 3):
        _send(a, i)
    folder = tmp_path / "orders" / "log"
    os.unlink(folder / checkpoint_name(CHECKPOINT_EVERY))
    for v in range(1, CHECKPOINT_EVERY // 2 + 1):
        os.unlink(folder / entry_name(v))
    assert _ids(_address(tmp_path)) == list(
        range(2 * CHECKPOINT_EVERY + 3))


def test_expired_log_without_a_readable_checkpoint_is_a_clear_error(tmp_path):
    a = _address(tmp_path, fsync=False)
    for i in range(CHECKPOINT_EVERY + 3):
        _send(a, i)
    _expire(a)
    (tmp_path / "orders" / "log" / checkpoint_name(CHECKPOINT_EVERY)).write_bytes(b"garbage")
    with pytest.raises(StorageError, match="expired and no checkpoint is readable"):
        _address(tmp_path).stats()


def test_a_late_checkpoint_cannot_bring_back_an_old_view(tmp_path):
    # A writer published entry N (CHECKPOINT_EVERY) and stalled past the retention before
    # writing checkpoint N (and setting the hint back to it); meanwhile the log moved on and was
    # expired.
    a = _address(tmp_path, fsync=False)
    for i in range(CHECKPOINT_EVERY):
        _send(a, i)
    late = a.log.state  # the writer's view after entry N
    folder = tmp_path / "orders" / "log"
    os.unlink(folder / checkpoint_name(CHECKPOINT_EVERY))  # "not written yet"
    for i in range(CHECKPOINT_EVERY, 3 * CHECKPOINT_EVERY + 10):
        _send(a, i)
    _expire(a)
    assert not (folder / entry_name(CHECKPOINT_EVERY)).exists()
    a.log.write_checkpoint(late)  # the stalled writer resumes
    (folder / "_last_checkpoint").write_text(json.dumps({"version": CHECKPOINT_EVERY}))
    fresh = _address(tmp_path)
    assert fresh.state.version == 3 * CHECKPOINT_EVERY + 10
    assert fresh.send(pa.table({"id": pa.array([99_999], pa.int64())})).seq == \
        3 * CHECKPOINT_EVERY + 10
    assert _ids(_address(tmp_path)) == [
        *range(3 * CHECKPOINT_EVERY + 10), 99_999]


def test_a_drop_that_loses_a_race_gets_a_fresh_time(tmp_path):
    # The DROP policy publishes its entry again after losing a race for an entry number: its
    # time must not go back, or later writers would not recognise the entry their view ends
    # with and would withdraw their own commits forever.
    a = _address(tmp_path, max_size_messages=1,
                                            address_full_policy="DROP", fsync=False)
    b = _address(tmp_path)
    b._sends = SendQueue()  # another process's sends, not in this process's groups
    # Writers on a local disk queue for the log (flock); racing as on an object store:
    a.log.storage.lock = lambda path: contextlib.nullcontext()
    # its publish lock: Storage.lock for each block (the no-op above), not a kept flock
    a.log.storage.kept_lock = lambda path: KeptLock(a.log.storage, path)
    _send(a, 0)
    create = a.log.storage.create
    raced = []

    def other_writer_wins(path, data, **kwargs):
        if not raced and "/log/" in path:
            time.sleep(0.01)  # the winner's entry gets a later time
            raced.append(b.send(pa.table({"id": pa.array([1], pa.int64())})))
        return create(path, data, **kwargs)

    a.log.storage.create = other_writer_wins
    assert a.send(pa.table({"id": pa.array([2], pa.int64())})).dropped
    assert raced and raced[0].dropped
    a.log.storage.create = create
    state = _address(tmp_path).log.refresh()
    entries = [a.log.read_entry(v) for v in range(1, state.version + 1)]
    assert [e["ts"] for e in entries] == sorted(e["ts"] for e in entries)
    assert len({e["id"] for e in entries}) == len(entries)
    done = []
    worker = threading.Thread(daemon=True, target=lambda: done.append(
        _address(tmp_path).send(
            pa.table({"id": pa.array([3], pa.int64())}))))
    worker.start()
    worker.join(timeout=30)
    assert done and done[0].dropped, "the next publish is stuck"
    assert _address(tmp_path).stats()["dropped_sends"] == 3


def test_a_reader_polling_often_still_notices_an_expired_view(tmp_path, monkeypatch):
    # Its view can go stale without a pause between polls (a suspended machine, a replay
    # slower than the retention); here cleanup's clock is ahead. It must check again anyway.
    monkeypatch.setattr(_log, "VERIFY_EVERY_S", 0.3)
    reader = _address(tmp_path, fsync=False)
    _send(reader, 0)
    consumer = reader.consumer("c", start="earliest")
    consumer.ack(consumer.receive())
    busy = _address(tmp_path)
    for i in range(1, 2 * CHECKPOINT_EVERY + 10):
        _send(busy, i)
    _expire(busy)
    got: list[int] = []
    deadline = time.monotonic() + 5
    while len(got) < 2 * CHECKPOINT_EVERY + 9 and time.monotonic() < deadline:
        batch = consumer.receive(max_messages=10**6)
        got += batch.column("id").to_pylist()
        consumer.ack(batch)
        time.sleep(0.05)  # polls far more often than VERIFY_EVERY_S
    assert got == list(range(1, 2 * CHECKPOINT_EVERY + 10))


def test_a_half_written_predecessor_is_not_the_view_s_entry(tmp_path):
    # Without hard links, a stale writer may be re-creating the freed number of the entry a
    # view ends with; a view only ever applied complete entries, so that file is not its own.
    a = _address(tmp_path, fsync=False)
    for i in range(3):
        _send(a, i)
    state = a.log.refresh()
    assert a.log._still_there(state)
    (tmp_path / "orders" / "log" / entry_name(3)).write_bytes(b'{"op": "app')
    assert not a.log._still_there(state)


def test_a_log_written_before_entries_had_ids_opens(tmp_path):
    # The previous release republished a DROP entry after a lost race with its first time.
    _address(tmp_path)
    older_format(tmp_path, "orders", 3)  # it wrote entries without checksums
    a = _address(tmp_path, fsync=False)
    for i in range(3):
        _send(a, i)
    del a  # its view of the log, which this process's sends build on, is the release's own
    folder = tmp_path / "orders" / "log"
    entries = [json.loads((folder / entry_name(v)).read_text()) for v in (1, 2, 3)]
    for v, entry in enumerate(entries, 1):
        entry.pop("id")
        if v == 3:  # a drop whose time is earlier than the entry before it
            entry = {"op": "drop", "dropped": {"messages": 1, "bytes": 10},
                     "ts": entries[1]["ts"] - 5, "v": 1}
        (folder / entry_name(v)).write_text(json.dumps(entry))
    legacy = _address(tmp_path)
    assert legacy.stats()["dropped_sends"] == 1
    done: list = []
    worker = threading.Thread(daemon=True, target=lambda: done.append(_send(legacy, 7)))
    worker.start()
    worker.join(timeout=30)
    assert done, "publishing on a legacy log is stuck"
    assert _ids(_address(tmp_path)) == [0, 1, 7]


def test_a_failing_check_after_publishing_does_not_fail_the_send(tmp_path, monkeypatch):
    a = _address(tmp_path, fsync=False)
    _send(a, 0)

    def unreadable(version):
        raise StorageError(5, "simulated read error")

    monkeypatch.setattr(a.log, "read_entry", unreadable)
    _send(a, 1)  # published: must not raise, or the caller would send it again
    monkeypatch.undo()
    assert _ids(_address(tmp_path)) == [0, 1]
