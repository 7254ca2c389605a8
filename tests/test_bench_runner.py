"""benchmarks/run_all.py (``make bench``): it knows every benchmark, refuses unknown names,
and its report draws plots from real (tiny) runs of the single-message benchmark and of the
message-size and batch-size sweep."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _runner():
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_script_is_in_the_suite():
    runner = _runner()
    scripts = {b.script for b in runner.BENCHES}
    # the S3 one needs its test endpoint; the stream latency one is run on its own; the A/B
    # one needs a second checkout to compare with
    on_disk = {p.name for p in BENCHMARKS.glob("bench_*.py")} - {
        "bench_messages_s3.py", "bench_stream_latency.py", "bench_send_ab.py"}
    assert on_disk <= scripts, on_disk - scripts


def test_dry_run_lists_commands_and_unknown_names_are_refused():
    run = [sys.executable, str(BENCHMARKS / "run_all.py")]
    out = subprocess.run([*run, "--dry-run"], capture_output=True, text=True, check=True)
    assert "bench_messages.py --quick" in out.stdout
    assert "bench_sizes.py --quick" in out.stdout
    assert "bench_messages.py --quick --journal" in out.stdout
    bad = subprocess.run([*run, "--only", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown benchmark" in bad.stderr


@pytest.mark.slow
def test_report_plots_a_real_run(tmp_path):
    data = tmp_path / "messages.json"
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_messages.py"), "--scenarios",
                    "bare,send,receive", "--seconds", "0.3", "--threads", "2", "--procs",
                    "1x2", "--backlog", "200", "--deferred-backlog", "500",
                    "--root", str(tmp_path / "data"), "--json", str(data)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(data.read_text())
    assert {r["name"] for r in rows} >= {"bare write+fdatasync", "project send([row])"}
    assert all(r["rate"] and r["rate"] > 0 for r in rows)
    runner = _runner()
    made = runner.plot_messages(rows, tmp_path)
    assert made == ["messages-throughput.png", "messages-latency.png"]
    for name in made:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sizes_sweep_writes_both_sweeps_and_the_report_plots_them(tmp_path):
    data = tmp_path / "sizes.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_sizes.py"), "--sizes",
                           "100,1024", "--batches", "1,10", "--seconds", "0.05",
                           "--max-bytes", "65536", "--root", str(tmp_path / "data"),
                           "--json", str(data)],
                          check=True, capture_output=True, text=True, timeout=300)
    assert "by message size, 100 messages per send" in proc.stdout
    assert "by batch size, messages of 1 KiB" in proc.stdout
    result = json.loads(data.read_text())
    assert [r["message_bytes"] for r in result["sizes"]] == [100, 1024]
    assert [r["batch"] for r in result["batches"]] == [1, 10]
    for r in result["sizes"] + result["batches"]:
        # every message sent was received, the payload is what was asked for, and each rate
        # and ratio agrees with the seconds measured
        assert r["messages"] % r["batch"] == 0 and r["messages"] >= 2 * r["batch"]
        assert r["payload_bytes"] == r["messages"] * r["message_bytes"]
        assert r["send_msgs_s"] == pytest.approx(r["messages"] / r["send_s"])
        assert r["send_ratio"] == pytest.approx(r["bare_s"] / r["send_s"])
        assert r["receive_mb_s"] == pytest.approx(r["payload_bytes"] / r["receive_s"] / 1e6)
    assert not list((tmp_path / "data").iterdir())  # each point removes its address
    made = _runner().plot_sizes(result, tmp_path)
    assert made == ["sizes-throughput.png", "batches-throughput.png"]
    for name in made:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_the_metrics_benchmark_runs_at_a_tiny_size(tmp_path):
    data = tmp_path / "metrics.json"
    (tmp_path / "data").mkdir()
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_metrics.py"), "--addresses",
                           "3", "--consumers", "2", "--sends", "2", "--rows", "20", "--scrapes",
                           "2", "--root", str(tmp_path / "data"), "--json", str(data)],
                          check=True, capture_output=True, text=True, timeout=300)
    assert "steady-state scrape (median of 2)" in proc.stdout
    result = json.loads(data.read_text())
    assert result["backlog_messages_per_address"] == {"A": 40, "B": 400}
    assert len(result["scrapes"]["A"]) == len(result["scrapes"]["B"]) == 2
    assert result["ratio_B_A"] > 0 and result["cpu_ratio_B_A"] > 0
    assert list((tmp_path / "data").iterdir()) == []  # its data deleted


def test_a_new_report_keeps_the_sections_make_soak_and_make_crash_matrix_wrote(tmp_path):
    runner = _runner()
    report = tmp_path / "performance.md"
    soak = "## soak: 30 minutes of every client at once\n\nslopes:\n```\nrss flat\n```\n"
    matrix = "## crash-matrix: thousands of SIGKILLs\n\n10,000 kills, 0 problems\n"
    by_hand = "## issue 43: targets, one command each\n\nbefore / after\n"
    report.write_text("# Performance report\n\nold header\n\n## messages: old\n\nold figures\n\n"
                      + by_hand + "\n" + soak + "\n" + matrix)
    runner.write_report([], report, "a test machine")
    text = report.read_text()
    assert "old figures" not in text and "a test machine" in text
    assert text.endswith(by_hand + "\n" + soak + "\n" + matrix), text


def _module(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_process_scenarios_flag_issue_43s_p99_spread_and_batch_gaps():
    bench = _module("bench_messages")

    def run(p99):  # 100 calls: the 99th percentile is the 99th of them
        return bench.Run(latencies=[0.001] * 98 + [p99] * 2)

    even = [run(0.004), run(0.006)]
    per_process, spread = bench.p99_spread(even)
    assert per_process == "1.0/4.0, 1.0/6.0"
    assert spread == "p99 max/min across processes 1.50x (target <= 2x: met)"
    uneven = [even[0], run(0.009)]
    assert bench.p99_spread(uneven)[1].endswith("2.25x (target <= 2x: NOT met)")
    assert bench.batch_note(bench.Run(values=[201, 1, 101]), 100) == "_seq dense in batches of 100"
    assert bench.batch_note(bench.Run(values=[1, 101, 301]), 100) == (
        "1 batches not 100 _seq apart")


def test_the_send_ab_children_import_the_checkout_they_are_given_not_the_working_folder(
        tmp_path):
    # run from this checkout with an empty folder as A: A's child must refuse the package it
    # finds instead (the working folder: ``python -c`` puts it first on sys.path, before
    # PYTHONPATH; or an editable install's checkout)
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_send_ab.py"), "--a",
                           str(tmp_path), "--rounds", "1", "--seconds", "0.05", "--scenarios",
                           "single-1", "--fsync", "never"], cwd=BENCHMARKS.parent,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"the single-1 run of {tmp_path} failed" in proc.stderr
    assert "AssertionError" in proc.stderr and "pyspark_durable_queue/__init__.py" in proc.stderr
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "bench_send_ab.py"), "--a",
                          str(tmp_path), "--scenarios", "single-2"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown scenario(s) ['single-2']" in bad.stderr


@pytest.mark.slow
def test_batchprocs_reports_the_issue_43_ratios(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_messages.py"), "--scenarios",
                           "batchprocs", "--seconds", "0.2",
                           "--batch-procs", "2", "--batch-rows", "10", "--busy", "1",
                           "--root", str(tmp_path / "data")],
                          check=True, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    for name in ("send(10), 1 procs ", "send(10), 2 procs ", "send(10), 1 procs, 1 busy",
                 "send(10), 2 procs, 1 busy"):
        assert f"project {name}" in out, name
    assert out.count("_seq dense in batches of 10") >= 4
    assert out.count(" cores, ") >= 4 and "us/msg" in out  # the writers' CPU use
    assert "x 1 proc (target >= 2x:" in out and "x 1 proc, 1 busy (target >= 2x:" in out
    assert "p99 max/min across processes" in out and "ERROR" not in out
    assert not any((tmp_path / "data").glob("batchprocs-*"))  # each sub-run deleted its data
