"""What ``stats()`` says for monitoring (issue 41, metrics): per consumer the age of its oldest
unsettled message and its messages in flight, per address the age of its first message; the
counters rates follow from (``next_seq``, ``ack_point``).

Times are checked against the ``_timestamp`` a reader gets for the message at the consumer's
watermark (an independent read of the messages), never against the figure itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops.commit import backlog_after
from pyspark_durable_queue._ops.metrics import Backlogs
from pyspark_durable_queue._ops.window import DeliveryWindow

CHILD = Path(__file__).parent / "_procs" / "inflight_child.py"


def _times_ms(address) -> dict[int, int]:
    """The ``_timestamp`` (epoch ms) a reader gets for each retained message, by ``_seq``."""
    probe = address.consumer("probe", start="earliest")
    table = probe.receive(10_000)
    probe.delete()
    return dict(zip(table.column("_seq").to_pylist(),
                    (t.value // 1000 for t in table.column("_timestamp")), strict=True))


def _sends(address, times: int, rows: int = 5) -> None:
    for k in range(times):
        address.send([{"k": k, "n": i} for i in range(rows)])
        time.sleep(0.02)  # each send a commit time of its own


@pytest.mark.parametrize("journal", [True, False], ids=["journal-run-of-units",
                                                        "page-file-per-commit"])
def test_oldest_unsettled_age_is_that_of_the_message_at_the_watermark(tmp_path, journal):
    a = DurableQueue(str(tmp_path)).address("jobs", journal=journal, fsync="never")
    _sends(a, 6)  # 30 messages, 6 commit times
    times = _times_ms(a)
    c = a.consumer("w")
    c.ack(c.receive(12))  # the watermark inside the third send: not where a row starts
    before = int(time.time() * 1000)
    row = a.stats()["consumers"]["w"]
    after = int(time.time() * 1000)
    expected = times[12]
    assert row["oldest_unsettled_seq"] == 12
    assert row["oldest_unsettled_timestamp_ms"] == expected
    assert before - expected <= row["oldest_unsettled_age_ms"] <= after - expected
    # and the first send's messages are older: the figure moved with the watermark
    assert expected > times[0]


def test_in_a_compacted_page_the_age_is_at_most_a_frame_too_old(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", journal=False, fsync="never")
    _sends(a, 6)
    assert a.compact().runs == 1
    assert a.stats()["pages"] == 1  # one page, one frame: its messages' times differ
    times = _times_ms(a)
    c = a.consumer("w")
    c.ack(c.receive(12))
    row = a.stats()["consumers"]["w"]
    # the frame's first time: never younger than the message, never older than the page
    assert times[0] <= row["oldest_unsettled_timestamp_ms"] <= times[12]


def test_nothing_unsettled_means_no_oldest_message_and_age_zero(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", fsync="never")
    a.consumer("w")
    empty = a.stats()
    assert empty["oldest_message_age_ms"] == 0
    assert empty["consumers"]["w"]["oldest_unsettled_seq"] is None
    a.send([{"n": 1}, {"n": 2}])
    c = a.consumer("w")
    c.ack(c.receive(10))
    row = a.stats()["consumers"]["w"]
    assert (row["oldest_unsettled_seq"], row["oldest_unsettled_timestamp_ms"],
            row["oldest_unsettled_age_ms"]) == (None, None, 0)
    assert row["ack_point"] == 2 and a.stats()["next_seq"] == 2  # the counters of the rates


def test_below_what_retention_removed_the_oldest_is_the_first_retained(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", journal=False, fsync="never",
                                            retention_bytes=1)
    a.consumer("idle")
    _sends(a, 3)
    a.cleanup(dry_run=False)
    stats = a.stats()
    assert stats["retention_removed_messages"] > 0 and stats["first_seq"] > 0
    row = stats["consumers"]["idle"]
    assert row["position"] == 0
    assert row["oldest_unsettled_seq"] == stats["first_seq"]
    assert row["oldest_unsettled_timestamp_ms"] == _times_ms(a)[stats["first_seq"]]


def test_a_nack_holding_the_watermark_back_makes_its_message_the_oldest(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", fsync="never")
    _sends(a, 3)
    times = _times_ms(a)
    c = a.consumer("w")
    batch = c.receive(15)
    c.nack(batch.slice(2, 1), delay_ms=60_000)
    c.ack(batch)
    row = a.stats()["consumers"]["w"]
    assert (row["position"], row["ack_point"]) == (2, 15)
    assert row["oldest_unsettled_seq"] == 2
    assert row["oldest_unsettled_timestamp_ms"] == times[2]
    c.close()


def _wait_for(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_in_flight_is_what_the_owner_in_another_process_holds(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", fsync="never")
    _sends(a, 4)  # 20 messages
    a.consumer("w")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, str(CHILD), str(tmp_path), "jobs", "w", "600"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdin is not None and child.stdout is not None

    def command(line: str) -> str:
        child.stdin.write(line + "\n")
        child.stdin.flush()
        reply = child.stdout.readline()
        assert reply.startswith("ok"), reply
        return reply

    def in_flight() -> int:
        return DurableQueue(str(tmp_path)).address("jobs").stats()["consumers"]["w"][
            "in_flight"]

    try:
        command("receive 7")
        _wait_for(lambda: in_flight() == 7, "7 in flight")  # the next renewal says so
        command("ack 2")  # _seq 0, 1, 2
        assert in_flight() <= 4  # at once: acknowledged rows are no longer in flight
        _wait_for(lambda: in_flight() == 4, "4 in flight")
        command("nack 3")  # _seq 3 waits for redelivery: not in flight
        _wait_for(lambda: in_flight() == 3, "3 in flight")
        row = a.stats()["consumers"]["w"]
        assert (row["redelivery_pending"], row["position"]) == (1, 3)
        child.send_signal(signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL  # the kill landed
        # a dead owner holds nothing: what it had is delivered again to the next one
        assert in_flight() == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_closed_consumer_has_nothing_in_flight(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs", fsync="never")
    _sends(a, 2)
    c = a.consumer("w")
    c.receive(4)
    c.close()  # releases its lease: no owner
    assert a.stats()["consumers"]["w"]["in_flight"] == 0


def test_the_window_counts_rows_delivered_and_not_settled():
    # a model: rows 0..9 delivered (cursor 10); 0..3 acknowledged; 5 and 7 nacked;
    # 5 delivered again
    w = DeliveryWindow(0)
    w.settle(4)
    w.nack(5, 1, 0)
    w.nack(7, 1, 0)
    assert w.in_flight(10) == 6 - 2  # 4, 6, 8, 9
    w.hand_out([5])
    assert w.in_flight(10) == 5  # and 5 again
    w.settle(10)  # acknowledges 4..9 and the redelivered 5; 7 still waits
    assert w.in_flight(10) == 0
    w.hand_out([7])
    assert w.in_flight(10) == 1  # 7, handed out again below the ack point


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "page-files"])
def test_backlogs_of_every_position_are_what_backlog_after_counts(tmp_path, journal):
    a = DurableQueue(str(tmp_path)).address("jobs", journal=journal, fsync="never",
                                            page_size_bytes=4096)
    for k in range(12):
        a.send([{"k": k, "body": "x" * (50 + 40 * k)} for _ in range(7 + k)])
    c = a.consumer("w")
    c.ack(c.receive(30))
    a.cleanup(dry_run=False)  # pages before _seq 30 go: positions below the first retained
    state = a.state
    assert len(state.pages) > 3
    backlogs = Backlogs(state)
    for position in range(0, state.next_seq + 3):
        assert backlogs.after(position) == backlog_after(state, position), position


def test_a_spark_querys_planned_batch_is_in_flight_until_committed(tmp_path):
    """The stream reader's driver side, called as Spark calls it (no JVM needed)."""
    pytest.importorskip("pyspark")
    from pyspark_durable_queue.spark._reader import spark_schema
    from pyspark_durable_queue.spark._source import DurableQueueStreamReader

    a = DurableQueue(str(tmp_path)).address("jobs", fsync="never")
    _sends(a, 4)  # 20 messages
    reader = DurableQueueStreamReader(
        {"path": str(tmp_path), "address": "jobs", "consumer": "q", "consumerLeaseMs": "1000",
         "maxOffsetsPerTrigger": "12"}, spark_schema(a.schema))

    def in_flight() -> int:
        return a.stats()["consumers"]["q"]["in_flight"]

    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        assert end == {"seq": 12}
        _wait_for(lambda: in_flight() == 12, "the planned batch in flight")  # a renewal later
        reader.commit(end)
        assert in_flight() == 0  # at once: its acknowledgement lowers it
        _wait_for(lambda: in_flight() == 0, "nothing in flight")
    finally:
        reader.stop()
    assert in_flight() == 0  # stopped: the lease is released


@pytest.mark.parametrize("journal", [True, False], ids=["journal-run-of-units",
                                                        "page-file-per-commit"])
def test_expired_messages_count_as_settled_so_the_oldest_is_the_first_unexpired(tmp_path,
                                                                              journal):
    a = DurableQueue(str(tmp_path)).address("jobs", fsync="never", journal=journal)
    _sends(a, 3)  # 15 messages that will expire
    time.sleep(1.2)
    _sends(a, 2)  # 10 that will not
    times = _times_ms(a)
    a = DurableQueue(str(tmp_path)).address("jobs", expiry_delay_ms=1000)
    a.consumer("w")
    stats = a.stats()
    # counted by whole index rows: a run of journal units holding both is not counted
    assert stats["expired_messages"] == (0 if journal else 15)
    row = stats["consumers"]["w"]
    assert row["position"] == 0
    assert row["oldest_unsettled_seq"] == 15
    assert row["oldest_unsettled_timestamp_ms"] == times[15]
    assert row["oldest_unsettled_age_ms"] < 1200 + 2000  # not the expired messages' age
