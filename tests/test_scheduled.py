"""Scheduled delivery: ``send(rows, deliver_at=...)`` / ``send(rows, delay_ms=...)``.

Real files on every backend; small delays. The crash test is in ``test_scheduled_crash.py``.
"""

from __future__ import annotations

import datetime as dt
import time

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.scheduled import ScheduledName, decode, encode
from pyspark_durable_queue._log.state import LogState, append_entry
from pyspark_durable_queue._log.txn import REMEMBER_SCHEDULED, SCHEDULED_PREFIX, scheduled_txn
from pyspark_durable_queue.errors import CorruptPageError, InvalidOptionError

UTC = dt.timezone.utc


def _xs(table: pa.Table) -> list:
    return table.column("x").to_pylist()


def _now() -> dt.datetime:
    return dt.datetime.now(UTC)


def test_a_delayed_send_is_delivered_after_its_time_not_before(root):
    address = DurableQueue(root).address("orders")
    address.send({"x": 0})
    consumer = address.consumer("c")
    sent = time.time()
    result = address.send([{"x": 1}, {"x": 2}], delay_ms=1000)
    assert result.count == 0 and result.scheduled is not None
    counted = address.stats()["scheduled_messages"]
    if time.time() < sent + 1:  # an object store may be slow enough to pass the due time
        assert counted == 2
    got = []
    while len(got) < 3 and time.time() < sent + 30:
        table = consumer.receive(10, timeout_ms=200)
        seqs = table.column("_seq").to_pylist()
        got += [(x, seq, time.time()) for x, seq in zip(_xs(table), seqs, strict=True)]
    assert [(x, seq) for x, seq, _ in got] == [(0, 0), (1, 1), (2, 2)]  # new _seq values
    assert all(at >= sent + 1 for x, _, at in got if x > 0)  # not before its time
    consumer.ack()
    stats = address.stats()
    assert stats["scheduled_messages"] == 0 and stats["scheduled_sends"] == 0
    # reopened: nothing left to deliver, nothing delivered twice
    again = DurableQueue(root).address("orders")
    assert again.scheduled() == []
    assert again.consumer("c").receive(10).num_rows == 0


def test_deliver_at_is_delivered_at_its_time(tmp_path):
    address = DurableQueue(str(tmp_path / "dq")).address("orders")
    at = _now() + dt.timedelta(milliseconds=300)
    address.send({"x": 7}, deliver_at=at)
    consumer = address.consumer("c")
    table = consumer.receive(10, timeout_ms=5000)
    assert _now() >= at
    assert _xs(table) == [7]
    # a time already past (another zone, same instant rules) sends at once
    tokyo = dt.timezone(dt.timedelta(hours=9))
    result = address.send({"x": 8}, deliver_at=dt.datetime.now(tokyo) - dt.timedelta(seconds=1))
    assert result.count == 1 and result.scheduled is None


def test_due_schedules_go_by_due_time_then_send_order(tmp_path):
    address = DurableQueue(str(tmp_path / "dq")).address("orders")
    base = _now() + dt.timedelta(milliseconds=300)
    address.send({"x": 3}, deliver_at=base + dt.timedelta(milliseconds=20))
    address.send({"x": 1}, deliver_at=base)
    address.send({"x": 2}, deliver_at=base)  # same time: after the send before it
    address.send({"x": 0}, deliver_at=base - dt.timedelta(milliseconds=20))
    address.send({"x": 9}, delay_ms=60_000)  # not due
    time.sleep(0.4)
    assert address.release_due() == 4
    consumer = address.consumer("c")
    assert _xs(consumer.receive(10)) == [0, 1, 2, 3]
    assert [s["rows"] for s in address.scheduled()] == [1]


def test_bad_schedules_are_refused_with_a_clear_error(tmp_path):
    address = DurableQueue(str(tmp_path / "dq")).address("orders")
    with pytest.raises(InvalidOptionError, match="no time zone"):
        address.send({"x": 1}, deliver_at=dt.datetime.now() + dt.timedelta(minutes=1))
    with pytest.raises(InvalidOptionError, match="not both"):
        address.send({"x": 1}, deliver_at=_now(), delay_ms=10)
    with pytest.raises(InvalidOptionError, match="delay_ms must be an int >= 0"):
        address.send({"x": 1}, delay_ms=-1)
    with pytest.raises(InvalidOptionError, match="delay_ms must be an int >= 0"):
        address.send({"x": 1}, delay_ms=1.5)
    with pytest.raises(InvalidOptionError, match="deliver_at must be a datetime"):
        address.send({"x": 1}, deliver_at="2030-01-01T00:00:00Z")
    with pytest.raises(InvalidOptionError, match="txn cannot be combined"):
        address.send({"x": 1}, delay_ms=10, txn=("app", 1))
    address.send({"x": 1})
    with pytest.raises(Exception, match="not in the schema"):  # checked now, not a year later
        address.send({"y": 1}, delay_ms=60_000)
    assert address.scheduled() == []
    assert address.send({"x": 1}, delay_ms=0).count == 1  # no delay: at once


def test_a_year_ahead_holds_back_nothing_and_costs_a_receive_no_listing(tmp_path):
    address = DurableQueue(str(tmp_path / "dq")).address("orders", cleanup_interval_ms=60_000)
    address.send({"x": 1}, deliver_at=_now() + dt.timedelta(days=365))
    address.send([{"x": i} for i in range(10)])
    consumer = address.consumer("c")
    listed = address._clock.listed_at
    for _ in range(5):
        table = consumer.receive(2)
        consumer.ack()
    assert _xs(table) == [8, 9]
    # neither the folder was listed again nor anything released: only the clock was compared
    assert address._clock.listed_at == listed
    report = address.cleanup(dry_run=False)
    assert report is not None
    stats = address.stats()
    assert stats["scheduled_messages"] == 1
    assert stats["consumers"]["c"]["position"] == 10  # the watermark passed every message
    assert stats["consumers"]["c"]["backlog_messages"] == 0


def test_another_process_schedule_is_found_by_the_listing_interval(tmp_path):
    url = str(tmp_path / "dq")
    scheduler = DurableQueue(url).address("orders")
    scheduler.send({"x": 0})
    reader = DurableQueue(url).address("orders", cleanup_interval_ms=200)
    consumer = reader.consumer("c")
    assert _xs(consumer.receive(10)) == [0]
    # another process's clock knows nothing of this schedule: simulate it by forgetting ours
    scheduler.send({"x": 1}, delay_ms=100)
    scheduler._clock.next_due_ms = float("inf")
    started = time.monotonic()
    table = consumer.receive(10, timeout_ms=5000)
    assert _xs(table) == [1]
    assert time.monotonic() - started < 2  # found by a listing, within ~200 ms of its time


def test_a_release_repeated_after_a_crash_appends_nothing_twice(tmp_path):
    """The crash window: rows appended, file not yet deleted (a file put back as it was)."""
    address = DurableQueue(str(tmp_path / "dq")).address("orders")
    result = address.send([{"x": 1}, {"x": 2}], delay_ms=50)
    path = address.scheduled()[0]["file"]
    kept = open(path, "rb").read()
    time.sleep(0.1)
    assert address.release_due() == 2
    with open(path, "wb") as f:  # what a crash before the delete leaves
        f.write(kept)
    assert address.release_due(force=True) == 0
    assert address.scheduled() == []
    assert _xs(address.consumer("c").receive(10)) == [1, 2]
    assert scheduled_txn(result.scheduled)[0] in address.state.txns


def test_cancel_removes_a_schedule_once(tmp_path):
    address = DurableQueue(str(tmp_path / "dq")).address("orders")
    keep = address.send({"x": 1}, delay_ms=100).scheduled
    drop = address.send({"x": 2}, delay_ms=100).scheduled
    assert address.cancel_scheduled(drop) is True
    assert address.cancel_scheduled(drop) is False
    assert address.cancel_scheduled("not-an-id") is False
    time.sleep(0.15)
    address.release_due()
    assert address.cancel_scheduled(keep) is False  # delivered already
    assert _xs(address.consumer("c").receive(10)) == [1]


def test_merge_schema_is_applied_when_due(tmp_path):
    address = DurableQueue(str(tmp_path / "dq")).address("orders")
    address.send({"x": 1})
    address.send({"x": 2, "y": "new"}, delay_ms=50, merge_schema=True)
    time.sleep(0.1)
    assert address.release_due() == 1
    table = address.consumer("c").receive(10)
    assert table.column("y").to_pylist() == [None, "new"]


def test_a_damaged_scheduled_file_is_reported_and_stays(tmp_path, caplog):
    address = DurableQueue(str(tmp_path / "dq")).address("orders")
    address.send({"x": 1}, delay_ms=20)
    path = address.scheduled()[0]["file"]
    data = bytearray(open(path, "rb").read())
    data[-20] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    time.sleep(0.05)
    assert address.release_due() == 0
    assert "was not delivered" in caplog.text and "--cancel" in caplog.text
    assert len(address.scheduled()) == 1
    with pytest.raises(CorruptPageError, match="checksum"):
        decode(bytes(data), path)


def test_the_file_format_round_trips_and_names_parse():
    table = pa.table({"x": [1, 2, 3], "s": ["a", None, "c"]})
    assert decode(encode(table), "p").equals(table)
    name = ScheduledName.parse("00000001795815676454-00066148eb77db963d808e44-3.arrow")
    assert name == ScheduledName(1795815676454, "00066148eb77db963d808e44", 3)
    assert ScheduledName.parse(name.id) == name
    for bad in ("x.arrow", "1-2-3", "00000001795815676454-zz066148eb77db963d808e44-3"):
        assert ScheduledName.parse(bad) is None


def test_the_log_keeps_only_the_newest_release_keys():
    state = LogState()
    state.apply(1, {**append_entry(0, [], txns=[("app:a", 4)]), "ts": 1})
    n = 2 * REMEMBER_SCHEDULED + 10
    for i in range(n):
        state.apply(i + 2, {**append_entry(0, [], txns=[(f"{SCHEDULED_PREFIX}{i}", 0)]), "ts": 1})
    kept = [k for k in state.txns if k.startswith(SCHEDULED_PREFIX)]
    assert REMEMBER_SCHEDULED <= len(kept) <= 2 * REMEMBER_SCHEDULED
    assert kept[-1] == f"{SCHEDULED_PREFIX}{n - 1}"
    assert f"{SCHEDULED_PREFIX}0" not in state.txns
    assert state.txns["app:a"] == 4  # other keys are never forgotten


def test_prometheus_and_the_cli_count_scheduled_messages(tmp_path, capsys):
    from conftest import run_cli
    from prometheus_client import CollectorRegistry, generate_latest

    from pyspark_durable_queue.metrics import register_collector

    url = str(tmp_path / "dq")
    address = DurableQueue(url).address("orders")
    address.send([{"x": 1}, {"x": 2}, {"x": 3}], delay_ms=3_600_000)
    registry = CollectorRegistry()
    register_collector(url, registry)
    text = generate_latest(registry).decode()
    assert 'durablequeue_scheduled_messages{address="orders"} 3.0' in text
    code, out, _ = run_cli(capsys, url, "stats", "orders")
    assert code == 0 and "scheduled_messages: 3" in out


def test_the_cli_lists_and_cancels_scheduled_sends(tmp_path, capsys, monkeypatch):
    import io
    import json

    from conftest import run_cli

    url = str(tmp_path / "dq")
    monkeypatch.setattr("sys.stdin", io.StringIO('{"x": 1}\n{"x": 2}\n'))
    code, out, _ = run_cli(capsys, url, "send", "orders", "--delay-ms", "3600000")
    assert code == 0 and out.startswith("scheduled 2 messages as ")
    first = out.split()[-1]
    address = DurableQueue(url).address("orders")
    second = address.send({"x": 3}, delay_ms=7_200_000).scheduled
    code, out, _ = run_cli(capsys, url, "scheduled", "orders")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["id", "due", "when", "rows", "file"]
    assert [line.split()[0] for line in lines[1:]] == [first, second]
    assert lines[1].split()[-2] == "2" and "in 60.0 min" in lines[1]
    code, out, _ = run_cli(capsys, url, "scheduled", "orders", "--json")
    listed = json.loads(out)
    assert [(s["id"], s["rows"]) for s in listed] == [(first, 2), (second, 1)]
    assert listed[0]["file"].endswith(f"/orders/scheduled/{first}.arrow")
    code, out, _ = run_cli(capsys, url, "scheduled", "orders", "--cancel", first)
    assert code == 0 and f"cancelled scheduled send {first}" in out
    code, out, err = run_cli(capsys, url, "scheduled", "orders", "--cancel", first)
    assert code == 1 and first in err and "delivered or cancelled already" in err
    assert [s["id"] for s in address.scheduled()] == [second]
    code, _, err = run_cli(capsys, url, "scheduled", "nowhere")
    assert code == 1 and "nowhere" in err
    with pytest.raises(SystemExit):
        run_cli(capsys, url, "send", "orders", "--delay-ms", "-5")
