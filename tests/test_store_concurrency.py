"""Several processes on one address at the same time (no mocks: real subprocesses, one store).

The children (``_procs/store_child.py``) report every send that returned; the parent waits for
them and audits the store (``_procs/history.py``): every message present exactly once, ``_seq``
dense, each process's sends in the order it made them, sends whole.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._log.commit_log import CHECKPOINT_EVERY, checkpoint_name

_spec = importlib.util.spec_from_file_location(
    "dq_history", Path(__file__).parent / "_procs" / "history.py")
history = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(history)

pytestmark = pytest.mark.slow

NAME = "shared"

#: Every address here keeps a page file and a log entry per commit (``journal=False``): the
#: audit (``_procs/history.py``) walks log entry files and page files. The journal's crash and
#: multi-process tests, with their own walker of segment files, are test_journal_crash.py and
#: test_journal_concurrency.py.
FILE_PER_COMMIT = {"journal": False}


def run_children(tmp_path: Path, root: str, specs: list[tuple[str, int]],
                 settings: dict) -> list[dict]:
    """Start one child per ``(mode, max_sends)``, let them all go at once when every one is
    warmed up (imports take seconds on a loaded machine); wait; return their reports."""
    go = tmp_path / "go"
    env = {**os.environ, "DQ_CHILD_GO": str(go)}
    procs = []
    for run, (mode, max_sends) in enumerate(specs):
        out = tmp_path / f"child-{run}.out"
        with open(out, "w") as f:
            procs.append((subprocess.Popen(
                [sys.executable, history.CHILD, root, NAME, str(run), str(1000 + run), mode,
                 str(max_sends), json.dumps(settings)],
                stdout=f, stderr=subprocess.PIPE, env=env), out))
    for proc, out in procs:
        history.wait_ready(out, proc, timeout=60)
    go.touch()
    reports = []
    for proc, out in procs:
        _, err = proc.communicate(timeout=120)
        report = history.parse_report(out)
        assert proc.returncode == 0, err.decode()[-3000:]
        assert report["done"] and not report["errors"], report["errors"]
        reports.append(report)
    return reports


def check_order(sent: dict) -> None:
    """Within one process, later sends got later ``_seq``."""
    by_run: dict[int, list[tuple[int, int]]] = {}
    for (run, k), (_m, seq) in sent.items():
        by_run.setdefault(run, []).append((k, seq))
    for items in by_run.values():
        items.sort()
        seqs = [s for _, s in items]
        assert seqs == sorted(seqs)


def test_two_processes_send(tmp_path, shared_root):
    """Both also race to create the address."""
    root = shared_root
    settings = dict(FILE_PER_COMMIT, page_size_bytes=2048, fsync=True)
    reports = run_children(tmp_path, root, [("send", 60), ("send", 60)], settings)
    sent = {k: v for r in reports for k, v in r["sent"].items()}
    assert len(sent) == 120
    summary = history.audit(root, NAME, sent=sent)
    assert summary["sends"] == 120
    assert summary["next_seq"] == sum(m for m, _ in sent.values())
    check_order(sent)
    # the two really ran at the same time: their sends interleave in the log
    order = sorted(sent.items(), key=lambda kv: kv[1][1])
    switches = sum(1 for a, b in itertools.pairwise(order) if a[0][0] != b[0][0])
    assert switches > 1
    assert DurableQueue(root).address(NAME).settings.page_size_bytes == 2048


def test_sender_and_acking_consumer_processes(tmp_path, shared_root):
    """One process sends while another sends, receives, acks and cleans up (archiving)."""
    root = shared_root
    settings = dict(FILE_PER_COMMIT, page_size_bytes=2048, cleanup_interval_ms=0,
                    archive_data_logs=True, fsync=False)
    DurableQueue(root).address(NAME, **settings)
    reports = run_children(tmp_path, root, [("send", 70), ("sendack", 70)], settings)
    sent = {k: v for r in reports for k, v in r["sent"].items()}
    acked = max(r["acked"] for r in reports)
    summary = history.audit(root, NAME, sent=sent, min_position=acked)
    assert summary["removed"], "the consumer never cleaned up"
    assert summary["removed"] <= summary["archived"]
    check_order(sent)


def test_concurrent_commits_cross_a_checkpoint(tmp_path):
    root = str(tmp_path / "dq")
    settings = dict(FILE_PER_COMMIT, page_size_bytes=4096, fsync=False)
    DurableQueue(root).address(NAME, **settings)
    per_child = CHECKPOINT_EVERY // 3 + 10
    reports = run_children(tmp_path, root, [("send", per_child)] * 3, settings)
    sent = {k: v for r in reports for k, v in r["sent"].items()}
    summary = history.audit(root, NAME, sent=sent)
    assert summary["version"] > CHECKPOINT_EVERY
    a = DurableQueue(root).address(NAME)
    assert checkpoint_name(CHECKPOINT_EVERY) in a.storage.list(f"{a.folder}/log")
    # the checkpoint written by whichever process won entry 100 folds to the same state
    from pyspark_durable_queue._log.commit_log import CommitLog, LogState

    log = CommitLog(a.storage, f"{a.folder}/log")
    from_checkpoint = log.read_checkpoint(CHECKPOINT_EVERY)
    assert from_checkpoint is not None and from_checkpoint.version == CHECKPOINT_EVERY
    replayed = LogState()
    for v in range(1, CHECKPOINT_EVERY + 1):
        replayed.apply(v, log.read_entry(v))
    assert from_checkpoint.header() == replayed.header()
    assert from_checkpoint.pages.to_table().equals(replayed.pages.to_table())


def test_log_retention_while_two_processes_send(tmp_path):
    """A third process expires the commit log (entries older than 0.2 s) while two others
    commit."""
    root = str(tmp_path / "dq")
    settings = dict(FILE_PER_COMMIT, page_size_bytes=4096, fsync=True)
    DurableQueue(root).address(NAME, **settings)
    reports = run_children(tmp_path, root,
                           [("send", 400), ("send", 400), ("expire", 400)], settings)
    sent = {k: v for r in reports for k, v in r["sent"].items()}
    assert len(sent) == 800
    a = DurableQueue(root).address(NAME)
    assert "00000000000000000001.json" not in a.storage.list(f"{a.folder}/log")
    c = a.consumer("audit", start="earliest")
    t = c.receive(max_messages=10**9)
    assert t.column("_seq").to_pylist() == list(range(a.state.next_seq))
    keys = list(zip(t.column("run").to_pylist(), t.column("k").to_pylist(),
                    t.column("idx").to_pylist(), strict=True))
    assert len(keys) == len(set(keys)) == sum(m for m, _ in sent.values())
    for (run, k), (m, seq) in sent.items():  # each send whole, where its commit said
        at = keys.index((run, k, 0))
        assert t.column("_seq")[at].as_py() == seq
        assert keys[at:at + m] == [(run, k, j) for j in range(m)]
    check_order(sent)
