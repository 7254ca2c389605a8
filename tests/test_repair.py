"""Repair: a damaged last log entry left by a killed writer, and damaged pages.

The damage is made on the real store the way it happens: a log entry cut short (what a writer
killed while writing leaves where entries are created with ``O_EXCL``), a page file with a
flipped byte (bit rot), a page file gone. Run on ``file://``, ``memory://`` and S3.

The subject is the file-per-commit layout (log entry files, page files): addresses are created
with ``journal=False``. Repair of a journal's torn tail is tested in test_journal.py.
"""

from __future__ import annotations

import json
import logging
import os
import time

import pyarrow as pa
import pytest
from conftest import raw_write

from pyspark_durable_queue import DamagedLogError, DurableQueue, StorageError
from pyspark_durable_queue._format import checked
from pyspark_durable_queue._log.commit_log import CHECKPOINT_EVERY, CommitLog, entry_name
from pyspark_durable_queue._storage import NoLinksLocalStorage, open_storage
from pyspark_durable_queue.cli import main

NAME = "orders"
HOUR = 3600.0


def address(root, **settings):
    return DurableQueue(root).address(NAME, journal=False, **settings)


def fill(root, sends: int = 3, rows: int = 100) -> None:
    a = address(root, page_size_bytes=4096)
    for k in range(sends):
        a.send(pa.table({"i": pa.array(range(k * rows, (k + 1) * rows), pa.int64())}))


def cut_short_entry(root, version: int) -> str:
    """Entry ``version`` as a writer killed halfway through writing it leaves it."""
    a = address(root)
    full = json.dumps({"op": "append", "seq": 300, "pages": [{"name": "x.page", "rows": 1,
                                                               "bytes": 9, "stats": {}}]})
    path = f"{a.log.folder}/{entry_name(version)}"
    raw_write(a.storage, path, full[: len(full) // 2].encode())
    return path


def all_ids(root) -> list[int]:
    c = address(root).consumer("audit", start="earliest")
    try:
        return c.receive(max_messages=10**6).column("i").to_pylist()
    finally:
        c.delete()


def damage_page(a, name: str) -> None:
    """Flip one byte in the middle of a page's first frame (its checksum no longer holds)."""
    path = f"{a.pages_folder}/{name}"
    data = bytearray(a.storage.read(path))
    data[len(data) // 3] ^= 0xFF
    raw_write(a.storage, path, bytes(data))


# -- the log ------------------------------------------------------------------------------------
def test_a_cut_short_last_entry_is_set_aside(root):
    fill(root)
    cut_short_entry(root, 4)
    with pytest.raises(DamagedLogError, match="repair") as err:
        address(root).log.refresh()
    assert err.value.partial and err.value.version == 4

    # too young to be abandoned: its writer may still be writing it
    report = address(root).repair(dry_run=False)
    assert report.waiting == entry_name(4) and report.log_entry is None
    # old enough: a dry run reports, changes nothing
    report = address(root).repair(now=time.time() + HOUR)
    assert report.log_entry == entry_name(4) and report.dry_run
    with pytest.raises(DamagedLogError):
        address(root).log.refresh()

    report = address(root).repair(dry_run=False, now=time.time() + HOUR)
    assert report.log_entry == entry_name(4) and report.pages == [] and report.pages_checked
    assert all_ids(root) == list(range(300))  # everything acknowledged is still there
    r = address(root).send([{"i": 300}])
    assert (r.version, r.seq) == (4, 300)  # the entry number is free again, _seq dense
    a = address(root)
    kept = a.storage.list(f"{a.folder}/damaged")
    assert len(kept) == 1 and kept[0].endswith(entry_name(4))  # set aside, not deleted


def test_a_damaged_entry_with_successors_is_left_alone(root):
    fill(root)
    a = address(root)
    path = f"{a.log.folder}/{entry_name(2)}"
    a.storage.replace(path, b'{"op": "app')
    with pytest.raises(DamagedLogError) as err:
        address(root).repair(dry_run=False, now=time.time() + HOUR)
    assert err.value.version == 2  # no crash leaves this: a person has to look
    assert a.storage.exists(path)


def test_a_malformed_entry_is_not_taken_for_a_crash(root):
    fill(root)
    a = address(root)
    raw_write(a.storage, f"{a.log.folder}/{entry_name(4)}",  # checksummed, as format 5 writes
              checked.dumps({"op": "append", "seq": "x"}))
    with pytest.raises(DamagedLogError) as err:
        address(root).repair(dry_run=False, now=time.time() + HOUR)
    assert not err.value.partial


# -- pages --------------------------------------------------------------------------------------
def test_damaged_pages_are_taken_out_and_recorded_as_lost(root, caplog):
    fill(root, sends=4)
    a = address(root)
    pages = list(a.state.pages.names)
    seqs = list(a.state.pages.seq)
    ends = list(a.state.pages.ends)
    assert len(pages) >= 4
    damage_page(a, pages[1])
    a.storage.delete(f"{a.pages_folder}/{pages[2]}")
    consumer = a.consumer("slow", start="earliest")

    report = address(root).repair()  # dry run
    assert [(p.page, p.problem) for p in report.pages] == [(pages[1], "corrupt"),
                                                           (pages[2], "missing")]
    assert report.lost == [(seqs[1], ends[2])]  # adjacent pages, one range
    assert address(root).state.pages.names == pages

    report = address(root).repair(dry_run=False)
    assert report.lost == [(seqs[1], ends[2])]
    a = address(root)
    assert a.state.pages.names == [p for p in pages if p not in pages[1:3]]
    assert a.state.lost == [(seqs[1], ends[2])]
    assert [n.split("-", 1)[1] for n in a.storage.list(f"{a.folder}/damaged")] == [pages[1]]
    assert address(root).repair().clean

    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        got = consumer.receive(max_messages=10**6).column("i").to_pylist()
    assert got == [i for i in range(400) if not seqs[1] <= i < ends[2]]
    assert f"_seq {seqs[1]}..{ends[2] - 1} are lost" in caplog.text


def test_lost_ranges_survive_a_checkpoint(tmp_path):
    root = str(tmp_path / "dq")
    fill(root, sends=2, rows=50)
    a = address(root)
    a.storage.delete(f"{a.pages_folder}/{a.state.pages.names[0]}")
    lost = a.repair(dry_run=False).lost
    one = pa.table({"i": pa.array([0], pa.int64())})
    a = address(root, fsync=False)
    while a.state.version < CHECKPOINT_EVERY:
        a.send(one)
    fresh = CommitLog(open_storage(root), f"{root}/{NAME}/log")
    assert fresh.state.checkpoint == CHECKPOINT_EVERY and fresh.state.lost == lost


def test_repair_on_a_healthy_address_does_nothing(root):
    fill(root)
    report = address(root).repair(dry_run=False)
    assert report.clean and report.pages_checked == len(address(root).state.pages)
    assert address(root).state.version == 3


# -- a writer whose entry repair set aside ------------------------------------------------------
def test_a_writer_whose_entry_was_set_aside_does_not_report_success(tmp_path, monkeypatch):
    # Without hard links an entry is visible while its writer writes it. Repair, run with a
    # writer stalled past the grace period, moves it away: that writer must fail, not return
    # as if it had published.
    s = NoLinksLocalStorage(str(tmp_path))
    path = os.path.join(str(tmp_path), "00000000000000000001.json")
    real_fsync = os.fsync

    def stalled_then_repaired(fd):
        if os.path.exists(path):
            os.replace(path, path + ".set-aside")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", stalled_then_repaired)
    with pytest.raises(StorageError, match="set aside"):
        s.create(path, b'{"op": "append"}')
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert s.create(path, b'{"op": "append"}')  # the number is free for the next attempt


# -- the command line ---------------------------------------------------------------------------
def test_cli_verify_and_repair(tmp_path, capsys):
    root = str(tmp_path / "dq")
    fill(root)
    a = address(root)
    damage_page(a, a.state.pages.names[0])
    assert main([root, "verify", NAME]) == 1
    assert "corrupt" in capsys.readouterr().out
    assert main([root, "repair", NAME]) == 1  # dry run with work to do
    out = capsys.readouterr().out
    assert "would set aside page" in out and "--apply" in out
    assert main([root, "--json", "repair", NAME, "--apply"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["lost"] and not done["dry_run"]
    assert main([root, "verify", NAME]) == 0

    cut_short_entry(root, address(root).state.version + 1)
    assert main([root, "verify", NAME]) == 1
    assert "commit log is damaged" in capsys.readouterr().out
    assert main([root, "repair", NAME, "--apply", "--grace-ms", "0"]) == 0
    assert "set aside the damaged last commit-log entry" in capsys.readouterr().out
    assert main([root, "verify", NAME]) == 0
