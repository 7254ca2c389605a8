"""The soak (benchmarks/soak.py, ``make soak``): its trend judge on series made here, and a
short run of every client at once that must end without a trend.

The short run is CI-sized: the issue (43) asks for 2 minutes in the suite, but the suite's
budget is at its limit, so the clients run :data:`SECONDS` once each is at work (~20 s to start
them on a loaded 2-core machine), ~60-70 s in all, without the Spark query (a JVM takes 20-100 s
to start and warm up here, longer than the window; ``make soak`` runs it). A short window
catches only fast leaks (its rise must pass each limit's floor: 16 MiB of RSS, 8 descriptors,
4 threads, 20 files); the 30-minute ``make soak`` bounds the slow ones (docs/performance.md).
A process that reaches its level late (under load, within the window) makes the run go on for
as long again, once, and is judged over the longer window: a leak still fails there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SOAK = Path(__file__).parent.parent / "benchmarks" / "soak.py"
#: Seconds the clients run in the suite once each is at work; 120 is the issue's 2 minutes.
SECONDS = 35
WARMUP = 12


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = _load()
MiB = 1 << 20


def _series(name: str, values: list[float], every: float = 2.0) -> list[tuple[float, str, float]]:
    return [(i * every, name, v) for i, v in enumerate(values)]


def test_a_leak_of_two_mib_a_minute_fails_and_a_flat_noisy_series_passes():
    ts = range(360)  # the 30-minute run: a sample every 5 s, the first 10 minutes warm-up
    leak = _series("rss:consumer", [100 * MiB + t * 5 / 30 * MiB for t in ts], every=5)
    # a level with noise and a sawtooth (a cache filling and emptying) of 12 MiB
    flat = _series("rss:producer", [130 * MiB + (t % 10) * 1.2 * MiB for t in ts], every=5)
    verdicts = soak.judge(leak + flat, warmup=600)
    assert verdicts["rss:consumer"]["failed"], verdicts["rss:consumer"]
    assert verdicts["rss:consumer"]["per_hour"] == pytest.approx(120 * MiB, rel=0.01)
    assert "limit 64.0 MiB/h" in verdicts["rss:consumer"]["reason"]
    assert not verdicts["rss:producer"]["failed"], verdicts["rss:producer"]
    # the same leak over the suite's short window rises less than the floor: not caught
    short = soak.judge(leak, warmup=1740)["rss:consumer"]
    assert short["samples"] >= 5 and not short["failed"]


def test_a_step_inside_the_warmup_is_a_level_and_a_slow_slope_under_the_floor_passes():
    # a process importing and filling its caches for 30 s, then flat: not a trend
    step = _series("rss:maintenance", [10 * MiB if t < 10 else 135 * MiB for t in range(60)])
    # 200 MiB/h is over the per-hour limit, but 5 MiB over the 90 s window is under the floor
    slow = _series("rss:senders", [100 * MiB + t * 2 * (200 * MiB / 3600) for t in range(60)])
    verdicts = soak.judge(step + slow, warmup=30)
    assert not verdicts["rss:maintenance"]["failed"]
    assert verdicts["rss:senders"]["per_hour"] > soak.LIMITS["rss"].per_hour
    assert not verdicts["rss:senders"]["failed"]


def test_a_step_that_then_stays_level_is_not_a_trend_but_a_leak_that_goes_on_is():
    # the Spark JVM's threads in the 30-minute run: ~140, then ~250 from the window's middle on
    ts = range(360)
    step = _series("threads:spark-jvm", [140.0 if t < 200 else 250.0 for t in ts], every=5)
    verdict = soak.judge(step, warmup=600)["threads:spark-jvm"]
    assert verdict["per_hour"] > 100 and verdict["late_per_hour"] < 10
    assert not verdict["failed"]
    # the same rise spread over the window goes on rising in its second half
    ramp = _series("threads:spark-jvm", [140.0 + max(0, t - 120) * 110 / 240 for t in ts],
                   every=5)
    assert soak.judge(ramp, warmup=600)["threads:spark-jvm"]["failed"]


def test_descriptors_threads_files_and_backlog_are_judged_by_their_own_limits():
    ts = range(60)
    samples = (_series("fds:consumer", [6 + t // 3 for t in ts])  # one more every 6 s
               + _series("threads:senders", [7.0] * 60)
               + _series("files:address", [10 + t for t in ts])
               + _series("backlog:excl", [50 + (t % 5) for t in ts])
               + _series("pages:address", [t * 100 for t in ts]))
    verdicts = soak.judge(samples, warmup=30)
    assert verdicts["fds:consumer"]["failed"]
    assert verdicts["files:address"]["failed"]
    assert not verdicts["threads:senders"]["failed"]
    assert not verdicts["backlog:excl"]["failed"]
    assert verdicts["pages:address"]["judged"] is False  # reported only


def test_log_files_are_not_judged_before_the_log_retention_let_them_settle():
    rising = [float(t) for t in range(400)]
    short = soak.judge(_series("log_files:address", rising), warmup=30)["log_files:address"]
    assert short["judged"] is False and "settles after" in short["reason"]
    long = soak.judge(_series("log_files:address", rising), warmup=400)["log_files:address"]
    assert long["judged"] and long["failed"]


def test_a_level_reached_late_passes_once_the_window_is_extended_and_a_leak_still_fails():
    # the suite's run: a sample every 2 s, the trend after 12 s, a planned end at 35 s and as
    # much again when something looks like a trend then
    planned, extended = range(18), range(29)
    # a process whose first compaction ran late under load: 100 MiB, then 51 MiB more between
    # 22 s and 34 s, level after (the suite's failure: the others were level at 152-156 MiB)
    late = [100 * MiB + min(max(0, 2 * t - 22), 12) * 51 / 12 * MiB for t in extended]
    # a real leak of 1 MiB a second, and a role level from the start
    leak = [100 * MiB + 2 * t * MiB for t in extended]
    level = [150 * MiB + (t % 3) * MiB for t in extended]

    def samples(ts):
        return (_series("rss:maintenance", [late[t] for t in ts])
                + _series("rss:consumer", [leak[t] for t in ts])
                + _series("rss:producer", [level[t] for t in ts]))

    at_planned_end = soak.judge(samples(planned), warmup=12)
    assert at_planned_end["rss:maintenance"]["failed"], at_planned_end["rss:maintenance"]
    assert soak.suspects(at_planned_end) == ["rss:consumer", "rss:maintenance"]
    longer = soak.judge(samples(extended), warmup=12)
    assert not longer["rss:maintenance"]["failed"], longer["rss:maintenance"]
    assert longer["rss:consumer"]["failed"], longer["rss:consumer"]
    assert longer["rss:consumer"]["rise"] > at_planned_end["rss:consumer"]["rise"]
    assert not longer["rss:producer"]["failed"]
    # a healthy run ends on time; too few samples is not a trend a longer window would judge
    assert soak.suspects(soak.judge(_series("rss:producer", level[:18]), warmup=12)) == []
    assert soak.suspects(soak.judge(_series("fds:producer", [6.0] * 20), warmup=36)) == []


def test_a_series_with_too_few_samples_after_the_warmup_fails():
    verdict = soak.judge(_series("fds:producer", [6.0] * 20), warmup=36)["fds:producer"]
    assert verdict["failed"] and "samples after the warm-up" in verdict["reason"]


def test_bad_arguments_are_refused_with_the_value():
    run = subprocess.run([sys.executable, str(SOAK), "--seconds", "30", "--warmup", "40"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "--warmup must be within the run: 0 <= 40.0 < 30.0" in run.stderr
    run = subprocess.run([sys.executable, str(SOAK), "--seconds", "30", "--extend", "-5"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "--extend must be 0 or more seconds, not -5.0" in run.stderr


@pytest.mark.slow
def test_every_client_at_once_shows_no_trend(tmp_path):
    results = tmp_path / "results"
    scratch = tmp_path / "tmp"  # the driver's store and stop file (TMPDIR): deleted at the end
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SOAK.parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, str(SOAK), "--seconds", str(SECONDS), "--warmup", str(WARMUP),
         "--interval", "2", "--no-spark", "--results", str(results)],
        capture_output=True, text=True, env=env, timeout=600)
    summary = json.loads((results / "summary.json").read_text())
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert summary["problems"] == []
    # a series that looked like a trend at the planned end ran the window on once, as long
    # again, and passed over the longer window (a level reached late)
    assert summary["extended_s"] == (SECONDS - WARMUP if summary[
        "looked_like_trends_at_the_planned_end"] else 0)
    roles = summary["roles"]
    # every client did its part: sends of both kinds, deferred and flushing acks, nacks that
    # came back, both workers of the shared pool, cleanup that removed pages, compaction
    assert roles["producer"]["sent"] > 1000 and roles["senders"]["sent"] > 100
    assert roles["consumer"]["redelivered"] > 0 and roles["consumer"]["acks_flushed"] > 0
    assert roles["shared-1"]["acked"] > 0 and roles["shared-2"]["acked"] > 0
    # (cleanup removing pages is required of runs of PAGES_REMOVED_AFTER_S or more: ~3 a minute)
    assert roles["maintenance"]["cleanups"] > 0
    assert roles["maintenance"]["runs_compacted"] > 0
    # the consumers kept up: what was sent was received, less at most the last seconds' worth
    sent = roles["producer"]["sent"] + roles["senders"]["sent"]
    assert roles["consumer"]["received"] >= 0.8 * sent
    pool = roles["shared-1"]["received"] + roles["shared-2"]["received"]
    assert pool >= 0.8 * sent
    # each process's RSS, descriptors and threads, and the address's series, were judged
    series = summary["series"]
    for role in ("producer", "senders", "consumer", "shared-1", "shared-2", "maintenance"):
        for kind in ("rss", "fds", "threads"):
            verdict = series[f"{kind}:{role}"]
            assert verdict["judged"] and verdict["samples"] >= SECONDS // 2 - WARMUP // 2 - 2
    for name in ("files:address", "bytes:address", "log_entries:address", "backlog:excl",
                 "backlog:pool"):
        assert series[name]["judged"], name
    assert (results / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (results / "samples.csv").read_text().splitlines()
    assert lines[0] == "t,series,value" and len(lines) > 500
    assert list(scratch.iterdir()) == [], "the soak left its store behind"
