"""Crash test of shared consumers: three worker processes on one shared consumer (short
leases, small prefetch) acknowledge, nack, renew, hold rows past their lease and nack poison
messages (every seventh) until ``max_delivery_attempts`` moves them to the dead-letter address;
the test SIGKILLs a random worker at random moments (while it claims, acknowledges, nacks,
renews or moves dead letters) and starts it again, until the backlog is settled.

Audited against what the workers printed (``_procs/shared_child.py``) and the stores: every
message is settled exactly once, by one acknowledgement that returned, or as one row of the
dead-letter address (a worker killed between its acknowledgement's write and its line leaves
the message settled with an ``A`` as its last line); none is lost; none is delivered again
after its acknowledgement returned (the lines carry the host's monotonic clock); at the end the
consumer's state holds nothing leased, pending or moving and its watermark is the log's end.

Sized for CI (300 messages, 6 kills, ~10 s; ~25 s at a load average of 15 on 2 cores).
``DQ_CRASH_CYCLES=40 DQ_CRASH_MESSAGES=6000`` runs a longer one; ``DQ_CRASH_SEED`` repeats a
run's kill times and the workers' choices.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from crash_runs import crash_seed, dead_lettered_once, read_lines

from pyspark_durable_queue import DurableQueue

pytestmark = pytest.mark.crash

_child = Path(__file__).parent / "_procs" / "shared_child.py"
N = int(os.environ.get("DQ_CRASH_MESSAGES", 300))
KILLS = int(os.environ.get("DQ_CRASH_CYCLES", 6))
WORKERS = 3
LEASE_MS = 400
PREFETCH = 4
ATTEMPTS = 3


class Worker:
    """One worker slot: its current process and the files of every run it had."""

    def __init__(self, root: str, tmp: Path, slot: int, seed: int) -> None:
        self.root, self.tmp, self.slot, self.seed = root, tmp, slot, seed
        self.runs: list[Path] = []
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        out = self.tmp / f"worker-{self.slot}-{len(self.runs)}.out"
        self.runs.append(out)
        with open(out, "w") as f, open(out.with_suffix(".err"), "w") as e:
            self.proc = subprocess.Popen(
                [sys.executable, str(_child), self.root, "jobs",
                 str(self.seed * 1000 + self.slot * 100 + len(self.runs)), str(LEASE_MS),
                 str(PREFETCH)], stdout=f, stderr=e)

    def working(self) -> bool:
        """It printed a line: it opened the consumer and received (or found nothing)."""
        return bool(read_lines(self.runs[-1]))

    def kill(self) -> None:
        """SIGKILL the running worker; asserts it was running and the kill landed."""
        proc = self.proc
        assert proc is not None
        err = self.runs[-1].with_suffix(".err")
        assert proc.poll() is None, err.read_text()[-2000:]  # it did not exit by itself
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL, err.read_text()[-2000:]

    def lines(self) -> list[list[list[str]]]:
        return [read_lines(run) for run in self.runs]


def test_every_message_is_settled_exactly_once_across_sigkills_of_a_worker_pool(tmp_path):
    root = str(tmp_path / "q")
    address = DurableQueue(root).address("jobs", max_delivery_attempts=ATTEMPTS,
                                         dead_letter_address="DLQ")
    address.send([{"id": i} for i in range(N)])
    seed, rng = crash_seed()
    workers = [Worker(root, tmp_path, slot, seed) for slot in range(WORKERS)]
    for w in workers:
        w.start()
    watcher = address.consumer("pool", shared=True)  # reads the state, claims nothing

    def settled() -> bool:
        state = watcher.state()
        return (state.ack_point == N and not state.leases and not state.pending
                and state.moving is None)

    kills = 0
    deadline = time.monotonic() + 300
    try:
        while kills < KILLS and not settled():
            assert time.monotonic() < deadline, "the kills never happened"
            time.sleep(rng.uniform(0.02, 0.5))
            ready = [w for w in workers if w.working()]
            if not ready:
                continue
            victim = rng.choice(ready)
            victim.kill()
            kills += 1
            victim.start()
        while not settled():  # the workers go on until the backlog is settled
            assert time.monotonic() < deadline, f"the backlog was never settled (seed {seed})"
            for w in workers:
                assert w.proc is not None and w.proc.poll() is None, \
                    w.runs[-1].with_suffix(".err").read_text()[-2000:]
            time.sleep(0.05)
        for w in workers:
            w.kill()
    finally:
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    assert kills >= min(KILLS, 3), f"only {kills} kills before the backlog was settled"

    runs = [run for w in workers for run in w.lines()]
    poison = {i for i in range(N) if i % 7 == 0}  # _seq == id: one send of N rows
    acked: dict[int, int] = {}  # _seq -> when its ack returned
    delivered: dict[int, list[int]] = collections.defaultdict(list)  # -> when received
    unprinted: set[int] = set()  # an ack called, then the kill
    for lines in runs:
        for line in lines:
            if line[0] == "D":
                seq, count = int(line[1]), int(line[2])
                assert count <= ATTEMPTS, f"_seq {seq} delivered {count} times (seed {seed})"
                delivered[seq].append(int(line[3]))
            elif line[0] == "K":
                seq = int(line[1])
                assert seq not in acked, f"_seq {seq} acknowledged twice (seed {seed})"
                acked[seq] = int(line[2])
        if lines and lines[-1][0] == "A":
            unprinted.add(int(lines[-1][1]))
    for seq, at in acked.items():
        late = [t for t in delivered[seq] if t > at]
        assert not late, f"_seq {seq} delivered again after its ack returned (seed {seed})"
    assert not poison & set(acked)

    stored = dead_lettered_once(root, seed)
    assert poison <= set(stored), (sorted(poison - set(stored))[:10], f"seed {seed}")
    assert not set(stored) & set(acked), f"acknowledged and dead-lettered (seed {seed})"
    lost = set(range(N)) - set(acked) - set(stored) - unprinted
    assert not lost, f"never settled: {sorted(lost)[:20]} (seed {seed})"
    assert set(delivered) >= set(acked)

    state = watcher.state()
    assert state.cursor == N and state.ack_point == N
    assert state.counters.get("dead_lettered", 0) == len(stored)
    # the kills landed in the middle of things: rows of dead workers came back
    assert sum(1 for s, times in delivered.items() if s not in poison and len(times) > 1)
    watcher.close()  # writes the watermark file
    assert DurableQueue(root).address("jobs").consumers()["pool"]["position"] == N
