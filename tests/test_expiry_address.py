"""``expiry_address`` (Artemis' ``expiry-address``): expired messages are moved there once per
address, with their origin (the dead-letter columns, reason ``expired``), by the idempotent
two-step of dead letters (intent recorded, send under a transaction key, intent settled).
Without it expired messages stay dropped. Consumers go on skipping expired messages.

Time is real: messages are made old by waiting a few hundred milliseconds.
"""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format import checked
from pyspark_durable_queue._ops.dead_letter import letters, messages
from pyspark_durable_queue._ops.expiry import ExpiryMover, move_key
from pyspark_durable_queue._options import parse_options
from pyspark_durable_queue.errors import InvalidNameError, InvalidOptionError

TTL_MS = 300
#: for tests whose consumers must take messages before they expire (a loaded machine is slow)
SLOW_MS = 1500
LONG_MS = 600_000


def expire() -> None:
    time.sleep(TTL_MS / 1000 + 0.15)


def moved(root: str, target: str = "EXP") -> pa.Table:
    """Everything in the expiry address, read by a fresh consumer."""
    c = DurableQueue(root).address(target).consumer(f"audit{time.monotonic_ns()}",
                                                    start="earliest")
    try:
        return pa.concat_tables(list(c.batches(max_messages=100_000))) \
            if c.address.stats()["next_seq"] else pa.table({})
    finally:
        c.close()


def test_the_option_has_artemis_name_and_may_not_name_its_own_address(tmp_path):
    assert parse_options({"expiryAddress": "EXP"}, "address")["expiry_address"] == "EXP"
    assert parse_options({"expiry-address": "EXP"}, "address")["expiry_address"] == "EXP"
    with pytest.raises(InvalidOptionError, match="expiry_address"):
        DurableQueue(str(tmp_path)).address("jobs", expiry_address="jobs")
    with pytest.raises(InvalidNameError, match="expiry_address"):
        DurableQueue(str(tmp_path)).address("jobs", expiry_address="../x")


def test_expired_messages_are_moved_once_with_their_origin(root):
    q = DurableQueue(root)
    a = q.address("jobs", expiry_address="EXP")
    c = a.consumer("w")
    a.send([{"id": 0}, {"id": 1}], ttl_ms=TTL_MS)
    a.send([{"id": 2}])
    a.send([{"id": 3}], ttl_ms=TTL_MS)
    expire()
    report = a.move_expired()
    assert report.moves == 1 and report.moved == 3 and report.cursor == 4
    assert a.move_expired().moved == 0  # nothing twice
    dead = moved(root)
    assert dead.column("origin_address").to_pylist() == ["jobs"] * 3
    assert dead.column("origin_seq").to_pylist() == [0, 1, 3]
    assert set(dead.column("reason").to_pylist()) == {"expired"}
    assert [r["id"] for _, t in messages(dead) for r in t.to_pylist()] == [0, 1, 3]
    got = c.receive(10)  # consumers skip them as before
    assert got.column("id").to_pylist() == [2]
    c.close()


def test_the_address_expiry_delay_moves_what_no_consumer_took_in_time(tmp_path):
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", expiry_delay_ms=SLOW_MS, expiry_address="EXP")
    c = a.consumer("w")
    a.send([{"id": i} for i in range(3)])
    got = c.receive(2)  # 0 and 1 taken while alive
    c.ack(got)
    assert a.move_expired().moved == 0  # alive: the cursor waits at 2
    c.close()
    time.sleep(SLOW_MS / 1000 + 0.15)
    report = a.move_expired()
    assert report.moved == 1 and moved(root).column("origin_seq").to_pylist() == [2]
    c = DurableQueue(root).address("jobs").consumer("w")
    assert c.receive(10).num_rows == 0
    c.close()


def test_messages_consumed_before_they_expired_are_not_moved(tmp_path):
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", expiry_address="EXP")
    c = a.consumer("w")
    a.send([{"id": i} for i in range(5)], ttl_ms=SLOW_MS)
    c.ack(c.receive(10))
    assert a.move_expired().moved == 0  # consumed while alive: passed
    time.sleep(SLOW_MS / 1000 + 0.15)
    assert a.move_expired().moved == 0
    assert DurableQueue(root).address("EXP").stats()["next_seq"] == 0
    c.close()


def test_without_an_expiry_address_nothing_is_moved(tmp_path):
    a = DurableQueue(str(tmp_path)).address("jobs")
    a.send([{"id": 0}], ttl_ms=TTL_MS)
    expire()
    assert a.move_expired().moves == 0
    a.cleanup(dry_run=False)
    assert not a.storage.exists(a.layout.expiry)
    assert "EXP" not in DurableQueue(str(tmp_path)).addresses()


def test_a_move_repeated_after_its_send_is_stored_once(tmp_path):
    # a crash between the send and the settle: the intent is on disk, the letters are in the
    # expiry address; the next pass sends again under the same key (a duplicate) and settles
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", expiry_address="EXP")
    a.send([{"id": i} for i in range(4)], ttl_ms=TTL_MS)
    expire()
    mover = ExpiryMover(a._context)
    a.storage.makedirs(a.layout.expiry)
    intent = mover._plan({"cursor": 0}, time.time())
    assert intent is not None and intent["moving"]["end"] == 4
    assert a.storage.create(mover._path(1), checked.dumps(intent))
    _, rows = mover._judge(0, 4, intent["moving"])
    table = letters("jobs", "", rows, dict.fromkeys(rows.column("_seq").to_pylist(), 0),
                    "expired")
    assert not a._send_expired("EXP", table, move_key("jobs", 1)).duplicate
    report = a.move_expired()
    assert report.moves == 1 and report.moved == 0  # the repeat was a duplicate
    assert moved(root).column("origin_seq").to_pylist() == [0, 1, 2, 3]
    assert a.move_expired().moves == 0


def test_an_intent_left_before_its_send_is_finished_by_the_next_pass(tmp_path):
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", expiry_address="EXP")
    a.send([{"id": i} for i in range(3)], ttl_ms=TTL_MS)
    expire()
    mover = ExpiryMover(a._context)
    a.storage.makedirs(a.layout.expiry)
    intent = mover._plan({"cursor": 0}, time.time())
    assert a.storage.create(mover._path(1), checked.dumps(intent))
    a.send([{"id": 3}], ttl_ms=TTL_MS)  # after the intent: the next move's
    expire()
    report = a.move_expired()
    assert report.moves == 2 and report.moved == 4
    assert moved(root).column("origin_seq").to_pylist() == [0, 1, 2, 3]


def test_cleanup_moves_first_and_keeps_pages_the_moves_still_need(tmp_path):
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", expiry_address="EXP", journal=False,
                                   cleanup_interval_ms=3_600_000)
    c = a.consumer("w")
    a.send([{"id": 0}], ttl_ms=TTL_MS)
    a.send([{"id": 1}], ttl_ms=LONG_MS)
    expire()
    got = c.receive(10)
    assert got.column("id").to_pylist() == [1]  # 0 expired: skipped
    c.ack(got)  # the watermark passes both; the cleanup it starts moves 0 first
    a.cleanup(dry_run=False)
    assert moved(root).column("origin_seq").to_pylist() == [0]
    assert len(a.log.refresh().pages) == 0  # then both pages went
    c.close()


def test_without_consumers_only_pages_of_moved_expired_messages_go(tmp_path):
    root = str(tmp_path)
    a = DurableQueue(root).address("jobs", expiry_address="EXP", journal=False)
    a.send([{"id": 0}], ttl_ms=TTL_MS)
    a.send([{"id": 1}])
    expire()
    report = a.cleanup(dry_run=False)  # moves 0 first; no consumer: nothing is consumed
    assert report.expired == [(0, 1)] and len(report.pages) == 1
    assert moved(root).column("origin_seq").to_pylist() == [0]
    assert [r.seq for r in a.log.refresh().pages.refs(0)] == [1]


def test_pages_stay_while_a_move_cannot_be_made(tmp_path, caplog):
    root = str(tmp_path)
    DurableQueue(root).address("EXP").send([{"other": "schema"}])  # dead letters do not fit
    a = DurableQueue(root).address("jobs", expiry_address="EXP", journal=False)
    c = a.consumer("w")
    a.send([{"id": 0}], ttl_ms=TTL_MS)
    a.send([{"id": 1}])
    expire()
    got = c.receive(10)
    c.ack(got)
    a.cleanup(dry_run=False)
    assert "moving expired messages to EXP failed" in caplog.text
    assert len(a.log.refresh().pages) == 2  # the move still needs them
    c.close()


def test_stats_count_messages_moved_and_expired_pages_removed(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("jobs", journal=False, expiry_address="EXP")
    assert a.stats()["expired_moved_messages"] == 0
    a.send([{"id": 0}, {"id": 1}], ttl_ms=TTL_MS)
    a.send([{"id": 2}], ttl_ms=TTL_MS)
    expire()
    assert a.move_expired().moved == 3
    a.send([{"id": 3}], ttl_ms=TTL_MS)
    expire()
    assert a.move_expired().moved == 1
    stats = a.stats()
    assert stats["expired_moved_messages"] == 4
    a.cleanup(dry_run=False)  # the moved messages' pages go, recorded as expired
    stats = a.stats()
    assert stats["expired_moved_messages"] == 4
    assert stats["expired_removed_messages"] == 4
    assert stats["lost_messages"] == 0 and stats["retention_removed_messages"] == 0
    fresh = DurableQueue(root).address("jobs").stats()  # from the files, not this handle
    assert fresh["expired_moved_messages"] == 4 and fresh["expired_removed_messages"] == 4


def test_the_cli_moves_expired_messages_now(tmp_path, capsys):
    import json

    from conftest import run_cli

    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("jobs", expiry_address="EXP")
    a.send([{"id": 0}, {"id": 1}], ttl_ms=TTL_MS)
    a.send([{"id": 2}])
    DurableQueue(root).address("plain").send([{"id": 9}], ttl_ms=TTL_MS)
    expire()
    code, out, _ = run_cli(capsys, root, "expire", "jobs")
    assert code == 0 and "moved 2 expired messages to EXP in 1 moves" in out
    assert moved(root).column("origin_seq").to_pylist() == [0, 1]
    code, out, _ = run_cli(capsys, root, "--json", "expire", "jobs")  # nothing twice
    assert code == 0 and json.loads(out)["moved"] == 0
    code, out, _ = run_cli(capsys, root, "expire", "plain")
    assert code == 0 and "has no expiry_address" in out
    code, _, err = run_cli(capsys, root, "expire", "nope")
    assert code != 0 and "nope" in err
