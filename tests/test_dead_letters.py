"""Dead letters: a message nacked after ``max_delivery_attempts`` deliveries goes to the
``dead_letter_address`` with its origin (or is dropped, counted and logged without one); the
move is written before it is made and a move a crash stopped is finished, never twice; and
``durablequeue redrive`` sends dead letters back, each once.

What is stored is read back by fresh handles (or the CLI), never from the consumer that wrote it.
"""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pytest
from conftest import run_cli as run

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops import dead_letter
from pyspark_durable_queue._ops.window import DeliveryWindow
from pyspark_durable_queue.errors import InvalidNameError, InvalidOptionError


def poisoned(root, attempts=3, **settings):
    a = DurableQueue(root).address("jobs", max_delivery_attempts=attempts, **settings)
    a.send([{"id": i, "body": f"m{i}"} for i in range(5)])
    return a


def fail_until_dead(consumer, attempts):
    """Receive the first message and nack it ``attempts`` times; its delivery counts."""
    counts = []
    for _ in range(attempts):
        got = consumer.receive(1)
        assert got.column("id").to_pylist() == [0]
        counts.append(got.column("_delivery_count")[0].as_py())
        consumer.nack(got, delay_ms=0)
    return counts


def dead_letters(root, name="DLQ"):
    a = DurableQueue(root).address(name, create=False)
    return [row for batch, _ in a.snapshot().messages(a.stats()["first_seq"])
            if batch is not None for row in batch.to_pylist()]


def test_a_message_nacked_max_delivery_attempts_times_goes_to_the_dead_letter_address(root):
    a = poisoned(root, dead_letter_address="DLQ")
    c = a.consumer("w")
    assert fail_until_dead(c, 3) == [1, 2, 3]
    # the others flow on; the dead one is not delivered again
    assert c.receive(10).column("id").to_pylist() == [1, 2, 3, 4]
    c.ack()
    [letter] = dead_letters(root)
    assert letter["origin_address"] == "jobs" and letter["origin_consumer"] == "w"
    assert letter["origin_seq"] == 0 and letter["delivery_count"] == 3
    assert letter["reason"] == "max_delivery_attempts (3) reached"
    assert dead_letter.message_row(letter["message"]) == {"id": 0, "body": "m0"}
    stats = DurableQueue(root).address("jobs").stats()["consumers"]["w"]
    assert stats["position"] == 5  # settled: the watermark passed it
    assert stats["dead_lettered"] == 1 and stats["dead_letters_dropped"] == 0
    assert stats["redelivery_pending"] == 0
    c.close()


def test_without_a_dead_letter_address_the_message_is_dropped_counted_and_logged(root, caplog):
    a = poisoned(root, attempts=2)
    c = a.consumer("w")
    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        fail_until_dead(c, 2)
    assert "_seq 0..0 are dropped: max_delivery_attempts (2) reached" in caplog.text
    assert c.receive(10).column("id").to_pylist() == [1, 2, 3, 4]
    c.ack()
    stats = DurableQueue(root).address("jobs").stats()["consumers"]["w"]
    assert stats["dead_letters_dropped"] == 1 and stats["dead_lettered"] == 0
    assert stats["position"] == 5
    assert "DLQ" not in DurableQueue(root).addresses()


def test_unset_max_delivery_attempts_redelivers_for_ever(root):
    a = DurableQueue(root).address("jobs", dead_letter_address="DLQ")
    a.send([{"id": 0}])
    c = a.consumer("w")
    for count in range(1, 13):  # past Artemis' default of 10: unset keeps today's behaviour
        got = c.receive(1)
        assert got.column("_delivery_count").to_pylist() == [count]
        c.nack(got, delay_ms=0)
    assert "DLQ" not in DurableQueue(root).addresses()


def test_one_dead_letter_address_serves_addresses_of_different_schemas(tmp_path, capsys):
    root = str(tmp_path / "dq")
    q = DurableQueue(root)
    orders = q.address("orders", max_delivery_attempts=1, dead_letter_address="DLQ")
    orders.send([{"order": 7, "amount": 1.5}])
    mails = q.address("mails", max_delivery_attempts=1, dead_letter_address="DLQ")
    mails.send([{"to": "a@example.com", "tags": ["x", "y"]}])
    for a in (orders, mails):
        c = a.consumer("w")
        c.nack(c.receive(1))
        c.close()
    letters = dead_letters(root)
    assert [r["origin_address"] for r in letters] == ["orders", "mails"]
    assert [dead_letter.message_row(r["message"]) for r in letters] == [
        {"order": 7, "amount": 1.5}, {"to": "a@example.com", "tags": ["x", "y"]}]
    # browse shows the row itself beside why it is there
    code, out, err = run(capsys, root, "browse", "DLQ", "--json")
    assert code == 0, err
    shown = [json.loads(line) for line in out.splitlines()] if out.lstrip()[0] == "{" \
        else json.loads(out)
    assert [r["message"] for r in shown] == [{"order": 7, "amount": 1.5},
                                             {"to": "a@example.com", "tags": ["x", "y"]}]
    assert {r["reason"] for r in shown} == {"max_delivery_attempts (1) reached"}
    # redrive sends each back to its origin, with its own schema
    code, out, err = run(capsys, root, "redrive", "DLQ", "--json")
    assert code == 0, err
    assert json.loads(out)["destinations"] == {"orders": 1, "mails": 1}
    back = q.address("orders").consumer("w").receive(10)
    assert back.select(["order", "amount"]).to_pylist() == [{"order": 7, "amount": 1.5}]
    assert back.column("_delivery_count").to_pylist() == [1]  # a new message there
    back = q.address("mails").consumer("w").receive(10)
    assert back.select(["to", "tags"]).to_pylist() == [{"to": "a@example.com",
                                                        "tags": ["x", "y"]}]


def _move_begun(root, *, sent: bool):
    """A consumer that died during a dead-letter move: its window holds the move's intent, and
    (``sent``) the dead letters were stored before the kill. Built with the files' own writers,
    as the consumer writes them (the crash test kills a real process at random)."""
    a = poisoned(root, dead_letter_address="DLQ")
    c = a.consumer("w")
    got = c.receive(1)
    c.close()
    window = DeliveryWindow(0)  # the moving row holds the ack point, as nack leaves it
    move = window.begin_move({0: 3}, "DLQ", "max_delivery_attempts (3) reached")
    a.save_consumer_window("w", window.record(0))
    if sent:
        a.send_dead_letters("DLQ", dead_letter.letters("jobs", "w", got, {0: 3}, move.reason),
                            dead_letter.move_key("jobs", "w", move.number))
    return a


@pytest.mark.parametrize("sent", [False, True], ids=["before-the-append", "after-the-append"])
def test_a_move_a_crash_stopped_is_finished_by_the_next_receive_once(root, sent):
    _move_begun(root, sent=sent)
    a = DurableQueue(root).address("jobs")
    assert a.stats()["consumers"]["w"]["position"] == 0  # the moving row holds the watermark
    c = a.consumer("w")
    assert c.receive(10).column("id").to_pylist() == [1, 2, 3, 4]  # never the moving row
    c.ack()
    assert [r["origin_seq"] for r in dead_letters(root)] == [0]  # stored once
    stats = DurableQueue(root).address("jobs").stats()["consumers"]["w"]
    assert stats["dead_lettered"] == 1 and stats["position"] == 5


def test_dead_letter_moves_are_numbered_and_a_repeated_move_is_a_duplicate(tmp_path):
    root = str(tmp_path)
    a = poisoned(root, attempts=1, dead_letter_address="DLQ")
    c = a.consumer("w")
    for _ in range(3):
        c.nack(c.receive(1))
    assert [r["origin_seq"] for r in dead_letters(root)] == [0, 1, 2]
    got = DurableQueue(root).address("jobs").consumer("other").receive(1)
    again = a.send_dead_letters("DLQ", dead_letter.letters("jobs", "w", got, {0: 1}, "again"),
                                dead_letter.move_key("jobs", "w", 2))
    assert again.duplicate and len(dead_letters(root)) == 3


def test_a_nack_of_several_rows_dead_letters_those_at_the_limit_and_redelivers_the_others(
        tmp_path):
    root = str(tmp_path)
    a = poisoned(root, attempts=2, dead_letter_address="DLQ")
    c = a.consumer("w")
    first = c.receive(2)  # ids 0, 1
    c.nack(first.slice(0, 1), delay_ms=0)  # 0: once
    again = c.receive(1)
    assert again.column("id").to_pylist() == [0]
    c.nack(again, delay_ms=0)  # 0: its second delivery failed: dead
    c.nack(first.slice(1, 1), delay_ms=0)  # 1: first failure, comes back
    assert [r["origin_seq"] for r in dead_letters(root)] == [0]
    got = c.receive(10)
    assert got.column("id").to_pylist() == [1]
    assert got.column("_delivery_count").to_pylist() == [2]


def test_redrive_is_resumable_and_sends_each_dead_letter_once(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a = poisoned(root, attempts=1, dead_letter_address="DLQ")
    c = a.consumer("w")
    for _ in range(4):
        c.nack(c.receive(1))
    c.close()
    code, out, err = run(capsys, root, "redrive", "DLQ", "--selector", "origin_seq < 2",
                         "--batch-size", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["messages"] == 2
    # a run that died after sending and before acknowledging: its consumer starts over
    DurableQueue(root).address("DLQ").consumer("redrive").seek("earliest")
    code, out, err = run(capsys, root, "redrive", "DLQ", "--selector", "origin_seq < 2")
    assert code == 0, err
    assert "redrove 0 dead letters" in out
    code, out, err = run(capsys, root, "redrive", "DLQ", "--to", "retry", "--consumer", "all",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["destinations"] == {"retry": 4}
    retry = DurableQueue(root).address("retry").consumer("r").receive(10)
    assert retry.column("id").to_pylist() == [0, 1, 2, 3]
    jobs = DurableQueue(root).address("jobs").consumer("fresh").receive(10)
    assert jobs.column("id").to_pylist() == [0, 1, 2, 3, 4, 0, 1]


def test_redrive_of_an_address_that_is_not_dead_letters_is_refused(tmp_path, capsys):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("plain").send([{"id": 1}])
    code, _out, err = run(capsys, root, "redrive", "plain")
    assert code == 2
    assert "plain does not hold dead letters: the columns origin_address" in err
    assert DurableQueue(root).address("plain").consumer("check").receive(10).num_rows == 1


def test_settings_are_checked(tmp_path):
    q = DurableQueue(str(tmp_path))
    with pytest.raises(InvalidOptionError, match=r"max_delivery_attempts|maxDeliveryAttempts"):
        q.address("a", max_delivery_attempts=0)
    with pytest.raises(InvalidNameError, match="dead_letter_address"):
        q.address("a", dead_letter_address="../elsewhere")
    with pytest.raises(InvalidOptionError, match="names itself as its dead_letter_address"):
        q.address("a", dead_letter_address="a")
    a = q.address("b", **{"maxDeliveryAttempts": "5", "deadLetterAddress": "DLQ"})
    assert a.settings.max_delivery_attempts == 5 and a.settings.dead_letter_address == "DLQ"


def test_the_consumers_command_shows_dead_lettered_counts(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a = poisoned(root, attempts=1, dead_letter_address="DLQ")
    c = a.consumer("w")
    c.nack(c.receive(1))
    c.close()
    code, out, err = run(capsys, root, "consumers", "jobs")
    assert code == 0, err
    header, row = out.splitlines()[:2]
    column = header.split().index("dead_lettered")
    assert row.split()[column] == "1"


def test_dead_letters_hold_the_origin_row_whole(tmp_path):
    rows = pa.table({"id": pa.array([5], pa.int16()), "when": pa.array([1.25])})
    a = DurableQueue(str(tmp_path)).address("typed", max_delivery_attempts=1,
                                            dead_letter_address="DLQ")
    a.send(rows)
    c = a.consumer("w")
    c.nack(c.receive(1))
    [(origin, table)] = dead_letter.messages(
        DurableQueue(str(tmp_path)).address("DLQ").consumer("x").receive(10))
    assert origin == "typed" and table.equals(rows)  # types kept (int16 stays int16)


def test_a_reopened_consumer_reading_one_at_a_time_steps_over_a_dead_lettered_row(root):
    a = poisoned(root, attempts=1, dead_letter_address="DLQ")
    c = a.consumer("w")
    c.receive(3)
    c.nack(1)  # the first delivery was the last: dead-lettered, settled above the ack point
    c.close()
    reopened = DurableQueue(root).address("jobs").consumer("w")  # from the ack point, 0
    got = [reopened.receive(1).column("id").to_pylist() for _ in range(4)]
    assert got == [[0], [2], [3], [4]]  # never 1, and never an empty table before the end
    assert reopened.receive(1).num_rows == 0
