"""Exactly-once pipeline: address -> durablequeue source -> query -> durablequeue sink -> address,
with the query's driver SIGKILLed at random moments and restarted from the same checkpoint.

Every input message must reach the output address exactly once; the consumer's watermark ends
at the end of the input; after every kill, every message at or after the consumer's durable
watermark is still in a live page file (pages go only once consumed), and all of them are gone
at the end (the pipeline's consumer is the only one).

Beside it, in the same driver (so the same kills), a query over three addresses (``m1,m2,e``:
one offset each in one checkpoint) routes each row by an ``_address`` column to ``mout.m1`` /
``mout.m2`` / ``mout.e``: every message of ``m1``/``m2`` reaches its own output address exactly
once, and the consumer's watermark ends at the end of each input.

Address ``e`` expires: its messages are sent with ``ttl_ms`` (40 sends of 3 rows per chunk, TTLs
4-160 s spread so that any 12 consecutive sends hold TTLs at most 16 s apart) and its
``expiry_address`` is ``e.dead``. Each batch's offset records the plan's time (``ttl_now``);
``mout.e`` must hold exactly, once each, the rows of each batch's range alive at its
``ttl_now`` (the test knows each row's deadline: its page's commit time + its TTL). After each
kill, a batch planned but neither committed nor stored in ``mout.e`` is replayed by the next run;
the rows of it alive at its plan whose deadline passed before that run started the queries
(``STARTING`` in the driver's log) expired between the plan and the replay: at least one such row
over the run, delivered by the replay (the test waits up to 10 s before a restart for the first
of them). Every row of ``e`` not delivered is in ``e.dead`` (origin ``e``, reason ``expired``),
and no row is there twice; a row delivered and later expired may be there too (the mover's
safe side, ``docs/architecture.md``), counted in the printed summary.

The seed is printed and named in every failure; ``DQ_CRASH_SEED=<seed>`` replays its schedule;
``DQ_SPARK_CRASH_KILLS=8`` runs longer.
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

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.page import decode_page
from pyspark_durable_queue.errors import AddressNotFoundError

DRIVER = Path(__file__).parent / "_procs" / "source_pipeline.py"
CHUNK = 600
#: Each kill costs a driver start (a JVM, ~40 s of this test on the 2-core CI machine). Two
#: cover the claim: a restart from a checkpoint a kill left, and a kill of such a restarted
#: driver; with a new random schedule every run. More kills are opt-in.
KILLS = int(os.environ.get("DQ_SPARK_CRASH_KILLS", 2))
MAX_RUNS = 3 * KILLS  # runs that drain the backlog before their kill do not count as kills
#: how long a run may take to plan its first micro-batch (a wait, not a timer on the work)
FIRST_BATCH_S = 300
#: Address ``e``: per chunk, E_SENDS sends of E_ROWS rows, send ``j`` with TTL
#: ``TTL_STEP_MS * (1 + 11j mod E_SENDS)``: a multi batch takes ~45 rows of ``e`` (its share of
#: 500 by backlog), 15 sends, and any 12 consecutive sends' TTLs are at most 4 steps apart.
E_SENDS, E_ROWS, TTL_STEP_MS = 40, 3, 4000


def _start(root: Path, ckpt: Path, log: Path, *, drain: bool = False) -> subprocess.Popen:
    """A driver run; ``drain``: the last one, which takes what is left in one micro-batch per
    query."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    # A session of its own: SIGKILL reaches the JVM and its Python processes too, as when the
    # driver machine dies.
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, str(DRIVER), str(root), str(ckpt)]
                                + (["drain"] if drain else []),
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """Kill the driver's whole session (JVM and Python workers) if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _planned(ckpt: Path) -> int:
    offsets = ckpt / "offsets"
    return len([p for p in offsets.iterdir() if p.name.isdigit()]) if offsets.exists() else 0


def _produce(address, start: int, n: int) -> int:
    ids = list(range(start, start + n))
    address.send(pa.table({"id": pa.array(ids, pa.int64()),
                           "body": [f"body-{i}" for i in ids]}))
    return start + n


def _produce_many(addresses, start: int, n: int) -> None:
    ids = list(range(start, start + n))
    for address in addresses:
        address.send(pa.table({"id": pa.array(ids, pa.int64()),
                               "body": [f"{address.name}-{i}" for i in ids]}))


def _produce_expiring(address, start: int, deadlines: list[int]) -> int:
    """One chunk of ``e``: E_SENDS sends with their TTLs; each row's deadline (its page's commit
    time + its TTL, epoch microseconds: it is alive at ``ttl_now`` while ``ttl_now`` is below
    it) appended to ``deadlines`` (index = ``_seq`` = ``id``)."""
    for j in range(E_SENDS):
        ids = list(range(start, start + E_ROWS))
        ttl_ms = TTL_STEP_MS * (1 + (11 * j) % E_SENDS)
        result = address.send(pa.table({"id": pa.array(ids, pa.int64()),
                                         "body": [f"e-{i}" for i in ids]}), ttl_ms=ttl_ms)
        assert result.seq == start and result.count == E_ROWS
        pages = address.log.refresh().pages
        ts = pages.ts[pages.find(start)]  # a page file per send (journal=False)
        deadlines.extend([ts + ttl_ms * 1000] * E_ROWS)
        start += E_ROWS
    return start


def _multi_offsets(ckpt: Path) -> dict[int, dict]:
    """The end offset of address ``e`` in each planned batch of the multi query."""
    folder = ckpt / "offsets"
    if not folder.exists():
        return {}
    return {int(p.name): json.loads(p.read_text().splitlines()[-1])["addresses"]["e"]
            for p in folder.iterdir() if p.name.isdigit()}


def _e_batches(ckpt: Path) -> dict[int, tuple[int, int, int | None]]:
    """Each planned batch's range of ``e`` and the time it is read at: ``{batch: (begin,
    end, ttl_now)}`` (batch 0 begins at the new consumer's 0)."""
    ends = _multi_offsets(ckpt)
    return {n: (ends[n - 1]["seq"] if n else 0, e["seq"], e.get("ttl_now"))
            for n, e in sorted(ends.items())}


def _pending_expiring(root: Path, ckpt: Path, deadlines: list[int]) -> dict[int, int] | None:
    """After a kill: the rows of ``e`` the multi query's replay must read (``{id: deadline}``,
    alive at the plan), when its last planned batch was neither committed nor stored in
    ``mout.e`` (a first attempt that stored it makes the replay's store a duplicate); ``None``
    when no such batch."""
    batches = _e_batches(ckpt)
    if not batches:
        print("kill: the multi query planned nothing yet")
        return None
    last = max(batches)
    if (ckpt / "commits" / str(last)).exists():
        print(f"kill: the multi query's batch {last} was committed")
        return None
    try:
        stored = DurableQueue(str(root)).address("mout.e", create=False).log.refresh().txns
    except AddressNotFoundError:  # nothing stored yet
        stored = {}
    if max(stored.values(), default=-1) >= last:
        print(f"kill: the multi query's batch {last} was stored in mout.e")
        return None
    begin, end, ttl_now = batches[last]
    if end <= begin:
        print(f"kill: the multi query's batch {last} reads nothing of e")
        return None
    assert ttl_now is not None, f"batch {last} of e has no ttl_now: {batches[last]}"
    alive = {i: deadlines[i] for i in range(begin, end) if deadlines[i] > ttl_now}
    print(f"kill: the multi query's batch {last} will be replayed: e {begin}..{end}, "
          f"{len(alive)} alive at its plan, the first expiring "
          f"{(min(alive.values()) - ttl_now) / 1e6 if alive else None} s after it")
    return alive


def _check_unconsumed_pages_kept(root: Path, produced: int, why: str) -> None:
    """Every ``_seq`` from the consumer's durable watermark (read from its own files: the
    state file and, from on-disk format 3, its watermark file) up to the end of the input
    (counted by the test) is in a live page whose file exists and holds exactly those
    messages (``id == _seq`` here): no gap at or after the watermark."""
    folder = root / "in"
    address = DurableQueue(str(root)).address("in")
    position = int(address.consumers().get("pipe", {}).get("position", 0))
    state = address.log.refresh()
    assert state.next_seq == produced, why
    pages = state.pages
    at = position
    for i in range(pages.find(position), len(pages)):
        assert pages.seq[i] <= at, (f"_seq {at}..{pages.seq[i] - 1} at or after the watermark "
                                    f"{position} are in no live page; {why}")
        path = folder / "pages" / pages.names[i]
        assert path.exists(), f"page {pages.names[i]} (needed from {position}) is gone; {why}"
        page = decode_page(path.read_bytes(), str(path))
        ids = [x for b in page.batches for x in b.column("id").to_pylist()]
        assert ids == list(range(pages.seq[i], pages.ends[i])), f"{path.name}; {why}"
        at = max(at, pages.ends[i])
    assert at >= produced, (f"_seq {at}..{produced - 1} at or after the watermark {position} "
                            f"are in no live page; {why}")


@pytest.mark.crash
@pytest.mark.slow
def test_pipeline_survives_sigkilled_drivers_exactly_once(tmp_path):
    seed = int(os.environ.get("DQ_CRASH_SEED", time.time()))
    print(f"DQ_CRASH_SEED={seed}")
    rng = random.Random(seed)
    root, ckpt, log = tmp_path / "dq", tmp_path / "ckpt", tmp_path / "driver.log"
    # a page file per send (journal=False): the audit decodes each live page file, and at
    # the end cleanup has removed every one (a journal keeps the segment being written)
    source = DurableQueue(str(root)).address("in", page_size_bytes=16 * 1024, journal=False)
    many = [DurableQueue(str(root)).address(n, page_size_bytes=16 * 1024, journal=False)
            for n in ("m1", "m2")]
    expiring = DurableQueue(str(root)).address("e", page_size_bytes=16 * 1024, journal=False,
                                               expiry_address="e.dead")
    deadlines: list[int] = []  # of each row of e
    produced = produced_e = 0
    for _ in range(8):
        _produce_many(many, produced, CHUNK)
        produced_e = _produce_expiring(expiring, produced_e, deadlines)
        produced = _produce(source, produced, CHUNK)
    kills: list[int] = []  # planned batches at each kill
    replays: list[tuple[int, dict[int, int]]] = []  # (next run, rows its replay reads of e)
    finished = 0  # runs that drained the backlog and exited 0 before their kill
    proc = None
    try:
        while len(kills) < KILLS:
            runs = len(kills) + finished
            assert runs < MAX_RUNS, (f"only {len(kills)} of {KILLS} kills in {runs} runs: the "
                                     f"others finished first; seed {seed}")
            before = _planned(ckpt)
            proc = _start(root, ckpt, log)
            # (120 s was not enough once at a load average of ~20)
            deadline = time.monotonic() + FIRST_BATCH_S
            while _planned(ckpt) <= before and proc.poll() is None:
                assert time.monotonic() < deadline, (
                    f"run {runs} planned no micro-batch in {FIRST_BATCH_S} s; seed {seed}\n"
                    + log.read_text()[-3000:])
                time.sleep(0.1)
            time.sleep(rng.uniform(0.0, 3.0))
            _stop(proc)
            if proc.returncode == -signal.SIGKILL:  # the kill landed on a live driver
                kills.append(_planned(ckpt))
                replay = _pending_expiring(root, Path(f"{ckpt}-multi"), deadlines)
                if replay:
                    replays.append((runs + 1, replay))
                    # the first of them to expire expires before the next run reads (its JVM
                    # takes longer than 3 s to start the queries)
                    time.sleep(min(10.0, max(0.0, min(replay.values()) / 1e6 - time.time() - 3)))
            else:
                assert proc.returncode == 0, (f"run {runs}: the driver died on its own "
                                              f"({proc.returncode}); seed {seed}\n"
                                              + log.read_text()[-3000:])
                finished += 1
            _produce_many(many, produced, CHUNK)
            produced_e = _produce_expiring(expiring, produced_e, deadlines)
            produced = _produce(source, produced, CHUNK)  # the producer never stops
            _check_unconsumed_pages_kept(root, produced,
                                         f"seed {seed}; kills at batches {kills}")
        proc = _start(root, ckpt, log, drain=True)
        assert proc.wait(timeout=300) == 0, f"seed {seed}\n" + log.read_text()[-4000:]
    finally:
        if proc is not None:
            _stop(proc)

    out = DurableQueue(str(root)).address("out", create=False)
    check = out.consumer("check")
    got = []
    for batch in check.batches(max_messages=100_000, max_bytes=1 << 30):
        got.extend(zip(batch.column("id").to_pylist(), batch.column("src_seq").to_pylist(),
                       batch.column("body").to_pylist(), strict=True))
    ids = [g[0] for g in got]
    why = f"seed {seed}; kills at batches {kills}"
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} duplicates; {why}"
    assert sorted(ids) == list(range(produced)), why
    assert all(seq == i and body == f"body-{i}" for i, seq, body in got), why
    assert source.consumers()["pipe"]["position"] == produced, why
    assert len(source.log.refresh().pages) == 0, why  # everything consumed was cleaned up
    for name in ("m1", "m2"):  # the query over both addresses, routed to one output each
        routed = DurableQueue(str(root)).address(f"mout.{name}", create=False).consumer("check")
        rows = [(i, seq, body) for batch in routed.batches(max_messages=100_000, max_bytes=1 << 30)
                for i, seq, body in zip(batch.column("id").to_pylist(),
                                        batch.column("src_seq").to_pylist(),
                                        batch.column("body").to_pylist(), strict=True)]
        ids = [r[0] for r in rows]
        assert len(ids) == len(set(ids)), f"{name}: {len(ids) - len(set(ids))} duplicates; {why}"
        assert sorted(ids) == list(range(produced)), f"{name}; {why}"
        assert all(seq == i and body == f"{name}-{i}" for i, seq, body in rows), f"{name}; {why}"
        assert DurableQueue(str(root)).address(name).consumers()["multi"]["position"] == \
            produced, f"{name}; {why}"
    replayed, both = _check_expiring(root, Path(f"{ckpt}-multi"), log, produced_e, deadlines,
                                     replays, why)
    print(f"seed {seed}: {produced} messages, kills after planned batches {kills}, "
          f"{finished} runs finished before their kill; e: {produced_e} messages, "
          f"{replayed} expired between plan and replay (runs {[r for r, _ in replays]}), "
          f"{both} both delivered and moved to e.dead")


def _check_expiring(root: Path, ckpt: Path, log: Path, produced: int, deadlines: list[int],
                    replays: list[tuple[int, dict[int, int]]], why: str) -> tuple[int, int]:
    """The audit of address ``e`` (the module's docstring); returns how many rows expired
    between their batch's plan and its replay, and how many are both in ``mout.e`` and
    ``e.dead``."""
    queue = DurableQueue(str(root))
    rows = [(i, seq, body) for batch in queue.address("mout.e", create=False).consumer("check")
            .batches(max_messages=100_000, max_bytes=1 << 30)
            for i, seq, body in zip(batch.column("id").to_pylist(),
                                    batch.column("src_seq").to_pylist(),
                                    batch.column("body").to_pylist(), strict=True)]
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids)), f"e: {len(ids) - len(set(ids))} duplicates; {why}"
    assert all(seq == i and body == f"e-{i}" for i, seq, body in rows), f"e; {why}"
    batches = _e_batches(ckpt)
    assert max(end for _, end, _ in batches.values()) == produced, f"e; {why}"
    expected = set()
    for n, (begin, end, ttl_now) in batches.items():
        assert end <= begin or ttl_now is not None, f"batch {n} of e has no ttl_now; {why}"
        expected.update(i for i in range(begin, end) if deadlines[i] > ttl_now)
    late = sorted(set(ids) - expected)
    assert not late, f"e: {len(late)} rows delivered after they expired ({late[:5]}); {why}"
    missing = sorted(expected - set(ids))
    assert not missing, f"e: {len(missing)} rows alive at their plan not delivered " \
        f"({missing[:5]}); {why}"
    # the replays: rows alive at their plan that expired before the next run started reading
    starts = [float(line.split()[1]) for line in log.read_text().splitlines()
              if line.startswith("STARTING ")]
    expired_before_replay = sorted(i for run, replay in replays
                                   for i, deadline in replay.items()
                                   if deadline <= starts[run] * 1e6)
    # a kill lands inside the multi query's batch (planned, not stored) in nearly every run;
    # when none did there is no replay to check here (the reader-level replay is in test_ttl)
    assert expired_before_replay or not replays, (
        f"no row of e expired between a batch's plan and its replay (replays {replays}); {why}")
    if not replays:
        print("no kill landed inside a batch of the multi query: no replay of e to check")
    assert set(expired_before_replay) <= set(ids), f"e; {why}"
    assert queue.address("e").consumers()["multi"]["position"] == produced, f"e; {why}"
    dead = [(seq, origin, reason) for batch in queue.address("e.dead", create=False)
            .consumer("check").batches(max_messages=100_000, max_bytes=1 << 30)
            for seq, origin, reason in zip(
                batch.column("origin_seq").to_pylist(), batch.column("origin_address").to_pylist(),
                batch.column("reason").to_pylist(), strict=True)]
    moved = [d[0] for d in dead]  # _seq in e == id
    assert len(moved) == len(set(moved)), f"e.dead: {len(moved) - len(set(moved))} " \
        f"duplicates; {why}"
    assert all(o == "e" and r == "expired" for _, o, r in dead), f"e.dead; {why}"
    lost = sorted(set(range(produced)) - set(ids) - set(moved))
    assert not lost, f"e: {len(lost)} expired rows not in e.dead ({lost[:5]}); {why}"
    return len(expired_before_replay), len(set(ids) & set(moved))
