"""What the SIGKILL crash tests of consumers share: a worker script run as a child process,
its lines read from a file, killed at a random moment (or once it printed its last line), and
proof that the kill landed (the child did not exit by itself, before or after); and the
audit of a dead-letter address (each origin stored once).

Used by ``test_consumer_crash.py``, ``test_consumer_window_crash.py``,
``test_consumer_settle_crash.py``, ``test_dead_letter_crash.py`` and ``test_shared_crash.py``.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


def read_lines(path: Path) -> list[list[str]]:
    """The child's lines so far, split into words (a line cut by the kill is dropped: the
    child writes a line at a time, ending with its newline)."""
    if not path.exists():
        return []
    text = path.read_text()
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    return [line.split() for line in text.splitlines() if line.strip()]


def crash_seed() -> tuple[int, random.Random]:
    """The seed of a run's random kill times, and a generator from it: ``DQ_CRASH_SEED``
    repeats a run's (printed, and to be named in assertion messages)."""
    seed = int(os.environ.get("DQ_CRASH_SEED", time.time()))
    print(f"DQ_CRASH_SEED={seed}")
    return seed, random.Random(seed)


def run_and_kill(script: Path, args: list[str], out: Path, *, after_s: float | None = None,
                 last: list[str] | None = None, lines: Path | None = None,
                 start_timeout_s: float = 60, finish_timeout_s: float = 300
                 ) -> list[list[str]]:
    """Run ``script args`` (stdout in ``out``, stderr beside it as ``.err``); once it wrote
    its first line (to ``lines``, default ``out``), let it run ``after_s`` seconds, or until
    its last line is ``last``; then SIGKILL it. Asserts it was still running and that the kill
    landed (exit status -SIGKILL); returns its lines.
    """
    assert (after_s is None) != (last is None), "after_s or last"
    watched = out if lines is None else lines
    err = out.with_suffix(".err")
    with open(out, "w") as f, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, str(script), *args], stdout=f, stderr=e)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not read_lines(watched):  # it received its first message (or found none)
            assert proc.poll() is None, err.read_text()[-2000:]
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.005)
        if after_s is not None:
            time.sleep(after_s)
        else:
            deadline += finish_timeout_s
            while read_lines(watched)[-1] != last:
                assert proc.poll() is None, err.read_text()[-2000:]
                assert time.monotonic() < deadline, "the worker never finished"
                time.sleep(0.01)
        assert proc.poll() is None, err.read_text()[-2000:]  # it did not exit by itself
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL  # the kill landed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return read_lines(watched)


def dead_lettered_once(root: str, seed: int, address: str = "DLQ") -> collections.Counter[int]:
    """How many times each origin ``_seq`` is stored in dead-letter ``address``, after
    asserting that none is stored twice (the move's transaction key makes a repeat a no-op)."""
    from pyspark_durable_queue import DurableQueue

    dlq = DurableQueue(root).address(address)
    stored = collections.Counter(
        row["origin_seq"] for batch, _ in dlq.snapshot().messages(0) if batch is not None
        for row in batch.select(["origin_seq"]).to_pylist())
    twice = sorted(s for s, n in stored.items() if n > 1)
    assert not twice, f"dead-lettered more than once: {twice} (seed {seed})"
    return stored
