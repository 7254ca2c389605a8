"""Crash test of settling, audited (issue 39): a worker that receives a few messages at a time,
nacks some one by one (delay 0), acknowledges a part of the table now and then and then the
table, writing each step to its own fsynced audit file (``_procs/settle_child.py``), is
SIGKILLed at random moments, restarted on the same consumer several times, then drains.

The audit, from the workers' lines alone:

- settled once: no row is in two ``K`` lines, and no row is delivered after a ``K`` line
  that settled it (an acknowledgement holds once ``ack`` returned);
- none lost: every row is delivered; a row in no ``K`` line was in the table a kill
  interrupted (its ack was written, its line was not); every nacked row is delivered again;
- delivery counts: 1 the first time; after a ``N`` line one more; a delivery a kill
  interrupted counts again the same, or one more when its nack was written unprinted (a
  delivery the crash interrupted is not counted, see ``Consumer.receive``), never less;
- order: while rows nacked in a run wait (due at once), the next table holds only rows
  delivered before, lowest first, beginning with the lowest waiting unless lower ones (from
  before the restart) come first;

and from the store: the watermark is past every row, the window holds nothing, and a
consumer that never acknowledged reads every row once, in order.

Sized for CI (600 messages, 5 kills and a last run that settles the rest, ~15 s).
``DQ_CRASH_MESSAGES=20000`` runs a longer one (a kill per 120 messages); ``DQ_CRASH_SEED``
repeats a run's kill times.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from crash_runs import crash_seed, run_and_kill

from pyspark_durable_queue import DurableQueue

_child = Path(__file__).parent / "_procs" / "settle_child.py"
N = int(os.environ.get("DQ_CRASH_MESSAGES", 600))


@pytest.mark.crash
def test_every_message_is_settled_once_none_lost_across_sigkills(tmp_path):
    root = str(tmp_path / "q")
    address = DurableQueue(root).address("jobs", fsync="always")
    auditor = address.consumer("auditor")  # holds every page: nothing is cleaned up
    address.send([{"id": i} for i in range(N)])
    seed, rng = crash_seed()
    runs: list[list[list[str]]] = []
    kill_runs = max(5, N // 120)
    for run in range(kill_runs + 1):  # the last run goes on until the backlog is settled
        audit = tmp_path / f"audit-{run}.txt"
        args = [root, "jobs", str(audit), str(seed + run)]
        out = tmp_path / f"run-{run}.out"
        if run < kill_runs:
            lines = run_and_kill(_child, args, out, lines=audit, after_s=rng.uniform(0.0, 0.5))
        else:
            lines = run_and_kill(_child, args, out, lines=audit, last=["E"])
        runs.append(lines)
    assert runs[-1][-1] == ["E"], "the workers never got through the backlog"
    assert sum(1 for lines in runs for line in lines if line[0] == "N"), "nothing was nacked"
    print(audit_history(runs, seed, N))

    again = DurableQueue(root).address("jobs")
    assert again.consumers()["worker"]["position"] == N
    window = again.registry.load_window("worker")
    assert window is None or not window["pending"]
    assert [m["id"] for m in auditor.messages(timeout_ms=0)] == list(range(N))


def audit_history(runs: list[list[list[str]]], seed: int, n: int) -> dict[str, int]:
    """The checks of the module docstring, over the lines of each run in order; returns what
    the history held (how many redeliveries, tables a kill interrupted...)."""
    why = f"(DQ_CRASH_SEED={seed})"
    settled: set[int] = set()  # in a K line
    count_of: dict[int, int] = {}  # the count a row was last delivered with
    # what its next delivery may count: (least, most)
    next_count: dict[int, tuple[int, int]] = {}
    must_return: set[int] = set()  # nacked (printed): must be delivered again
    unsettled_at_kill: set[int] = set()  # in the table a kill interrupted, in no K line
    for r, lines in enumerate(runs):
        killed_at_work = r < len(runs) - 1
        waiting: set[int] = set()  # nacked in this run, not delivered again yet
        table: list[int] = []  # the last table received
        pending_in_table: set[int] = set()  # its rows neither nacked nor in a K line yet
        for line in lines:
            kind, words = line[0], line[1:]
            if kind == "D":
                pairs = [tuple(map(int, w.split(":"))) for w in words]
                table = [s for s, _ in pairs]
                assert table == sorted(table), (line, why)
                if waiting:  # due at once: nacked rows come before newer rows
                    assert all(s in count_of for s in table), (
                        f"new rows {table} delivered while {sorted(waiting)} waited {why}")
                    low = min(waiting)
                    assert low in table or table[-1] < low, (table, sorted(waiting), why)
                for s, count in pairs:
                    assert s not in settled, f"_seq {s} delivered after its ack returned {why}"
                    least, most = next_count.get(s, (1, 1))
                    assert least <= count <= most, (
                        f"_seq {s} delivered with count {count}, expected {least}..{most} {why}")
                    count_of[s] = count
                    must_return.discard(s)
                    unsettled_at_kill.discard(s)
                    waiting.discard(s)
                    # unsettled by a kill now: delivered again as this delivery, or one more
                    # if a nack was written and not printed
                    next_count[s] = (count, count + 1)
                pending_in_table = set(table)
            elif kind == "N":
                s = int(words[0])
                next_count[s] = (count_of[s] + 1, count_of[s] + 1)
                must_return.add(s)
                waiting.add(s)
                pending_in_table.discard(s)
            elif kind == "K":
                for s in map(int, words):
                    assert s not in settled, f"_seq {s} settled twice {why}"
                    settled.add(s)
                    pending_in_table.discard(s)
            elif kind == "E":
                table = []
                pending_in_table = set()
        if killed_at_work and table:
            # the table the kill interrupted: its rows with no K line may have been settled
            # (the ack was written, the line not) or not (delivered again later)
            unsettled_at_kill |= pending_in_table
        else:
            assert not table or not pending_in_table, (pending_in_table, why)
    assert not must_return, f"nacked and never delivered again: {sorted(must_return)} {why}"
    delivered = set(count_of)
    assert delivered == set(range(n)), (sorted(set(range(n)) - delivered)[:10], why)
    lost = set(range(n)) - settled - unsettled_at_kill
    assert not lost, f"rows neither settled nor interrupted by a kill: {sorted(lost)[:10]} {why}"
    return {"deliveries": sum(len(line) - 1 for lines in runs for line in lines
                              if line[0] == "D"),
            "nacks": sum(1 for lines in runs for line in lines if line[0] == "N"),
            "kills_inside_a_table": sum(1 for lines in runs[:-1] if lines[-1][0] != "K"),
            "settled_unprinted": len(unsettled_at_kill)}


def _runs(text: str) -> list[list[list[str]]]:
    return [[line.split() for line in run.strip().splitlines()] for run in text.split("|")]


@pytest.mark.parametrize(("history", "error"), [
    ("D 0:1 1:1\nN 0\nK 1\nD 0:2\nK 0\nE", None),
    # killed after the ack of 0..1 was written, before its line: settled, unprinted
    ("D 0:1 1:1 | D 2:1\nK 2\nE", None),
    # killed before: delivered again, counting the interrupted delivery again
    ("D 0:1 1:1 | D 0:1 1:1\nK 0 1\nE", None),
    ("D 0:1 1:1\nK 0 1\nD 1:1\nK\nE", "delivered after its ack returned"),
    ("D 0:1 1:1\nK 0 1 1\nE", "settled twice"),
    ("D 0:1 1:1\nN 0\nK 1\nE", "never delivered again"),
    ("D 0:1 1:1\nN 0\nK 1\nD 0:1\nK 0\nE", "count 1, expected 2..2"),
    ("D 0:1 1:1\nN 1\nK 0\nD 2:1\nK 2\nD 1:2\nK 1\nE", "while \\[1\\] waited"),
    ("D 0:1\nK 0\nE", r"\[1, 2\]"),  # never delivered
], ids=["redelivered-after-nack", "ack-written-unprinted", "ack-lost-to-the-kill",
        "redelivered-after-ack", "settled-twice", "nack-lost", "count-not-raised",
        "new-before-due", "not-delivered"])
def test_the_audit_tells_a_good_history_from_a_bad_one(history, error):
    if error is None:
        audit_history(_runs(history), 0, 3 if "2:" in history else 2)
    else:
        with pytest.raises(AssertionError, match=error):
            audit_history(_runs(history), 0, 3)
