"""The operator CLI: every command, human and --json output, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue.cli import main


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders", page_size_bytes=4096, orphan_grace_ms=0,
                                   cleanup_interval_ms=3_600_000)
    for i in range(3):
        a.send([{"id": i * 100 + j, "region": "EU" if j % 2 else "US"} for j in range(100)])
    c = a.consumer("billing", selector="region = 'EU'")
    c.ack(c.receive(max_messages=50))
    return root


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_addresses_and_stats(store, capsys):
    code, out, _ = run(capsys, store, "addresses")
    assert code == 0 and "orders" in out
    code, out, _ = run(capsys, store, "--json", "stats", "orders")
    stats = json.loads(out)
    assert stats["next_seq"] == 300
    assert stats["consumers"]["billing"]["selector"] == "region = 'EU'"
    code, out, _ = run(capsys, store, "--json", "consumers", "orders")
    assert json.loads(out)["billing"]["position"] > 0
    code, out, _ = run(capsys, store, "--json", "pages", "orders")
    pages = json.loads(out)
    assert sum(p["rows"] for p in pages) == 300 - stats["first_seq"]
    assert pages[0]["first_seq"] == stats["first_seq"]


def test_browse_with_selector_does_not_consume(store, capsys):
    code, out, _ = run(capsys, store, "browse", "orders", "--from", "0", "--limit", "5",
                       "--selector", "id >= 200 AND region = 'US'")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == [200, 202, 204, 206, 208]
    assert all(r["region"] == "US" for r in rows)
    before = DurableQueue(store).address("orders").stats()["consumers"]["billing"]["position"]
    run(capsys, store, "browse", "orders")
    after = DurableQueue(store).address("orders").stats()["consumers"]["billing"]["position"]
    assert before == after


def test_verify_finds_corruption(store, capsys):
    code, out, _ = run(capsys, store, "--json", "verify", "orders")
    assert code == 0 and json.loads(out)["ok"]
    pages = os.path.join(store, "orders", "pages")
    victim = os.path.join(pages, sorted(os.listdir(pages))[0])
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    code, out, _ = run(capsys, store, "--json", "verify", "orders")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert report["problems"][0]["problem"] == "corrupt"
    assert report["problems"][0]["page"] == os.path.basename(victim)


def test_cleanup_dry_run_then_apply(store, capsys):
    a = DurableQueue(store).address("orders")
    c = a.consumer("billing")
    while c.receive(max_messages=1000).num_rows:
        pass
    c.ack()
    code, out, _ = run(capsys, store, "--json", "cleanup", "orders")
    assert code == 0
    dry = json.loads(out)
    assert dry["dry_run"] and dry["pages"]
    assert DurableQueue(store).address("orders").stats()["pages"] == len(dry["pages"])
    code, out, _ = run(capsys, store, "--json", "cleanup", "orders", "--apply")
    assert code == 0
    assert not json.loads(out)["dry_run"]
    assert DurableQueue(store).address("orders").stats()["pages"] == 0


def test_errors_are_one_line_with_exit_code(store, capsys):
    code, _, err = run(capsys, store, "stats", "nope")
    assert code == 1 and "address 'nope' does not exist" in err
    code, _, err = run(capsys, store, "stats", "../etc")
    assert code == 1 and "invalid address name" in err
    code, _, err = run(capsys, store, "browse", "orders", "--selector", "a = = 1")
    assert code == 1 and "^" in err


def test_send_from_stdin_as_installed_command(tmp_path):
    root = str(tmp_path / "dq")
    exe = os.path.join(os.path.dirname(sys.executable), "durablequeue")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "pyspark_durable_queue.cli"]
    proc = subprocess.run([*cmd, root, "send", "events"], input='{"a": 1}\n\n{"a": 2}\n',
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "sent 2 messages" in proc.stdout
    proc = subprocess.run([*cmd, root, "send", "events"], input='{"a": 3}\nnot json\n',
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "line 2 is not JSON" in proc.stderr
    assert DurableQueue(root).address("events").stats()["messages"] == 2
