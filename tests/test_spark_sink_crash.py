"""Crash test of the sink: SIGKILL the driver of a streaming query at random moments.

After restarts from the same checkpoint every input row must be in the address exactly once,
and once orphan pages are collected no page file is left that the log does not name.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from pyspark_durable_queue import DurableQueue

DRIVER = Path(__file__).parent / "_procs" / "sink_crash_driver.py"
FILES, ROWS = 30, 400
KILLS = 4


def _start(src: Path, root: Path, ckpt: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    # A session of its own: SIGKILL reaches the JVM and the Python workers too, as when a
    # driver machine dies.
    return subprocess.Popen([sys.executable, str(DRIVER), str(src), str(root), str(ckpt)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _planned(ckpt: Path) -> int:
    """Micro-batches Spark has planned (offset log entries) so far."""
    offsets = ckpt / "offsets"
    return len([p for p in offsets.iterdir() if p.name.isdigit()]) if offsets.exists() else 0


@pytest.mark.crash
@pytest.mark.slow
def test_sigkilled_driver_restarts_exactly_once(tmp_path):
    rng = random.Random(int(os.environ.get("DQ_CRASH_SEED", time.time())))
    src, root, ckpt = tmp_path / "in", tmp_path / "dq", tmp_path / "ckpt"
    src.mkdir()
    for f in range(FILES):
        (src / f"part-{f:04d}.json").write_text("".join(
            json.dumps({"id": f * ROWS + i, "body": f"body-{f * ROWS + i}"}) + "\n"
            for i in range(ROWS)))
    log = tmp_path / "driver.log"
    progress = []
    for _ in range(KILLS):
        before = _planned(ckpt)
        proc = _start(src, root, ckpt, log)
        # The JVM takes 10 s or more to start on a loaded machine: wait until this run has
        # planned a new micro-batch, then kill at a random moment of the following seconds
        # (tasks writing pages, the sink's commit, Spark's own checkpoint commit...).
        deadline = time.monotonic() + 120
        while _planned(ckpt) <= before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 4.0))
        if proc.poll() is not None:
            break  # finished before we got to kill it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        commits = ckpt / "commits"
        progress.append(len([p for p in commits.iterdir() if p.name.isdigit()])
                        if commits.exists() else 0)
    proc = _start(src, root, ckpt, log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]

    address = DurableQueue(str(root)).address("numbers", create=False)
    consumer = address.consumer("check")
    ids = []
    while True:
        batch = consumer.receive(max_messages=100_000, max_bytes=1 << 30)
        if batch.num_rows == 0:
            break
        ids.extend(batch.column("id").to_pylist())
        assert batch.column("body").to_pylist() == [f"body-{i}" for i in
                                                    batch.column("id").to_pylist()]
    assert len(ids) == FILES * ROWS, f"{len(ids) - len(set(ids))} duplicates; progress {progress}"
    assert sorted(ids) == list(range(FILES * ROWS))
    # Killed tasks may have left unpublished pages: cleanup collects them, nothing else is left.
    report = address.cleanup(dry_run=False, now=time.time() + 10 * 24 * 3600)
    print(f"batches committed at each kill: {progress}; orphan pages collected: "
          f"{len(report.orphans)}; commit log entries: {address.state.version}")
    on_disk = sorted(p.name for p in (root / "numbers" / "pages").glob("*.page"))
    assert on_disk == sorted(address.state.pages.names)
