"""Crash test of expiry moves: a sender that moves what expired after every round of sends (moves
of at most 7 messages: an intent written, the rows sent to the expiry address under the move's
key, the intent settled) and cleans up every other round (which moves first, then removes the
pages whose messages all expired; a page file per send) is SIGKILLed at random moments and
started again on the same address; after the last kill the test makes the last pass itself.

Audited against the store (``_procs/expiry_child.py``: one send per message, so ``id`` is the
``_seq`` it got, and every ``id`` not a multiple of 3 was sent with ``ttl_ms=1``): every message
committed with a TTL is in the expiry address exactly once, with its own row (never lost, never
stored twice, whatever the kill interrupted), and no message without a TTL is.

Sized for CI (4 kills, ~10 s). ``DQ_CRASH_KILLS=40`` runs a longer one; ``DQ_CRASH_SEED``
repeats a run's kill times.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pyarrow as pa
import pytest
from crash_runs import crash_seed, run_and_kill

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops.dead_letter import messages
from pyspark_durable_queue._ops.expiry import _latest

pytestmark = pytest.mark.crash

_child = Path(__file__).parent / "_procs" / "expiry_child.py"
KILLS = int(os.environ.get("DQ_CRASH_KILLS", 4))


def test_every_expired_message_is_moved_exactly_once_across_sigkills(tmp_path):
    root = str(tmp_path / "q")
    # a page file per send: cleanup removes the pages of expired messages behind the moves
    DurableQueue(root).address("jobs", expiry_address="EXP", journal=False)
    seed, rng = crash_seed()
    moves = interrupted = cleanups = 0
    a = DurableQueue(root).address("jobs", expiry_address="EXP")
    for run in range(KILLS):
        lines = run_and_kill(_child, [root, "jobs"], tmp_path / f"run-{run}.out",
                             after_s=rng.uniform(0.2, 1.5))
        moves += sum(int(line[1]) for line in lines if line[0] == "M")
        cleanups += sum(line[0] == "C" for line in lines)
        latest = _latest(a._cleaner)
        interrupted += latest is not None and bool(latest[1].get("moving"))
    print(f"{KILLS} kills, {interrupted} inside a move (an intent left), {moves} moves, "
          f"{cleanups} cleanups")
    assert moves > 0, "no move was ever finished"
    if KILLS >= 40:
        assert interrupted > 0, f"no kill landed inside a move (seed {seed})"
    left = a.move_expired()  # what the last kill interrupted, and what it had not moved yet
    a.cleanup(dry_run=False)
    committed = a.stats()["next_seq"]
    assert committed > 0
    # pages whose messages all expired went (after they were moved: the audit below)
    assert a.log.refresh().expired_removed_messages > 0
    expected = {i for i in range(committed) if i % 3}

    exp = DurableQueue(root).address("EXP")
    stored = collections.Counter()
    for batch, _ in exp.snapshot().messages(0):
        if batch is None:
            continue
        table = pa.Table.from_batches([batch])
        seqs = table.column("origin_seq").to_pylist()
        ids = [row["id"] for _, t in messages(table) for row in t.to_pylist()]
        assert seqs == ids, f"a moved row is not its message (seed {seed})"
        stored.update(seqs)
    twice = sorted(s for s, n in stored.items() if n > 1)
    assert not twice, f"moved more than once: {twice[:10]} (seed {seed})"
    missing = sorted(expected - set(stored))
    assert not missing, f"expired and never moved: {missing[:10]} (seed {seed}, {left})"
    assert set(stored) == expected, sorted(set(stored) - expected)[:10]
