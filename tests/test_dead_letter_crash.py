"""Crash test of dead-lettering: a worker that acknowledges good messages and nacks poison ones
(every third) until ``max_delivery_attempts`` (2) moves them to the dead-letter address is
SIGKILLed at random moments (inside moves too: a move is a window write, an append to the
dead-letter address and a second window write) and restarted on the same consumer, until the
backlog is settled.

Audited against what the workers printed (``_procs/nack_child.py`` in its ``poison`` mode)
and the stores: every poison message is in the dead-letter address exactly once (never lost,
never stored twice, whatever the kill interrupted), no good message is; a message whose
``ack`` returned is never delivered again; at the end the consumer's watermark is past every
message and its window holds nothing pending or moving.

Sized for CI (300 messages, 4 kills and a last run that settles the rest, ~10 s).
``DQ_CRASH_MESSAGES=6000`` runs a longer one (a kill per 75 messages); ``DQ_CRASH_SEED``
repeats a run's kill times.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from crash_runs import crash_seed, dead_lettered_once, run_and_kill

from pyspark_durable_queue import DurableQueue

pytestmark = pytest.mark.crash

_child = Path(__file__).parent / "_procs" / "nack_child.py"
N = int(os.environ.get("DQ_CRASH_MESSAGES", 300))


def test_every_poison_message_is_dead_lettered_exactly_once_across_sigkills(tmp_path):
    root = str(tmp_path / "q")
    address = DurableQueue(root).address("jobs", max_delivery_attempts=2,
                                         dead_letter_address="DLQ")
    address.send([{"id": i} for i in range(N)])
    seed, rng = crash_seed()
    history: list[list[str]] = []
    kill_runs = max(4, N // 75)
    for run in range(kill_runs + 1):  # the last run goes on until the backlog is settled
        out = tmp_path / f"run-{run}.out"
        if run < kill_runs:
            history.extend(run_and_kill(_child, [root, "jobs", "poison"], out,
                                        after_s=rng.uniform(0.0, 0.4)))
        else:
            history.extend(run_and_kill(_child, [root, "jobs", "poison"], out, last=["E"]))
    assert history[-1] == ["E"], "the workers never got through the backlog"

    poison = {i for i in range(N) if i % 3 == 0}  # _seq == id: one send of N rows
    acked: set[int] = set()
    delivered: set[int] = set()
    for line in history:
        if line[0] == "D":
            seq, count = int(line[1]), int(line[2])
            assert seq not in acked, f"_seq {seq} delivered after its ack returned (seed {seed})"
            assert count <= 2, f"_seq {seq} delivered {count} times, past the limit (seed {seed})"
            delivered.add(seq)
        elif line[0] == "K":
            acked.add(int(line[1]))
    # a kill between an ack's write and its "K" line leaves a good message settled unprinted
    assert delivered == set(range(N)) and acked <= set(range(N)) - poison

    stored = dead_lettered_once(root, seed)
    assert set(stored) == poison, (sorted(poison - set(stored))[:10], f"seed {seed}")

    again = DurableQueue(root).address("jobs")
    stats = again.stats()["consumers"]["worker"]
    assert stats["position"] == N and stats["redelivery_pending"] == 0
    assert stats["dead_lettered"] == len(poison)
    window = again.registry.load_window("worker")
    assert window is not None and window["moving"] is None and not window["pending"]
