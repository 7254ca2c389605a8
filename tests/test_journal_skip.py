"""Selectors skip journal data they cannot match, as they skip page files (issue 36).

A unit of at least ``STATS_MIN_BYTES`` carries its statistics (and its frames' statistics)
in its commit record: the page index has them, so a consumer, the Spark planner and cleanup
skip the unit, or the frames of it, without reading them. Bytes read are counted by the
kernel (``rchar`` of ``/proc/self/io``), against the bytes the address stores.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.schema import compile_selector
from pyspark_durable_queue._log import commit_log as _log
from pyspark_durable_queue._read.plan import plan_tasks

#: rows per send: ~4.4 MB, a unit with statistics (STATS_MIN_BYTES) of four or five frames
ROWS = 40_000
SENDS = 6


def rchar() -> int:
    """Bytes this process read through ``read(2)``/``pread(2)`` so far (any file)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def table(first: int, rows: int) -> pa.Table:
    ids = np.arange(first, first + rows, dtype=np.int64)
    return pa.table({"id": ids, "kind": pa.array(np.array(["a", "b", "c"])[ids % 3]),
                     "body": pa.array([b"x" * 100] * rows)})


def stored(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "a" / "pages").iterdir())


def backlog(root: Path, **settings) -> tuple:
    address = DurableQueue(str(root)).address("a", journal=True, fsync="never", **settings)
    address.consumer("keep", start="earliest")  # never acks: cleanup removes nothing
    for k in range(SENDS):
        address.send(table(k * ROWS, ROWS))
    return address, SENDS * ROWS


def receive_all(consumer) -> list[int]:
    got: list[int] = []
    while True:
        batch = consumer.receive(max_messages=50_000, timeout_ms=0)
        if batch.num_rows == 0:
            return got
        got += batch.column("id").to_pylist()
        consumer.ack(batch)


_NAMES = itertools.count()


def read_by(address, selector: str) -> tuple[list[int], int]:
    """The ids a new consumer with ``selector`` receives from the start, and the bytes this
    process read meanwhile (the address's view is up to date before counting starts)."""
    address.state  # noqa: B018 - brought up to date before counting
    consumer = address.consumer(f"c{next(_NAMES)}", selector=selector, start="earliest")
    before = rchar()
    got = receive_all(consumer)
    return got, rchar() - before


@pytest.mark.parametrize("selector", [
    pytest.param("id < 0", id="matches-nothing"),
    pytest.param("id > 1000000000", id="above-every-unit"),
    pytest.param("kind = 'rare'", id="absent-value"),
])
def test_a_selector_that_matches_no_unit_reads_none_of_them(tmp_path, selector):
    address, _n = backlog(tmp_path)
    got, read = read_by(address, selector)
    assert got == []
    assert read <= 0.01 * stored(tmp_path), (read, stored(tmp_path))


def test_a_clustered_tail_reads_only_the_frames_that_hold_it(tmp_path):
    address, n = backlog(tmp_path)
    got, read = read_by(address, f"id >= {n - 100}")
    assert got == list(range(n - 100, n))
    # the last unit's last frame (~1 MiB of ~13) and that unit's head and entry
    assert read <= 0.12 * stored(tmp_path), (read, stored(tmp_path))
    _everything, read_all = read_by(address, "id >= 0")
    assert read < read_all / 5


def test_each_unit_with_statistics_is_a_row_of_its_own_across_segment_rolls(tmp_path):
    address, _n = backlog(tmp_path, page_size_bytes=4 << 20)
    segments = [p for p in (tmp_path / "a" / "pages").iterdir() if p.suffix == ".dqj"]
    assert len(segments) >= 3  # rolled: three or four units a segment
    index = address.state.pages
    assert len(index) == SENDS and len(set(index.names)) == len(segments)
    for i in range(len(index)):
        stats = index.stats(i)
        assert stats is not None and stats["columns"]["id"]["min"] == i * ROWS
        assert stats["columns"]["id"]["max"] == (i + 1) * ROWS - 1
    middle = SENDS // 2 * ROWS
    got, read = read_by(address, f"id >= {middle} AND id < {middle + 10}")
    assert got == list(range(middle, middle + 10))
    assert read <= 0.12 * stored(tmp_path)


def test_small_units_carry_no_statistics_and_are_read_as_before(tmp_path):
    address = DurableQueue(str(tmp_path)).address("a", journal=True, fsync="never",
                                                  page_size_bytes=64 << 20)
    address.send(table(0, ROWS))  # a large unit: its own row, with statistics
    for i in range(ROWS, ROWS + 50):  # single sends: one row without statistics
        address.send([{"id": i, "kind": "b", "body": b"y"}])
    address.send(table(ROWS + 50, ROWS // 10))  # 10,000 rows: under the threshold
    address.send(table(ROWS + 50 + ROWS // 10, ROWS))
    index = address.state.pages
    assert [index.stats(i) is not None for i in range(len(index))] == [True, False, True]
    assert index.units == [1, 51, 1]
    consumer = address.consumer("c", selector=f"id >= {ROWS - 10} AND id < {ROWS + 60}",
                                start="earliest")
    assert receive_all(consumer) == list(range(ROWS - 10, ROWS + 60))


def test_a_growing_run_of_small_units_is_never_judged_by_an_old_verdict(tmp_path):
    """A selector that matched nothing in a run of small units still takes a matching unit
    appended to the same run (the run's verdict is not cached as final)."""
    address = DurableQueue(str(tmp_path)).address("a", journal=True, fsync="never")
    for i in range(20):
        address.send([{"id": i, "kind": "a"}])
    consumer = address.consumer("c", selector="kind = 'z'", start="earliest")
    assert receive_all(consumer) == []
    address.send([{"id": 20, "kind": "z"}])
    assert len(address.state.pages) == 1  # the same row grew
    assert receive_all(consumer) == [20]


def test_the_spark_planner_leaves_out_units_that_cannot_match(tmp_path):
    address, n = backlog(tmp_path)
    index = address.state.pages
    schema = address.schema
    assert plan_tasks(index, 0, n, selector=compile_selector("id < 0", schema), slots=2) == []
    tasks = plan_tasks(index, 0, n, selector=compile_selector(f"id >= {n - 5}", schema),
                       slots=2)
    slices = [s for task in tasks for s in task]
    assert [(s.seq, s.rows) for s in slices] == [((SENDS - 1) * ROWS, ROWS)]


def test_statistics_survive_a_checkpoint_and_opening_replays_a_bounded_tail(tmp_path,
                                                                              monkeypatch):
    # a checkpoint after every ~2.5 units' bytes, instead of 64 MiB
    monkeypatch.setattr(_log, "JOURNAL_CHECKPOINT_BYTES", int(2.5 * ROWS * 110))
    _address, n = backlog(tmp_path)
    checkpoints = [p.name for p in (tmp_path / "a" / "log").iterdir()
                   if p.name.endswith(".checkpoint.arrow")]
    assert len(checkpoints) >= SENDS // 3
    before = rchar()
    fresh = DurableQueue(str(tmp_path)).address("a")
    state = fresh.state
    opened = rchar() - before
    assert state.checkpoint > 0 and state.next_seq == n
    assert opened <= 4 * ROWS * 120, opened  # the units after the newest checkpoint, at most
    assert all(state.pages.stats(i) is not None for i in range(len(state.pages)))
    got, read = read_by(fresh, "id < 0")
    assert got == [] and read <= 0.01 * stored(tmp_path)


def test_compaction_keeps_skipping(tmp_path):
    address = DurableQueue(str(tmp_path)).address("a", journal=True, fsync="never",
                                                  compact_small_pages=0)
    for k in range(300):
        address.send([{"id": k, "kind": "a", "body": b"z" * 100}])
    address.consumer("keep", start="earliest")  # compaction rewrites what a consumer needs
    report = address.compact()
    assert report.runs >= 1
    assert all(address.state.pages.stats(i) is not None for i in range(len(address.state.pages)))
    got, _read = read_by(address, "id < 0")
    assert got == []
    got, _read = read_by(address, "id >= 295")
    assert got == [295, 296, 297, 298, 299]



def singles(root: Path, n: int, **settings):
    """``n`` single sends into segments of 64 KiB (rolled every ~75 sends)."""
    address = DurableQueue(str(root)).address("a", journal=True, fsync="never",
                                              page_size_bytes=64 << 10, **settings)
    address.consumer("keep", start="earliest")
    for i in range(n):
        address.send([{"id": i, "kind": "a", "body": b"x" * 100}])
    return address


def open_segment_bytes(address) -> int:
    index = address.state.pages
    return index.bytes[-1]


def test_single_sends_in_rolled_segments_are_skipped_once_sealed(tmp_path):
    address = singles(tmp_path, 2000, compact_small_pages=0)
    index = address.state.pages
    assert len(index) > 20 and all(index.stats(i) is None for i in range(len(index)))
    _got, unsealed_read = read_by(address, "id < 0")
    assert unsealed_read > 0.9 * stored(tmp_path)  # what a selector reads without statistics

    report = address.seal()
    index = address.state.pages
    assert report.rows == len(index) - 1 and report.messages == index.seq[-1]
    assert [index.stats(i) is not None for i in range(len(index))] == \
        [True] * (len(index) - 1) + [False]  # the segment being written stays open
    got, read = read_by(address, "id < 0")
    assert got == [] and read <= open_segment_bytes(address) + 0.01 * stored(tmp_path)
    got, read = read_by(address, "id >= 1990")
    assert got == list(range(1990, 2000))
    # the open segment and the sealed one the tail starts in, each listed (the units'
    # heads and entries, once per process) and read
    assert read <= 2 * (open_segment_bytes(address) + (64 << 10)) + 0.01 * stored(tmp_path)
    got, _read = read_by(address, "id >= 0")
    assert got == list(range(2000))  # statistics that are sound: nothing lost

    # what the seal published is in the log: a new handle replays it, then a checkpoint
    fresh = DurableQueue(str(tmp_path)).address("a").state
    assert [fresh.pages.stats(i) for i in range(len(fresh.pages))] == \
        [index.stats(i) for i in range(len(index))]
    fresh_log = DurableQueue(str(tmp_path)).address("a").log
    fresh_log.write_checkpoint(fresh_log.refresh())
    reloaded = DurableQueue(str(tmp_path)).address("a").state
    assert reloaded.checkpoint == fresh.version
    assert [reloaded.pages.stats(i) for i in range(len(reloaded.pages))] == \
        [index.stats(i) for i in range(len(index))]
    assert address.seal().rows == 0  # nothing left to seal


def test_maintenance_seals_in_the_background_when_a_consumer_has_a_selector(tmp_path):
    address = singles(tmp_path, 600, compact_small_pages=0, cleanup_interval_ms=0)
    assert address.maybe_cleanup() is not None  # ran, and sealed nothing: no selector
    time.sleep(0.2)
    assert address.state.pages.stats(0) is None
    address.consumer("picky", selector="id > 590", start="earliest")
    assert address.maybe_cleanup() is not None
    deadline = time.monotonic() + 30
    while address.state.pages.stats(0) is None and time.monotonic() < deadline:
        time.sleep(0.05)  # a page's worth, on a daemon thread
    index = address.state.pages
    assert index.stats(0) is not None and index.stats(len(index) - 1) is None


def test_a_sealed_run_spans_the_commit_times_of_all_its_units(tmp_path):
    """Found in review: a run's _timestamp was taken to be its first unit's time alone, so a
    selector on _timestamp skipped later units of it, and cleanup removed what a consumer
    with such a selector still needed."""
    address = DurableQueue(str(tmp_path)).address("a", journal=True, fsync="never",
                                                  page_size_bytes=64 << 10,
                                                  compact_small_pages=0)
    address.consumer("keep", start="earliest")
    for i in range(600):
        address.send([{"id": i, "body": b"x" * 100}])
        if i == 30:
            time.sleep(0.01)
            middle = int(time.time() * 1000) + 1
            time.sleep(0.01)
    selector = f"_timestamp >= {middle} AND id < 75"
    before, _read = read_by(address, selector)
    assert before == list(range(31, 75))
    address.seal()
    after, _read = read_by(address, selector)
    assert after == before
    # a consumer with that selector keeps what it still needs through a cleanup
    address.delete_consumer_state("keep")
    address.consumer("timed", selector=selector, start="earliest")
    address.cleanup(dry_run=False)
    assert receive_all(address.consumer("timed")) == list(range(31, 75))


def test_statistics_that_do_not_count_the_rows_messages_are_not_trusted(tmp_path):
    """A release before journal statistics grows the last row by the next unit whatever its
    statistics say (and checkpoints it so); such statistics are not the row's."""
    address, _n = backlog(tmp_path)
    index = address.state.pages
    last = len(index) - 1
    assert index.stats(last) is not None
    index.rows[last] += 1  # what the older release's add() does to the row
    index.ends[last] += 1
    assert index.stats(last) is None


def test_a_journal_rows_verdict_is_kept_by_the_entry_that_gave_its_statistics():
    from pyspark_durable_queue._log.index import PageRef
    from pyspark_durable_queue._read.scan import page_may_match
    from pyspark_durable_queue.selector import Selector

    selector = Selector("id > 5")
    ref = PageRef("00000000000000000001.dqj", 0, 10, 1000, 1_000_000, span=(32, 1032))

    def stats(lo: int, hi: int, token: str | None) -> dict:
        out = {"rows": 10, "columns": {"id": {"null_count": 0, "min": lo, "max": hi}}}
        return out if token is None else {**out, "id": token}

    # the same segment name, range and time in two addresses: two verdicts
    assert not page_may_match(selector, stats(0, 5, "entry-a"), ref)
    assert page_may_match(selector, stats(6, 9, "entry-b"), ref)
    assert not page_may_match(selector, stats(0, 5, None), ref)  # not kept, still right
    assert page_may_match(selector, stats(6, 9, None), ref)


def test_sealing_leaves_out_runs_every_consumer_has_passed(tmp_path):
    address = singles(tmp_path, 600, compact_small_pages=0)
    passed = address.state.pages.ends[2]
    # acknowledged past the first rows (without the cleanup an ack runs, which would take
    # them): not worth reading
    address.save_consumer_position("keep", {**address.consumers()["keep"], "position": passed})
    assert address.consumers()["keep"]["position"] == passed
    report = address.seal()
    index = address.state.pages
    assert report.rows == len(index) - 1 - 3
    assert [index.stats(i) is None for i in range(len(index))] == \
        [True] * 3 + [False] * (len(index) - 4) + [True]


def test_a_run_sealed_elsewhere_or_replaced_is_passed_over(tmp_path):
    address = singles(tmp_path, 300, compact_small_pages=0)
    index = address.state.pages
    name, seq, rows = index.names[0], index.seq[0], index.rows[0]
    assert index.row_without_stats(name, seq, rows) == 0
    assert not index.add_stats(name, seq, rows + 1, {"rows": rows + 1, "columns": {}})
    assert index.add_stats(name, seq, rows, {"rows": rows, "columns": {}})
    assert index.row_without_stats(name, seq, rows) is None  # sealed: never again
    assert not index.add_stats(name, seq, rows, {"rows": rows, "columns": {}})
