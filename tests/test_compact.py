"""Compaction (``_ops.compact``): runs of small pages rewritten as full pages and swapped in with
one commit-log entry; ``_seq`` and ``_timestamp`` unchanged, no reader missing or re-reading a
message across the swap, on a file per commit, on a journal and on ``memory://``."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from conftest import run_cli

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.schema import with_system_schema
from pyspark_durable_queue._log.index import PageRef
from pyspark_durable_queue._read import read_task
from pyspark_durable_queue._read.scan import Snapshot, page_may_match
from pyspark_durable_queue.address import Address
from pyspark_durable_queue.errors import DataLossError
from pyspark_durable_queue.selector import Selector

PAGE = 64 * 1024
#: What the Spark readers give ``read_task`` to open the address when a page is missing.
OPEN = functools.partial(Address.open, create=False)


def _page_files(address) -> list[str]:
    folder = address.pages_folder
    return [n for n, _s, _m in address.storage.list_detailed(folder)
            if n.endswith((".page", ".dqj"))]


def _times(table: pa.Table) -> dict[int, int]:
    return dict(zip(table.column("_seq").to_pylist(),
                    table.column("_timestamp").cast(pa.int64()).to_pylist(), strict=True))


def _fresh_handle_sends(root: str, n: int, **settings) -> None:
    for i in range(n):
        DurableQueue(root).address("a", **settings).send(
            [{"i": i, "region": "EU" if i % 2 else "US", "body": "x" * 100}])


def _peek(address) -> pa.Table:
    """Every retained message, read without a consumer (nothing is acknowledged)."""
    snap = address.snapshot()
    return pa.Table.from_batches([b for b, _ in snap.messages(snap.first_seq) if b is not None],
                                 schema=with_system_schema(snap.schema))


def _drain(consumer) -> pa.Table:
    parts = []
    while True:
        t = consumer.receive(max_messages=97)  # odd batches: cuts fall inside pages
        if not t.num_rows:
            return pa.concat_tables(parts) if parts else t
        consumer.ack(t)
        parts.append(t)


def test_single_sends_from_fresh_handles_compact_to_few_full_pages(root):
    """Target 1 of issue 28 (600 sends; 60 on the object-store test servers), on every
    backend: a file per commit, compacted, read by a consumer that was half-way through and by
    one from ``earliest``."""
    n = 600 if root.startswith(("memory://", "/")) else 60
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   cleanup_interval_ms=3_600_000, compact_small_pages=0)
    half = a.consumer("half", start="earliest")
    probe = a.consumer("probe", start="earliest")  # keeps every page in the backlog
    _fresh_handle_sends(root, n)
    first = half.receive(max_messages=n // 2)
    half.ack(first)
    before = _times(probe.receive(max_messages=1000))
    assert len(_page_files(a)) == n

    report = a.compact()

    assert report.runs >= 1 and report.messages == n and report.abandoned == 0
    stored = sum(a.state.pages.bytes)
    assert len(a.state.pages) <= math.ceil(stored / PAGE) + 4
    again = DurableQueue(root).address("a")  # the swap as another process reads it
    assert again.state.pages.names == a.state.pages.names
    cleaned = a.cleanup(dry_run=False, now=time.time() + 3600)  # past compactGraceMs
    assert len(cleaned.orphans) == n
    assert len(_page_files(a)) <= math.ceil(stored / PAGE) + 4
    rest = _drain(half)
    assert first.column("i").to_pylist() + rest.column("i").to_pylist() == list(range(n))
    late = _drain(again.consumer("late", start="earliest"))
    assert late.column("i").to_pylist() == list(range(n))
    assert _times(late) == before  # every message keeps its own commit time


def test_a_journal_address_compacts_its_rows_into_page_files_and_reopens(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", page_size_bytes=PAGE, compact_small_pages=0)
    assert a.format.journal
    _fresh_handle_sends(root, 900)
    before = _times(a.consumer("c", start="earliest").receive(max_messages=2000))
    assert any(s is not None for s in a.state.pages.spans)

    report = a.compact()

    assert report.messages == 900 and report.pages_after >= 1
    assert all(s is None for s in a.state.pages.spans)
    again = DurableQueue(root).address("a")  # replays the swap from the journal
    assert again.state.pages.names == a.state.pages.names
    got = _drain(again.consumer("d", start="earliest"))
    assert got.column("i").to_pylist() == list(range(900))
    assert _times(got) == before
    a.send([{"i": 900, "region": "EU", "body": "y"}])  # the journal goes on after the swap
    assert _drain(again.consumer("d")).column("i").to_pylist() == [900]


def test_a_journal_row_that_grows_while_it_is_compacted_keeps_the_rest(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", page_size_bytes=1 << 20, compact_small_pages=0)
    _fresh_handle_sends(root, 50)
    sent = []

    def progress(done, total):
        if done and not sent:  # while the run is being read: two more commits
            for i in (50, 51):
                a.send([{"i": i, "region": "EU", "body": "z"}])
                sent.append(i)

    report = a.compact(progress=progress)

    assert sent == [50, 51] and report.messages == 50 and report.abandoned == 0
    pages = a.state.pages
    assert [s is None for s in pages.spans] == [True, False]
    assert (pages.seq[1], pages.rows[1]) == (50, 2)
    a.send([{"i": 52, "region": "EU", "body": "z"}])  # after the swap's own unit: a new row
    assert a.state.pages.ends == [50, 52, 53]
    for handle in (a, DurableQueue(root).address("a")):
        assert _peek(handle).column("i").to_pylist() == list(range(53))


def test_a_swap_is_abandoned_when_cleanup_removed_its_pages_meanwhile(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   cleanup_interval_ms=3_600_000, compact_small_pages=0)
    c = a.consumer("c", start="earliest")
    _fresh_handle_sends(root, 20)
    done = []

    def progress(read, total):
        if read and not done:  # everything acknowledged and removed under the compaction
            c.ack(c.receive(max_messages=100))
            done.append(a.cleanup(dry_run=False, orphans=False))

    report = a.compact(progress=progress)

    assert done and report.abandoned == 1 and report.runs == 0
    assert len(a.state.pages) == 0
    assert _page_files(a) == []  # the new pages went with the abandoned swap


def test_a_reader_holding_a_view_from_before_the_swap_reads_every_message_once(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   compact_small_pages=0, compact_grace_ms=0)
    _fresh_handle_sends(root, 200)
    old = a.snapshot()
    a.compact()
    a.cleanup(dry_run=False)  # no grace: the replaced files go at once
    assert len(_page_files(a)) < 10

    got = [b for b, _ in old.messages(0) if b is not None]
    assert pa.Table.from_batches(got).column("i").to_pylist() == list(range(200))
    # without a way to look up the swap, the same view reports the pages lost
    blind = Snapshot(old.storage, old.pages_folder, old.version, old.end, old.first_seq,
                     old.schema, old.lost, old.pages)
    with pytest.raises(DataLossError):
        list(blind.messages(0))


@pytest.mark.parametrize("journal", [False, True], ids=["file-per-commit", "journal"])
def test_a_spark_task_planned_before_the_swap_reads_its_slices_from_the_new_pages(
        tmp_path, journal):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=journal, page_size_bytes=PAGE,
                                   compact_small_pages=0, compact_grace_ms=0)
    _fresh_handle_sends(root, 300)
    slices = [r.slice(100, 250) for r in a.snapshot().refs(100, 250)]
    a.compact()
    a.cleanup(dry_run=False)
    output = with_system_schema(a.schema)
    got = pa.Table.from_batches(list(read_task(
        root, None, "a", slices, output, selector=None, fail_on_data_loss=True,
        page_max_cache_size=5, open_address=OPEN)))
    assert got.column("_seq").to_pylist() == list(range(100, 250))


def test_readers_planned_before_the_swap_read_the_new_pages_on_every_backend(root):
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   compact_small_pages=0, compact_grace_ms=0)
    _fresh_handle_sends(root, 30)
    old = a.snapshot()
    slices = [r.slice(5, 25) for r in old.refs(5, 25)]
    a.compact()
    assert len(a.cleanup(dry_run=False).orphans) == 30
    got = [b for b, _ in old.messages(0) if b is not None]
    assert pa.Table.from_batches(got).column("i").to_pylist() == list(range(30))
    task = pa.Table.from_batches(list(read_task(
        root, None, "a", slices, with_system_schema(a.schema), selector=None,
        fail_on_data_loss=True, page_max_cache_size=5, open_address=OPEN)))
    assert task.column("i").to_pylist() == list(range(5, 25))


def test_compacted_pages_carry_statistics_for_selectors_and_times(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   compact_small_pages=0)
    for i in range(300):
        a.send([{"i": i, "region": "EU" if i < 150 else "US", "body": "x" * 100}])
        if i == 149:
            time.sleep(0.01)
    table = _peek(a)
    a.compact()
    idx = a.state.pages
    assert all(idx.stats(k) and "_timestamp" in idx.stats(k)["columns"]
               for k in range(len(idx)))
    nowhere = Selector("region = 'ASIA'")
    assert not any(page_may_match(nowhere, idx.stats(k), idx.ref(k)) for k in range(len(idx)))
    # a time inside a compacted page is found exactly
    times = table.column("_timestamp").cast(pa.int64()).to_pylist()
    snap = a.snapshot()
    for k in (0, 1, 149, 150, 299):
        assert snap.seek_time(times[k]) == times.index(times[k])
    late = Selector(f"_timestamp > {times[149] // 1000}")
    assert any(not page_may_match(late, idx.stats(k), idx.ref(k)) for k in range(len(idx))) \
        or len(idx) == 1
    eu = a.consumer("eu", start="earliest", selector="region = 'EU'")
    assert _drain(eu).column("i").to_pylist() == list(range(150))


def test_compacting_compacted_pages_keeps_each_message_time(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   compact_small_pages=0)
    _fresh_handle_sends(root, 50)
    a.compact()
    _fresh_handle_sends(root, 50)
    before = _times(_peek(a))
    assert a.compact().pages_before == 51
    assert _times(_peek(a)) == before and len(a.state.pages) == 1


def test_a_grown_schema_is_compacted_with_nulls_for_older_messages(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, compact_small_pages=0)
    for i in range(5):
        a.send([{"i": i}])
    for i in range(5, 10):
        a.send([{"i": i, "extra": f"e{i}"}], merge_schema=True)
    a.compact()
    assert len(a.state.pages) == 1
    got = _drain(a.consumer("c", start="earliest"))
    assert got.column("extra").to_pylist() == [None] * 5 + [f"e{i}" for i in range(5, 10)]


def test_replaced_files_stay_for_the_grace_then_go_whatever_their_age(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, compact_small_pages=0,
                                   compact_grace_ms=60_000, orphan_grace_ms=3_600_000)
    _fresh_handle_sends(root, 10)
    a.compact()
    assert a.cleanup(dry_run=False).orphans == []
    assert len(_page_files(a)) == 11
    later = a.cleanup(dry_run=False, now=time.time() + 61)
    assert len(later.orphans) == 10  # young files (minutes old), but retired a grace ago
    assert len(_page_files(a)) == 1


def test_the_swap_and_its_retired_files_survive_a_checkpoint(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, compact_small_pages=0)
    _fresh_handle_sends(root, 10)
    a.compact()
    state = a.state
    a.log.write_checkpoint(state)
    restored = a.log.read_checkpoint(state.version)
    assert restored is not None
    assert restored.retired == state.retired and len(restored.retired) == 10
    assert restored.pages.ts_last == state.pages.ts_last
    assert restored.pages.ts_last[0] > restored.pages.ts[0]


def test_cleanup_compacts_once_enough_pages_are_small(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   cleanup_interval_ms=0, compact_small_pages=30)
    c = a.consumer("c", start="earliest")
    _fresh_handle_sends(root, 20)
    c.ack(c.receive(max_messages=1))  # a cleanup: 19 small pages left, under the threshold
    assert len(a.state.pages) == 19
    _fresh_handle_sends(root, 20)
    c.ack(c.receive(max_messages=1))
    assert len(a.state.pages) == 1
    assert _drain(c).column("i").to_pylist() == list(range(2, 20)) + list(range(20))


def test_a_dry_run_changes_nothing(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   compact_small_pages=0)
    _fresh_handle_sends(root, 40)
    report = a.compact(dry_run=True)
    assert report.dry_run and report.pages_before == 40
    assert report.pages_after == math.ceil(report.bytes_read / PAGE)
    assert len(_page_files(a)) == 40 and len(a.state.pages) == 40


def test_pages_every_consumer_acknowledged_are_left_to_cleanup(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, cleanup_interval_ms=3_600_000,
                                   compact_small_pages=0)
    c = a.consumer("c", start="earliest")
    _fresh_handle_sends(root, 10)
    c.ack(c.receive(max_messages=6))
    report = a.compact()
    assert report.messages == 4


def test_page_refs_of_compacted_pages_round_trip():
    ref = PageRef("x.page", 10, 5, 100, 7)
    assert PageRef.from_dict(ref.to_dict()) == ref


def test_the_cli_compacts_after_a_dry_run(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   compact_small_pages=0)
    _fresh_handle_sends(root, 30)
    code, out, _ = run_cli(capsys, root, "--json", "compact", "a")
    dry = json.loads(out)
    assert code == 0 and dry["dry_run"] and dry["pages_before"] == 30
    assert len(_page_files(a)) == 30
    code, out, _ = run_cli(capsys, root, "compact", "a", "--apply")
    assert code == 0 and "rewrote 30 small pages (30 messages" in out and "into 1 pages" in out
    assert len(DurableQueue(root).address("a").state.pages) == 1
    code, out, _ = run_cli(capsys, root, "compact", "a")
    assert code == 0 and "would rewrite 0 small pages" in out
    code, out, _ = run_cli(capsys, root, "verify", "a")
    assert code == 0 and "30 files compaction replaced" in out and "unpublished" not in out


def test_a_journal_row_counts_its_commits_and_only_small_ones_are_rewritten(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", page_size_bytes=PAGE, cleanup_interval_ms=0,
                                   compact_small_pages=50)
    big = [{"i": i, "region": "EU", "body": "b" * 100} for i in range(400)]
    a.send(big)  # one commit of ~50 KB: a unit of large frames
    a.send(big)  # rolls: the first segment holds one large unit
    _fresh_handle_sends(root, 700)  # single sends: units of one message, several rolls
    idx = a.state.pages
    assert idx.units[0] == 1 and max(idx.units) > 50
    c = a.consumer("c", start="earliest")
    c.ack(c.receive(max_messages=1))  # the cleanup after it compacts the rolled small units
    idx = a.state.pages
    assert idx.spans[0] is not None and idx.units[0] == 1  # the large unit is left as it was
    assert idx.spans[-1] is not None  # and so is the segment being written
    assert any(s is None for s in idx.spans)  # rolled segments of single sends were rewritten
    assert _peek(a).column("i").to_pylist() == list(range(400)) * 2 + list(range(700))


def test_a_cleanup_planned_before_a_swap_removes_the_swapped_in_pages_too(tmp_path):
    """Found by the crash test: a cleanup that planned on the old rows and published after a
    swap removed the rows it had planned but kept the compacted page before them (its name
    was not planned), leaving a hole in the retained range that a consumer from ``earliest``
    reports as data loss. The cleanup decides on the freshest log instead."""
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   cleanup_interval_ms=3_600_000, compact_small_pages=0)
    a.cleanup(dry_run=False)  # the interval starts now: acks below do not clean up
    c = a.consumer("c", start="earliest")
    _fresh_handle_sends(root, 5)
    a.send([{"i": 5, "region": "EU", "body": "x" * (PAGE // 2)}])  # not small: ends the run
    _fresh_handle_sends(root, 4)
    planned = []

    def progress(done, total):
        if done and not planned:  # the first run is being read: acks and a cleanup plan
            c.ack(6)
            planned.append(a.cleanup(dry_run=True))

    a.compact(progress=progress)
    assert len(planned[0].pages) == 7  # _seq 0..6: a page each
    a._cleaner._remove(planned[0])  # published after the swap
    idx = a.state.pages
    assert all(idx.seq[k] == idx.ends[k - 1] for k in range(1, len(idx)))
    assert idx.seq[0] == 6  # the first run's page went; the second run's holds _seq 6..9
    assert _drain(a.consumer("late", start="earliest")).column("_seq").to_pylist() == \
        list(range(a.state.first_seq, 10))


def test_a_view_whose_next_segment_was_compacted_away_reloads_instead_of_stalling(
        tmp_path, monkeypatch):
    """Found by the crash test: a segment that keeps live rows (one large message, not
    small) ends with a roll mark to the next one; compaction rewrote the next one and cleanup
    deleted it. A view that had read up to the mark found the next segment missing and took
    it for a roll under way: it saw no new commit again (a consumer stalls, a compactor plans
    on rows whose files are gone). A later segment proves the missing one was deleted: the
    view reloads from the newest checkpoint."""
    from pyspark_durable_queue._log import commit_log as _log

    monkeypatch.setattr(_log, "JOURNAL_CHECKPOINT_EVERY", 5)
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", page_size_bytes=PAGE, compact_small_pages=0,
                                   compact_grace_ms=0, cleanup_interval_ms=3_600_000)
    large = [{"i": 0, "region": "EU", "body": "L" * PAGE}]
    a.send(large)  # segment 1: one large unit (the next one does not fit)
    view = DurableQueue(root).address("a")
    assert view.state.next_seq == 1  # read up to the end of segment 1
    _fresh_handle_sends(root, 200)  # segments 2, 3...: single sends
    a.send(large)  # a large one after them
    a.compact()
    a.send([{"i": 1, "region": "EU", "body": "x"}])  # a checkpoint past the segments
    for _ in range(5):
        a.send([{"i": 1, "region": "EU", "body": "x"}])
    gone = a.cleanup(dry_run=False).orphans
    assert "00000000000000000002.dqj" in gone  # compacted away, its predecessor kept
    assert os.path.exists(os.path.join(root, "a", "pages", "00000000000000000001.dqj"))
    assert view.state.next_seq == a.state.next_seq == 208
    assert _peek(view).column("_seq").to_pylist() == list(range(208))


def test_a_view_taken_before_the_first_send_reloads_once_the_first_segments_are_gone(
        tmp_path, monkeypatch):
    from pyspark_durable_queue._log import commit_log as _log

    monkeypatch.setattr(_log, "JOURNAL_CHECKPOINT_EVERY", 5)
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", page_size_bytes=PAGE, cleanup_interval_ms=3_600_000)
    view = DurableQueue(root).address("a")
    assert view.state.next_seq == 0  # an empty view: before segment 1
    c = a.consumer("c", start="earliest")
    _fresh_handle_sends(root, 200)
    c.ack(199)
    for _ in range(6):
        a.send([{"i": 1, "region": "EU", "body": "x"}])
    a.cleanup(dry_run=False)
    a.cleanup(dry_run=False)  # the segments the first one removed from the log go now
    assert not os.path.exists(os.path.join(root, "a", "pages", "00000000000000000001.dqj"))
    assert view.state.next_seq == 206


def test_thousands_of_small_pages_are_received_and_compacted_under_a_low_open_file_limit(
        tmp_path):
    """Found by bench_compact.py: a table received from (or a frame compaction gathers from)
    thousands of one-message page files held each file's memory map, and with it a file
    descriptor: ``EMFILE``. Small files are read, not mapped."""
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        "from pyspark_durable_queue import DurableQueue\n"
        "a = DurableQueue(sys.argv[1]).address('a', journal=False, compact_small_pages=0,\n"
        "                                      fsync='never')\n"
        "for i in range(1500): a.send([{'i': i}])\n"
        "t = a.consumer('c', start='earliest').receive(max_messages=10000)\n"
        "r = a.compact()\n"
        "print(t.num_rows, r.pages_before, r.pages_after)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dq")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1500", "1500", "1"]


def test_a_stretch_longer_than_one_swap_is_merged_by_a_second_pass(tmp_path, monkeypatch):
    """A run replaces at most MAX_REPLACED rows, so a long stretch of small pages is compacted
    as several runs, each ending in a part-filled page; the second pass merges those (100,000
    single-row commits drained at 0.44x one batch after compaction with 10 pages left)."""
    from pyspark_durable_queue._ops import compact as _compact

    monkeypatch.setattr(_compact, "MAX_REPLACED", 20)
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, page_size_bytes=PAGE,
                                   compact_small_pages=0)
    _fresh_handle_sends(root, 70)
    dry = a.compact(dry_run=True)
    assert (dry.runs, dry.pages_before, dry.pages_after) == (4, 70, 2)
    report = a.compact()
    assert report.pages_before == 70 and report.messages == 70
    assert report.pages_after == len(a.state.pages) == len(report.pages) == 1
    assert set(report.pages) == set(a.state.pages.names)
    assert _peek(a).column("i").to_pylist() == list(range(70))


def test_replaced_files_whose_messages_were_consumed_go_without_waiting_for_the_grace(
        tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=False, compact_small_pages=0,
                                   cleanup_interval_ms=3_600_000)
    c = a.consumer("c", start="earliest")
    _fresh_handle_sends(root, 10)
    a.compact()
    assert a.cleanup(dry_run=False).orphans == []  # retained: kept for readers (the grace)
    c.ack(c.receive(max_messages=100))
    assert len(a.cleanup(dry_run=False).pages) == 1  # the compacted page, consumed
    assert len(a.cleanup(dry_run=False).orphans) == 10  # so nobody needs what it replaced
    assert _page_files(a) == []


def test_a_backlog_growing_a_commit_at_a_time_is_not_rewritten_on_every_pass(tmp_path):
    # The kill matrix's load: single sends, compaction looping, a consumer that reads later.
    # Each pass used to rewrite the whole compacted backlog (its own part-filled page) with
    # the new commits: bytes written grew with the square of the backlog (16x the bytes sent
    # after 40 s of the matrix's sends). Size-tiered, a page waits for as much again.
    a = DurableQueue(str(tmp_path / "dq")).address("a", page_size_bytes=PAGE,
                                                   compact_small_pages=0)
    c = a.consumer("c", start="earliest")
    sent = written = 0
    for i in range(200):
        a.send([{"i": i, "region": "EU", "body": "x" * 200}])
        spans = a.state.pages.spans
        sent += sum(s[1] - s[0] for s in spans if s is not None)  # the new commit's unit
        written += a.compact().bytes_written
    assert written <= 6 * sent, (written, sent)  # 4.2x; 16.2x before (each pass: all of it)
    assert len(a.state.pages) <= 12  # still few pages (4; 2 before)
    assert _drain(c).column("i").to_pylist() == list(range(200))
