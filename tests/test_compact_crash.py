"""Compaction SIGKILLed at random points while other processes send, receive and acknowledge
(issue 28), on a local disk (a file per commit and the journal) and on S3 (moto's server).

Per kill cycle: a writer (``_procs/journal_child.py send``, two threads of single sends: a small
page, or journal unit, per commit; every 25th message of a thread is a large one) and a
compactor (``_procs/compact_child.py compact``: ``Address.compact()`` then
``cleanup(dry_run=False)`` in a loop) run together; the compactor is killed, at a random moment
or stopped first at one of the points a random kill rarely hits (a run half read; its new pages
written and synced but the swap not published; the swap published, cleanup not started;
cleanup half-way through deleting files), then the writer. Every kill is proved to have landed
on a live child (it had not exited, and died of SIGKILL).

Meanwhile two consumers in other processes (``compact_child.py consume``) receive and
acknowledge through every cycle. The address has ``cleanup_interval_ms=0``,
``compact_small_pages=8`` and ``compact_grace_ms=0``: each of their acknowledgements runs
cleanup, which also compacts, and files a swap replaced are deleted at once, so a reader whose
snapshot planned on one finds it gone and reads the same ``_seq`` range from the live pages
(the consumers report each such fallback). "steady" is never killed: it must get every message
exactly once, in ``_seq`` order. "flaky" is killed in some cycles and restarted: at least once
across its crashes (each run resumes at its written watermark or later, never past what it
received), exactly once and in order within a run. A third consumer, moved by the test to half
of what the others got, keeps a backlog for compaction to work on.

The audit, at the end: every send the writers reported delivered at its ``_seq`` once (each
writer's messages in its order), each message whole; each message's ``_timestamp`` the same in
every receipt (before and after compactions) and never going backwards along ``_seq``; a consumer
made at ``earliest`` gets the retained range dense and as sent; after a cleanup far in the
future no ``.page`` file remains that the log does not list (a killed compactor's unpublished
pages included) and verify finds every retained page whole.

``DQ_CRASH_CYCLES=30`` runs longer (S3: half as many cycles); ``DQ_CRASH_SEED`` repeats a run's
choices (kill times and points).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import load_file

from pyspark_durable_queue import DurableQueue

pytestmark = pytest.mark.crash

_tests = Path(__file__).parent
_procs = _tests / "_procs"


child = load_file("dq_compact_child", _procs / "compact_child.py")
#: child_env, kill (proved to have landed), the writers' reports
crash = load_file("dq_journal_crash_helpers", _tests / "test_journal_crash.py")
#: audit_acked: a consumer's record against the writers'
cleanup_crash = load_file("dq_journal_cleanup_crash", _tests / "test_journal_cleanup_crash.py")

NAME = "compacted"
THREADS = 2
CYCLES = int(os.environ.get("DQ_CRASH_CYCLES", 5))
S3_CYCLES = max(2, CYCLES // 2)
#: Journal logs checkpoint this often (1,000 in the package), so that spent segments, which
#: go only before the newest checkpoint's, are deleted during the run.
CHECKPOINT_EVERY = 50
#: Where the compactor is stopped before its kill (``None``: a random moment).
STALLS = ("written", "swapped", "read", "cleanup", None)
SETTINGS = {"cleanup_interval_ms": 0, "compact_small_pages": 8, "compact_grace_ms": 0}


def _start(tmp_path: Path, label: str, args: list[str], stall: str | None = None
           ) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{label}.out"
    env = crash.child_env(DQ_JOURNAL_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY),
                          **({"DQ_COMPACT_STALL": stall} if stall else {}))
    script = "journal_child.py" if args[0] == "send" else "compact_child.py"
    with open(out, "w") as f, open(out.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen([sys.executable, str(_procs / script), *args],
                                stdout=f, stderr=err, env=env)
    _STARTED.append(proc)
    return proc, out


#: Every child started, so that a failing test leaves none running behind it.
_STARTED: list[subprocess.Popen] = []


def _kill_all() -> None:
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(autouse=True)
def _no_child_left():
    """Writers, compactors and consumers a failed test left running are killed."""
    yield
    _kill_all()


def _wait(out: Path, proc: subprocess.Popen, until, what: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        report = child.parse(out)
        assert not report["errors"], (out.name, report["errors"])
        if until(report):
            return report
        assert proc.poll() is None, (f"{out.name} exited ({proc.returncode}) before {what}: "
                                     f"{out.with_suffix('.err').read_text()[-2000:]}")
        if time.monotonic() > deadline:
            return report
        time.sleep(0.005)


def _progress(out: Path) -> int:
    """Where a consumer's run got to: after the last message it reported."""
    run = child.parse(out)
    return (run["start"] or 0) + len(run["got"])


def _published(root: str) -> set[str]:
    """Every name the log lists now, removed (by cleanup) or retired (by a later swap)."""
    state = DurableQueue(root).address(NAME).state
    return set(state.pages.names) | set(state.removed) | {n for n, *_ in state.retired}


def _page_files(root: str) -> set[str]:
    a = DurableQueue(root).address(NAME)
    return {n for n in a.storage.list(a.pages_folder) if n.endswith(".page")}


def _retained(root: str) -> list[tuple[int, int, int, int]]:
    """Every retained message ``(_seq, writer, k, _timestamp)``, through a fresh handle and a
    new consumer at ``earliest`` (deleted after)."""
    c = DurableQueue(root).address(NAME).consumer(f"audit-{uuid.uuid4().hex[:8]}",
                                                  start="earliest")
    out: list[tuple[int, int, int, int]] = []
    try:
        while True:
            t = c.receive(max_messages=10 ** 7, max_bytes=1 << 40)
            if not t.num_rows:
                return out
            assert all(p == child.crash_pad(w, k) for w, k, p in zip(
                t.column("w").to_pylist(), t.column("k").to_pylist(),
                t.column("pad").to_pylist(), strict=True))
            out += zip(t.column("_seq").to_pylist(), t.column("w").to_pylist(),
                       t.column("k").to_pylist(),
                       t.column("_timestamp").cast(pa.int64()).to_pylist(), strict=True)
    finally:
        c.delete()


def crash_compactions(tmp_path: Path, root: str, *, cycles: int, seed: int, skip: int = 1,
                      **settings) -> dict:
    """Run the kill cycles and the audit (see the module docstring); returns what happened."""
    rng = random.Random(seed)
    a = DurableQueue(root).address(NAME, **{**SETTINGS, **settings})
    for who in ("steady", "flaky", "keeper"):  # all exist before the first send
        a.consumer(who, start="earliest")
    keeper = a.consumer("keeper")
    stop = tmp_path / "stop"
    steady = _start(tmp_path, "steady", ["consume", root, NAME, "steady",
                                         str(rng.randrange(1 << 30)), str(stop)])
    flaky_runs = [_start(tmp_path, "flaky-0", ["consume", root, NAME, "flaky",
                                               str(rng.randrange(1 << 30)), str(stop)])]
    sent: dict[tuple[int, int], int] = {}
    landed: Counter[str] = Counter()  # where the compactor's kills landed
    unpublished: set[str] = set()  # new pages of a run killed before its swap
    compactions: list[dict] = []
    try:
        for cycle in range(cycles):
            stall = STALLS[cycle % len(STALLS)]
            writer = _start(tmp_path, f"writer-{cycle}", [
                "send", root, NAME, str(cycle), str(rng.randrange(1 << 30)), str(THREADS)])
            proc, out = _start(tmp_path, f"compactor-{cycle}",
                               ["compact", root, NAME, str(rng.randrange(1 << 30))],
                               stall=stall and f"{stall}:{rng.randint(0, skip)}")
            crash.wait_for(writer[1], writer[0], lambda r: len(r["sent"]) >= 4, "sends")
            if stall:
                report = _wait(out, proc, lambda r: r["stalled"] is not None,
                               f"stalled {stall}", timeout=20)
            else:
                _wait(out, proc, lambda r: r["last"] is not None, "a compaction")
                time.sleep(rng.uniform(0.05, 1.0))
                report = child.parse(out)
            crash.kill(proc, out)  # it was alive (had not exited on its own): the kill landed
            report = child.parse(out)
            assert not report["errors"], report["errors"]
            compactions += report["compacted"]
            if report["stalled"] is not None:
                kind, detail = report["stalled"]
                landed[kind] += 1
                if kind == "written":  # written and synced, yet not in the log: orphans now
                    assert set(detail) <= _page_files(root), detail
                    assert not set(detail) & _published(root), detail
                    unpublished |= set(detail)
                elif kind == "swapped":  # the swap is in the log
                    assert set(detail) <= _published(root), detail
            else:
                last = report["last"]
                after_swap = last == "compacted" and report["compacted"][-1]["runs"] > 0
                landed[{"compact": "random: planning", "reading": "random: reading runs",
                        "cleanup": "random: in cleanup"}.get(
                    last, "random: after a swap" if after_swap else "random: idle")] += 1
            if rng.random() < 0.5:  # the flaky consumer too, in its receives, acks, cleanups
                fproc, fout = flaky_runs[-1]
                _wait(fout, fproc, lambda r: r["start"] is not None, "ready")
                time.sleep(rng.uniform(0, 0.2))
                crash.kill(fproc, fout)
                flaky_runs.append(_start(tmp_path, f"flaky-{len(flaky_runs)}", [
                    "consume", root, NAME, "flaky", str(rng.randrange(1 << 30)), str(stop)]))
            crash.wait_for(writer[1], writer[0], lambda r: len(r["sent"]) >= 20, "20 sends")
            crash.kill(*writer)
            wrote = crash.parse(writer[1])
            assert not wrote["errors"], wrote["errors"]
            sent.update(wrote["sent"])
            for proc, out in (steady, flaky_runs[-1]):
                assert proc.poll() is None, out.with_suffix(".err").read_text()[-2000:]
                assert not child.parse(out)["errors"], child.parse(out)["errors"]
            # the third consumer follows at half of where the others are
            behind = min(_progress(steady[1]), max(map(_progress, (o for _p, o in flaky_runs))))
            if behind // 2 > keeper.position:
                keeper.ack(behind // 2 - 1, flush=False)  # written (and cleans up) soon
            state = DurableQueue(root).address(NAME).state  # a fresh opener folds every swap
            assert state.next_seq > max(sent.values()), (seed, cycle)
    finally:
        stop.touch()
    # the consumers drain what is left and stop
    for proc, out in (steady, flaky_runs[-1]):
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{out.name} did not finish") from None
        assert proc.returncode == 0, (out.name, proc.returncode,
                                      out.with_suffix(".err").read_text()[-2000:])
    keeper.close()  # its deferred acknowledgement written (and cleaned up after) before the audit
    state = DurableQueue(root).address(NAME).state
    end = state.next_seq

    # steady: every message once, in _seq order; every reported send at its _seq
    got = child.parse(steady[1])
    assert not got["errors"] and got["done"] == end, (got["errors"], got["done"], end)
    record = {seq: (w, k, ts) for seq, w, k, ts in got["got"]}
    assert [g[0] for g in got["got"]] == list(range(end)), "steady: not each _seq once in order"
    cleanup_crash.audit_acked([(w, k) for _s, w, k, _t in got["got"]], sent)
    times = [ts for _s, _w, _k, ts in got["got"]]
    assert times == sorted(times), "a message's _timestamp went backwards along _seq"

    # flaky: dense within each run from where it resumed; a run resumes at or after what the
    # one before had written as its watermark, never after what it received
    written = received = 0
    duplicates = 0
    for i, (_proc, out) in enumerate(flaky_runs):
        run = child.parse(out)
        assert not run["errors"], (out.name, run["errors"])
        if run["start"] is None:
            continue  # killed before it opened its consumer
        start = run["start"]
        assert written <= start <= received, (out.name, written, start, received)
        assert [g[0] for g in run["got"]] == list(range(start, start + len(run["got"]))), \
            out.name
        for seq, w, k, ts in run["got"]:  # the same message, with the same _timestamp
            assert record[seq] == (w, k, ts), (out.name, seq, record[seq], (w, k, ts))
        duplicates += max(0, received - start)
        received = start + len(run["got"])
        written = max(written, run["flushed"], start)
        if i == len(flaky_runs) - 1:
            assert received == end and run["done"] is not None, (out.name, received, end)

    # a consumer made at earliest gets the retained range, dense and as sent
    def check_retained() -> int:
        rows = _retained(root)
        first = rows[0][0] if rows else end
        assert first <= keeper.position
        assert [r[0] for r in rows] == list(range(first, end))
        assert all(record[s] == (w, k, ts) for s, w, k, ts in rows), "retained differ"
        return len(rows)

    retained = check_retained()

    # far in the future: every file the log does not list goes (a killed compactor's new pages,
    # files of swaps whose cleanup was killed); what is retained still reads, and verifies
    a = DurableQueue(root).address(NAME)
    a.cleanup(dry_run=False, now=time.time() + 10 ** 6)
    a = DurableQueue(root).address(NAME)
    live = {n for n in a.state.pages.names if n.endswith(".page")}
    files = _page_files(root)
    assert files == live, (sorted(files - live)[:10], sorted(live - files)[:10])
    assert not unpublished & files
    assert not a.storage.temp_files()
    # (fewer, when a compaction after the last acknowledgements turned rows of a journal segment
    # that was still needed into pages of their own, which every consumer had passed)
    assert check_retained() <= retained
    verify = a.repair(dry_run=True)
    assert verify.clean, verify

    resolved = [len(child.parse(o)["resolved"]) for _p, o in (steady, *flaky_runs)]
    summary = {
        "seed": seed, "messages": end, "sends reported": len(sent), "kills": dict(landed),
        "flaky runs": len(flaky_runs), "flaky re-received": duplicates,
        "swaps": sum(c["runs"] for c in compactions),
        "abandoned": sum(c["abandoned"] for c in compactions),
        "pages rewritten": sum(c["before"] for c in compactions),
        "reader fallbacks": sum(resolved), "retained": retained,
        "live pages": len(a.state.pages), "unpublished pages collected": len(unpublished)}
    print(summary)
    assert len(sent) >= 20 * cycles, "the writers hardly ran"
    return summary


def _seed() -> int:
    seed = int(os.environ.get("DQ_CRASH_SEED", time.time()))
    print(f"DQ_CRASH_SEED={seed}")
    return seed


@pytest.mark.parametrize("journal", [False, True], ids=["file-per-commit", "journal"])
def test_compaction_killed_at_random_points_loses_duplicates_and_reorders_nothing(
        tmp_path, journal):
    summary = crash_compactions(tmp_path, str(tmp_path / "dq"), cycles=CYCLES, seed=_seed(),
                                journal=journal, page_size_bytes=256 << 10 if not journal
                                else 64 << 10)
    kills = summary["kills"]
    # the kills landed during compaction (a run read, its pages written, no swap yet) and
    # after a swap
    assert kills.get("read", 0) + kills.get("written", 0) >= min(CYCLES // 5 + 1, 2), kills
    assert kills.get("swapped", 0) + kills.get("cleanup", 0) >= 1, kills
    assert summary["swaps"] >= 1, summary


def test_compaction_killed_on_s3(tmp_path, request):
    from conftest import object_store_root

    summary = crash_compactions(tmp_path, object_store_root(request, "s3"), cycles=S3_CYCLES,
                                seed=_seed(), skip=0, page_size_bytes=256 << 10,
                                compact_small_pages=30)
    assert summary["swaps"] >= 1, summary
