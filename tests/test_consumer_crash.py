"""Crash test of deferred acknowledgements: a worker acknowledging one message at a time with
``ack(flush=False)`` (written by its flushes and by the 20 ms timer) is SIGKILLed at random
moments and restarted on the same consumer.

After every kill: the watermark is at or past everything the worker saw ``flush()`` write
(nothing acknowledged and written is delivered again), the next worker starts exactly at the
watermark (what was acknowledged only in memory is delivered again, nothing is skipped), and at
the end a consumer that never acknowledged reads every message once, in order (nothing lost).

Sized for CI (4,000 messages, a few kills, ~10 s). ``DQ_CRASH_MESSAGES=100000`` runs a longer
one (more kills); ``DQ_CRASH_SEED`` repeats a run's kill times.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from crash_runs import crash_seed, run_and_kill

from pyspark_durable_queue import DurableQueue

pytestmark = pytest.mark.crash

_child = Path(__file__).parent / "_procs" / "ack_child.py"
N = int(os.environ.get("DQ_CRASH_MESSAGES", 4000))


def test_deferred_acks_survive_sigkill_at_least_once(tmp_path):
    root = str(tmp_path / "q")
    address = DurableQueue(root).address("jobs")
    auditor = address.consumer("auditor")  # holds every page: nothing is cleaned up
    address.send([{"id": i} for i in range(N)])
    seed, rng = crash_seed()
    watermark = 0
    kills = 0
    for run in range(40 * max(1, N // 4000)):
        out = tmp_path / f"run-{run}.out"
        lines = run_and_kill(_child, [root, "jobs", str(run)], out, after_s=rng.uniform(0.0, 0.4))
        kills += 1
        # resumed exactly there
        assert lines[0] == ["S", str(watermark)], (lines[0], watermark, f"seed {seed}")
        flushed = [int(line[1]) for line in lines if line[0] == "F"]
        stored = int(address.consumers()["worker"]["position"])
        assert stored >= max(flushed, default=watermark), (stored, flushed)
        assert stored >= watermark
        watermark = stored
        if watermark == N:
            break
    assert watermark == N, "the workers never got through the backlog"
    assert kills >= 3
    ids = [m["id"] for m in auditor.messages(timeout_ms=0)]
    assert ids == list(range(N))
