"""Crash tests: real subprocesses SIGKILLed at random moments while they send and acknowledge.

A child (``_procs/store_child.py``) sends numbered messages and acks them, reporting each call
that returned on a flushed stdout line (a file). The parent kills it at a random moment,
reopens the store and audits it (``_procs/history.py``): every acknowledged send present exactly
once, every send all-or-nothing, ``_seq`` dense, the consumer's watermark at or after the last
acknowledged ack, no page anyone still needs deleted. Then it restarts the child on the same
store and kills it again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyspark_durable_queue import DamagedLogError, DurableQueue

_spec = importlib.util.spec_from_file_location(
    "dq_history", Path(__file__).parent / "_procs" / "history.py")
history = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(history)

pytestmark = pytest.mark.crash

NAME = "crashy"

#: Every address here keeps a page file and a log entry per commit (``journal=False``): the
#: audit (``_procs/history.py``) walks log entry files and page files. The journal's crash and
#: multi-process tests, with their own walker of segment files, are test_journal_crash.py and
#: test_journal_concurrency.py.
FILE_PER_COMMIT = {"journal": False}


def start_child(root: str, run: int, seed: int, out: Path, *, mode: str = "sendack",
                max_sends: int = 0, settings: dict | None = None,
                env: dict | None = None) -> subprocess.Popen:
    args = [sys.executable, history.CHILD, root, NAME, str(run), str(seed), mode,
            str(max_sends), json.dumps(settings or {})]
    with open(out, "w") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.PIPE,
                                env={**os.environ, **(env or {})})


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def crash_loop(tmp_path: Path, *, kills: int, seed: int, settings: dict,
               create_in_child: bool = False, max_run_s: float = 0.35,
               root: str | None = None, env: dict | None = None,
               stalled_runs: int = 0) -> dict:
    """Start, kill at random, audit, restart... on one store (``root``, a local folder by
    default); returns the last audit. A log entry a kill cut short (possible only without hard
    links) is set aside by repair before the audit, as an operator would.

    ``stalled_runs`` of the runs (chosen at random; needs ``DQ_CHILD_NO_LINKS``) are killed
    while their child is stopped half-way through writing a commit-log entry (its 1st to 4th,
    ``DQ_CHILD_STALL_ENTRY``): each of them must leave a cut-short entry that repair sets aside.
    """
    root = root or str(tmp_path / "dq")
    if not create_in_child:
        DurableQueue(root).address(NAME, **settings)
    rng = random.Random(seed)
    stalled = set(rng.sample(range(kills), stalled_runs)) if stalled_runs else set()
    sent: dict = {}
    acked = -1
    cache: dict = {}
    summary: dict = {}
    repairs = 0
    for run in range(kills):
        out = tmp_path / f"run-{run}.out"
        child_env = dict(env or {})
        if run in stalled:
            child_env["DQ_CHILD_STALL_ENTRY"] = str(rng.randint(1, 4))
        proc = start_child(root, run, rng.randrange(1 << 30), out, settings=settings,
                           env=child_env)
        try:
            if run in stalled:
                history.wait_ready(out, proc, what="stalled")
            elif rng.random() < 0.15:
                time.sleep(rng.uniform(0, 0.4))  # sometimes while it is still opening
            elif history.wait_ready(out, proc):
                history.wait_sent(out, proc, 4)  # so that every run sends something
                time.sleep(rng.uniform(0, max_run_s))
        finally:
            kill(proc)
        stderr = proc.stderr.read().decode()
        proc.stderr.close()
        report = history.parse_report(out)
        assert not report["errors"], report["errors"]
        # the kill landed on a live child: it did not die on its own (seed {seed}, run {run})
        assert proc.returncode == -signal.SIGKILL, (seed, run, proc.returncode, stderr[-2000:])
        assert (report["stalled"] is not None) == (run in stalled), (seed, run, report)
        sent.update(report["sent"])
        acked = max(acked, report["acked"])
        if not report["ready"] and NAME not in DurableQueue(root).addresses():
            continue  # killed before the address existed
        try:
            DurableQueue(root).address(NAME).log.refresh()
        except DamagedLogError as exc:
            assert exc.partial, exc
            fixed = DurableQueue(root).address(NAME).repair(dry_run=False, grace_ms=0)
            assert fixed.log_entry and not fixed.pages, fixed
            if run in stalled:  # the entry set aside is the one the child stopped in
                assert report["stalled"].endswith(fixed.log_entry), (report, fixed)
            repairs += 1
        else:
            assert run not in stalled, f"run {run} was killed half-way through " \
                f"{report['stalled']}, yet the log opened without repair (seed {seed})"
        summary = history.audit(root, NAME, sent=sent, min_position=acked, cache=cache)
    return {"summary": summary, "sent": sent, "acked": acked, "root": root, "cache": cache,
            "repairs": repairs}


def final_cleanup_check(result: dict, archive: bool) -> None:
    """After all the crashes, orphans are collected and only live pages remain."""
    root = result["root"]
    a = DurableQueue(root).address(NAME)
    report = a.cleanup(dry_run=False, now=time.time() + 10 ** 6)
    a = DurableQueue(root).address(NAME)
    pages = {n for n in a.storage.list(a.pages_folder)}
    assert pages == set(a.state.pages.names), (report.orphans, pages - set(a.state.pages.names))
    temp = Path(root, ".tmp")
    assert not temp.exists() or not [p for p in temp.iterdir() if p.suffix == ".tmp"]
    after = history.audit(root, NAME, sent=result["sent"], min_position=result["acked"],
                          cache=result["cache"])
    if archive:
        # every removed page, including those whose move a crash interrupted, is archived
        # (orphans of interrupted sends are archived too, so this is not an equality)
        assert after["removed"] <= after["archived"], after["removed"] - after["archived"]


def test_crash_during_send_and_ack(tmp_path):
    settings = dict(FILE_PER_COMMIT, page_size_bytes=2048, cleanup_interval_ms=0,
                    archive_data_logs=True)
    result = crash_loop(tmp_path, kills=14, seed=1234, settings=settings)
    s = result["summary"]
    assert len(result["sent"]) > 20, "the children hardly ran; the test proves nothing"
    assert s["removed"], "no cleanup ran between the kills"
    final_cleanup_check(result, archive=True)


@pytest.mark.parametrize("store", ["s3", "abfs"])
def test_crash_during_send_and_ack_on_an_object_store(tmp_path, request, store):
    """The same on S3 and Azure Blob storage, where a killed writer leaves a whole object or
    none (an unfinished upload is invisible) and publishing is a conditional PUT."""
    from conftest import object_store_root

    settings = dict(FILE_PER_COMMIT, page_size_bytes=2048, cleanup_interval_ms=0,
                    archive_data_logs=True)
    result = crash_loop(tmp_path, kills=8, seed=2468, settings=settings, max_run_s=1.5,
                        root=object_store_root(request, store))
    assert len(result["sent"]) > 20, "the children hardly ran; the test proves nothing"
    assert result["summary"]["removed"], "no cleanup ran between the kills"
    final_cleanup_check(result, archive=True)


def test_crash_without_hard_links(tmp_path):
    """Where there are no hard links (cloud FUSE volumes) log entries are created with O_EXCL
    and are visible while being written: a kill inside that window leaves a cut-short entry,
    which repair sets aside; nothing acknowledged may be lost either way.

    Random kills hit that window only now and then, so three of the runs are killed while their
    child is stopped half-way through writing an entry (the test proves each left a short
    entry that repair set aside); the other runs are killed at random moments as usual."""
    settings = dict(FILE_PER_COMMIT, page_size_bytes=2048, cleanup_interval_ms=0,
                    archive_data_logs=True)
    result = crash_loop(tmp_path, kills=12, seed=97531, settings=settings,
                        env={"DQ_CHILD_NO_LINKS": "1"}, stalled_runs=3)
    assert len(result["sent"]) > 20, "the children hardly ran; the test proves nothing"
    assert result["repairs"] >= 3, result["repairs"]
    final_cleanup_check(result, archive=True)


def test_crash_compressed_small_pages(tmp_path):
    """lz4 pages and many commits, so kills also land around checkpoint writes."""
    settings = dict(FILE_PER_COMMIT, page_size_bytes=1024, cleanup_interval_ms=0, compression="lz4",
                    archive_data_logs=True)
    result = crash_loop(tmp_path, kills=10, seed=99, settings=settings, max_run_s=0.5)
    assert len(result["sent"]) > 20
    final_cleanup_check(result, archive=True)
    a = DurableQueue(result["root"]).address(NAME)
    if a.state.version >= 100:
        assert any(n.endswith(".checkpoint.arrow") for n in a.storage.list(f"{a.folder}/log"))


def test_crash_while_creating(tmp_path):
    """The child creates the address itself; early kills hit the creation."""
    settings = dict(FILE_PER_COMMIT, page_size_bytes=4096, cleanup_interval_ms=0,
                    archive_data_logs=True)
    result = crash_loop(tmp_path, kills=6, seed=7, settings=settings, create_in_child=True,
                        max_run_s=0.15)
    a = DurableQueue(result["root"]).address(NAME)
    assert a.settings.page_size_bytes == 4096
    final_cleanup_check(result, archive=True)


def test_crash_two_writers(tmp_path):
    """Two children send to one address; both are killed at random moments, restarted..."""
    root = str(tmp_path / "dq")
    settings = dict(FILE_PER_COMMIT, page_size_bytes=2048, cleanup_interval_ms=0,
                    archive_data_logs=True)
    DurableQueue(root).address(NAME, **settings)
    rng = random.Random(4242)
    sent: dict = {}
    acked = -1
    cache: dict = {}
    run = 0
    for _ in range(5):
        procs = []
        for mode in ("sendack", "send"):
            out = tmp_path / f"run-{run}.out"
            procs.append((start_child(root, run, rng.randrange(1 << 30), out, mode=mode), out))
            run += 1
        for proc, out in procs:
            if not history.wait_ready(out, proc):
                raise AssertionError(f"child {out.name} exited ({proc.returncode}) before it "
                                     f"was ready: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(rng.uniform(0.05, 0.4))
        for proc, _out in rng.sample(procs, 2):
            kill(proc)
            time.sleep(rng.uniform(0, 0.05))
        for proc, out in procs:
            stderr = proc.stderr.read().decode()
            proc.stderr.close()
            # each kill landed on a live child: neither died on its own meanwhile
            assert proc.returncode == -signal.SIGKILL, (out.name, proc.returncode,
                                                        stderr[-2000:])
            report = history.parse_report(out)
            assert not report["errors"], report["errors"]
            sent.update(report["sent"])
            acked = max(acked, report["acked"])
        history.audit(root, NAME, sent=sent, min_position=acked, cache=cache)
    assert len({k[0] for k in sent}) >= 4  # both kinds of writers got sends through
    final_cleanup_check({"root": root, "sent": sent, "acked": acked, "cache": cache},
                        archive=True)
