"""``durablequeue stats ADDR --watch``: a live view of backlog and rates, one view per interval.

Runs the real command line (``cli.main``) against a real store under ``tmp_path``; the sends
and acknowledgements between views come from a thread of the test, as another process's would.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import run_cli as run

from pyspark_durable_queue import DurableQueue


def test_watch_shows_backlog_and_rates_per_view(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders")
    a.send([{"id": i} for i in range(100)])
    c = a.consumer("billing")
    stop = threading.Event()

    def traffic() -> None:  # 50 sends and 20 acknowledgements between the views
        time.sleep(0.6)  # after the first view (it reads the store once: milliseconds)
        a.send([{"id": i} for i in range(50)])
        c.ack(19)
        stop.set()

    thread = threading.Thread(target=traffic)
    thread.start()
    code, out, err = run(capsys, root, "stats", "orders", "--watch", "--interval", "1.5",
                         "--count", "2", "--json")
    thread.join()
    assert code == 0, err
    assert stop.is_set()
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["send_rate"] is None and first["consumers"]["billing"]["ack_rate"] is None
    assert first["next_seq"] == 100  # the traffic came between the views
    assert first["consumers"]["billing"]["backlog_messages"] == 100
    assert second["next_seq"] == 150
    billing = second["consumers"]["billing"]
    assert {k: billing[k] for k in ("position", "ack_point", "backlog_messages", "in_flight",
                                    "redelivery_pending", "dead_lettered")} == {
        "position": 20, "ack_point": 20, "backlog_messages": 130, "in_flight": 0,
        "redelivery_pending": 0, "dead_lettered": 0}
    # the message at the watermark (_seq 20) was sent before the first view
    assert billing["oldest_unsettled_age_ms"] >= 1500
    assert second["oldest_message_age_ms"] >= billing["oldest_unsettled_age_ms"]
    # 50 sends and 20 acks in one interval of at least 1.5 s (and well under 6.5 s)
    assert 50 / 6.5 <= second["send_rate"] <= 50 / 1.5 + 0.1
    assert 20 / 6.5 <= second["consumers"]["billing"]["ack_rate"] <= 20 / 1.5 + 0.1


def test_watch_as_text_without_a_terminal_prints_one_view_after_another(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders")
    a.send([{"id": 1}])
    a.consumer("billing")
    code, out, _ = run(capsys, root, "stats", "orders", "--watch", "--interval", "0.05",
                       "--count", "3")
    assert code == 0
    assert "\x1b" not in out  # no screen control codes when not on a terminal
    views = out.strip().split("\n\n")
    assert len(views) == 3
    assert views[0].startswith("orders: 1 messages, ") and "sending -" in views[0]
    assert "sending 0/s" in views[2]
    assert views[2].splitlines()[1].split() == ["consumer", "position", "backlog",
                                                "backlog_bytes", "acks/s", "oldest",
                                                "in_flight", "nacked", "dead"]
    assert views[2].splitlines()[2].split()[:3] == ["billing", "0", "1"]


def test_watch_of_a_missing_address_fails_at_once(tmp_path, capsys):
    code, _, err = run(capsys, str(tmp_path / "dq"), "stats", "nope", "--watch")
    assert code == 1 and "address 'nope' does not exist" in err


def test_watch_takes_its_interval_as_seconds(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders")
    a.send([{"id": 1}])
    started = time.monotonic()
    code, out, _ = run(capsys, root, "stats", "orders", "--watch", "0.3", "--count", "3",
                       "--json")
    assert code == 0
    assert len(out.splitlines()) == 3
    assert time.monotonic() - started >= 0.6  # two waits of 0.3 s, not --interval's 1 s each
    with pytest.raises(SystemExit) as refused:
        run(capsys, root, "stats", "orders", "--watch", "0")
    assert refused.value.code == 2
    assert "'0' is not a number of seconds > 0" in capsys.readouterr().err


def test_watch_before_the_address_still_works(tmp_path, capsys):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("orders").send([{"id": 1}])
    code, out, _ = run(capsys, root, "stats", "--watch", "orders", "--count", "1", "--json")
    assert code == 0 and json.loads(out)["messages"] == 1


def test_watch_shows_the_leases_of_shared_consumers(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders")
    a.send([{"id": i} for i in range(10)])
    a.consumer("billing").close()
    pool = a.consumer("pool", shared=True, prefetch=1)
    assert pool.receive(4).num_rows == 4
    code, out, err = run(capsys, root, "stats", "orders", "--watch", "--count", "1", "--json")
    assert code == 0, err
    view = json.loads(out)["consumers"]
    assert (view["pool"]["shared"], view["pool"]["leased"], view["pool"]["handles"]) == (
        True, 4, 1)
    assert view["pool"]["first_lease_expiry_ms"] > time.time() * 1000
    assert "leased" not in view["billing"]
    code, out, err = run(capsys, root, "stats", "orders", "--watch", "--count", "1")
    header, *rows = out.strip().splitlines()[1:]
    assert header.split()[-4:] == ["shared", "leased", "handles", "first_lease_expiry"]
    row = next(r.split() for r in rows if r.startswith("pool "))
    assert row[-5:-2] == ["yes", "4", "1"] and row[-2] == "in", row
    pool.close()
