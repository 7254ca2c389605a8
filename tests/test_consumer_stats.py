"""What stats(), `durablequeue ROOT consumers ADDR` and verify say of a consumer's delivery
window (issue 39): rows nacked and not settled, those not due yet, the highest delivery count,
and the ack point above a watermark that nacked rows hold back."""

from __future__ import annotations

import json

from conftest import run_cli

from pyspark_durable_queue import DurableQueue


def _address(root):
    a = DurableQueue(str(root)).address("jobs", fsync="never")
    a.send([{"n": i} for i in range(10)])
    return a


def test_stats_count_what_waits_for_redelivery(root):
    a = _address(root)
    c = a.consumer("w")
    fresh = a.stats()["consumers"]["w"]
    assert {k: fresh[k] for k in ("position", "ack_point", "redelivery_pending",
                                  "redelivery_delayed", "max_delivery_count")} == {
        "position": 0, "ack_point": 0, "redelivery_pending": 0, "redelivery_delayed": 0,
        "max_delivery_count": 0}
    batch = c.receive(4)
    c.nack(batch.slice(1, 1), delay_ms=60_000)  # _seq 1: not due for a minute
    c.nack(batch.slice(2, 1), delay_ms=0)  # _seq 2: due at once
    c.ack(batch)  # cumulative: settles 0 and 3, never a nacked row
    stats = DurableQueue(str(root)).address("jobs").stats()["consumers"]["w"]
    assert (stats["position"], stats["ack_point"]) == (1, 4)  # the nacked _seq 1 holds it
    assert (stats["redelivery_pending"], stats["redelivery_delayed"]) == (2, 1)
    assert stats["max_delivery_count"] == 1
    again = c.receive(1)  # _seq 2 comes back first, its second delivery
    assert again.column("_seq").to_pylist() == [2]
    c.nack(again, delay_ms=60_000)
    stats = a.stats()["consumers"]["w"]
    assert (stats["redelivery_pending"], stats["redelivery_delayed"]) == (2, 2)
    assert stats["max_delivery_count"] == 2
    c.close()


def test_the_consumers_command_shows_the_window(tmp_path, capsys):
    a = _address(tmp_path)
    c = a.consumer("w")
    c.nack(c.receive(2), delay_ms=60_000)
    c.close()
    code, out, _ = run_cli(capsys, str(tmp_path), "consumers", "jobs")
    assert code == 0
    header, row = out.splitlines()[:2]
    assert "nacked" in header and "delayed" in header and "max_deliveries" in header
    assert row.split()[:7] == ["w", "0", "10", row.split()[3], "2", "2", "1"]
    code, out, _ = run_cli(capsys, str(tmp_path), "--json", "consumers", "jobs")
    assert json.loads(out)["w"]["redelivery_pending"] == 2


def test_verify_reports_a_damaged_window_file(tmp_path, capsys):
    a = _address(tmp_path)
    c = a.consumer("w")
    c.nack(c.receive(2), delay_ms=60_000)
    c.close()
    path = tmp_path / "jobs" / "consumers" / "w.window"
    data = bytearray(path.read_bytes())
    data[16] ^= 0x01  # the ack point in the header (_format/window.py)
    path.write_bytes(bytes(data))
    code, out, _ = run_cli(capsys, str(tmp_path), "verify", "jobs")
    assert code == 1 and "w.window" in out
