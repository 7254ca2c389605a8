"""Crash test of group commit: processes of several sending threads SIGKILLed at random moments.

Three children (``_procs/group_child.py``) each run four threads sending single-row messages
to one address (two threads share an ``Address``, two hold one each; about half the sends are
idempotent with a transaction of their own), so their sends are committed in groups carrying
several rows and several transactions, and on the local disk the processes queue for the log's
publish lock. Every send that returned is reported on a flushed stdout line. The parent kills
all the children at random moments, audits the store (``_procs/history.py``) and restarts them
on the same store: every send that returned is present exactly once at the ``_seq`` it was
given, rows are whole, ``_seq`` is dense, and the only files beyond the live pages are what
the killed processes were writing.
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

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._log.txn import APP_PREFIX
from pyspark_durable_queue._storage._spares import PER_FOLDER

_procs = Path(__file__).parent / "_procs"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"dq_{name}", _procs / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


history = _load("history")
child = _load("group_child")

pytestmark = pytest.mark.crash

NAME = "grouped"
PROCS = 3
THREADS = 4


def start_child(root: str, run: int, seed: int, out: Path, settings: dict) -> subprocess.Popen:
    args = [sys.executable, str(_procs / "group_child.py"), root, NAME, str(run), str(seed),
            str(THREADS), json.dumps(settings)]
    with open(out, "w") as f, open(out.with_suffix(".err"), "w") as err:
        return subprocess.Popen(args, stdout=f, stderr=err)


def kill_cycle(tmp_path: Path, root: str, rng: random.Random, first_run: int, settings: dict,
               max_run_s: float) -> dict:
    """Start PROCS children, kill each at a random moment once it reported a few sends; return
    the sends they reported."""
    procs = []
    for run in range(first_run, first_run + PROCS):
        out = tmp_path / f"run-{run}.out"
        procs.append((start_child(root, run, rng.randrange(1 << 30), out, settings), out))
    for proc, out in procs:
        if not history.wait_ready(out, proc, timeout=60):
            raise AssertionError(f"{out.name} exited ({proc.returncode}) before it was ready: "
                                 f"{out.with_suffix('.err').read_text()[-2000:]}")
    for proc, out in procs:
        history.wait_sent(out, proc, 2 * THREADS)  # so that every run sends something
    time.sleep(rng.uniform(0, max_run_s))
    for proc, out in rng.sample(procs, len(procs)):
        # the kill lands on a live child: it has not died on its own
        assert proc.poll() is None, (out.name, proc.returncode,
                                     out.with_suffix(".err").read_text()[-2000:])
        os.kill(proc.pid, signal.SIGKILL)
        time.sleep(rng.uniform(0, 0.03))
    sent: dict = {}
    for proc, out in procs:
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL, (out.name, proc.returncode,
                                                    out.with_suffix(".err").read_text()[-2000:])
        report = history.parse_report(out)
        assert not report["errors"], (out.name, report["errors"])
        sent.update(report["sent"])
    return sent


def audit_rows(root: str, sent: dict) -> dict:
    """Beyond ``history.audit``: every stored row is the whole row its id makes, each thread's
    sends kept their order, and every idempotent send that returned is in the log's
    transactions. Returns what the log shows about grouping."""
    a = DurableQueue(root).address(NAME)
    c = a.consumer("rows", start="earliest")
    try:
        t = c.receive(max_messages=10 ** 7, max_bytes=1 << 40)
    finally:
        c.delete()
    rows = t.to_pylist()
    assert [r["_seq"] for r in rows] == list(range(len(rows)))
    for r in rows:
        writer = r["proc"] * THREADS + r["thread"]
        assert (r["run"], r["idx"], r["m"]) == (writer, 0, 1), r
        assert r["pad"] == child.row_pad(writer, r["k"]), r
    by_id = {(r["run"], r["k"]): r for r in rows}
    txns = a.state.txns
    last: dict[int, tuple[int, int]] = {}
    for (writer, k), (_m, seq) in sorted(sent.items()):
        if writer in last:  # a thread's later send got a later _seq
            assert seq > last[writer][1], (writer, last[writer], (k, seq))
        last[writer] = (k, seq)
        if by_id[(writer, k)]["txn"]:
            app = f"{APP_PREFIX}g{writer // THREADS}-{writer % THREADS}"
            assert txns.get(app, -1) >= k, (writer, k, txns.get(app))
    entries = [a.log.read_entry(v) for v in range(1, a.state.version + 1)]
    appends = [e for e in entries if e["op"] == "append"]
    return {"rows": len(rows), "appends": len(appends),
            "multi_row": sum(sum(int(p["rows"]) for p in e["pages"]) > 1 for e in appends),
            "multi_txn": sum(len(e.get("txns", ())) > 1 for e in appends)}


def crash_loop(tmp_path: Path, root: str, *, cycles: int, seed: int, settings: dict,
               max_run_s: float = 0.4) -> dict:
    # a page and a log entry per group (journal=False): what this audits (read_entry, staged
    # entries, spare files); test_journal_crash.py kills threads of journal senders
    settings = {**settings, "journal": False}
    DurableQueue(root).address(NAME, **settings)
    rng = random.Random(seed)
    sent: dict = {}
    cache: dict = {}
    grouping: dict = {}
    for cycle in range(cycles):
        sent.update(kill_cycle(tmp_path, root, rng, cycle * PROCS, settings, max_run_s))
        try:
            summary = history.audit(root, NAME, sent=sent, cache=cache)
            grouping = audit_rows(root, sent)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, after kill cycle {cycle}: {exc}") from exc
        # files beyond the live pages: at most the one group in flight of each killed process
        # (one page), and at most one staged log entry each plus the empty spare files it made
        # ahead (_storage/_spares.py)
        killed = (cycle + 1) * PROCS
        extra = summary["files"] - set(DurableQueue(root).address(NAME).state.pages.names)
        assert len(extra) <= killed, (seed, cycle, sorted(extra))
        temp = DurableQueue(root).storage.temp_files()
        assert len(temp) <= killed * (1 + PER_FOLDER), (seed, cycle, temp)
    assert len(sent) >= cycles * PROCS * 2 * THREADS, "the children hardly ran"
    # after all the kills, cleanup collects the orphans and only live pages remain
    a = DurableQueue(root).address(NAME)
    a.cleanup(dry_run=False, now=time.time() + 10 ** 6)
    a = DurableQueue(root).address(NAME)
    assert set(a.storage.list(a.pages_folder)) == set(a.state.pages.names)
    assert not a.storage.temp_files()
    history.audit(root, NAME, sent=sent, cache=cache)
    return grouping


@pytest.mark.parametrize(("store", "fsync", "cycles", "seed"), [
    pytest.param("file", True, 4, 8642, id="local"),
    pytest.param("file", "never", 2, 1357, id="local-fsync-never"),
    pytest.param("file", "periodic", 2, 2468, id="local-fsync-periodic"),
    pytest.param("s3", True, 2, 9753, id="s3"),
])
def test_every_returned_grouped_send_survives_sigkill_once_at_its_seq(
        tmp_path, request, store, fsync, cycles, seed):
    """On the local disk processes queue for the log on a flock; on S3 they race with
    conditional PUTs. ``fsync`` never or periodic changes nothing a SIGKILL can see (the
    page cache survives it): a send that returned is there in every mode."""
    if store == "file":
        root = str(tmp_path / "dq")
    else:
        from conftest import object_store_root

        root = object_store_root(request, store)
    settings = {"cleanup_interval_ms": 0, "fsync": fsync}
    grouping = crash_loop(tmp_path, root, cycles=cycles, seed=seed, settings=settings)
    # the scenario happened: sends were grouped, and groups carried several transactions
    assert grouping["multi_row"] > 0 and grouping["multi_txn"] > 0, grouping
