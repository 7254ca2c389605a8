"""The kill matrix: one driver that SIGKILLs every kind of process of a store at random
moments, many times over, and audits the whole history.

Used by ``tests/test_kill_matrix.py`` (>= 100 kills, ``DQ_KILL_MATRIX_KILLS``) and by
``make crash-matrix`` (``python tests/kill_matrix.py --kills 10000``).

One address ``jobs`` (``max_delivery_attempts`` 3 into ``DLQ``, ``expiry_address`` ``EXP``,
``compact_grace_ms`` 5 s)
and a fixed set of role slots, each a child FORKED from this warm parent (the package is
imported and the store opened before the first fork, so a child costs milliseconds):

==========  ==========================================================================
``bs0/bs1`` batch senders: batches of 1-5 rows with an idempotency key ``(bsN, version)``;
            a restarted sender first sends again the batch its killed run had begun
``ss0``     single sends from 3 threads of one process (group commit)
``sd0``     scheduled sends: ``deliver_at`` or ``delay_ms`` up to 300 ms ahead
``tt0``     sends with ``ttl_ms`` 1-200 (expired ones are moved to ``EXP``)
``ex0``     the exclusive consumer ``ex``: receives one row at a time, acknowledges
            (flushing) or nacks; poison rows (``k == "p"``) are nacked until dead-lettered
``po0/po1`` the shared consumer ``pool`` (400 ms leases, prefetch 4): acks, nacks, renews,
            holds a row past its lease now and then; poison rows end in ``DLQ``
``cl0``     cleanup (not a dry run) and ``move_expired`` in a loop
``cp0``     compaction in a loop
``rs0``     single sends to ``RET`` (``retention_ms`` 300, a page file per send): retention
            removes its pages whether read or not (by ``cl0``'s cleanups and sends' own)
``rr0``     the exclusive consumer ``rc`` of ``RET``: acknowledges each row, and now and then
            pauses past the retention, so that rows it had not read are removed
==========  ==========================================================================

Every child writes its own append-only audit file, a line per event, each line written whole
(``O_APPEND``) and fsynced, before (``A``) and after (``S``, ``K``...) each step. A round
waits a random moment and SIGKILLs one to three running children (each kill proven: the
child was still running, and ``waitpid`` says SIGKILL), then starts them again. Every
``check_every`` kills, and at the end, the driver kills the rest, forks a drain that releases
the due schedules, reads a third consumer ``audit`` to the end, moves what expired, reads
``DLQ`` and ``EXP`` whole and runs the CLI's ``verify`` on the three addresses, and audits the
whole history so far (:func:`audit`): every send that returned is stored exactly once (a
killed one at most once, a batch all or nothing), ``_seq`` is dense (what the audit consumer
read plus what expired unread), scheduled rows never come early or twice, nothing is
dead-lettered or expired twice, an acknowledgement that returned is never followed by a
delivery of that row, a restarted consumer resumes exactly at its watermark, shared
consumers settle a row once. At the end the exclusive and shared consumers run to the end
unkilled and every row must be settled by each of them.

Retention (address ``RET``, whose only consumer is ``rc``) removes rows ``rc`` has not read, so
its audit accepts a row as gone only where the log says retention removed it: ``lost`` is the
union over the drains of ``LogState.retention_lost`` (the ranges retention removed before every
consumer had passed them; a union, as the log remembers the last ranges only). ``seen`` is what
``rc`` was delivered plus what each drain found retained (read from a snapshot, not by a
consumer, which would keep the pages). Rules: every ``_seq`` below ``RET``'s end is in ``seen``
or in ``lost`` (nothing vanished otherwise; ``_seq`` dense); a ``_seq`` holds one id whoever
read it and whenever; a send that returned is in ``seen`` at its ``_seq`` with its id, or its
``_seq`` is in ``lost``; no id is stored at two ``_seq`` and every id seen was sent; ``rc`` never
acknowledges a row twice and never gets a row again after its ack returned; a restart resumes
at its watermark: above every row it acknowledged, and past unacknowledged rows only where they
are in ``lost`` (or are the row its killed run had in hand); at the end ``rc`` runs unkilled to
the end and every row is acknowledged by it or in ``lost``; ``verify`` passes on ``RET``. Not
checked: that ``rc`` got no row after retention removed it (the removal's time is not
recorded); such a row must still carry the id stored at its ``_seq``.

``DQ_CRASH_SEED`` (or ``--seed``) repeats a run's choices; it is printed and named in every
failure. Local disk only: ``memory://`` cannot cross processes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark_durable_queue import DurableQueue, LeaseExpiredError
from pyspark_durable_queue._ops import dead_letter

ADDRESS, DLQ, EXP, RET = "jobs", "DLQ", "EXP", "RET"
RET_MS = 300  # RET's retention_ms
ATTEMPTS = 3
LEASE_MS = 400
PREFETCH = 4
MAX_DELAY_MS = 300
MAX_TTL_MS = 200
#: The slowest the finishing consumers were seen to go at the end of a 10,000-kill run under a
#: load of 16 on 2 cores (one ``receive(1)`` and a flushed ack or a nack a row: ~90 rows/s),
#: with a margin: their wait is 600 s plus the rows behind at this rate (the run's end waited
#: 600 s for 52,000 rows before, and failed for want of time, not of a row).
FINISH_ROWS_PER_S = 20
SLOTS = ["bs0", "bs1", "ss0", "sd0", "tt0", "ex0", "po0", "po1", "cl0", "cp0", "rs0", "rr0"]


# -- the children's side -------------------------------------------------------------------------
class Lines:
    """A child's audit file: append-only, one whole line per ``os.write`` (``O_APPEND``, so
    the lines of threads do not mix), fsynced (``sync``)."""

    def __init__(self, path: Path, sync: bool) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.sync = sync

    def __call__(self, *words: Any) -> None:
        os.write(self.fd, (" ".join(str(w) for w in words) + "\n").encode())
        if self.sync:
            os.fsync(self.fd)


def read_lines(path: Path) -> list[list[str]]:
    """A file's whole lines, split (a line cut by the kill is dropped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [line.split() for line in text[:text.rfind("\n") + 1].splitlines() if line]


@dataclass
class Child:
    """What a role's loop gets: where the store is, its slot, run number and audit file."""

    root: str
    slot: str
    run: int
    out: Lines
    rng: random.Random
    folder: Path
    finish: bool = False

    def address(self) -> Any:
        return DurableQueue(self.root).address(ADDRESS)


def batch_rows(seed: int, slot: str, version: int) -> list[dict[str, Any]]:
    """Batch ``version`` of sender ``slot``: the same rows every time it is (re)sent."""
    rng = random.Random(f"{seed}-{slot}-{version}")
    return [{"id": f"{slot}.{version}.{i}", "k": "p" if rng.random() < 0.1 else "b", "due": 0}
            for i in range(rng.randint(1, 5))]


def role_batch(c: Child, seed: int) -> None:
    a = c.address()
    version, resend = 0, False
    for path in sorted(c.folder.glob(f"{c.slot}-*.log"), key=run_of):
        for line in read_lines(path):  # the last version begun, and whether it returned
            if line[0] == "A":
                version, resend = int(line[1]), True
            elif line[0] == "S":
                resend = False
    version = version if resend else version + 1
    c.out("R")
    while True:
        rows = batch_rows(seed, c.slot, version)
        c.out("A", version, len(rows))
        result = a.send(rows, txn=(c.slot, version))
        c.out("S", version, result.seq, result.count, int(result.duplicate))
        version += 1
        time.sleep(c.rng.uniform(0.02, 0.15))


def role_single(c: Child) -> None:
    a = c.address()
    c.out("R")

    def sender(t: int) -> None:
        rng = random.Random(c.rng.random())
        for n in range(1 << 30):
            rid = f"{c.slot}.{c.run}.{t}.{n}"
            kind = "p" if rng.random() < 0.05 else "s"
            c.out("A", rid)
            result = a.send([{"id": rid, "k": kind, "due": 0}])
            c.out("S", rid, result.seq)
            time.sleep(rng.uniform(0.05, 0.25))

    threads = [threading.Thread(target=guard(c, sender), args=(t,), daemon=True)
               for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def role_scheduled(c: Child) -> None:
    a = c.address()
    c.out("R")
    for n in range(1 << 30):
        rid = f"{c.slot}.{c.run}.{n}"
        delay = c.rng.randint(0, MAX_DELAY_MS)
        if n % 2:  # an exact time, built from whole milliseconds
            due = int(time.time() * 1000) + delay
            c.out("A", rid, due)
            at = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(milliseconds=due)
            result = a.send([{"id": rid, "k": "d", "due": due}], deliver_at=at)
        else:  # due at least now + delay
            due = int(time.time() * 1000) + delay
            c.out("A", rid, due)
            result = a.send([{"id": rid, "k": "d", "due": due}], delay_ms=delay)
        c.out("S", rid, result.scheduled or result.seq)
        time.sleep(c.rng.uniform(0.02, 0.15))


def role_ttl(c: Child) -> None:
    a = c.address()
    c.out("R")
    for n in range(1 << 30):
        rid = f"{c.slot}.{c.run}.{n}"
        ttl = c.rng.randint(1, MAX_TTL_MS)
        c.out("A", rid, ttl)
        result = a.send([{"id": rid, "k": "t", "due": 0}], ttl_ms=ttl)
        c.out("S", rid, result.seq)
        time.sleep(c.rng.uniform(0.02, 0.15))


def role_exclusive(c: Child) -> None:
    a = c.address()
    consumer = a.consumer("ex", wait_ms=120_000)
    c.out("W", consumer.position)
    idle = 0
    while True:
        before = time.monotonic_ns()
        table = consumer.receive(1, timeout_ms=100)
        if not table.num_rows:
            idle += 1
            if c.finish and idle >= 3:
                info = a.stats()
                mine = info["consumers"]["ex"]
                if mine["position"] == info["next_seq"] and not mine["redelivery_pending"]:
                    c.out("E", mine["position"])
                    return
            continue
        idle = 0
        seq = table.column("_seq")[0].as_py()
        c.out("D", seq, table.column("_delivery_count")[0].as_py(), before)
        if table.column("k")[0].as_py() == "p" or c.rng.random() < 0.1:
            consumer.nack(table, delay_ms=c.rng.choice([0, 0, 10]))
            c.out("N", seq)
        else:
            c.out("A", seq)
            consumer.ack(table)
            c.out("K", seq, time.monotonic_ns())


def role_pool(c: Child) -> None:
    a = c.address()
    consumer = a.consumer("pool", shared=True, lease_ms=LEASE_MS, prefetch=PREFETCH)
    c.out("R")
    idle = 0
    while True:
        before = time.monotonic_ns()
        table = consumer.receive(1, timeout_ms=100)
        if not table.num_rows:
            idle += 1
            if c.finish and idle >= 3:
                state, end = consumer.state(), a.stats()["next_seq"]
                if (state.ack_point == end and not state.leases and not state.pending
                        and state.moving is None):
                    c.out("E", end)
                    return
            continue
        idle = 0
        seq = table.column("_seq")[0].as_py()
        c.out("D", seq, table.column("_delivery_count")[0].as_py(), before)
        pick = c.rng.random()
        try:
            if table.column("k")[0].as_py() == "p" or pick < 0.1:
                consumer.nack(table, delay_ms=c.rng.choice([0, 0, 20]))
                c.out("N", seq)
                continue
            if pick < 0.2:
                consumer.renew(table)
            elif pick < 0.23 and not c.finish:
                time.sleep((LEASE_MS + 30) / 1000)  # past the lease: another may take it
            c.out("A", seq)
            consumer.ack(table)
            c.out("K", seq, time.monotonic_ns())
        except LeaseExpiredError:
            c.out("L", seq)


def role_cleanup(c: Child) -> None:
    a = c.address()
    ret = DurableQueue(c.root).address(RET)
    c.out("R")
    while True:
        c.out("A", "cleanup")
        a.cleanup(dry_run=False)
        c.out("A", "retention")
        ret.cleanup(dry_run=False)
        c.out("C")
        c.out("A", "move_expired")
        report = a.move_expired()
        c.out("M", report.moves, report.moved)
        time.sleep(c.rng.uniform(0.0, 0.05))


def role_compact(c: Child) -> None:
    a = c.address()
    c.out("R")
    while True:
        c.out("A", "compact")
        a.compact()
        c.out("P")
        time.sleep(c.rng.uniform(0.0, 0.05))


def role_ret_send(c: Child) -> None:
    a = DurableQueue(c.root).address(RET)
    c.out("R")
    for n in range(1 << 30):
        rid = f"{c.slot}.{c.run}.{n}"
        c.out("A", rid)
        result = a.send([{"id": rid}])
        c.out("S", rid, result.seq)
        time.sleep(c.rng.uniform(0.01, 0.05))


def role_ret_read(c: Child) -> None:
    a = DurableQueue(c.root).address(RET)
    consumer = a.consumer("rc", wait_ms=120_000)
    c.out("W", consumer.position)
    idle = 0
    while True:
        table = consumer.receive(1, timeout_ms=100)
        if not table.num_rows:
            idle += 1
            if c.finish and idle >= 3:
                consumer.ack(table)  # empty: passes a lost range skipped at the end
                info = a.stats()
                if info["consumers"]["rc"]["position"] == info["next_seq"]:
                    c.out("E", info["next_seq"])
                    return
            continue
        idle = 0
        seq = table.column("_seq")[0].as_py()
        c.out("D", seq, table.column("id")[0].as_py())
        c.out("A", seq)
        consumer.ack(table)
        c.out("K", seq)
        if not c.finish and c.rng.random() < 0.05:
            time.sleep(2 * RET_MS / 1000)  # behind: retention removes rows it has not read


def role_drain(c: Child) -> None:
    """The checkpoint's reader (never killed): releases every schedule, reads the audit
    consumer to the end, moves what expired, reads DLQ and EXP whole, runs ``verify``."""
    from pyspark_durable_queue.cli import main as cli

    q = DurableQueue(c.root)
    a = q.address(ADDRESS)
    while a.scheduled():  # the children are dead: what is scheduled was scheduled already
        time.sleep(max(0.0, min(s["due_ms"] for s in a.scheduled()) / 1000 - time.time()))
        a.release_due(force=True)
    consumer = a.consumer("audit", wait_ms=120_000)
    c.out("W", consumer.position)
    while True:
        table = consumer.receive(500)
        for seq, rid, kind, due, ts in zip(*(table.column(n).to_pylist() for n in (
                "_seq", "id", "k", "due")), table.column("_timestamp").cast("int64").to_pylist(),
                strict=True) if table.num_rows else ():
            c.out("M", seq, rid, kind, due, ts)
        consumer.ack(table)  # an empty table too: it passes expired rows skipped at the end
        if not table.num_rows:
            break
    consumer.close()
    time.sleep(MAX_TTL_MS / 1000 + 0.05)  # every TTL has run out: a pass moves every rest
    a.move_expired()
    result: dict[str, Any] = {"end": a.stats()["next_seq"], "verify": {}}
    for name, cols in ((DLQ, ["origin_consumer", "origin_seq"]), (EXP, ["origin_seq"])):
        rows = []
        for batch, _ in q.address(name).snapshot().messages(0):
            if batch is None:
                continue
            ids = [rid for _, t in dead_letter.messages(batch)
                   for rid in t.column("id").to_pylist()]
            keys = zip(*(batch.column(n).to_pylist() for n in cols), strict=True)
            rows += [[*k, rid] for k, rid in zip(keys, ids, strict=True)]
        result[name] = rows
    ret = q.address(RET)  # what it retains, read without a consumer (which would keep it)
    for batch, _ in ret.snapshot().messages(0, fail_on_data_loss=False):
        if batch is not None:
            for seq, rid in zip(batch.column("_seq").to_pylist(),
                                batch.column("id").to_pylist(), strict=True):
                c.out("T", seq, rid)
    state = ret.log.refresh()
    result[RET] = {"end": state.next_seq, "lost": [list(r) for r in state.retention_lost],
                   "removed": state.retention_removed_messages}
    for name in (ADDRESS, DLQ, EXP, RET):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            rc = cli([c.root, "--json", "verify", name])
        result["verify"][name] = [rc, text.getvalue()]
    (c.folder / f"{c.slot}-{c.run}.json").write_text(json.dumps(result))
    c.out("E")


ROLES: dict[str, Callable[..., None]] = {
    "bs": role_batch, "ss": role_single, "sd": role_scheduled, "tt": role_ttl,
    "ex": role_exclusive, "po": role_pool, "cl": role_cleanup, "cp": role_compact,
    "rs": role_ret_send, "rr": role_ret_read, "dr": role_drain,
}


def guard(c: Child, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` that writes an ``X`` line with its traceback and ends the process when it
    raises (a thread's error must end the child, or the driver would wait forever)."""
    def run(*args: Any) -> None:
        try:
            fn(*args)
        except BaseException:
            c.out("X", traceback.format_exc().replace("\n", " | "))
            os._exit(3)
    return run


def run_of(path: Path) -> int:
    return int(path.stem.rsplit("-", 1)[1])


# -- the driver's side ---------------------------------------------------------------------------
@dataclass
class Proc:
    slot: str
    run: int
    pid: int
    path: Path


@dataclass
class Matrix:
    """One run of the matrix: its store, its children and its counters."""

    root: Path
    seed: int
    sync: bool = True
    rng: random.Random = field(init=False)
    folder: Path = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict)
    runs: Counter[str] = field(default_factory=Counter)
    kills: int = 0
    mid_step: Counter[str] = field(default_factory=Counter)  # kills between an A and its end
    rounds: int = 0
    audits: int = 0
    drains: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.folder = self.root / "history"
        self.folder.mkdir(parents=True)
        self.store = str(self.root / "store")
        q = DurableQueue(self.store)
        # compact_grace_ms 5 s, not 10 minutes: the compaction loop replaces files many times
        # a second, and cleanup's deletion of replaced files is killed too
        a = q.address(ADDRESS, max_delivery_attempts=ATTEMPTS, dead_letter_address=DLQ,
                      expiry_address=EXP, compact_grace_ms=5_000)
        q.address(DLQ)
        q.address(EXP)
        for name in ("ex", "audit"):  # before any send: each reads from the first row
            a.consumer(name, start="earliest").close()
        q.address(RET, journal=False, retention_ms=RET_MS).consumer(
            "rc", start="earliest").close()
        a.consumer("pool", shared=True, start="earliest").close()

    def fork(self, slot: str, *, finish: bool = False) -> Proc:
        run = self.runs[slot]
        self.runs[slot] += 1
        path = self.folder / f"{slot}-{run}.log"
        child_seed = self.rng.randrange(1 << 62)
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller (the test, the CLI)
            code = 0
            try:
                out = Lines(path, self.sync)
                c = Child(self.store, slot, run, out, random.Random(child_seed), self.folder,
                          finish)
                fn = ROLES[slot[:2]]
                guard(c, lambda: fn(c, self.seed) if fn is role_batch else fn(c))()
            except BaseException:
                code = 4
            finally:
                os._exit(code)
        proc = Proc(slot, run, pid, path)
        self.procs[slot] = proc
        return proc

    def kill(self, proc: Proc) -> None:
        """SIGKILL ``proc``; asserts it was still running and that the kill landed."""
        done, status = os.waitpid(proc.pid, os.WNOHANG)
        assert done == 0, (f"{proc.slot} run {proc.run} exited by itself ({status:#x}) before "
                           f"the kill: {tail(proc.path)} (seed {self.seed})")
        os.kill(proc.pid, signal.SIGKILL)
        _, status = os.waitpid(proc.pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
            f"{proc.slot} run {proc.run}: the kill did not land ({status:#x}) (seed {self.seed})"
        self.kills += 1
        lines = read_lines(proc.path)
        if lines and (lines[-1][0] == "A" or lines[-1][0] == "D"):  # D: a consumer's
            self.mid_step[proc.slot[:2]] += 1  # row received, its ack or nack under way
        del self.procs[proc.slot]

    def wait(self, proc: Proc, timeout_s: float) -> None:
        """Wait for an unkilled child to finish; asserts it exited 0."""
        deadline = time.monotonic() + timeout_s
        while True:
            done, status = os.waitpid(proc.pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(proc.pid, signal.SIGKILL)
                os.waitpid(proc.pid, 0)
                raise AssertionError(f"{proc.slot} run {proc.run} did not finish in "
                                     f"{timeout_s} s: {tail(proc.path)} (seed {self.seed})")
            time.sleep(0.02)
        del self.procs[proc.slot]
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
            f"{proc.slot} run {proc.run} failed ({status:#x}): {tail(proc.path)} (seed {self.seed})"

    def round(self, max_wait_s: float) -> None:
        for slot in SLOTS:
            if slot not in self.procs:
                self.fork(slot)
        time.sleep(self.rng.uniform(0.0, max_wait_s))
        running = sorted(self.procs)
        victims = self.rng.sample(running, min(len(running), self.rng.choice([1, 2, 2, 3])))
        for slot in victims:
            self.kill(self.procs[slot])
        self.rounds += 1

    def checkpoint(self, *, final: bool = False) -> list[str]:
        """Kill every child, drain, and audit the whole history so far."""
        for proc in list(self.procs.values()):
            self.kill(proc)
        if final:  # the consumers go on, unkilled, until every row is settled
            self.drain()
            finishing = [self.fork(slot, finish=True) for slot in ("ex0", "po0", "po1",
                                                                   "rr0")]
            limit = 600 + self.lag() / FINISH_ROWS_PER_S
            for proc in finishing:
                self.wait(proc, limit)
        self.drain()
        self.audits += 1
        return audit(self.folder, self.drains, final=final)

    def lag(self) -> int:
        """How many rows the slowest consumer of ``jobs`` is behind its end: what the
        finishing consumers have to go through (a long run under load leaves the exclusive
        consumer tens of thousands behind, which it takes one ``receive(1)`` each)."""
        info = DurableQueue(self.store).address(ADDRESS).stats()
        positions = [c.get("position", info["next_seq"]) for c in info["consumers"].values()]
        return max(0, info["next_seq"] - min(positions, default=info["next_seq"]))

    def drain(self) -> None:
        proc = self.fork("dr0")
        self.wait(proc, 600)
        self.drains.append(self.folder / f"dr0-{proc.run}.json")

    def stop(self) -> None:
        for proc in list(self.procs.values()):
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(proc.pid, signal.SIGKILL)
                os.waitpid(proc.pid, 0)
        self.procs.clear()


def tail(path: Path) -> str:
    lines = read_lines(path)
    errors = [" ".join(line) for line in lines if line[0] == "X"]
    return errors[-1][-3000:] if errors else " / ".join(" ".join(x) for x in lines[-3:])


# -- the audit -----------------------------------------------------------------------------------
def audit(folder: Path, drains: list[Path], *, final: bool) -> list[str]:
    """Every problem the history in ``folder`` shows (empty: none); see the module docstring.
    ``final``: the consumers ran to the end, so every row must be settled by each."""
    problems: list[str] = []
    runs: dict[str, list[tuple[int, list[list[str]]]]] = defaultdict(list)
    for path in folder.glob("*.log"):
        runs[path.stem.rsplit("-", 1)[0]].append((run_of(path), read_lines(path)))
    for slot in runs:
        runs[slot].sort()
    for slot, rs in runs.items():
        for run, lines in rs:
            problems += [f"{slot} run {run} failed: {' '.join(x)[:3000]}"
                         for x in lines if x[0] == "X"]

    # what the audit consumer read, each drain resuming at its watermark
    stored: dict[str, int] = {}  # id -> _seq
    rows: dict[int, tuple[str, str, int, int]] = {}  # _seq -> id, kind, due, timestamp us
    previous_end = 0
    for (run, lines), drain in zip(runs["dr0"], drains, strict=False):
        for line in lines:
            if line[0] == "W" and int(line[1]) != previous_end:
                problems.append(f"drain {run}: the audit consumer resumed at {line[1]}, its "
                                f"watermark was {previous_end}")
            elif line[0] == "M":
                seq, rid = int(line[1]), line[2]
                if seq in rows:
                    problems.append(f"_seq {seq} read twice by the audit consumer")
                if rid in stored:
                    problems.append(f"{rid} stored twice (_seq {stored[rid]} and {seq})")
                rows[seq] = (rid, line[3], int(line[4]), int(line[5]))
                stored[rid] = seq
        if drain.exists():
            previous_end = json.loads(drain.read_text())["end"]
    if not drains:
        return problems
    last = json.loads(drains[-1].read_text())
    end = last["end"]
    for name, (rc, text) in last["verify"].items():
        if rc != 0:
            problems.append(f"verify {name} failed ({rc}): {text[:2000]}")
    expired = Counter(seq for seq, _ in last[EXP])
    problems += [f"_seq {s} expired {n} times" for s, n in expired.items() if n > 1]
    for seq, rid in last[EXP]:
        if seq in rows and rows[seq][0] != rid:
            problems.append(f"EXP _seq {seq} holds {rid}, the address held {rows[seq][0]}")
        stored.setdefault(rid, seq)
    dense = set(rows) | set(expired)
    if dense != set(range(end)):
        missing = sorted(set(range(end)) - dense)
        problems.append(f"_seq not dense below {end}: missing {missing[:20]}, extra "
                        f"{sorted(dense - set(range(end)))[:20]}")
    ttl = {seq for seq, row in rows.items() if row[1] == "t"} | set(expired)

    # the senders: every returned send stored once, killed ones at most once, batches whole
    attempted: set[str] = set()
    for slot in ("ss0", "tt0", "sd0"):
        for run, lines in runs[slot]:
            for line in lines:
                if line[0] == "A":
                    attempted.add(line[1])
                elif line[0] == "S":
                    rid = line[1]
                    if rid not in stored:
                        problems.append(f"{rid}: its send returned ({slot} run {run}) but it "
                                        "is not stored")
                    elif slot != "sd0" and int(line[2]) != stored[rid]:
                        problems.append(f"{rid}: sent as _seq {line[2]}, stored as "
                                        f"{stored[rid]}")
                    elif slot != "tt0" and stored[rid] not in rows:
                        problems.append(f"{rid} never expires but is in EXP")
    for slot in ("bs0", "bs1"):
        batches: dict[int, tuple[int, bool]] = {}  # version -> rows, returned
        for _, lines in runs[slot]:
            for line in lines:
                if line[0] == "A":
                    v = int(line[1])
                    batches[v] = (int(line[2]), batches.get(v, (0, False))[1])
                elif line[0] == "S":
                    v = int(line[1])
                    batches[v] = (batches[v][0], True)
                    if not int(line[4]) and int(line[3]) != batches[v][0]:
                        problems.append(f"{slot} batch {v}: {line[3]} rows appended of "
                                        f"{batches[v][0]}")
        for v, (n, returned) in batches.items():
            ids = [f"{slot}.{v}.{i}" for i in range(n)]
            attempted.update(ids)
            seqs = [stored[i] for i in ids if i in stored]
            if (returned or seqs) and len(seqs) != n:
                problems.append(f"{slot} batch {v} (returned: {returned}) torn: {len(seqs)} "
                                f"of {n} rows stored")
            elif seqs and seqs != list(range(seqs[0], seqs[0] + n)):
                problems.append(f"{slot} batch {v} not one commit: _seq {seqs}")
    problems += [f"{rid} (_seq {seq}) stored but never sent" for rid, seq in stored.items()
                 if rid not in attempted]
    for rid, kind, due, ts in rows.values():
        if kind == "d" and ts < due * 1000:
            problems.append(f"scheduled {rid} delivered early: _timestamp {ts} us, due {due} ms")

    # dead letters: once per consumer and row, never a row its consumer acknowledged
    dead = Counter((consumer, seq) for consumer, seq, _ in last[DLQ])
    problems += [f"{k} dead-lettered {n} times" for k, n in dead.items() if n > 1]
    for consumer, seq, rid in last[DLQ]:  # a TTL row may have expired for the audit reader
        if stored.get(rid) != seq:  # after a consumer took it: then it is in EXP
            problems.append(f"DLQ {consumer} _seq {seq} holds {rid}, stored as _seq "
                            f"{stored.get(rid)}")

    # the consumers
    for name, slots in (("ex", ["ex0"]), ("pool", ["po0", "po1"])):
        all_runs = [(slot, run, lines) for slot in slots for run, lines in runs[slot]]
        acked: dict[int, int] = {}
        delivered: dict[int, list[int]] = defaultdict(list)
        unprinted: set[int] = set()
        for slot, run, lines in all_runs:
            watermark = None
            for line in lines:
                if line[0] == "W":
                    watermark = int(line[1])
                elif line[0] == "D":
                    seq, count = int(line[1]), int(line[2])
                    delivered[seq].append(int(line[3]))
                    if count > ATTEMPTS:
                        problems.append(f"{name}: _seq {seq} delivered {count} times")
                    if watermark is not None and seq < watermark:
                        problems.append(f"{name} ({slot} run {run}) resumed at watermark "
                                        f"{watermark} and then delivered _seq {seq}")
                elif line[0] == "K":
                    seq = int(line[1])
                    if seq in acked:
                        problems.append(f"{name}: _seq {seq} acknowledged twice")
                    acked[seq] = int(line[2])
            if lines and lines[-1][0] == "A":
                unprinted.add(int(lines[-1][1]))
        for seq, at in acked.items():
            if any(t > at for t in delivered[seq]):
                problems.append(f"{name}: _seq {seq} delivered again after its ack returned")
        mine = {seq for consumer, seq, _ in last[DLQ] if consumer == name}
        problems += [f"{name}: _seq {s} acknowledged and dead-lettered"
                     for s in sorted(mine & set(acked))]
        if final:
            settled = set(acked) | mine | ttl | unprinted
            lost = sorted(set(range(end)) - settled)
            if lost:
                problems.append(f"{name}: never settled: {lost[:20]}")
            if name == "ex":
                for slot, run, lines in all_runs:
                    marks = [int(x[1]) for x in lines if x[0] == "W"]
                    gap = sorted(s for s in range(marks[0] if marks else 0) if s not in settled)
                    if gap:
                        problems.append(f"ex {slot} run {run} resumed at {marks[0]} past "
                                        f"unsettled _seq {gap[:20]}")
            finished = [x for _, _, lines in all_runs for x in lines if x[0] == "E"]
            if not finished or any(int(x[1]) != end for x in finished):
                problems.append(f"{name}: did not end at {end}: {finished}")
    return problems + audit_retention(runs, drains, final=final)


def audit_retention(runs: dict[str, list[tuple[int, list[list[str]]]]], drains: list[Path], *,
                    final: bool) -> list[str]:
    """The problems of address ``RET``'s history (the rules: the module's docstring)."""
    problems: list[str] = []
    lost: set[int] = set()
    read: dict[int, str] = {}  # _seq -> id: what the drains found retained, what rc got
    for (run, lines), drain in zip(runs["dr0"], drains, strict=False):
        for line in lines:
            if line[0] == "T":
                if read.setdefault(int(line[1]), line[2]) != line[2]:
                    problems.append(f"RET _seq {line[1]} held {read[int(line[1])]}, then "
                                    f"{line[2]} (drain {run})")
        if drain.exists():
            for lo, hi in json.loads(drain.read_text())[RET]["lost"]:
                lost.update(range(lo, hi))
    if not drains or not drains[-1].exists():
        return problems
    end = json.loads(drains[-1].read_text())[RET]["end"]
    for _, lines in runs["rr0"]:
        for line in lines:
            if line[0] == "D" and read.setdefault(int(line[1]), line[2]) != line[2]:
                problems.append(f"rc: _seq {line[1]} delivered as {line[2]}, it holds "
                                f"{read[int(line[1])]}")
    vanished = sorted(set(range(end)) - set(read) - lost)
    if vanished:
        problems.append(f"RET: _seq neither read nor removed by retention: {vanished[:20]}")
    where: dict[str, int] = {}
    for seq, rid in read.items():
        if rid in where:
            problems.append(f"RET: {rid} stored twice (_seq {where[rid]} and {seq})")
        where[rid] = seq
    attempted: set[str] = set()
    for _, lines in runs["rs0"]:
        for line in lines:
            if line[0] == "A":
                attempted.add(line[1])
            elif line[0] == "S":
                rid, seq = line[1], int(line[2])
                if seq in read and read[seq] != rid:
                    problems.append(f"RET: {rid} sent as _seq {seq}, which holds {read[seq]}")
                elif seq not in read and seq not in lost:
                    problems.append(f"RET: {rid} (_seq {seq}) returned but is neither read nor "
                                    "removed by retention")
    problems += [f"RET: {rid} stored but never sent" for rid in where if rid not in attempted]
    acked: set[int] = set()
    in_hand: set[int] = set()  # rows delivered whose K line never came (a kill in the ack)
    for run, lines in runs["rr0"]:
        for line in lines:
            if line[0] == "W":
                mark = int(line[1])
                top = max(acked, default=-1)
                if mark <= top:
                    problems.append(f"rc run {run} resumed at {mark}, below its ack of {top}")
                skipped = [s for s in range(top + 1, mark)
                           if s not in lost and s not in acked and s not in in_hand]
                if skipped:
                    problems.append(f"rc run {run} resumed at {mark} past unread rows "
                                    f"retention did not remove: {skipped[:20]}")
            elif line[0] == "D":
                seq, rid = int(line[1]), line[2]
                in_hand.add(seq)
                if seq in acked:
                    problems.append(f"rc: _seq {seq} delivered again after its ack returned")
                if rid not in attempted:
                    problems.append(f"rc: _seq {seq} delivered as {rid}, never sent")
            elif line[0] == "K":
                if int(line[1]) in acked:
                    problems.append(f"rc: _seq {line[1]} acknowledged twice")
                acked.add(int(line[1]))
                in_hand.discard(int(line[1]))
    if final:
        unsettled = sorted(set(range(end)) - acked - lost - in_hand)
        if unsettled:
            problems.append(f"rc: neither acknowledged nor removed by retention: "
                            f"{unsettled[:20]}")
        finished = [x for _, lines in runs["rr0"] for x in lines if x[0] == "E"]
        if not finished or any(int(x[1]) != end for x in finished):
            problems.append(f"rc: did not end at {end}: {finished}")
    return problems


def run(kills: int, seed: int, root: Path, *, check_every: int = 50, max_wait_s: float = 0.8,
        sync: bool = True, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the matrix until ``kills`` proven kills; audit every ``check_every`` kills and at
    the end. Raises ``AssertionError`` naming the seed on the first audit with problems;
    returns the counters."""
    started = time.monotonic()
    m = Matrix(root, seed, sync)
    say(f"kill matrix: DQ_CRASH_SEED={seed}, {kills} kills, audit every {check_every}")
    try:
        next_check = check_every
        while m.kills < kills:
            m.round(max_wait_s)
            if m.kills >= next_check and m.kills < kills:
                problems = m.checkpoint()
                assert not problems, report(problems, seed, m)
                next_check = m.kills + check_every
                say(f"  {m.kills} kills, {m.rounds} rounds, {m.audits} audits, "
                    f"{time.monotonic() - started:.0f} s")
        say(f"  {m.kills} kills, {m.rounds} rounds, {time.monotonic() - started:.0f} s: "
            "the last audit (the consumers run to the end first)")
        problems = m.checkpoint(final=True)
        assert not problems, report(problems, seed, m)
    finally:
        m.stop()
    last = json.loads(m.drains[-1].read_text())
    figures = {"seed": seed, "kills": m.kills, "rounds": m.rounds, "audits": m.audits,
               "seconds": round(time.monotonic() - started, 1), "messages": last["end"],
               "dead_letters": len(last[DLQ]), "expired": len(last[EXP]),
               "retention_messages": last[RET]["end"], "retention_removed": last[RET]["removed"],
               "retention_unread": sum(hi - lo for lo, hi in last[RET]["lost"]),
               "runs": sum(m.runs.values()), "mid_step_kills": sum(m.mid_step.values()),
               "mid_step_by_role": dict(sorted(m.mid_step.items()))}
    say("kill matrix: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    return figures


def report(problems: list[str], seed: int, m: Matrix) -> str:
    return (f"kill matrix (DQ_CRASH_SEED={seed}) after {m.kills} kills, {m.rounds} rounds: "
            f"{len(problems)} problems; history in {m.folder}:\n  " + "\n  ".join(problems[:30]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=int(os.environ.get("DQ_CRASH_SEED", time.time())))
    p.add_argument("--check-every", type=int, default=500)
    p.add_argument("--max-wait", type=float, default=0.8,
                   help="a round waits up to this many seconds before its kills")
    p.add_argument("--root", default=None, help="keep the store and history here")
    p.add_argument("--no-sync", action="store_true", help="do not fsync the audit files")
    args = p.parse_args(argv)
    root = Path(args.root or tempfile.mkdtemp(prefix="dq-kill-matrix-"))
    if args.root:
        root.mkdir(parents=True, exist_ok=False)
    try:
        run(args.kills, args.seed, root, check_every=args.check_every, max_wait_s=args.max_wait,
            sync=not args.no_sync,
            say=lambda s: print(s, flush=True))
    except AssertionError as exc:
        print(exc, file=sys.stderr)
        print(f"the store and history are kept in {root}", file=sys.stderr)
        return 1
    if not args.root:
        shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
