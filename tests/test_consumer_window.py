"""The consumer's delivery window: rows settled out of order, rows nacked and waiting for
redelivery, redelivery delays with backoff, ``max_in_flight``, delivery counts, and all of it
surviving a reopen; on every backend of the ``root`` fixture.

Independent values: what is durable is read back from the files (a fresh ``DurableQueue`` and
the window file decoded by ``_ops.window.decode``), never from the consumer that wrote it.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops import window as window_file
from pyspark_durable_queue._ops.window import DeliveryWindow, redelivery_delay_ms
from pyspark_durable_queue.errors import (
    DamagedMetadataError,
    InvalidOptionError,
    SchemaMismatchError,
)


def rows(n, start=0):
    return [{"id": i} for i in range(start, start + n)]


def seqs(table):
    return table.column("_seq").to_pylist()


def fresh(root, name="jobs"):
    """The address opened again by a new handle: only what is on disk."""
    return DurableQueue(root).address(name)


def stored_window(address, name="w"):
    path = address.layout.consumer_window(name)
    try:
        return window_file.decode(address.storage.read(path))
    except Exception as exc:
        if "NotFound" in type(exc).__name__:
            return None
        raise


@pytest.fixture
def address(root):
    a = DurableQueue(root).address("jobs")
    a.send(rows(20))
    return a


def test_a_nacked_row_holds_the_watermark_while_later_rows_are_acknowledged(root, address):
    c = address.consumer("w")
    t = c.receive(5)
    c.nack(2)
    c.ack(t)  # cumulative, but never settles the nacked row
    assert c.position == 2
    assert fresh(root).consumers()["w"]["position"] == 2  # cleanup keeps its page
    assert stored_window(address)["pending"].keys() == {2}
    assert stored_window(address)["ack_point"] == 5


def test_a_due_nacked_row_comes_back_before_newer_rows(address):
    c = address.consumer("w")
    t = c.receive(3)
    c.nack(t.slice(1, 1))
    c.ack(t)
    assert seqs(c.receive(5)) == [1]
    assert seqs(c.receive(5)) == [3, 4, 5, 6, 7]


def test_acknowledging_the_redelivered_row_settles_it_and_the_watermark_moves_on(root, address):
    c = address.consumer("w")
    t = c.receive(4)
    c.nack(1)
    c.ack(t)
    again = c.receive(10)
    assert seqs(again) == [1]
    c.ack(again)
    assert c.position == 4
    assert fresh(root).consumers()["w"]["position"] == 4
    assert stored_window(address)["pending"] == {}
    assert seqs(fresh(root).consumer("w").receive(2)) == [4, 5]


def test_reopen_keeps_pending_rows_their_counts_and_the_ack_point(root, address):
    c = address.consumer("w")
    t = c.receive(6)
    c.nack(t.slice(2, 2))  # 2 and 3
    c.ack(t)
    again = c.receive(10)
    assert seqs(again) == [2, 3]
    c.nack(again.slice(0, 1))  # 2, delivered twice
    c.close()
    reopened = fresh(root).consumer("w")
    assert reopened.position == 2
    # 3 was handed out again and not settled: pending again after a reopen
    assert seqs(reopened.receive(10)) == [2, 3]
    assert {s: c for s, (c, _) in stored_window(address)["pending"].items()} == {2: 2, 3: 1}
    assert seqs(reopened.receive(3)) == [6, 7, 8]


def test_rows_nacked_before_a_reopen_wait_their_delay_and_are_not_delivered_as_new(root,
                                                                                  address):
    c = address.consumer("w")
    t = c.receive(5)
    c.nack(t.slice(1, 2), delay_ms=60_000)  # 1 and 2 wait a minute; 0, 3, 4 are not acked
    c.close()
    reopened = fresh(root).consumer("w")
    got = reopened.receive(8)
    assert seqs(got) == [0, 3, 4, 5, 6, 7, 8, 9]  # delivered again, but never 1 or 2
    assert counts(got) == dict.fromkeys(seqs(got), 1)
    reopened.ack(got)
    assert reopened.position == 1
    assert {s: c for s, (c, _) in stored_window(address)["pending"].items()} == {1: 1, 2: 1}


def test_a_row_due_at_a_reopen_comes_back_once_with_its_count(root, address):
    c = address.consumer("w")
    t = c.receive(4)
    c.nack(t.slice(2, 1), delay_ms=0)
    c.close()
    reopened = fresh(root).consumer("w")
    assert counts(reopened.receive(10)) == {2: 2}  # due: first, delivered a second time
    assert counts(reopened.receive(4)) == {0: 1, 1: 1, 3: 1, 4: 1}  # not 2 again
    reopened.ack()
    assert reopened.position == 5 and stored_window(address)["pending"] == {}


def test_a_nack_with_a_delay_lets_newer_rows_flow_and_comes_back_after_it(address):
    c = address.consumer("w")
    t = c.receive(1)
    began = time.monotonic()
    c.nack(t, delay_ms=4000)  # long enough for an object store's round trips below, loaded
    assert seqs(c.receive(3)) == [1, 2, 3]  # not blocked behind it
    c.ack()
    assert seqs(c.receive(5)) == [4, 5, 6, 7, 8]
    c.ack()
    assert time.monotonic() - began < 4.0, "too slow to tell: the delay passed already"
    back = None
    while back is None or not back.num_rows or seqs(back)[0] != 0:
        back = c.receive(1, timeout_ms=5000)
        assert time.monotonic() - began < 15
    assert time.monotonic() - began >= 4.0
    assert seqs(back) == [0]


def test_a_waiting_receive_wakes_when_a_nacked_row_is_due(root):
    a = DurableQueue(root).address("idle")
    a.send(rows(1))
    c = a.consumer("w")
    t = c.receive(1)
    began = time.monotonic()
    c.nack(t, delay_ms=200)
    t = c.receive(1, timeout_ms=3000)
    took = time.monotonic() - began
    assert seqs(t) == [0]
    assert 0.19 <= took < 2.0, took


def test_a_receive_that_waited_for_a_nacked_row_first_read_past_the_rows_the_window_holds(
        root):
    """A waiting receive looks, finds nothing, waits and looks again: it ends as an empty
    ``receive()`` followed by one once the row is due. The empty look reads past the rows the
    window holds, so ``ack()`` afterwards settles the row it waited for (the state machine's
    example: a row redelivered after a reopen, below the cursor no longer)."""
    a = DurableQueue(root).address("waited")
    a.send(rows(1))
    c = a.consumer("w")
    c.nack(c.receive(1), delay_ms=0)
    c.close()
    c = fresh(root, "waited").consumer("w")
    t = c.receive(1)  # due at the reopen: delivered again, the cursor still at the ack point
    assert counts(t) == {0: 2} and c.cursor == 0
    c.nack(t, delay_ms=400)
    (_count, due), = stored_window(a)["pending"].values()
    began = time.time() * 1000
    t = c.receive(1, timeout_ms=5000)
    assert counts(t) == {0: 3}
    assert began < due - 200, "too slow to tell: its first look may have come after the due time"
    assert c.cursor == 1  # its first look found nothing and read past row 0
    c.ack()
    assert c.position == 1 and stored_window(a)["pending"] == {}
    assert fresh(root, "waited").consumers()["w"]["position"] == 1


def test_redelivery_delay_backs_off_up_to_its_maximum(root):
    a = DurableQueue(root).address("backoff", redelivery_delay_ms=100,
                                   redelivery_delay_multiplier=2.0, max_redelivery_delay_ms=300)
    a.send(rows(1))
    c = a.consumer("w")
    delays = []
    for _ in range(4):
        t = None
        while t is None or not t.num_rows:
            t = c.receive(1, timeout_ms=2000)
        now = int(time.time() * 1000)
        c.nack(t)
        (_count, due), = stored_window(a)["pending"].values()
        delays.append(round((due - now) / 100) * 100)
    assert delays == [100, 200, 300, 300]


def test_delay_defaults_follow_artemis():
    assert redelivery_delay_ms(1, 0, 1.0, None) == 0
    assert redelivery_delay_ms(3, 1000, 1.0, None) == 1000
    assert redelivery_delay_ms(5, 1000, 2.0, None) == 10_000  # 10 x the delay when unset
    assert redelivery_delay_ms(2, 1000, 2.0, 5000) == 2000
    assert redelivery_delay_ms(2000, 1000, 10.0, 5000) == 5000  # no overflow


def test_a_nack_given_a_delay_wins_over_the_settings(root):
    a = DurableQueue(root).address("win", redelivery_delay_ms=60_000)
    a.send(rows(2))
    c = a.consumer("w")
    c.nack(c.receive(1), delay_ms=0)
    assert seqs(c.receive(1)) == [0]


def test_max_in_flight_stops_new_rows_while_a_nacked_row_holds_the_watermark(root):
    a = DurableQueue(root).address("bounded", max_in_flight=5)
    a.send(rows(30))
    c = a.consumer("w")
    c.nack(c.receive(1), delay_ms=60_000)  # row 0 holds the watermark for a minute
    assert seqs(c.receive(100)) == [1, 2, 3, 4]
    assert c.receive(100).num_rows == 0
    c.ack()  # settles 1..4, not 0: the window still spans 0..4
    assert c.receive(100).num_rows == 0
    began = time.monotonic()
    assert c.receive(1, timeout_ms=100).num_rows == 0
    assert time.monotonic() - began >= 0.09
    c.seek(2)  # the window is gone
    assert seqs(c.receive(3)) == [2, 3, 4]
    c.nack(3)
    c.ack()
    assert seqs(c.receive(100)) == [3]  # due rows still come past the bound
    assert seqs(c.receive(100)) == [5, 6, 7]  # 3..7: five rows from the watermark
    c.nack(7, delay_ms=60_000)
    c.ack(6)  # settles the redelivered 3 too: the window spans 7..7
    for _ in range(4):
        assert c.receive(1).num_rows == 1  # one at a time: the read-ahead path
    assert c.receive(1).num_rows == 0
    assert (c.position, c.cursor) == (7, 12)


def test_without_nacked_rows_receive_is_not_bounded(root):
    a = DurableQueue(root).address("unbounded", max_in_flight=5)
    a.send(rows(30))
    c = a.consumer("w")
    assert c.receive(100).num_rows == 30


def test_nack_refuses_rows_not_delivered_or_already_acknowledged(address):
    c = address.consumer("w")
    c.ack(c.receive(3))
    with pytest.raises(InvalidOptionError, match="not delivered yet"):
        c.nack(5)
    with pytest.raises(InvalidOptionError, match="already acknowledged"):
        c.nack(1)
    with pytest.raises(InvalidOptionError, match="delay_ms"):
        c.nack(c.receive(1), delay_ms=-1)
    with pytest.raises(TypeError):
        c.nack("3")  # type: ignore[arg-type]
    assert stored_window(address) is None  # nothing was written


def test_without_nacks_no_window_file_is_written(root, address):
    c = address.consumer("w")
    for _ in range(10):
        c.ack(c.receive(1))
    assert stored_window(address) is None
    assert fresh(root).consumers()["w"]["position"] == 10


def test_seek_forgets_the_window(root, address):
    c = address.consumer("w")
    t = c.receive(5)
    c.nack(1)
    c.ack(t)
    c.seek(0)
    assert stored_window(address) is None
    reopened = fresh(root).consumer("w")
    assert (reopened.position, reopened.cursor) == (0, 0)
    assert seqs(reopened.receive(3)) == [0, 1, 2]


def test_deleting_a_consumer_removes_its_window(root, address):
    c = address.consumer("w")
    c.receive(2)
    c.nack(0)
    c.delete()
    assert stored_window(address) is None
    assert seqs(fresh(root).consumer("w").receive(2)) == [0, 1]


def test_a_selector_consumer_gets_its_nacked_row_back(root):
    a = DurableQueue(root).address("sel")
    a.send([{"id": i, "kind": "a" if i % 2 else "b"} for i in range(10)])
    c = a.consumer("w", selector="kind = 'a'")
    t = c.receive(2)
    assert seqs(t) == [1, 3]
    c.nack(t.slice(0, 1))
    c.ack(t)
    assert seqs(c.receive(1)) == [1]
    assert seqs(c.receive(2)) == [5, 7]


def test_a_damaged_window_file_is_reported_at_open(tmp_path):
    a = DurableQueue(str(tmp_path / "q")).address("jobs")
    a.send(rows(3))
    c = a.consumer("w")
    c.nack(c.receive(1))
    c.close()
    path = tmp_path / "q" / "jobs" / "consumers" / "w.window"
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedMetadataError, match=r"w\.window"):
        DurableQueue(str(tmp_path / "q")).address("jobs").consumer("w")


def test_a_format_2_address_keeps_its_format_and_gets_a_window_on_its_first_nack(tmp_path):
    root = tmp_path / "q"
    DurableQueue(str(root)).address("old")
    meta = root / "old" / "address.json"
    doc = json.loads(meta.read_text())
    doc.pop("crc32c")
    doc["format"] = 2
    meta.write_text(json.dumps(doc))
    a = DurableQueue(str(root)).address("old")
    a.send(rows(5))
    c = a.consumer("w")
    t = c.receive(3)
    c.nack(0)
    c.ack(t)
    assert json.loads(meta.read_text())["format"] == 2
    assert json.loads((root / "old" / "consumers" / "w.json").read_text())["position"] == 0
    reopened = DurableQueue(str(root)).address("old").consumer("w")
    assert seqs(reopened.receive(5)) == [0]
    assert seqs(reopened.receive(5)) == [3, 4]


def test_a_watermark_moved_back_by_another_writer_abandons_the_window():
    w = DeliveryWindow.restore(7, {"ack_point": 12, "floor": 9, "pending": {9: (1, 0)}})
    assert (w.ack_point, w.pending) == (7, {})
    # written over .wm 9, which then rose to 10 (an older release acknowledged past row 9)
    w = DeliveryWindow.restore(10, {"ack_point": 12, "floor": 9, "pending": {9: (1, 0)}})
    assert (w.ack_point, w.pending, w.watermark) == (12, {}, 12)
    # a crash between the window's write and the .wm's: the window holds
    w = DeliveryWindow.restore(9, {"ack_point": 12, "floor": 9, "pending": {11: (2, 0)}})
    assert (w.ack_point, w.pending, w.watermark) == (12, {11: (2, 0)}, 11)


@pytest.mark.parametrize("arrays", [False, True], ids=["dict", "as-decoded"])
def test_settle_below_settles_every_row_below_it_and_keeps_those_above(arrays):
    # the Spark source's commit (it read the whole range): rows waiting for redelivery and rows
    # handed out again below the point are settled, rows settled one by one are forgotten,
    # rows above it stay as they are, and a move in progress is left to be finished
    record = {"ack_point": 6, "floor": 2, "pending": {2: (1, 0), 4: (2, 10**15), 9: (1, 0)},
              "moves": 1, "dead_lettered": 1, "dropped": 0, "moving": None, "settled": [7]}
    if arrays:
        record = window_file.decode(window_file.encode(record))
    w = DeliveryWindow.restore(2, record)
    if not arrays:
        w.hand_out([2])
    assert w.watermark == 2
    assert w.settle_below(8)
    assert (w.ack_point, w.pending, w.settled, w.watermark) == (8, {9: (1, 0)}, set(), 8)
    assert not w.settle_below(8)  # nothing left below it
    assert w.settle_below(10) and (w.pending, w.watermark) == ({}, 10)
    moving = DeliveryWindow(3, {5: (1, 0)})
    moving.begin_move({1: 3}, None, "max_delivery_attempts (3) reached")
    assert moving.settle_below(6)
    assert (moving.ack_point, moving.pending, moving.watermark) == (6, {}, 1)


@pytest.mark.parametrize("arrays", [False, True], ids=["dict", "as-decoded"])
def test_unsettled_runs_are_the_pending_rows_below_the_ack_point_and_the_rest_above(arrays):
    record = {"ack_point": 6, "floor": 2, "pending": {2: (1, 0), 3: (1, 0), 5: (2, 0)},
              "moves": 1, "dead_lettered": 1, "dropped": 0, "moving": None, "settled": [8]}
    if arrays:
        record = window_file.decode(window_file.encode(record))
    w = DeliveryWindow.restore(2, record)
    assert w.unsettled(2, 12) == [(2, 4), (5, 8), (9, 12)]
    assert w.unsettled(4, 9) == [(5, 8)]
    assert w.unsettled(3, 3) == [] and w.unsettled(9, 12) == [(9, 12)]
    assert DeliveryWindow(4).unsettled(4, 9) == [(4, 9)]  # the common case, unchanged
    assert DeliveryWindow(6).unsettled(2, 9) == [(6, 9)]  # acknowledged below the ack point
    moving = DeliveryWindow(3, {1: (1, 0)})
    moving.begin_move({2: 3}, None, "max_delivery_attempts (3) reached")
    assert moving.unsettled(0, 5) == [(1, 2), (3, 5)]


@pytest.mark.parametrize("record", [
    {"ack_point": 3, "floor": 5, "pending": []},
    {"ack_point": 9, "floor": 5, "pending": [[4, 1, 0]]},
    {"ack_point": 9, "floor": 5, "pending": [[6, -1, 0]]},
    {"ack_point": 9, "floor": 5, "pending": [[6, 1]]},
    {"ack_point": "9", "floor": 5, "pending": []},
], ids=["floor-above-ack-point", "pending-below-floor", "negative-count", "short-entry",
        "text-number"])
def test_window_records_that_cannot_be_right_are_refused(record):
    from pyspark_durable_queue._format import checked

    with pytest.raises((ValueError, KeyError, TypeError)):
        window_file.decode(checked.dumps(record))


def test_window_files_round_trip():
    record = {"ack_point": 9, "floor": 5, "pending": {5: (1, 10), 7: (3, 20)}}
    assert window_file.decode(window_file.encode(record)) == record


# -- delivery counts (part 3) ------------------------------------------------------------------


def counts(table):
    return dict(zip(seqs(table), table.column("_delivery_count").to_pylist(), strict=True))


def test_rows_carry_their_delivery_count_one_then_one_more_per_redelivery(root, address):
    c = address.consumer("w")
    t = c.receive(3)
    assert t.schema.field("_delivery_count").type == pa.int32()
    assert counts(t) == {0: 1, 1: 1, 2: 1}
    c.nack(t.slice(1, 1))
    c.ack(t)
    again = c.receive(5)
    assert counts(again) == {1: 2}
    c.nack(again)
    assert counts(c.receive(5)) == {1: 3}
    c.nack(1)
    c.close()
    # reopened: the count written with the nack goes on
    reopened = fresh(root).consumer("w")
    assert counts(reopened.receive(5)) == {1: 4}
    assert counts(reopened.receive(2)) == {3: 1, 4: 1}


def test_messages_yield_the_delivery_count(address):
    c = address.consumer("w")
    first = next(c.messages(timeout_ms=0))
    assert (first["_seq"], first["_delivery_count"]) == (0, 1)
    c.nack(first["_seq"])
    again = next(c.messages(timeout_ms=0))
    assert (again["_seq"], again["_delivery_count"]) == (0, 2)


def test_an_empty_receive_has_the_delivery_count_column(root):
    a = DurableQueue(root).address("empty")
    assert a.consumer("w").receive().column_names == ["_seq", "_timestamp", "_delivery_count"]
    a.send(rows(1))
    assert "_delivery_count" in a.consumer("w").receive(timeout_ms=0).column_names


def test_delivery_count_is_reserved_and_not_in_the_spark_schema(address):
    with pytest.raises(SchemaMismatchError, match="_delivery_count"):
        address.send(pa.table({"id": [1], "_delivery_count": pa.array([1], pa.int32())}))
    pytest.importorskip("pyspark")
    from pyspark_durable_queue.spark._reader import spark_schema

    assert spark_schema(address.schema).fieldNames() == ["id", "_seq", "_timestamp"]


def test_acknowledging_part_of_a_table_settles_up_to_its_last_row_only(root, address):
    # found by tests/test_consumer_state_machine.py: the table's label (the position after
    # it) went with its slices, so acknowledging the first row acknowledged the whole table
    c = address.consumer("w")
    t = c.receive(5)
    c.ack(t.slice(0, 2))
    assert c.position == 2
    assert fresh(root).consumers()["w"]["position"] == 2
    c.ack(t.slice(3, 2))  # ends with the table's last row: as the table
    assert c.position == 5
    assert seqs(c.receive(2)) == [5, 6]


def test_acknowledging_a_selector_table_passes_the_rows_skipped_after_it(root):
    a = DurableQueue(root).address("sel")
    a.send([{"id": i, "kind": "a" if i < 3 else "b"} for i in range(8)])
    c = a.consumer("w", selector="kind = 'a'")
    t = c.receive(10)
    assert seqs(t) == [0, 1, 2]
    c.ack(t.slice(0, 1))
    assert c.position == 1
    c.ack(t)  # past the non-matching 3..7
    assert c.position == 8


def test_a_selector_consumer_refuses_to_nack_a_row_it_skipped(root):
    # found by tests/test_consumer_state_machine.py: the skipped row was nacked, then
    # "redelivered" (count 2) to a consumer whose selector does not match it
    a = DurableQueue(root).address("sel")
    a.send([{"id": i, "kind": "a" if i == 3 else "b"} for i in range(5)])
    c = a.consumer("w", selector="kind = 'a'")
    assert seqs(c.receive(5)) == [3]
    with pytest.raises(InvalidOptionError, match=r"_seq 1 .* not delivered .*kind = 'a'"):
        c.nack(1, delay_ms=0)
    assert c.receive(5).num_rows == 0
    c.nack(3, delay_ms=0)
    assert counts(c.receive(5)) == {3: 2}


def test_a_refused_nack_changes_nothing(root, address):
    # found by tests/test_consumer_state_machine.py: the rows before the refused one were
    # nacked in memory (and written by the next acknowledgement)
    c = address.consumer("w")
    t = c.receive(2)
    c.nack(0, delay_ms=0)
    c.ack(1)  # settles 1; 0 waits for redelivery
    assert seqs(c.receive(5)) == [0]
    with pytest.raises(InvalidOptionError, match=r"_seq 1 .* already acknowledged"):
        c.nack(t, delay_ms=0)  # 0 could be nacked again, 1 cannot
    c.ack()  # settles the redelivered 0: it was not nacked again
    assert c.position == 2
    assert stored_window(address)["pending"] == {}
