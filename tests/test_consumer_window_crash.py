"""Crash test of nack and per-row settling: a worker that acknowledges or nacks one message at
a time (each written before it returns) is SIGKILLed at random moments and restarted on the same
consumer, until the backlog is settled.

Audited against what the workers printed (``_procs/nack_child.py``): a message whose ``ack``
returned is never delivered again (settled once); a message whose ``nack`` returned is
delivered again later (never lost); every message was delivered; at the end the consumer's
watermark is past every message and its window holds nothing, and a consumer that never
acknowledged reads every message once, in order.

Sized for CI (600 messages, 4 kills and a last run that settles the rest, ~10 s).
``DQ_CRASH_MESSAGES=20000`` runs a longer one (a kill per 150 messages); ``DQ_CRASH_SEED``
repeats a run's kill times.
"""

from __future__ import annotations

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

_child = Path(__file__).parent / "_procs" / "nack_child.py"
N = int(os.environ.get("DQ_CRASH_MESSAGES", 600))


def read_lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def test_acks_and_nacks_survive_sigkill_each_message_settled_once(tmp_path):
    root = str(tmp_path / "q")
    address = DurableQueue(root).address("jobs")
    auditor = address.consumer("auditor")  # holds every page: nothing is cleaned up
    address.send([{"id": i} for i in range(N)])
    seed = int(os.environ.get("DQ_CRASH_SEED", time.time()))
    print(f"DQ_CRASH_SEED={seed}")
    rng = random.Random(seed)
    history: list[list[str]] = []
    kills = 0
    kill_runs = max(4, N // 150)
    for run in range(kill_runs + 1):  # the last run goes on until the backlog is settled
        out = tmp_path / f"run-{run}.out"
        with open(out, "w") as f, open(out.with_suffix(".err"), "w") as err:
            proc = subprocess.Popen([sys.executable, str(_child), root, "jobs", str(run)],
                                    stdout=f, stderr=err)
        deadline = time.monotonic() + 60
        while not read_lines(out):  # it received its first message (or found none)
            assert proc.poll() is None, out.with_suffix(".err").read_text()[-2000:]
            assert time.monotonic() < deadline, "the worker never received"
            time.sleep(0.005)
        if run < kill_runs:
            time.sleep(rng.uniform(0.0, 0.3))
        else:
            while read_lines(out)[-1] != ["E"]:
                assert proc.poll() is None, out.with_suffix(".err").read_text()[-2000:]
                assert time.monotonic() < deadline + 240, "the last worker never finished"
                time.sleep(0.01)
        assert proc.poll() is None, out.with_suffix(".err").read_text()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL  # the kill landed; it did not exit itself
        kills += 1
        lines = read_lines(out)
        history.extend(lines)
    assert history[-1] == ["E"], "the workers never got through the backlog"
    assert kills == kill_runs + 1

    delivered: set[int] = set()
    acked: set[int] = set()
    nacked_waiting: set[int] = set()
    for line in history:
        if line[0] == "D":
            seq = int(line[1])
            assert seq not in acked, f"_seq {seq} delivered after its ack returned (seed {seed})"
            delivered.add(seq)
            nacked_waiting.discard(seq)
        elif line[0] == "K":
            acked.add(int(line[1]))
        elif line[0] == "N":
            nacked_waiting.add(int(line[1]))
    assert not nacked_waiting, f"nacked and never delivered again: {sorted(nacked_waiting)}"
    assert delivered == set(range(N))
    assert any(line[0] == "N" for line in history)

    again = DurableQueue(root).address("jobs")
    assert again.consumers()["worker"]["position"] == N
    window = again.registry.load_window("worker")
    assert window is None or not window["pending"]
    ids = [m["id"] for m in auditor.messages(timeout_ms=0)]
    assert ids == list(range(N))
