"""Cleanup of a journal (on-disk format 4) while its writers are SIGKILLed: segments every
consumer passed go, and nothing a consumer or an opener still needs goes with them.

Three children (``_procs/journal_child.py send``) of two threads each send single messages to
one address with 4 KiB pages (a segment rolls every few units, every 25th message of a thread
is a large one of its own segment) and checkpoint the log every 20 commits, so the newest
checkpoint keeps moving into new segments. The parent kills them at random moments and starts
them again. Meanwhile a consumer thread in the parent receives (1, 20 or 500 at a time) and
acknowledges (flushing or deferred) what it got, and each acknowledgement runs cleanup
(``cleanup_interval_ms=0``): a ``remove`` entry for the segments it passed, then the files that
are before both the segment being written and the newest checkpoint's.

The audit rests on two records made apart from the address's state: what the writers reported
before they died, and what the consumer received, in order. Every acknowledged send was
delivered once, at its ``_seq``, to the consumer; a consumer made at ``earliest`` afterwards
gets exactly the retained tail; a fresh opener (after every kill cycle and at the end) reads
the log from its newest checkpoint, which needs every segment from the checkpoint's on;
segment files really went during the run; verify finds nothing wrong.

``DQ_CRASH_CYCLES=30`` runs a longer one; ``DQ_CRASH_SEED`` repeats a run's kill times.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import load_file

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._log import commit_log as _log

_tests = Path(__file__).parent
_procs = _tests / "_procs"


child = load_file("dq_journal_child", _procs / "journal_child.py")
#: the SIGKILL helpers: a kill is proved to have landed, a report is read line by line
crash = load_file("dq_journal_crash_helpers", _tests / "test_journal_crash.py")

NAME = "journaled"
PROCS = 3
THREADS = 2
PAGE = 4096
CYCLES = int(os.environ.get("DQ_CRASH_CYCLES", 5))
#: The writers (and the parent's cleanups) checkpoint this often, 1,000 in the package.
CHECKPOINT_EVERY = 20


def start_writer(tmp_path: Path, root: str, run: int, seed: int
                 ) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"run-{run}.out"
    env = crash.child_env(DQ_JOURNAL_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY))
    args = [sys.executable, str(_procs / "journal_child.py"), "send", root, NAME, str(run),
            str(seed), str(THREADS)]
    with open(out, "w") as f, open(out.with_suffix(".err"), "w") as err:
        return subprocess.Popen(args, stdout=f, stderr=err, env=env), out


def kill_cycle(tmp_path: Path, root: str, rng: random.Random, cycle: int
               ) -> tuple[dict, list[list[int]]]:
    """Start PROCS writers, let them send a while, kill them all; return what they reported
    and the segment files there once they were all sending and just before the kills."""
    procs = [start_writer(tmp_path, root, cycle * PROCS + i, rng.randrange(1 << 30))
             for i in range(PROCS)]
    for proc, out in procs:
        crash.wait_for(out, proc, lambda r: len(r["sent"]) >= 2 * THREADS, "a few sends")
    files = [segments(root)]
    time.sleep(rng.uniform(0.2, 0.8))
    files.append(segments(root))
    for proc, out in rng.sample(procs, len(procs)):
        crash.kill(proc, out)
        time.sleep(rng.uniform(0, 0.05))
    sent: dict = {}
    for _proc, out in procs:
        report = crash.parse(out)
        assert not report["errors"], (out.name, report["errors"])
        sent.update(report["sent"])
    return sent, files


class Acker(threading.Thread):
    """One consumer receiving and acknowledging until told to stop and nothing is left; its
    acknowledgements run cleanup. ``got`` is what it received, in order."""

    def __init__(self, root: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.rng = random.Random(seed)
        self.got: list[tuple[int, int]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            c = DurableQueue(self.root).address(NAME).consumer("acker")
            while True:
                stopping = self.stop.is_set()
                t = c.receive(max_messages=self.rng.choice([1, 20, 500]), timeout_ms=20)
                if not t.num_rows:
                    if stopping:
                        break
                    continue
                for r in t.drop_columns(["_timestamp", "_delivery_count"]).to_pylist():
                    assert r["_seq"] == len(self.got), (r["_seq"], len(self.got))
                    assert r["pad"] == child.crash_pad(r["w"], r["k"]), (r["w"], r["k"])
                    self.got.append((r["w"], r["k"]))
                c.ack(t, flush=self.rng.random() < 0.5)
            c.flush()
        except BaseException as exc:
            self.error = exc


def segments(root: str) -> list[int]:
    return child.segment_numbers(Path(root, NAME, "pages"))


def read_retained(root: str) -> list[dict]:
    """Every retained message, through a fresh handle and a new consumer at ``earliest``
    (deleted after, so that it holds no segment back)."""
    return crash.read_all(root)


def check_checkpoint_segments(root: str) -> tuple[int, list[int]]:
    """Every segment from the newest checkpoint's to the one being written is there: an
    opener replays them. Read in this order (the state, the files, the checkpoint) so that a
    cleanup or checkpoint in between cannot make a kept segment look missing. Returns the
    checkpoint's segment and the files."""
    a = DurableQueue(root).address(NAME)
    state = a.log.refresh()
    present = segments(root)
    position = a.log.checkpoint_position()
    assert position is not None, "no checkpoint was written"
    missing = sorted(set(range(position.segment, state.journal.segment + 1)) - set(present))
    assert not missing, (f"segments {missing} deleted, checkpoint in {position.segment}, "
                         f"writing {state.journal.segment}, files {present}")
    return position.segment, present


def audit_acked(got: list[tuple[int, int]], sent: dict[tuple[int, int], int]) -> None:
    """The consumer's record against the writers': every acknowledged send once, at its
    ``_seq``; each thread's messages in its order, at most its one send in flight besides."""
    at: dict[tuple[int, int], int] = {}
    by_writer: dict[int, list[int]] = {}
    for seq, key in enumerate(got):
        assert key not in at, f"message {key} delivered at _seq {at[key]} and {seq}"
        at[key] = seq
        by_writer.setdefault(key[0], []).append(key[1])
    for key, seq in sent.items():
        assert key in at, f"acknowledged send {key} (_seq {seq}) never delivered"
        assert at[key] == seq, f"send {key} delivered at {at[key]}, reported {seq}"
    last_acked: dict[int, int] = {}
    for writer, k in sent:
        last_acked[writer] = max(last_acked.get(writer, 0), k)
    for writer, ks in by_writer.items():
        assert ks == list(range(1, len(ks) + 1)), f"writer {writer}: {ks[:20]}..."
        assert len(ks) - last_acked.get(writer, 0) in (0, 1), (writer, len(ks), last_acked)


@pytest.mark.crash
def test_cleanup_removes_spent_segments_while_writers_are_killed_and_keeps_what_is_needed(
        tmp_path, monkeypatch):
    # the parent's cleanups publish too: they checkpoint as often as the writers
    monkeypatch.setattr(_log, "JOURNAL_CHECKPOINT_EVERY", CHECKPOINT_EVERY)
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address(NAME, journal=True, page_size_bytes=PAGE,
                                   cleanup_interval_ms=0)
    assert a.format.journal
    seed = int(os.environ.get("DQ_CRASH_SEED", time.time()))
    print(f"DQ_CRASH_SEED={seed}")
    rng = random.Random(seed)
    a.consumer("acker")  # exists before the first send: it is to receive everything
    acker = Acker(root, rng.randrange(1 << 30))
    acker.start()
    sent: dict = {}
    seen: set[int] = set()  # every segment file seen (while writers send, after each cycle)
    history = []
    went_live = 0  # cycles in which segment files were deleted while writers were sending
    try:
        for cycle in range(CYCLES):
            new, files = kill_cycle(tmp_path, root, rng, cycle)
            sent.update(new)
            assert acker.error is None, f"seed {seed}: {acker.error!r}"
            for listed in files:
                seen.update(listed)
            # segments went while the writers were sending (the first file moved on)
            went_live += files[1][0] > files[0][0]
            # a fresh opener (the writers dead, cleanup going on) folds the log from the
            # newest checkpoint: the segments it replays are there
            state = DurableQueue(root).address(NAME).state
            assert state.next_seq > max(sent.values()), (seed, cycle)
            checkpoint, now = check_checkpoint_segments(root)
            # a consumer made at earliest meanwhile gets a gapless tail to the end, the same
            # messages the acknowledging consumer got there
            retained = read_retained(root)
            seqs = [r["_seq"] for r in retained]
            start = seqs[0] if seqs else state.next_seq
            if not seqs:  # possible: the segment being written holds only remove entries
                fresh = DurableQueue(root).address(NAME).state
                assert fresh.first_seq == fresh.next_seq == state.next_seq, (seed, cycle)
            assert start >= state.first_seq, (seed, cycle, start, state.first_seq)
            assert seqs == list(range(start, state.next_seq)), (seed, cycle)
            assert all(r["pad"] == child.crash_pad(r["w"], r["k"]) for r in retained)
            mine = acker.got[start:]
            assert [(r["w"], r["k"]) for r in retained[:len(mine)]] == mine, (seed, cycle)
            seen.update(now)
            history.append((len(sent), state.first_seq, state.next_seq, checkpoint, now[0],
                            now[-1]))
    finally:
        acker.stop.set()
        acker.join(120)
    assert not acker.is_alive(), "the consumer did not finish"
    assert acker.error is None, f"seed {seed}: {acker.error!r}"
    print("after each cycle (acknowledged sends, first_seq, next_seq, checkpoint's segment, "
          "first and last segment):", history)

    state = DurableQueue(root).address(NAME).state
    got = acker.got
    # the consumer got everything committed, each acknowledged send once and at its _seq
    assert len(got) == state.next_seq, (len(got), state.next_seq)
    audit_acked(got, sent)

    # the scenario happened: many sends and segments, large units, checkpoints, and segment
    # files deleted during the run (not only at its end)
    final = segments(root)
    seen.update(final)
    deleted = sorted(seen - set(final))
    print(f"{len(sent)} sends acknowledged, {state.next_seq} messages, segments "
          f"{final[0]}..{final[-1]} left ({final[0] - 1} deleted, {len(deleted)} of them seen "
          f"first); deleted while writers were sending in {went_live} of {CYCLES} cycles")
    assert len(sent) >= 20 * CYCLES, "the writers hardly ran"
    assert any(k % 25 == 0 for _w, k in sent), "no large message was sent"
    assert list(Path(root, NAME, "log").glob("*.checkpoint.arrow"))
    # Segments are not always deleted strictly from the front: compaction swaps the small
    # journal pages of segments for page files, and the segments it swapped out stay for
    # readers that planned on them (``compactGraceMs``, while their messages are retained),
    # so later spent segments can go first (seen: 723-733 swapped out and kept, their
    # messages not yet removed, 774-776 deleted). What a reader needs is what is checked:
    # every segment from the newest checkpoint's on, and the retained tail.
    assert len(deleted) >= 5, (final, deleted)
    assert went_live >= 1, "no segment file was deleted while the writers were sending"

    # the retained tail: a consumer made at earliest now gets first_seq .. end, no gap, the
    # same messages the acknowledging consumer got there
    retained = read_retained(root)
    first = state.first_seq
    assert 0 < first <= state.next_seq
    assert [r["_seq"] for r in retained] == list(range(first, state.next_seq))
    assert [(r["w"], r["k"]) for r in retained] == got[first:]
    assert all(r["pad"] == child.crash_pad(r["w"], r["k"]) for r in retained)

    # every segment the newest checkpoint needs is still there, and a fresh opener reads on
    # from it to the end
    check_checkpoint_segments(root)

    # a send after it all goes on from the end and is received; verify finds every retained
    # range whole (at least this one: all before it may have been consumed and removed)
    a = DurableQueue(root).address(NAME)
    r = a.send([child.crash_row(10 ** 6, 1)])
    assert r.seq == state.next_seq
    assert read_retained(root)[-1]["_seq"] == r.seq
    report = DurableQueue(root).address(NAME).repair(dry_run=True)
    assert report.clean and report.pages_checked, report
