"""The local journal (on-disk format 4): commits as units appended to rolling segments.

Crash and multi-process tests are in test_journal_crash.py and test_journal_concurrency.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import time
import tracemalloc

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.frame import FRAME_HEAD
from pyspark_durable_queue._log.commit_log import JOURNAL_CHECKPOINT_EVERY
from pyspark_durable_queue._log.index import PageIndex, PageRef
from pyspark_durable_queue._log.journal import _UNIT_HEAD, HEAD, STATS_MIN_BYTES, is_segment
from pyspark_durable_queue.errors import CorruptPageError, DamagedLogError


def _journal(root, name="orders", **settings):
    settings.setdefault("fsync", "never")  # the tests check structure, not durability
    return DurableQueue(str(root)).address(name, journal=True, **settings)


def _files(root, name="orders"):
    pages = sorted(os.listdir(os.path.join(root, name, "pages")))
    log = sorted(os.listdir(os.path.join(root, name, "log")))
    return pages, log


def _read_all(address, consumer="audit"):
    c = address.consumer(consumer, start="earliest")
    table = c.receive(max_messages=1_000_000)
    c.close()
    return table


def test_a_journal_address_keeps_its_commits_in_segments_not_a_file_each(tmp_path):
    a = _journal(tmp_path)
    for i in range(200):
        a.send([{"n": i}])
    with open(os.path.join(tmp_path, "orders", "address.json")) as f:
        meta = json.load(f)
    assert meta["format"] == 5 and meta["journal"]
    pages, log = _files(tmp_path)
    assert pages == ["00000000000000000001.dqj"]
    assert not [n for n in log if n.endswith(".json")]  # no log entry files
    t = _read_all(DurableQueue(str(tmp_path)).address("orders"))  # another handle replays
    assert t.column("n").to_pylist() == list(range(200))
    assert t.column("_seq").to_pylist() == list(range(200))
    times = t.column("_timestamp").cast(pa.int64()).to_pylist()
    assert times == sorted(times) and times[0] < times[-1]  # each unit has its own time


def test_one_index_row_per_run_of_units_not_per_commit(tmp_path):
    a = _journal(tmp_path)
    for i in range(50):
        a.send([{"n": i}])
    state = a.log.refresh()
    assert len(state.pages) == 1 and state.pages.rows[0] == 50
    ref = state.pages.ref(0)
    assert ref.span is not None and ref.span[0] == HEAD and ref.bytes == ref.span[1] - HEAD
    assert state.pages.stats(0) is None  # journal rows carry no column statistics


def test_segments_roll_at_the_page_size(tmp_path):
    a = _journal(tmp_path, page_size_bytes=4096)
    for i in range(300):
        a.send([{"n": i, "body": "x" * 40}])
    pages, _ = _files(tmp_path)
    assert len(pages) > 10 and all(is_segment(p) for p in pages)
    for name in pages[:-1]:
        assert os.path.getsize(os.path.join(tmp_path, "orders", "pages", name)) <= 4096 + 32
    b = DurableQueue(str(tmp_path)).address("orders")
    assert _read_all(b).column("n").to_pylist() == list(range(300))
    assert len(b.log.refresh().pages) == len(pages)  # a row per segment


def test_a_unit_larger_than_a_page_gets_a_segment_of_its_own(tmp_path):
    a = _journal(tmp_path, page_size_bytes=4096)
    a.send([{"n": 0, "body": "small"}])
    a.send([{"n": i, "body": "y" * 100} for i in range(1, 200)])  # ~20 KB in one commit
    a.send([{"n": 200, "body": "small"}])
    pages, _ = _files(tmp_path)
    assert len(pages) == 3
    t = _read_all(DurableQueue(str(tmp_path)).address("orders"))
    assert t.column("n").to_pylist() == list(range(201))


def test_opening_replays_from_the_newest_checkpoint(tmp_path):
    a = _journal(tmp_path, page_size_bytes=64 * 1024)
    n = JOURNAL_CHECKPOINT_EVERY + 20
    for i in range(n):
        a.send([{"n": i}])
    _, log = _files(tmp_path)
    assert f"{JOURNAL_CHECKPOINT_EVERY:020d}.checkpoint.arrow" in log
    b = DurableQueue(str(tmp_path)).address("orders")
    state = b.log.refresh()
    assert state.checkpoint == JOURNAL_CHECKPOINT_EVERY and state.version == n
    assert state.journal == a.log.refresh().journal
    assert _read_all(b).column("n").to_pylist() == list(range(n))


def test_cleanup_removes_consumed_segments_once_a_checkpoint_passed_them(tmp_path):
    a = _journal(tmp_path, page_size_bytes=8192, cleanup_interval_ms=0)
    c = a.consumer("billing", start="earliest")
    n = JOURNAL_CHECKPOINT_EVERY + 100
    for i in range(n):
        a.send([{"n": i}])
    before, _ = _files(tmp_path)
    got = c.receive(max_messages=n)
    assert got.num_rows == n
    c.ack(got)
    a.cleanup(dry_run=False)
    after, _ = _files(tmp_path)
    checkpoint = a.log.checkpoint_position()
    assert checkpoint is not None
    assert after and len(after) < len(before)
    # kept: the segment being written and every one from the checkpoint's on
    assert min(int(p.split(".")[0]) for p in after) == checkpoint.segment
    b = DurableQueue(str(tmp_path)).address("orders")  # opens from the checkpoint
    b.send([{"n": n}])
    first = b.snapshot().first_seq  # the segment being written stays whole
    assert 0 < first < n
    fresh = b.consumer("late", start="earliest").receive(max_messages=n)
    assert fresh.column("n").to_pylist() == list(range(first, n + 1))
    assert c.receive(max_messages=10).column("n").to_pylist() == [n]


def test_a_handle_whose_segment_was_cleaned_up_reloads(tmp_path):
    a = _journal(tmp_path, page_size_bytes=8192, cleanup_interval_ms=0)
    stale = DurableQueue(str(tmp_path)).address("orders")
    a.send([{"n": -1}])
    stale.log.refresh()  # a view in segment 1
    c = a.consumer("billing", start="earliest")
    n = JOURNAL_CHECKPOINT_EVERY + 100
    for i in range(n):
        a.send([{"n": i}])
    c.ack(c.receive(max_messages=n + 1))
    a.cleanup(dry_run=False)
    assert "00000000000000000001.dqj" not in _files(tmp_path)[0]
    assert stale.log.refresh().version == a.log.refresh().version
    stale.send([{"n": n}])
    assert a.consumer("billing").receive(max_messages=5).column("n").to_pylist() == [n]


def test_selectors_and_time_positions_read_journal_rows(tmp_path):
    a = _journal(tmp_path)
    for i in range(20):
        a.send([{"n": i, "region": "EU" if i % 2 else "US"}])
    time.sleep(0.01)
    middle = dt.datetime.now(dt.timezone.utc)
    time.sleep(0.01)
    for i in range(20, 40):
        a.send([{"n": i, "region": "EU" if i % 2 else "US"}])
    eu = a.consumer("eu", selector="region = 'EU' AND n > 10", start="earliest")
    assert eu.receive(max_messages=100).column("n").to_pylist() == list(range(11, 40, 2))
    late = a.consumer("late", selector=f"_timestamp >= {int(middle.timestamp() * 1000)}",
                      start="earliest")
    assert late.receive(max_messages=100).column("n").to_pylist() == list(range(20, 40))
    since = a.consumer("since", start=middle).receive(max_messages=100)
    assert since.column("n").to_pylist() == list(range(20, 40))  # found inside the row
    assert len(a.log.refresh().pages) == 1
    # without reading the row (a LogState), the row's start: early, never late
    assert a.log.refresh().seek_time(int(middle.timestamp() * 1e6)) == 0


def test_pages_written_apart_are_published_by_a_unit_without_frames(tmp_path):
    # what the Spark sink does: tasks write page files, the driver commits them
    a = _journal(tmp_path)
    a.send([{"n": 0}])
    writer = a.page_writer()
    writer.write(pa.table({"n": pa.array([1, 2, 3], pa.int64())}))
    pages = writer.close()
    a.commit(pages, pa.schema([("n", pa.int64())]))
    a.send([{"n": 4}])
    names = _files(tmp_path)[0]
    assert len([n for n in names if n.endswith(".page")]) == 1
    t = _read_all(DurableQueue(str(tmp_path)).address("orders"))
    assert t.column("n").to_pylist() == [0, 1, 2, 3, 4]


def test_existing_addresses_and_other_backends_keep_a_file_per_commit(tmp_path):
    DurableQueue(str(tmp_path)).address("old", journal=False).send([{"n": 0}])
    old = DurableQueue(str(tmp_path)).address("old", journal=True)
    old.send([{"n": 1}])
    assert not old.format.journal and old.log.journal is None
    assert not [n for n in os.listdir(tmp_path / "old" / "pages") if is_segment(n)]
    mem = DurableQueue("memory://journal-test").address("m", journal=True)
    mem.send([{"n": 0}])
    assert not mem.format.journal and mem.log.journal is None


def test_page_refs_of_journal_rows_travel_with_their_range():
    ref = PageRef("00000000000000000001.dqj", 10, 5, 900, 123, span=(32, 932))
    for copy in (pickle.loads(pickle.dumps(ref)), PageRef.from_dict(ref.to_dict())):
        assert copy == ref and copy.span == (32, 932)
    assert ref.slice(12, 14).span == (32, 932)


def test_the_index_merges_a_segments_units_and_checkpoints_keep_the_ranges():
    index = PageIndex()
    index.add("a.page", 0, 10, 1000, 1, {"rows": 10, "columns": {}})
    index.add("1.dqj", 10, 1, 100, 2, {}, (32, 132))
    index.add("1.dqj", 11, 2, 150, 3, {}, (132, 282))
    index.add("1.dqj", 13, 1, 90, 4, {}, (400, 490))  # not contiguous: a row of its own
    assert index.rows == [10, 3, 1] and index.spans == [None, (32, 282), (400, 490)]
    assert index.ts == [1, 2, 4] and index.ts_last == [1, 3, 4]
    assert index.seek_time(3, 99) == 10  # inside the merged row: its start
    back = PageIndex.from_table(index.to_table())
    assert back.spans == index.spans and back.ts_last == index.ts_last
    assert back.ends == index.ends and back.bytes == index.bytes


def test_durable_sends_on_a_journal_address(tmp_path):
    a = _journal(tmp_path, fsync="always")
    results = [a.send([{"n": i}]) for i in range(20)]
    assert [r.seq for r in results] == list(range(20))
    assert _read_all(DurableQueue(str(tmp_path)).address("orders")).num_rows == 20


@pytest.mark.parametrize("threads", [4])
def test_concurrent_sends_share_one_segment(tmp_path, threads):
    import threading

    a = _journal(tmp_path)
    done: list[int] = []

    def body(k: int) -> None:
        for i in range(100):
            done.append(a.send([{"n": k * 1000 + i}]).seq)

    ts = [threading.Thread(target=body, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(done) == list(range(threads * 100))
    assert _files(tmp_path)[0] == ["00000000000000000001.dqj"]
    got = _read_all(DurableQueue(str(tmp_path)).address("orders")).column("n").to_pylist()
    for k in range(threads):
        assert [x for x in got if x // 1000 == k] == [k * 1000 + i for i in range(100)]


def test_verify_reads_journal_ranges_and_finds_a_damaged_unit(tmp_path):
    a = _journal(tmp_path, fsync="always")
    for i in range(30):
        a.send([{"n": i, "body": "z" * 50}])
    report = a.repair(dry_run=True)
    assert report.clean and report.pages_checked == 1
    path = os.path.join(tmp_path, "orders", "pages", "00000000000000000001.dqj")
    with open(path, "r+b") as f:  # flip a byte inside a published frame (a bad disk)
        data = f.read(4096)
        at = data.index(b"z" * 50) + 10
        f.seek(at)
        f.write(b"Z")
    # a view that applied the unit before: verify finds the damaged frame
    report = a.repair(dry_run=True)
    assert not report.clean and report.pages[0].problem == "corrupt"
    assert report.lost == [(0, 30)]
    # a fresh view stops at the damaged unit: every page of it is written, so it is damage,
    # not the journal's end (a writer would overwrite what follows)
    # (another fsync mode: its own view of the log, not the one this process's sends share)
    fresh = DurableQueue(str(tmp_path)).address("orders", fsync="never")
    with pytest.raises(DamagedLogError, match="every 4 KiB block written"):
        fresh.send([{"n": 30}])
    assert os.path.getsize(path) > 0 and a.log.refresh().next_seq == 30


def _unit_spans(path: str) -> list[tuple[int, int]]:
    data = open(path, "rb").read()
    starts = _unit_offsets(path)
    spans = []
    for at in starts:
        _m, _c, _v, _p, entry_len, frames_len = _UNIT_HEAD.unpack_from(data, at)
        spans.append((at, at + _UNIT_HEAD.size + entry_len + frames_len))
    return spans


def test_without_syncs_a_lost_page_before_intact_units_is_a_lost_tail(tmp_path):
    # fsync=never: a power failure may keep a later unit's page and not an earlier one's
    a = _journal(tmp_path, fsync="never")
    for i in range(12):
        a.send([{"n": i, "pad": "p" * 3000}])
    path = os.path.join(tmp_path, "orders", "pages", "00000000000000000001.dqj")
    at, end = _unit_spans(path)[10]  # unit 11
    page = (at // 4096 + 1) * 4096
    assert page < end
    with open(path, "r+b") as f:  # its second page was not persisted
        f.seek(page)
        f.write(bytes(4096))
    fresh = DurableQueue(str(tmp_path)).address("orders")
    assert fresh.log.refresh().next_seq == 10  # the units from the torn one on are lost
    fresh.send([{"n": 99, "pad": ""}])
    got = _read_all(DurableQueue(str(tmp_path)).address("orders")).column("n").to_pylist()
    assert got == [*range(10), 99]


def test_without_syncs_a_flipped_byte_before_intact_units_is_damage_not_a_lost_tail(tmp_path):
    # every page of the unit written: no power failure leaves that, whatever the fsync mode
    a = _journal(tmp_path, fsync="never")
    for i in range(12):
        a.send([{"n": i, "pad": "p" * 3000}])
    path = os.path.join(tmp_path, "orders", "pages", "00000000000000000001.dqj")
    at, _end = _unit_spans(path)[10]
    with open(path, "r+b") as f:
        data = f.read()
        pos = data.index(b"p" * 3000, at) + 100
        f.seek(pos)
        f.write(b"q")
    fresh = DurableQueue(str(tmp_path)).address("orders", fsync="always")
    with pytest.raises(DamagedLogError, match=f"00000000000000000001.dqj@{at} "):
        fresh.send([{"n": 99, "pad": ""}])
    with open(path, "rb") as f:
        assert f.read()[pos] == ord("q")  # nothing written over it


def test_an_address_made_again_under_its_name_is_read_afresh(tmp_path):
    a = _journal(tmp_path)
    for i in range(40):
        a.send([{"n": i, "body": "a" * (i % 7)}])
    assert _read_all(a).column("n").to_pylist() == list(range(40))
    DurableQueue(str(tmp_path)).delete_address("orders") if hasattr(
        DurableQueue, "delete_address") else a.storage.delete_tree(a.folder)
    b = _journal(tmp_path)
    for i in range(40):
        b.send([{"n": 100 + i, "body": "b" * (i % 5 + 3)}])
    assert _read_all(b).column("n").to_pylist() == [100 + i for i in range(40)]


def _elsewhere(code: str, root) -> None:
    """Run ``code`` (``q``: a DurableQueue of ``root``) in another process: a writer there
    shares no send queue, log view or open file with this one."""
    import subprocess
    import sys

    code = "import os, sys\nfrom pyspark_durable_queue import DurableQueue\n" \
        "q = DurableQueue(sys.argv[1])\n" + code
    subprocess.run([sys.executable, "-c", code, str(root)], check=True, timeout=120)


@pytest.mark.parametrize("how", ["deleted", "moved aside"])
@pytest.mark.parametrize("roll", [False, True])
def test_a_handle_kept_while_its_address_is_made_again_writes_to_the_new_one(tmp_path, how,
                                                                            roll):
    # Another process deletes the address (or moves its folder aside, as a restore would) and
    # makes it again; this process's handle, its open segment and its kept publish lock
    # belong to the old folder. Its next send (one that rolls the segment, too) must go to
    # the address as it is now, not into the old files.
    a = _journal(tmp_path, page_size_bytes=4096)
    for i in range(2):
        a.send([{"n": i, "pad": "x" * 1500}])
    away = "q.delete_address('orders')" if how == "deleted" else \
        "os.rename(sys.argv[1] + '/orders', sys.argv[1] + '/orders.aside')"
    _elsewhere(f"{away}\nq.address('orders', journal=True, page_size_bytes=4096)"
               ".send([{'n': 100, 'pad': ''}])\n", tmp_path)
    r = a.send([{"n": 1000, "pad": "y" * (1500 if roll else 1)}])
    assert r.seq == 1
    fresh = DurableQueue(str(tmp_path)).address("orders")
    assert _read_all(fresh).column("n").to_pylist() == [100, 1000]


def test_a_copy_of_a_handle_has_a_journal_of_its_own(tmp_path):
    # copy.copy(address) (a producer's forked child makes one) must not share the open segment
    # with the original: each looks at it under its own publish lock
    import copy

    a = _journal(tmp_path)
    a.send([{"n": 0}])
    b = copy.copy(a)
    assert b.log is not a.log and b.log.journal is not a.log.journal
    _elsewhere("q.delete_address('orders')\n"
               "q.address('orders', journal=True).send([{'n': 100}])\n", tmp_path)
    assert b.send([{"n": 1}]).seq == 1
    assert _read_all(DurableQueue(str(tmp_path)).address("orders")).column(
        "n").to_pylist() == [100, 1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["FAIL", "DROP"])
def test_a_full_journal_address_applies_its_policy(tmp_path, policy):
    # admission estimates a send's size from its Arrow table; a unit's frames are larger:
    # the commit must not be refused again and again for the difference (it looped)
    from pyspark_durable_queue import AddressFullError

    a = _journal(tmp_path, max_size_bytes=4096, address_full_policy=policy)
    outcomes = []
    for k in range(50):
        try:
            outcomes.append(a.send([{"n": k, "s": "z" * 100}]).dropped)
        except AddressFullError:
            outcomes.append("full")
    assert outcomes[0] is False
    assert (True if policy == "DROP" else "full") in outcomes


def _unit_offsets(path: str) -> list[int]:
    """Where each unit of a segment starts, walked from the file (not the reader's directory)."""
    from pyspark_durable_queue._log.journal import _UNIT_HEAD, UNITS
    data = open(path, "rb").read()
    at, found = HEAD, []
    while at + _UNIT_HEAD.size <= len(data):
        magic, _crc, _version, _prev, entry_len, frames_len = _UNIT_HEAD.unpack_from(data, at)
        if magic not in UNITS:
            break
        found.append(at)
        at += _UNIT_HEAD.size + entry_len + frames_len
    return found


def test_damage_to_the_last_unit_is_found_not_taken_for_a_torn_tail(tmp_path):
    import subprocess
    import sys

    a = _journal(tmp_path, fsync="always")  # each send returns after its unit is synced
    for i in range(3):
        a.send([{"n": i}])
    path = os.path.join(tmp_path, "orders", "pages", a.state.pages.names[0])
    last = _unit_offsets(path)[-1]
    assert len(_unit_offsets(path)) == 3
    with open(path, "r+b") as f:  # bit rot in the last unit's magic, after send returned
        f.seek(last)
        byte = f.read(1)
        f.seek(last)
        f.write(bytes([byte[0] ^ 0xFF]))
    code = ("import sys; from pyspark_durable_queue.cli import main\n"
            "sys.exit(main([sys.argv[1], 'verify', 'orders']))\n")
    verify = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    # (it said "1 of 1 pages verified, OK" with exit status 0, and the reader got 2 messages)
    assert verify.returncode == 1, verify.stdout
    assert f"{os.path.basename(path)}@{last}" in verify.stdout, verify.stdout
    with pytest.raises(DamagedLogError, match=f"@{last} "):
        DurableQueue(str(tmp_path)).address("orders").stats()


def test_repair_reports_and_zeroes_an_unfinished_unit_after_the_last_commit(tmp_path):
    a = _journal(tmp_path, fsync="always")
    for i in range(5):
        a.send([{"n": i}])
    end = a.log.refresh().journal
    assert a.repair(dry_run=True).journal_tail == 0
    path = os.path.join(tmp_path, "orders", "pages", "00000000000000000001.dqj")
    a.send([{"n": 5}] * 2000)  # then taken back, as a crash does:
    at, stop = _unit_spans(path)[-1]
    assert at == end.offset
    cut = at + 9000
    with open(path, "r+b") as f:  # what a writer killed half-way through its unit leaves
        f.seek(cut)
        f.write(bytes(stop - cut))
        f.seek(at)
        torn = f.read(cut - at)
    fresh = DurableQueue(str(tmp_path)).address("orders", fsync="never")
    report = fresh.repair(dry_run=True)
    assert report.journal_tail == cut - at and report.clean  # reported, not damage
    assert fresh.repair(dry_run=False).journal_tail == cut - at
    with open(path, "rb") as f:
        f.seek(end.offset)
        assert f.read(stop - at + 4096) == bytes(stop - at + 4096)
    # repair never deletes: a copy of what it zeroed is in damaged/
    kept = list((tmp_path / "orders" / "damaged").iterdir())
    assert len(kept) == 1 and kept[0].name.endswith(f"@{end.offset}.tail")
    assert kept[0].read_bytes() == torn
    assert fresh.repair(dry_run=True).journal_tail == 0
    fresh.send([{"n": 6}])
    assert _read_all(DurableQueue(str(tmp_path)).address("orders")).column("n").to_pylist() == [
        0, 1, 2, 3, 4, 6]


def test_a_slice_of_one_large_send_reads_only_the_frames_that_hold_it(tmp_path):
    # One send of ~22 MB is one unit of ~22 frames. A reader of 1,000 messages from its
    # middle (a Spark task's slice, a consumer) reads those frames' bytes, not the unit's:
    # read whole, the unit would show in this process's memory (it did: a 22.6 MB peak).
    n = 200_000
    a = DurableQueue(str(tmp_path)).address("big", page_size_bytes=64 << 20)
    a.send(pa.table({"i": pa.array(range(n), pa.int64()), "body": pa.array(["y" * 100] * n)}))
    unit = a.stats()["bytes"]
    assert unit > 20 << 20
    c = DurableQueue(str(tmp_path)).address("big").consumer("mid", start=150_000)
    tracemalloc.start()
    try:
        got = c.receive(max_messages=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.column("i").to_pylist() == list(range(150_000, 151_000))
    assert peak < 4 << 20, (peak, unit)
    # and every message of it, read in slices that cut frames anywhere, once and in order
    whole = DurableQueue(str(tmp_path)).address("big").consumer("all")
    seen = []
    while True:
        batch = whole.receive(max_messages=37_000)
        if batch.num_rows == 0:
            break
        seen.extend(batch.column("i").to_pylist())
        whole.ack(batch)
    assert seen == list(range(n))
    assert a.repair(dry_run=True).clean


def test_a_damaged_frame_of_a_large_unit_is_found_by_the_reader_that_reads_it(tmp_path):
    n = 100_000
    a = DurableQueue(str(tmp_path)).address("big", page_size_bytes=64 << 20)
    a.send(pa.table({"i": pa.array(range(n), pa.int64()), "body": pa.array(["y" * 100] * n)}))
    path = os.path.join(tmp_path, "big", "pages", "00000000000000000001.dqj")
    with open(path, "r+b") as f:  # a bad disk: one byte in the middle of the unit's frames
        f.seek(HEAD + a.stats()["bytes"] // 2)
        f.seek(f.tell() + f.read(1 << 20).index(b"y" * 100))
        f.write(b"Z")
    # (a view that applied the unit before the damage; a fresh view stops before the unit,
    # see test_damage_to_the_last_unit_is_found_not_taken_for_a_torn_tail)
    report = a.repair(dry_run=True)
    assert not report.clean and report.pages[0].problem == "corrupt"
    reader = a.consumer("all")
    with pytest.raises(CorruptPageError, match="checksum mismatch"):
        while True:
            batch = reader.receive(max_messages=10_000)
            assert batch.num_rows, "read past the damaged frame"
            reader.ack(batch)
    assert 0 < reader.position < n


@pytest.mark.parametrize("n", [pytest.param(30_000, id="3MB-unit-no-frame-index"),
                               pytest.param(100_000, id="11MB-unit-with-frame-index")])
def test_a_damaged_row_count_in_a_frame_before_the_slice_is_found_not_trusted(tmp_path, n):
    # The frames before a reader's slice place it (their row counts); a count damaged on disk
    # must fail the read, not shift every _seq after it (found in review: _seq 60,000 read
    # message 59,995 when frame 0's count was 5 too high). A unit with a frame index (at least
    # STATS_MIN_BYTES) is placed by its commit record: the damaged frame is not read at all
    # for a slice after it, which is read right, and fails its own read.
    a = DurableQueue(str(tmp_path)).address("big", page_size_bytes=64 << 20)
    a.send(pa.table({"i": pa.array(range(n), pa.int64()), "body": pa.array(["y" * 100] * n)}))
    indexed = n * 100 >= STATS_MIN_BYTES
    path = os.path.join(tmp_path, "big", "pages", "00000000000000000001.dqj")
    with open(path, "r+b") as f:
        data = f.read(1 << 20)
        entry_len = _UNIT_HEAD.unpack_from(data, HEAD)[4]
        frame = HEAD + _UNIT_HEAD.size + entry_len
        magic, length, rows, crc = FRAME_HEAD.unpack_from(data, frame)
        f.seek(frame)
        f.write(FRAME_HEAD.pack(magic, length, rows + 5, crc))
    mid = n * 6 // 10
    if indexed:
        got = a.consumer("mid", start=mid).receive(max_messages=3)
        assert got.column("i").to_pylist() == got.column("_seq").to_pylist() == \
            [mid, mid + 1, mid + 2]
        mid = 0
    with pytest.raises(CorruptPageError, match="checksum mismatch"):
        a.consumer("at", start=mid).receive(max_messages=3)


def test_a_reader_that_raced_a_units_write_reads_it_again_instead_of_calling_it_damaged(
        tmp_path):
    # A pwrite is not atomic against a pread: a reader can get a unit's body half-copied, and
    # by the time it looks past it the next unit is there, intact. Only a second read that
    # still fails the checksum is damage.
    from pyspark_durable_queue._log.journal import Journal, JournalPosition

    a = _journal(tmp_path, fsync="always")
    for i in range(3):
        a.send([{"n": i}])
    journal = Journal(a.storage, a.pages_folder, a.settings.page_size_bytes)
    first = journal.read_next(JournalPosition(), 1)
    assert first is not None
    body_start = first[2][1] + _UNIT_HEAD.size  # unit 2's body
    real_read, torn = journal._read, []

    def racing_read(segment, start, end):
        data = real_read(segment, start, end)
        if start <= body_start < start + len(data) and not torn:  # (read with its head)
            torn.append(start)
            cut = body_start - start + (len(data) - (body_start - start)) // 2
            return data[:cut] + bytes(len(data) - cut)
        return data

    journal._read = racing_read
    at, versions = first[1], [1]
    while (found := journal.read_next(at, versions[-1] + 1)) is not None:
        at = found[1]
        versions.append(versions[-1] + 1)
    assert torn, "the racing read did not happen"
    assert versions == [1, 2, 3]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_handles_dropped_without_closing_keep_no_descriptors(tmp_path):
    # A web service that opens the queue per request: each handle opens the address's segment,
    # its publish lock, readers and a watermark file; a dropped handle must not keep them
    # (each dropped handle kept two descriptors: a process ran out of them after ~500).
    import gc

    DurableQueue(str(tmp_path)).address("orders").consumer("worker")

    def request(i: int) -> None:
        a = DurableQueue(str(tmp_path)).address("orders")
        a.send([{"n": i}])
        c = a.consumer("worker")
        got = c.receive(10)
        assert got.num_rows >= 1
        c.ack(got)

    request(0)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(1, 101):
        request(i)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_entry_ids_stay_unique_across_threads_and_forked_children(tmp_path):
    # ids come from a per-process random prefix and a counter (no getrandom per commit): a
    # forked child must draw its own prefix, or it would repeat the ids its parent publishes
    import re

    a = _journal(tmp_path)
    for i in range(20):
        a.send([{"n": i}])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            for i in range(20):
                a.send([{"n": 100 + i}])
        finally:
            os._exit(0)
    for i in range(20):
        a.send([{"n": 200 + i}])
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    data = b"".join(open(os.path.join(tmp_path, "orders", "pages", n), "rb").read()
                    for n in _files(tmp_path)[0] if is_segment(n))
    ids = re.findall(rb'"id":"([0-9a-f]*)"', data)
    assert len(ids) == 60 and all(len(i) == 32 for i in ids)
    assert len(set(ids)) == 60
    assert len({i[:16] for i in ids}) == 2  # the parent's prefix and the child's
    t = _read_all(DurableQueue(str(tmp_path)).address("orders"))
    assert t.column("_seq").to_pylist() == list(range(60))
