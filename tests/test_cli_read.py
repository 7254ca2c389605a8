"""The CLI's reading commands for scripts: ``count`` and ``receive`` (JSON lines, --ack).

Every test runs the real command line (``cli.main``) against a real store under ``tmp_path``."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import pytest
from conftest import run_cli as run

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue.cli import main


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders", page_size_bytes=4096)
    for i in range(3):
        a.send([{"id": i * 100 + j, "region": "EU" if j % 3 == 0 else "US"}
                for j in range(100)])
    return root


def lines(out):
    return [json.loads(line) for line in out.splitlines()]


def test_count_all_and_with_a_selector(store, capsys):
    code, out, _ = run(capsys, store, "count", "orders")
    assert code == 0 and out == "300\n"
    code, out, _ = run(capsys, store, "count", "orders", "--selector", "region = 'EU'")
    assert code == 0 and out == f"{sum(1 for j in range(300) if j % 100 % 3 == 0)}\n"
    code, out, _ = run(capsys, store, "count", "orders", "--selector",
                       "region = 'EU' AND _seq >= 250", "--json")
    assert code == 0
    assert json.loads(out) == {"address": "orders", "messages": 17,
                               "selector": "region = 'EU' AND _seq >= 250"}


def test_count_counts_retained_messages_only(store, capsys):
    a = DurableQueue(store).address("orders", orphan_grace_ms=0)
    c = a.consumer("all")
    c.ack(249)
    a.cleanup(dry_run=False)
    first = a.stats()["first_seq"]
    assert 0 < first <= 250  # whole pages went
    code, out, _ = run(capsys, store, "count", "orders")
    assert code == 0 and int(out) == 300 - first
    code, out, _ = run(capsys, store, "count", "orders", "--selector", "id < 1000")
    assert code == 0 and int(out) == 300 - first


def test_count_of_an_address_without_messages(tmp_path, capsys):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("empty")
    assert run(capsys, root, "count", "empty")[1] == "0\n"
    assert run(capsys, root, "count", "empty", "--selector", "x = 1")[1] == "0\n"
    code, _, err = run(capsys, root, "count", "nope")
    assert code == 1 and "does not exist" in err


def test_count_with_a_bad_selector_exits_2(store, capsys):
    code, _, err = run(capsys, store, "count", "orders", "--selector", "region = = 1")
    assert code == 2 and "^" in err


def test_receive_prints_json_lines_without_acknowledging(store, capsys):
    DurableQueue(store).address("orders").consumer("eu", selector="region = 'EU'")
    code, out, err = run(capsys, store, "receive", "orders", "--consumer", "eu", "--limit", "5")
    assert code == 0, err
    rows = lines(out)
    assert [r["id"] for r in rows] == [0, 3, 6, 9, 12]
    assert [r["_seq"] for r in rows] == [0, 3, 6, 9, 12]
    assert all(r["region"] == "EU" for r in rows)
    assert dt.datetime.fromisoformat(rows[0]["_timestamp"]).year >= 2026
    assert DurableQueue(store).address("orders").consumers()["eu"]["position"] == 0
    code, out, _ = run(capsys, store, "receive", "orders", "--consumer", "eu", "--limit", "5")
    assert [r["id"] for r in lines(out)] == [0, 3, 6, 9, 12]  # the same again


def test_receive_with_ack_moves_the_watermark(store, capsys):
    DurableQueue(store).address("orders").consumer("c")
    code, out, _ = run(capsys, store, "receive", "orders", "--consumer", "c", "--ack",
                       "--limit", "250")
    assert code == 0
    assert [r["id"] for r in lines(out)] == list(range(250))
    assert DurableQueue(store).address("orders").consumers()["c"]["position"] == 250
    code, out, _ = run(capsys, store, "receive", "orders", "--consumer", "c", "--ack",
                       "--limit", "1000")
    assert [r["_seq"] for r in lines(out)] == list(range(250, 300))
    assert DurableQueue(store).address("orders").consumers()["c"]["position"] == 300
    code, out, _ = run(capsys, store, "receive", "orders", "--consumer", "c", "--ack")
    assert code == 0 and out == ""


def test_receive_ack_with_a_selector_passes_unmatched_messages(store, capsys):
    DurableQueue(store).address("orders").consumer("eu", selector="region = 'EU'")
    code, out, _ = run(capsys, store, "receive", "orders", "--consumer", "eu", "--ack",
                       "--limit", "1000", "--json")
    assert code == 0 and len(lines(out)) == 102  # j % 3 == 0 for 34 of each 100
    assert DurableQueue(store).address("orders").consumers()["eu"]["position"] == 300


def test_receive_default_limit_is_100(store, capsys):
    DurableQueue(store).address("orders").consumer("c")
    code, out, _ = run(capsys, store, "receive", "orders", "--consumer", "c")
    assert code == 0 and len(lines(out)) == 100


def test_receive_needs_an_existing_consumer(store, capsys):
    code, _, err = run(capsys, store, "receive", "orders", "--consumer", "nobody")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "nobody" in err
    assert DurableQueue(store).address("orders").consumers() == {}


@pytest.mark.parametrize("argv", [["--limit", "0"], ["--limit", "x"], []],
                         ids=["zero limit", "not a number", "no consumer"])
def test_receive_usage_errors_exit_2(store, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main([store, "receive", "orders", *(["--consumer", "c"] if argv else []), *argv])
    assert exc.value.code == 2


def test_receive_into_a_closed_pipe_stops_quietly_without_acknowledging(store):
    DurableQueue(store).address("orders").consumer("c")
    proc = subprocess.Popen([sys.executable, "-m", "pyspark_durable_queue", store, "receive",
                             "orders", "--consumer", "c", "--ack"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before anything is printed (`| head` did)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == ""  # no traceback
    assert DurableQueue(store).address("orders").consumers()["c"]["position"] == 0
