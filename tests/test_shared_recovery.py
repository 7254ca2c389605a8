"""Shared consumers after a handle died in the middle of a change: what the others find in
the state and finish for it (regression tests of bugs the SIGKILL crash test of
``test_shared_crash.py`` found, each made deterministic here with a child process that stops
at the point and SIGKILLs itself)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue import shared_consumer as sc


def run_child(code: str) -> subprocess.CompletedProcess:
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                           timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr  # the kill landed, at the point
    return child


def dead_letters(root: str) -> collections.Counter:
    dlq = DurableQueue(root).address("DLQ")
    return collections.Counter(
        row["origin_seq"] for batch, _ in dlq.snapshot().messages(0) if batch is not None
        for row in batch.select(["origin_seq"]).to_pylist())


def test_a_move_left_by_a_dead_handle_is_finished_at_once_by_the_next_claim(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("jobs", max_delivery_attempts=1, dead_letter_address="DLQ")
    a.send([{"id": i} for i in range(3)])
    # the child claims row 0, begins its dead-letter move (the state says so) and dies; the
    # move's own lease (10 minutes) has long to run
    child = run_child(
        "import os, signal\n"
        "from pyspark_durable_queue import DurableQueue\n"
        "from pyspark_durable_queue import shared_consumer as sc\n"
        f"c = DurableQueue({root!r}).address('jobs').consumer('pool', shared=True, "
        "prefetch=1, lease_ms=600000)\n"
        "assert c.receive(1).column('_seq').to_pylist() == [0]\n"
        "c._chain.update(lambda s: sc._begin_move(s, c.holder, [(0, 1)], 'DLQ', 'poison', "
        "sc.now_ms(), 600000))\n"
        "print('begun', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert child.stdout.strip() == "begun"
    a = DurableQueue(root).address("jobs")
    one = a.consumer("pool", shared=True, prefetch=1)
    assert one.state().moving["rows"] == [[0, 1]]
    assert one.receive(1).column("_seq").to_pylist() == [1]
    assert dead_letters(root) == {0: 1}  # the claim saw the mover dead and finished its move
    state = one.state()
    assert state.moving is None and state.counters["dead_lettered"] == 1
    one.close()


def test_rows_due_for_the_dead_letters_wait_for_the_move_in_progress(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("jobs", max_delivery_attempts=1, dead_letter_address="DLQ")
    a.send([{"id": i} for i in range(3)])
    mover = a.consumer("pool", shared=True, prefetch=1)
    slow = a.consumer("pool", shared=True, prefetch=1, lease_ms=100)
    assert mover.receive(1).column("_seq").to_pylist() == [0]
    assert slow.receive(1).column("_seq").to_pylist() == [1]
    # the mover is between the two writes of its move (letters not sent yet) ...
    (move, _) = mover._chain.update(lambda s: sc._begin_move(
        s, mover.holder, [(0, 1)], "DLQ", "poison", sc.now_ms(), 60_000))
    time.sleep(0.15)  # ... when row 1's lease, its last delivery, runs out
    other = a.consumer("pool", shared=True, prefetch=1)
    assert other.receive(5).column("_seq").to_pylist() == [2]
    assert other.state().moving["number"] == move["number"]  # not replaced by row 1's
    mover._finish_move(move)
    assert other.receive(5).num_rows == 0  # this claim moves row 1
    assert dead_letters(root) == {0: 1, 1: 1}  # each once, neither lost
    state = other.state()
    assert state.moving is None and state.ack_point == 2 and list(state.leases) == [2]
    for h in (mover, slow, other):
        h.close()


def test_a_lease_shorter_than_the_hand_out_margin_still_delivers(tmp_path):
    a = DurableQueue(str(tmp_path / "dq")).address("jobs")
    a.send([{"id": i} for i in range(3)])
    short = a.consumer("pool", shared=True, prefetch=2, lease_ms=100)
    seen: list[int] = []
    for _ in range(50):  # a claim that outlasts the lease (a loaded machine) is made again
        got = short.receive(1)
        seen += got.column("_seq").to_pylist()
        if got.num_rows:
            short.ack(got)
        if len(set(seen)) == 3:
            break
    assert sorted(set(seen)) == [0, 1, 2]  # with the margin above the lease: never any
    short.close()
