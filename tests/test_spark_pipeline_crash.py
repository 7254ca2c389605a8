"""Exactly-once pipeline: address -> durablequeue source -> query -> durablequeue sink -> address,
with the query's driver SIGKILLed at random moments and restarted from the same checkpoint.

Every input message must reach the output address exactly once; the consumer's watermark ends
at the end of the input; input pages are removed only once consumed, and all of them are gone
at the end (the pipeline's consumer is the only one).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from pyspark_durable_queue import DurableQueue

DRIVER = Path(__file__).parent / "_procs" / "source_pipeline.py"
CHUNK = 600
KILLS = 4


def _start(root: Path, ckpt: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    # A session of its own: SIGKILL reaches the JVM and its Python processes too, as when the
    # driver machine dies.
    return subprocess.Popen([sys.executable, str(DRIVER), str(root), str(ckpt)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _planned(ckpt: Path) -> int:
    offsets = ckpt / "offsets"
    return len([p for p in offsets.iterdir() if p.name.isdigit()]) if offsets.exists() else 0


def _produce(address, start: int, n: int) -> int:
    ids = list(range(start, start + n))
    address.send(pa.table({"id": pa.array(ids, pa.int64()),
                           "body": [f"body-{i}" for i in ids]}))
    return start + n


@pytest.mark.crash
@pytest.mark.slow
def test_pipeline_survives_sigkilled_drivers_exactly_once(tmp_path):
    seed = int(os.environ.get("DQ_CRASH_SEED", time.time()))
    rng = random.Random(seed)
    root, ckpt, log = tmp_path / "dq", tmp_path / "ckpt", tmp_path / "driver.log"
    source = DurableQueue(str(root)).address("in", page_size_bytes=16 * 1024)
    produced = 0
    for _ in range(8):
        produced = _produce(source, produced, CHUNK)
    kills = []
    for _ in range(KILLS):
        before = _planned(ckpt)
        proc = _start(root, ckpt, log)
        deadline = time.monotonic() + 120
        while _planned(ckpt) <= before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(rng.uniform(0.0, 3.0))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kills.append(_planned(ckpt))
        produced = _produce(source, produced, CHUNK)  # the producer never stops
        # pages are never removed before the consumer's watermark passed them
        position = source.consumers().get("pipe", {}).get("position", 0)
        state = source.log.refresh()
        assert state.first_seq <= max(position, state.pages.seq[0] if len(state.pages) else 0)
    proc = _start(root, ckpt, log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]

    out = DurableQueue(str(root)).address("out", create=False)
    check = out.consumer("check")
    got = []
    while True:
        batch = check.receive(max_messages=100_000, max_bytes=1 << 30)
        if batch.num_rows == 0:
            break
        got.extend(zip(batch.column("id").to_pylist(), batch.column("src_seq").to_pylist(),
                       batch.column("body").to_pylist(), strict=True))
    ids = [g[0] for g in got]
    assert len(ids) == len(set(ids)), (f"{len(ids) - len(set(ids))} duplicates; seed {seed}; "
                                       f"kills at batches {kills}")
    assert sorted(ids) == list(range(produced)), f"seed {seed}; kills at batches {kills}"
    assert all(seq == i and body == f"body-{i}" for i, seq, body in got)
    assert source.consumers()["pipe"]["position"] == produced
    assert len(source.log.refresh().pages) == 0  # everything consumed was cleaned up
    print(f"seed {seed}: {produced} messages, kills after planned batches {kills}")
