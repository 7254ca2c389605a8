"""Commit-log retention: cleanup deletes entries a checkpoint covers once they are older than
``log_retention_ms``, and processes whose view of the log is older than that never take a
deleted entry's number for a new commit, nor keep reading a log that moved on without them."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue, StorageError, _log
from pyspark_durable_queue._log import CHECKPOINT_EVERY, checkpoint_name, entry_name


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
    a = DurableQueue(root).address("orders", log_retention_ms=0, fsync=False)
    for i in range(2 * CHECKPOINT_EVERY + 30):
        _send(a, i)
    dry = a.cleanup(dry_run=True)
    # entries 1..200 and the checkpoint at 100; the newest checkpoint (200) and later stay
    assert len(dry.log_files) == 2 * CHECKPOINT_EVERY + 1
    assert checkpoint_name(CHECKPOINT_EVERY) in dry.log_files
    assert checkpoint_name(2 * CHECKPOINT_EVERY) not in dry.log_files
    assert len(_log_files(a)) > 2 * CHECKPOINT_EVERY  # a dry run deletes nothing
    report = a.cleanup(dry_run=False)
    assert report.log_files == dry.log_files
    left = _log_files(a)
    assert entry_name(2 * CHECKPOINT_EVERY + 1) in left
    assert entry_name(2 * CHECKPOINT_EVERY) not in left
    # a fresh process opens the address from the checkpoint and sees everything
    again = DurableQueue(root).address("orders")
    assert again.stats()["messages"] == 2 * CHECKPOINT_EVERY + 30
    assert _ids(again) == list(range(2 * CHECKPOINT_EVERY + 30))
    _send(again, 10_000)
    assert _ids(DurableQueue(root).address("orders"))[-1] == 10_000


def test_young_entries_are_kept(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders", fsync=False)  # one hour by default
    for i in range(CHECKPOINT_EVERY + 5):
        _send(a, i)
    assert a.cleanup(dry_run=False).log_files == []
    report = a.cleanup(dry_run=True, now=a.log.state.last_ts / 1e6 + 7200)
    assert len(report.log_files) == CHECKPOINT_EVERY


def test_a_stale_writer_never_reuses_an_expired_number(root):
    q = DurableQueue(root)
    stale = q.address("orders", log_retention_ms=0, fsync=False)
    _send(stale, 0)  # this handle's view ends at entry 1
    busy = DurableQueue(root).address("orders")
    for i in range(1, 2 * CHECKPOINT_EVERY + 10):
        _send(busy, i)
    busy.cleanup(dry_run=False)
    assert entry_name(2) not in _log_files(busy)
    # entry 2's name is free again, but the stale handle must not publish there
    _send(stale, 5_000)
    ids = _ids(DurableQueue(root).address("orders"))
    assert ids == [*range(2 * CHECKPOINT_EVERY + 10), 5_000]
    state = DurableQueue(root).address("orders").log.refresh()
    assert state.next_seq == 2 * CHECKPOINT_EVERY + 11  # _seq stays dense
    assert entry_name(2) not in _log_files(busy)


def test_a_stale_reader_reloads_instead_of_waiting_forever(root, monkeypatch):
    monkeypatch.setattr(_log, "VERIFY_EVERY_S", 0.0)
    reader = DurableQueue(root).address("orders", log_retention_ms=0, fsync=False)
    _send(reader, 0)
    consumer = reader.consumer("c", start="earliest")
    assert consumer.receive().column("id").to_pylist() == [0]
    consumer.ack()
    busy = DurableQueue(root).address("orders")
    for i in range(1, 2 * CHECKPOINT_EVERY + 10):
        _send(busy, i)
    busy.cleanup(dry_run=False)
    got = consumer.receive(max_messages=10**9).column("id").to_pylist()
    assert got == list(range(1, 2 * CHECKPOINT_EVERY + 10))


def test_a_partly_expired_log_opens(tmp_path):
    # cleanup killed half way: the oldest checkpoint and entries are gone, the rest is there
    a = DurableQueue(str(tmp_path)).address("orders", fsync=False)
    for i in range(2 * CHECKPOINT_EVERY + 3):
        _send(a, i)
    folder = tmp_path / "orders" / "log"
    os.unlink(folder / checkpoint_name(CHECKPOINT_EVERY))
    for v in range(1, 57):
        os.unlink(folder / entry_name(v))
    assert _ids(DurableQueue(str(tmp_path)).address("orders")) == list(
        range(2 * CHECKPOINT_EVERY + 3))


def test_expired_log_without_a_readable_checkpoint_is_a_clear_error(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders", log_retention_ms=0, fsync=False)
    for i in range(CHECKPOINT_EVERY + 3):
        _send(a, i)
    a.cleanup(dry_run=False)
    (tmp_path / "orders" / "log" / checkpoint_name(CHECKPOINT_EVERY)).write_bytes(b"garbage")
    with pytest.raises(StorageError, match="expired and no checkpoint is readable"):
        DurableQueue(str(tmp_path)).address("orders").stats()
