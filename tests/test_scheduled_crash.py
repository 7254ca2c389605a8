"""Crash test of scheduled delivery: a process releasing due scheduled sends in a loop is
SIGKILLed and restarted, until every schedule is released. Every other kill comes at a random
moment; the others come just after a release's append returned, inside the crash window before
its file is deleted (the child pauses there 20 ms, ``DQ_RELEASE_PAUSE_MS``), and the test
checks that at least one landed there: the next run found that release a duplicate.

Audited against the address: every scheduled message is appended exactly once (never lost,
never twice, whatever the kill interrupted), none before its due time, in due-time order (then
send order); no scheduled file is left. A release the kill cut between append and delete shows
as a duplicate append in the next run (``A <id> 1``).

Sized for CI (150 schedules of 2 rows due over ~5 s, 6 kills and a last run, ~20 s).
``DQ_CRASH_MESSAGES=3000`` runs a longer one; ``DQ_CRASH_SEED`` repeats a run's kill times.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyspark_durable_queue import DurableQueue

pytestmark = pytest.mark.crash

_child = Path(__file__).parent / "_procs" / "scheduled_child.py"
N = int(os.environ.get("DQ_CRASH_MESSAGES", 150))


def read_lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def test_every_scheduled_message_is_appended_exactly_once_across_sigkills(tmp_path):
    root = str(tmp_path / "q")
    address = DurableQueue(root).address("jobs")
    seed = int(os.environ.get("DQ_CRASH_SEED", time.time()))
    print(f"DQ_CRASH_SEED={seed}")
    rng = random.Random(seed)
    kill_runs = max(6, N // 25)
    spread_ms = 800 * kill_runs  # the releases go on while the kills come
    due = {}
    for i in range(N):
        scheduled = address.send([{"id": i}, {"id": i + N}], delay_ms=rng.randint(300, spread_ms))
        due[scheduled.scheduled] = (int(scheduled.scheduled.split("-")[0]), i)
    history: list[list[str]] = []
    for run in range(kill_runs + 1):  # the last run goes on until every schedule is released
        out = tmp_path / f"run-{run}.out"
        with open(out, "w") as f, open(out.with_suffix(".err"), "w") as err:
            proc = subprocess.Popen([sys.executable, str(_child), root, "jobs"],
                                    stdout=f, stderr=err,
                                    env={**os.environ, "DQ_RELEASE_PAUSE_MS": "20"})
        deadline = time.monotonic() + 60
        while not read_lines(out):
            assert proc.poll() is None, out.with_suffix(".err").read_text()[-2000:]
            assert time.monotonic() < deadline, "the releaser never started"
            time.sleep(0.005)
        if run < kill_runs and run % 2 == 0:
            time.sleep(rng.uniform(0.1, 0.8))
        elif run < kill_runs:  # just after an append: inside its 20 ms pause before the delete
            while not any(line[0] in ("A", "E") for line in read_lines(out)) \
                    and time.monotonic() < deadline:
                assert proc.poll() is None, out.with_suffix(".err").read_text()[-2000:]
                time.sleep(0.001)
        else:
            while read_lines(out)[-1] != ["E"]:
                assert proc.poll() is None, out.with_suffix(".err").read_text()[-2000:]
                assert time.monotonic() < deadline + 120, "the last releaser never finished"
                time.sleep(0.01)
        assert proc.poll() is None, out.with_suffix(".err").read_text()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL  # the kill landed; it did not exit itself
        history.extend(read_lines(out))
    assert history[-1] == ["E"]

    again = DurableQueue(root).address("jobs")
    rows = [row for batch, _ in again.snapshot().messages(0) if batch is not None
            for row in batch.select(["id", "_seq", "_timestamp"]).to_pylist()]
    counts = collections.Counter(row["id"] for row in rows)
    twice = sorted(i for i, n in counts.items() if n > 1)
    assert not twice, f"appended more than once: {twice[:10]} (seed {seed})"
    assert set(counts) == set(range(2 * N)), (sorted(set(range(2 * N)) - set(counts))[:10],
                                              f"seed {seed}")
    by_id = {i: due_ms for due_ms, i in due.values()}
    early = [row["id"] for row in rows
             if row["_timestamp"].timestamp() * 1000 < by_id[row["id"] % N] - 1]
    assert not early, f"appended before their time: {early[:10]} (seed {seed})"
    # in due-time order, then send order (the ids of one schedule next to each other)
    order = [i for _, i in sorted(due.values())]  # names sort as (due, send stamp)
    assert [row["id"] for row in rows] == [x for i in order for x in (i, i + N)]
    assert again.scheduled() == [] and again.stats()["scheduled_messages"] == 0
    # (a line the kill cut short has fewer fields: it names no outcome)
    duplicates = sum(1 for line in history if line[0] == "A" and line[2:3] == ["1"])
    print(f"releases a kill cut between append and delete, repeated as duplicates: "
          f"{duplicates}")
    assert duplicates >= 1, f"no kill landed between an append and its delete (seed {seed})"
