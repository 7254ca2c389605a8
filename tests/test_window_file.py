"""The window file's bytes (``_format/window.py``): a binary round trip of every part of a
window, damage anywhere found and reported, windows written as checked JSON by earlier
releases still opened (and rewritten in the binary layout by the next change), and a window
opened lazily, its rows kept as arrays, answering exactly as the same window kept as a dict.

Independent values: the old JSON layout is written here by the test itself; the lazy window is
checked against a window built from a plain dict and driven by the same operations.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format import checked
from pyspark_durable_queue._format import window as window_bytes
from pyspark_durable_queue._ops import window as window_file
from pyspark_durable_queue._ops.window import DeliveryWindow, Move, PendingRows
from pyspark_durable_queue.errors import DamagedMetadataError


def _legacy_json(record):
    """A window file as the first releases of format 5 wrote it (checked JSON)."""
    obj = {"ack_point": record["ack_point"], "floor": record["floor"],
           "pending": [[s, c, d] for s, (c, d) in sorted(record["pending"].items())]}
    if record.get("moves"):
        moving = record["moving"]
        obj.update(moves=record["moves"], dead_lettered=record["dead_lettered"],
                   dropped=record["dropped"], moving=None if moving is None else moving.json(),
                   settled=record["settled"])
    return checked.dumps(obj)


BIG = {s: (1 + s % 7, 1_732_240_000_000 + 13 * s) for s in range(1_000, 21_000, 2)}
RECORDS = {
    "empty": {"ack_point": 0, "floor": 0, "pending": {}},
    "10k-pending": {"ack_point": 21_000, "floor": 1_000, "pending": BIG},
    "dead-letters": {"ack_point": 50, "floor": 40, "pending": {41: (2, 7), 45: (1, 9)},
                     "moves": 3, "dead_lettered": 5, "dropped": 2, "moving": None,
                     "settled": [51, 60]},
    "moving": {"ack_point": 50, "floor": 40, "pending": {45: (1, 2**62)},
               "moves": 4, "dead_lettered": 5, "dropped": 0,
               "moving": Move(4, "DLQ", "max_delivery_attempts (3) reached", {42: 3, 44: 3}),
               "settled": [51]},
    "dropping": {"ack_point": 9, "floor": 9, "pending": {},
                 "moves": 1, "dead_lettered": 0, "dropped": 0,
                 "moving": Move(1, None, "why: \"quoted\" é", {9: 10}), "settled": []},
}


@pytest.mark.parametrize("name", list(RECORDS))
def test_a_window_round_trips_through_its_binary_file(name):
    record = RECORDS[name]
    data = window_file.encode(record)
    assert data[:4] == window_bytes.MAGIC
    back = window_file.decode(data)
    assert back == record
    assert isinstance(back["pending"], PendingRows)
    assert dict(back["pending"]) == record["pending"]  # the rows themselves, as a dict
    # and the JSON layout of the same window reads back to the same record
    assert window_file.decode(_legacy_json(record)) == record


def test_ten_thousand_pending_rows_take_24_bytes_each():
    data = window_file.encode(RECORDS["10k-pending"])
    assert len(data) == 56 + 24 * 10_000 + 4


def _flip_each(data, positions):
    for at in positions:
        damaged = bytearray(data)
        damaged[at] ^= 0x01 << (at % 8)
        yield at, bytes(damaged)


@pytest.mark.parametrize("name", ["empty", "dead-letters", "moving"])
def test_a_flipped_bit_in_any_byte_of_a_window_is_refused(name):
    data = window_file.encode(RECORDS[name])
    for at, damaged in _flip_each(data, range(len(data))):
        with pytest.raises((ValueError, KeyError, TypeError)):
            window_file.decode(damaged)
            pytest.fail(f"byte {at} flipped and the window decoded")


def test_a_flipped_bit_in_a_large_window_is_refused():
    data = window_file.encode(RECORDS["10k-pending"])
    picks = [*range(64), *random.Random(7).sample(range(64, len(data)), 300),
             *range(len(data) - 8, len(data))]
    for at, damaged in _flip_each(data, picks):
        with pytest.raises(ValueError, match=r"checksum|header|starts with"):
            window_file.decode(damaged)
            pytest.fail(f"byte {at} flipped and the window decoded")


def test_a_cut_window_is_refused():
    data = window_file.encode(RECORDS["dead-letters"])
    for end in (0, 3, 40, 59, len(data) - 1):
        with pytest.raises(ValueError):
            window_file.decode(data[:end])


def _reseal(body):
    return body + window_bytes._CRC.pack(window_bytes.crc32c(body))


@pytest.mark.parametrize("change, message", [
    (lambda h: h.__setitem__(slice(16, 24), (3).to_bytes(8, "little")), "above ack_point"),
    (lambda h: h.__setitem__(slice(4, 6), (2).to_bytes(2, "little")), "newer release"),
    (lambda h: h.__setitem__(slice(56 + 8, 64 + 8), (5).to_bytes(8, "little")), "order"),
    (lambda h: h.__setitem__(slice(56 + 16, 64 + 16), (-1).to_bytes(8, "little",
                                                                  signed=True)),
     "delivery count"),
    (lambda h: h.__setitem__(slice(56, 64), (1).to_bytes(8, "little")), "below floor"),
], ids=["floor-above-ack-point", "newer-version", "rows-out-of-order", "negative-count",
        "row-below-floor"])
def test_a_window_whose_checksum_holds_but_cannot_be_right_is_refused(change, message):
    data = bytearray(window_file.encode(
        {"ack_point": 9, "floor": 5, "pending": {5: (1, 10), 7: (2, 20)}})[:-4])
    change(data)
    with pytest.raises(ValueError, match=message):
        window_file.decode(_reseal(bytes(data)))


def _with_window(tmp_path, rows=20, nacked=(2, 3, 7)):
    a = DurableQueue(str(tmp_path / "q")).address("jobs")
    a.send([{"id": i} for i in range(rows)])
    c = a.consumer("w")
    t = c.receive(10)
    for s in nacked:
        c.nack(s, delay_ms=3_600_000)
    c.ack(t)
    c.close()
    return a, tmp_path / "q" / "jobs" / "consumers" / "w.window"


def test_a_damaged_window_file_is_damaged_metadata_at_open_and_in_stats(tmp_path):
    _, path = _with_window(tmp_path)
    data = path.read_bytes()
    assert data[:4] == window_bytes.MAGIC
    for at in (0, 9, 17, 60, 56 + 24 * 3 - 1, len(data) - 1):
        damaged = bytearray(data)
        damaged[at] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(DamagedMetadataError, match=r"w\.window"):
            DurableQueue(str(tmp_path / "q")).address("jobs").consumer("w")
        with pytest.raises(DamagedMetadataError, match=r"w\.window"):
            DurableQueue(str(tmp_path / "q")).address("jobs").stats()
    path.write_bytes(data)
    assert DurableQueue(str(tmp_path / "q")).address("jobs").consumer("w").position == 2


def test_a_json_window_written_before_still_opens_and_is_rewritten_binary(tmp_path):
    _, path = _with_window(tmp_path)
    record = window_file.decode(path.read_bytes())
    record["pending"] = dict(record["pending"])
    record["pending"][3] = (4, 0)  # due now, delivered four times
    path.write_bytes(_legacy_json(record))
    assert path.read_bytes()[:1] == b"{"
    q = DurableQueue(str(tmp_path / "q")).address("jobs")
    stats = q.stats()["consumers"]["w"]
    assert (stats["redelivery_pending"], stats["redelivery_delayed"],
            stats["max_delivery_count"], stats["ack_point"]) == (3, 2, 4, 10)
    c = q.consumer("w")
    assert c.position == 2
    again = c.receive(5)
    assert again.column("_seq").to_pylist() == [3]
    assert again.column("_delivery_count").to_pylist() == [5]
    c.ack(again)  # the window changed: written in the binary layout
    assert path.read_bytes()[:4] == window_bytes.MAGIC
    assert dict(window_file.decode(path.read_bytes())["pending"]).keys() == {2, 7}
    c.close()
    reopened = DurableQueue(str(tmp_path / "q")).address("jobs").consumer("w")
    assert reopened.position == 2
    assert reopened.receive(3).column("_seq").to_pylist() == [10, 11, 12]


def test_opening_a_consumer_keeps_its_pending_rows_as_arrays_until_they_change(tmp_path):
    a = DurableQueue(str(tmp_path / "q")).address("jobs")
    a.send([{"id": i} for i in range(3_000)])
    c = a.consumer("w")
    t = c.receive(3_000)
    c.nack(t.slice(0, 2_999), delay_ms=3_600_000)
    c.nack(2_999, delay_ms=0)
    c.ack(t)
    c.close()
    c = DurableQueue(str(tmp_path / "q")).address("jobs").consumer("w")
    window = c._window
    assert window._pending is None and window.pending_count() == 3_000
    assert (c.position, c.cursor, window.watermark) == (0, 3_000, 0)
    assert a.stats()["consumers"]["w"]["redelivery_delayed"] == 2_999
    again = c.receive(10)  # the due row is handed out: the dict is built
    assert again.column("_seq").to_pylist() == [2_999]
    assert again.column("_delivery_count").to_pylist() == [2]
    assert window._pending is not None and len(window.pending) == 3_000
    assert c.receive(10).num_rows == 0  # none due, none new
    c.ack(again)
    assert c.position == 0 and window.pending_count() == 2_999


# -- the lazy window (arrays) answers as the eager one (a dict) ---------------------------------

NOW = 1_000

rows_strategy = st.dictionaries(
    st.integers(0, 60), st.tuples(st.integers(1, 5), st.integers(NOW - 50, NOW + 50)),
    max_size=25)
ops_strategy = st.lists(st.one_of(
    st.tuples(st.just("settle"), st.integers(0, 70)),
    st.tuples(st.just("hand_out"), st.integers(1, 5)),
    st.tuples(st.just("nack"), st.integers(0, 70), st.integers(NOW - 10, NOW + 10)),
    st.tuples(st.just("settle_rows"), st.integers(0, 70)),
    st.tuples(st.just("crash"),),
), max_size=12)


def _answers(w, now):
    return (w.watermark, w.ack_point, w.pending_count(), w.waiting(), w.in_use,
            w.due(now, 5), w.due(now + 100, 1000), w.next_due_ms(), w.summary(now),
            w.in_flight(75), dict(w.record(3)["pending"]), repr(w), w.pending_from(0),
            w.pending_from(30), w.pending_from(71))


@settings(max_examples=150, deadline=None)
@given(rows=rows_strategy, ack_point=st.integers(0, 70), watermark=st.integers(0, 70),
       ops=ops_strategy)
def test_a_window_read_as_arrays_answers_as_the_same_window_as_a_dict(rows, ack_point,
                                                                      watermark, ops):
    floor = min([ack_point, *rows])
    record = {"ack_point": ack_point, "floor": floor, "pending": rows}
    lazy = DeliveryWindow.restore(watermark, window_file.decode(window_file.encode(record)))
    eager = DeliveryWindow.restore(watermark, record)
    assert (lazy._pending is None) == (watermark >= floor) and eager._rows is None
    assert _answers(lazy, NOW) == _answers(eager, NOW)
    assert lazy.record(3) == eager.record(3)
    for op in ops:
        for w in (lazy, eager):
            if op[0] == "settle":
                w.settle(op[1])
            elif op[0] == "hand_out":
                w.hand_out(w.due(NOW, op[1]))
            elif op[0] == "nack":
                w.nack(op[1], 2, op[2])
            elif op[0] == "settle_rows":
                w.settle_rows([op[1]])
            else:
                w.restore_after_crash()
        assert _answers(lazy, NOW) == _answers(eager, NOW)


def test_pending_rows_behave_as_the_dict_they_hold():
    rows = {5: (1, 10), 9: (3, 2), 12: (2, 30)}
    arrays = PendingRows.from_dict(rows)
    assert arrays == rows and rows == arrays and arrays != {5: (1, 10)}
    assert list(arrays) == [5, 9, 12] and len(arrays) == 3
    assert arrays[9] == (3, 2) and 9 in arrays and 6 not in arrays and "9" not in arrays
    assert np.int64(12) in arrays
    with pytest.raises(KeyError):
        arrays[6]
    assert arrays.since(6) == {9: (3, 2), 12: (2, 30)} and arrays.since(0) is arrays
    assert arrays.due_by(10, 5) == [5, 9] and arrays.due_by(10, 1) == [5]
    assert (arrays.first(), arrays.next_due_ms(), arrays.delayed(10), arrays.max_count(),
            arrays.count_from(9)) == (5, 2, 1, 3, 2)
    empty = PendingRows.from_dict({})
    assert (empty.first(), empty.next_due_ms(), empty.max_count(), len(empty)) == (
        None, None, 0, 0)
