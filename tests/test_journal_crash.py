"""The journal (on-disk format 4) after crashes: writers SIGKILLed at random moments and inside a
journal append, and torn tails left in a segment, which the next writer must write over.

SIGKILL: four children (``_procs/journal_child.py send``) of two threads each send single
messages to one address with 4 KiB pages (a segment rolls every few units; every 25th message
of a thread is a large one, whose frames are a write of their own), reporting every send that
returned. The parent kills them at random moments, or first stops one of them inside
``Journal.append`` with the publish lock held (after a roll mark, before a segment's header,
half-way through a unit...) so that the kill lands where a random one rarely does (on Linux,
``/proc/locks`` proves that the stopped child holds ``log/_publish.lock`` and that another
child waits for it, its sends queued, when the kill lands), or inside the sync of its unit,
which runs after the lock was let go (the others' sends are acknowledged past its unit and
``/proc/locks`` shows it does not hold the lock when the kill lands), audits the address, and
starts them again. The audit reads everything through a fresh handle and, apart from the package,
follows the journal's files as the format describes them (``journal_child.walk``): every
send that returned present once at its ``_seq``, ``_seq`` dense, each message whole, each
thread's messages in its order and none it did not send.

Meanwhile a reader in another process (``journal_child.py watch``) follows the address through
every crash: at the end it must have received exactly what the address holds, in order (it
never got a unit that a later writer wrote over). The writers checkpoint the log every 50
commits instead of every 1,000, so that kills land around checkpoints and every audit opens
the log from one. Run with ``fsync=always`` (6 kill cycles, ~12 s) and ``never`` (3 cycles).

``DQ_CRASH_CYCLES=40`` runs a longer one (~2 minutes); ``DQ_CRASH_SEED`` repeats a run's kill
times and stalls.

Torn tails: an address is filled by a child process that then exits (the writer that "crashed");
the test writes over the end of its journal what a writer killed in the middle of a write leaves
(half a unit, a segment without its header or with half its first unit), opens a fresh handle,
and checks that nothing of it is delivered and that new sends write over it. And what no crash
leaves (a unit with a flipped byte, random bytes, a unit head before random bytes, a unit
that does not chain to the one before it): damage, which readers report and writers do not
write over (the torn-tail rule, ``_format/unit.py``; ``test_journal_damage.py`` sweeps it).
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
import uuid
from pathlib import Path

import pytest
from crc32c import crc32c

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue.errors import DamagedLogError

_procs = Path(__file__).parent / "_procs"
_spec = importlib.util.spec_from_file_location("dq_journal_child", _procs / "journal_child.py")
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

REPO = str(Path(__file__).resolve().parent.parent)
NAME = "journaled"
PROCS = 4
THREADS = 2
PAGE = 4096
CYCLES = int(os.environ.get("DQ_CRASH_CYCLES", 6))
STALLS = ["roll", "segment", "header", "unit", "frames", "sync"]
#: The writers checkpoint this often (1,000 in the package): kills land around checkpoints too.
CHECKPOINT_EVERY = 50


def child_env(**extra: str) -> dict:
    """The children import this checkout's package (``PYTHONPATH``), whatever is installed."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return env


# -- the writers' reports --------------------------------------------------------------------------

def parse(out: Path) -> dict:
    """What a writer reported before it died (complete lines only)."""
    text = out.read_text() if out.exists() else ""
    sent: dict[tuple[int, int], int] = {}
    report: dict = {"sent": sent, "ready": False, "stalled": None, "errors": []}
    for line in text.split("\n")[:-1]:
        parts = line.split()
        if parts[0] == "sent":
            writer, k, seq = map(int, parts[1:])
            sent[(writer, k)] = seq
        elif parts[0] == "ready":
            report["ready"] = True
        elif parts[0] == "stalled":
            report["stalled"] = (parts[1], parts[2], int(parts[3]))
        elif parts[0] not in ("got", "done"):  # the watcher's
            report["errors"].append(line)
    return report


def wait_for(out: Path, proc: subprocess.Popen, until, what: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        report = parse(out)
        assert not report["errors"], (out.name, report["errors"])
        if until(report):
            return report
        assert proc.poll() is None, (f"{out.name} exited ({proc.returncode}) before {what}: "
                                     f"{out.with_suffix('.err').read_text()[-2000:]}")
        assert time.monotonic() < deadline, f"{out.name}: no {what} in {timeout} s"
        time.sleep(0.005)


def start_writer(tmp_path: Path, root: str, run: int, seed: int, stall: str | None,
                 fsync: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"run-{run}.out"
    env = child_env(DQ_JOURNAL_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY), DQ_JOURNAL_FSYNC=fsync,
                    **({"DQ_JOURNAL_STALL": stall} if stall else {}))
    args = [sys.executable, str(_procs / "journal_child.py"), "send", root, NAME, str(run),
            str(seed), str(THREADS)]
    with open(out, "w") as f, open(out.with_suffix(".err"), "w") as err:
        return subprocess.Popen(args, stdout=f, stderr=err, env=env), out


def publish_lock(root: str) -> tuple[set[int], set[int]]:
    """The pids holding ``log/_publish.lock``'s ``flock`` and those waiting for it, from
    ``/proc/locks`` (Linux; empty sets elsewhere)."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return set(), set()
    inode = os.stat(Path(root, NAME, "log", "_publish.lock")).st_ino
    holding: set[int] = set()
    waiting: set[int] = set()
    for line in text.splitlines():
        fields = line.split()
        blocked = len(fields) > 1 and fields[1] == "->"
        if blocked:
            del fields[1]
        if len(fields) < 6 or fields[1] != "FLOCK" or int(fields[5].rsplit(":", 1)[1]) != inode:
            continue
        (waiting if blocked else holding).add(int(fields[4]))
    return holding, waiting


def wait_queued(root: str, holder: subprocess.Popen, others: list[subprocess.Popen],
                timeout: float = 60) -> bool:
    """Wait until ``holder`` holds the publish lock and one of ``others`` waits for it; whether
    ``/proc/locks`` showed that (``False`` where there is no ``/proc/locks``)."""
    if not Path("/proc/locks").exists():
        return False
    pids = {p.pid for p in others}
    deadline = time.monotonic() + timeout
    while True:
        holding, waiting = publish_lock(root)
        if holding == {holder.pid} and waiting & pids:
            return True
        assert holding <= {holder.pid}, f"the lock is held by {holding}, not the stalled writer"
        assert time.monotonic() < deadline, (f"no writer queued behind the stalled one in "
                                             f"{timeout} s: holding {holding}, waiting {waiting}")
        time.sleep(0.005)


def kill(proc: subprocess.Popen, out: Path) -> None:
    """SIGKILL a child that is still running (it did not die on its own), and prove it died
    of the kill."""
    assert proc.poll() is None, (out.name, proc.returncode,
                                 out.with_suffix(".err").read_text()[-2000:])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (out.name, proc.returncode)


# -- the audit -------------------------------------------------------------------------------------

def read_all(root: str) -> list[dict]:
    """Every message, through a fresh handle and a new consumer."""
    a = DurableQueue(root).address(NAME)
    c = a.consumer(f"audit-{uuid.uuid4().hex[:8]}", start="earliest")
    rows: list[dict] = []
    try:
        while True:
            t = c.receive(max_messages=10 ** 7, max_bytes=1 << 40)
            if not t.num_rows:
                break
            rows.extend(t.drop_columns(["_timestamp", "_delivery_count"]).to_pylist())
    finally:
        c.delete()
    return rows


def audit(root: str, sent: dict[tuple[int, int], int]) -> dict:
    """Check what the address holds against what the writers reported; return the walk.

    ``sent`` must be read after the store (a send reported later may be in the store and not
    in ``sent``, never the other way round)."""
    rows = read_all(root)
    walked = child.walk(Path(root, NAME, "pages"))
    state = DurableQueue(root).address(NAME).state
    # the package's reader and the independent walk agree, on the messages and the commits
    assert [r["_seq"] for r in rows] == list(range(len(rows))), "_seq not dense from 0"
    assert rows == walked["messages"]
    assert state.next_seq == len(rows)
    assert state.version == len(walked["units"])
    present: dict[tuple[int, int], int] = {}
    by_writer: dict[int, list[int]] = {}
    for r in rows:
        key = (r["w"], r["k"])
        assert key not in present, f"message {key} at _seq {present[key]} and {r['_seq']}"
        present[key] = r["_seq"]
        assert r["pad"] == child.crash_pad(*key), f"message {key} is not whole"
        by_writer.setdefault(r["w"], []).append(r["k"])
    for key, seq in sent.items():
        assert key in present, f"acknowledged send {key} (_seq {seq}) lost"
        assert present[key] == seq, f"send {key} at {present[key]}, reported {seq}"
    last_acked: dict[int, int] = {}
    for writer, k in sent:
        last_acked[writer] = max(last_acked.get(writer, 0), k)
    for writer, ks in by_writer.items():
        # a thread sends k + 1 only after send k returned: its messages are 1..K in its order,
        # and at most the one send in flight when it was killed is there unacknowledged
        assert ks == list(range(1, len(ks) + 1)), f"writer {writer}: {ks[:20]}..."
        assert len(ks) - last_acked.get(writer, 0) in (0, 1), (writer, len(ks), last_acked)
    return walked


# -- SIGKILL ---------------------------------------------------------------------------------------

def check_stalled(root: str, kind: str, where: tuple[str, str, int]) -> int:
    """While a writer is stopped inside an append: the journal's end is what ``kind`` leaves,
    and a fresh handle sees the same messages as the walk (none past the last whole unit).
    Stopped in its sync (``sync``, the others append meanwhile): its unit is whole in the
    journal. Returns the number of messages there."""
    if kind == "sync":
        path = Path(where[1])
        for _ in range(100):  # the walk stops at a unit being written right now
            walked = child.walk(Path(root, NAME, "pages"), rows=False)
            ends = {(u["segment"], u["end"]) for u in walked["units"]}
            if (int(path.name[:-4]), where[2]) in ends:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the unit whose sync stalled is not whole at {where}: the "
                                 f"walk stops at {walked['stop']}, after "
                                 f"{walked['units'][-2:]}")
        return DurableQueue(root).address(NAME).state.next_seq
    walked = child.walk(Path(root, NAME, "pages"), rows=False)
    stop = walked["stop"]
    # the journal may be empty: the stalled unit is the very first one
    last = walked["units"][-1] if walked["units"] else {"segment": 0, "version": 0}
    path = Path(where[1])
    if kind == "roll":  # a roll mark (the walk went on to the next segment), nothing after it
        assert stop["segment"] == last["segment"] + 1 == int(path.name[:-4]) + 1, (stop, where)
        # usually no next segment yet; one a torn roll left earlier is not started again yet
        assert stop["reason"] in ("no segment", "bad header", "no unit"), stop
    elif kind == "segment":  # the next segment exists, without its new header
        assert stop["segment"] == last["segment"] + 1 == int(path.name[:-4]), (stop, where)
        assert where[2] == 0 and path.exists()
        # blank, unless a torn roll left a file there earlier (its stale units do not chain)
        assert stop["reason"] in ("bad header", "no unit"), stop
    elif kind == "header":  # a header and no unit after it
        assert stop["reason"] in ("no unit", "end of file"), stop
        assert stop["segment"] == last["segment"] + 1 and stop["at"] == child.SEGMENT_HEAD.size
    elif kind in ("unit", "frames"):  # part of a unit where the next one goes
        assert stop["reason"] in ("no unit", "end of file"), stop
        assert (stop["segment"], stop["at"]) == (int(path.name[:-4]), where[2]), (stop, where)
        assert any(stop["bytes"]), "nothing of the unit was written"
        if kind == "frames":
            magic, _crc, version, _prev, _e, frames_len = child.UNIT_HEAD.unpack_from(
                stop["bytes"])
            assert magic in child.UNIT_MAGICS and version == last["version"] + 1
            assert frames_len >= 1 << 16
    state = DurableQueue(root).address(NAME).state
    assert state.version == len(walked["units"]), (state.version, len(walked["units"]))
    return state.next_seq


def wait_unlocked(root: str, holder: subprocess.Popen, procs: list, stalled: int,
                  before: int) -> bool:
    """While ``holder`` is stopped in the sync of its unit: the others' sends are acknowledged
    at ``_seq`` past that unit's (``before``: the next ``_seq`` after it), and ``holder`` does
    not hold the publish lock (``/proc/locks``; whether it could tell)."""
    for proc, out in procs[:stalled] + procs[stalled + 1:]:
        wait_for(out, proc, lambda r: any(s >= before for s in r["sent"].values()),
                 f"a send past the unit whose sync stalled (_seq {before})")
    if not Path("/proc/locks").exists():
        return False
    for _ in range(20):
        holding, _waiting = publish_lock(root)
        assert holder.pid not in holding, "the stalled sync holds the publish lock"
        time.sleep(0.005)
    return True


def kill_cycle(tmp_path: Path, root: str, rng: random.Random, cycle: int,
               stall: str | None, fsync: str) -> tuple[dict, dict]:
    """Start PROCS writers (one of them stopping inside an append when ``stall``), kill them
    all; return what they reported and what happened."""
    stalled = rng.randrange(PROCS) if stall else -1
    spec = None
    if stall:
        spec = f"{stall}:{0 if stall == 'frames' else rng.randint(0, 3)}"
    procs = [start_writer(tmp_path, root, cycle * PROCS + i, rng.randrange(1 << 30),
                          spec if i == stalled else None, fsync) for i in range(PROCS)]
    events: dict = {}
    try:
        for proc, out in procs:
            wait_for(out, proc, lambda r: r["ready"], "ready")
        if stall:
            proc, out = procs[stalled]
            report = wait_for(out, proc, lambda r: r["stalled"] is not None, f"stall in {stall}")
            time.sleep(rng.uniform(0, 0.2))  # the other writers queue up behind its lock
            before = check_stalled(root, stall, report["stalled"])
            events["stalled"] = (stall, report["stalled"][2], before)
            others = [p for p, _o in procs[:stalled] + procs[stalled + 1:]]
            if stall == "sync":
                # proven: its sync runs without the publish lock, and the others' sends are
                # acknowledged past its unit (whose send never returns) before it dies
                events["queued"] = wait_unlocked(root, proc, procs, stalled, before)
            else:
                # proven: it holds the publish lock and others' sends wait for it as it dies
                events["queued"] = wait_queued(root, proc, others)
            kill(proc, out)
            # the others write over what it left: their sends go on past it
            for proc, out in procs[:stalled] + procs[stalled + 1:]:
                wait_for(out, proc, lambda r: any(s >= before for s in r["sent"].values()),
                         f"a send past the stalled writer's tail (_seq {before})")
        else:
            for proc, out in procs:
                wait_for(out, proc, lambda r: len(r["sent"]) >= 2 * THREADS, "a few sends")
        time.sleep(rng.uniform(0, 0.5))
        for proc, out in rng.sample(procs, len(procs)):
            if proc.returncode is None:
                kill(proc, out)
                time.sleep(rng.uniform(0, 0.03))
    finally:  # a failed check leaves no writer running on
        for proc, _out in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    sent: dict = {}
    for _proc, out in procs:
        report = parse(out)
        assert not report["errors"], (out.name, report["errors"])
        sent.update(report["sent"])
    return sent, events


@pytest.mark.crash
@pytest.mark.parametrize("fsync", ["always", "never"])
def test_every_acknowledged_send_survives_sigkill_in_the_journal_once_and_whole(tmp_path, fsync):
    """``fsync=never`` changes nothing a SIGKILL can see (the page cache survives it); its
    kills land elsewhere (no time spent in ``fdatasync``)."""
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address(NAME, journal=True, page_size_bytes=PAGE)
    assert a.format.journal
    a.consumer("holder")  # never acknowledges: every segment stays for the audit
    seed = int(os.environ.get("DQ_CRASH_SEED", time.time()))
    print(f"DQ_CRASH_SEED={seed}")
    rng = random.Random(seed)
    # the kinds of stall first (every kind with fsync=always), then random kills or stalls
    first = STALLS if fsync == "always" else ["unit", None, "roll"]
    cycles = CYCLES if fsync == "always" else max(3, CYCLES // 2)
    kinds = STALLS if fsync == "always" else [k for k in STALLS if k != "sync"]  # no sync
    plan = [first[c] if c < len(first) else rng.choice([None, None, *kinds])
            for c in range(cycles)]
    # a reader in another process follows the address through all the crashes
    stop = tmp_path / "watcher.stop"
    watcher, watched = tmp_path / "watcher.out", []
    with open(watcher, "w") as f, open(watcher.with_suffix(".err"), "w") as err:
        watch = subprocess.Popen([sys.executable, str(_procs / "journal_child.py"), "watch",
                                  root, NAME, str(stop)], stdout=f, stderr=err, env=child_env())
    sent: dict = {}
    tails = []
    queued = 0
    try:
        wait_for(watcher, watch, lambda r: r["ready"], "ready")
        for cycle, stall in enumerate(plan):
            new, events = kill_cycle(tmp_path, root, rng, cycle, stall, fsync)
            sent.update(new)
            try:
                walked = audit(root, sent)
            except AssertionError as exc:
                raise AssertionError(f"seed {seed}, after cycle {cycle} ({stall}): {exc}") \
                    from exc
            watched.append(watcher.read_text().count("\ngot "))
            tails.append((stall, walked["stop"]["reason"], events.get("stalled")))
            queued += bool(events.get("queued"))
        assert watch.poll() is None, watcher.with_suffix(".err").read_text()[-3000:]
    except BaseException:
        watch.kill()
        raise
    print("tails after each cycle:", tails)
    print(f"{len(sent)} sends acknowledged, {len(walked['units'])} commits, "
          f"{len(walked['segments'])} segments; the watcher had {watched} after each cycle")
    assert len(sent) >= 20 * cycles, "the writers hardly ran"
    if Path("/proc/locks").exists():  # every stalled writer died holding the lock, others queued
        assert queued == sum(stall is not None for stall in plan), (queued, plan)
    # the scenario happened: segments rolled many times, large units were written, the log
    # was checkpointed, the watcher read along
    assert len({u["segment"] for u in walked["units"]}) >= 20, walked["segments"][-1]
    assert any(len(r) > child.BIG for r in (child.crash_pad(w, k) for w, k in sent))
    assert list(Path(root, NAME, "log").glob("*.checkpoint.arrow"))
    assert sum(b > a for a, b in zip([0, *watched], watched, strict=False)) >= cycles // 2

    # new sends after the crashes work, from a fresh handle, and are read after the old ones
    a = DurableQueue(root).address(NAME)
    first = a.state.next_seq
    writer = 10 ** 6
    for k in range(1, 31):
        r = a.send([child.crash_row(writer, k)])
        sent[(writer, k)] = r.seq
    r = a.send([child.crash_row(writer + 1, k) for k in range(1, 11)])
    sent.update({(writer + 1, k): r.seq + k - 1 for k in range(1, 11)})
    assert sorted(sent[(writer, k)] for k in range(1, 31)) == list(range(first, first + 30))
    walked = audit(root, sent)
    assert walked["messages"][-1]["_seq"] == first + 39
    # verify finds every published range whole (what the killed writers left is no range)
    report = DurableQueue(root).address(NAME).repair(dry_run=True)
    assert report.clean and report.pages_checked, report
    # the watcher got every message once, in order, and never one that was not kept
    stop.touch()
    watch.wait(timeout=120)
    got = [line.split() for line in watcher.read_text().splitlines()]
    assert watch.returncode == 0 and got[-1][0] == "done", (got[-3:], watch.returncode)
    assert [(int(s), int(w), int(k)) for _, s, w, k in got[1:-1]] == [
        (m["_seq"], m["w"], m["k"]) for m in walked["messages"]]


# -- torn tails ------------------------------------------------------------------------------------

SMALL = 50
#: Addresses filled by one child process, then torn by the tests.
FILLS = {
    # 12 units, room after them for garbage (and for new units before the garbage ends)
    "garbage": {"settings": {"page_size_bytes": 65536}, "sends": [[SMALL]] * 12},
    # unit 11 is long, unit 12 after it short: tearing 11 leaves a valid 12 behind it
    "stale-short": {"settings": {"page_size_bytes": 65536},
                    "sends": [[SMALL]] * 10 + [[1500], [SMALL]]},
    # units 11 and 12 of the same size: a new unit 11 ends exactly where the old 12 starts
    "stale-same": {"settings": {"page_size_bytes": 65536}, "sends": [[SMALL]] * 12},
    # the last unit is the first of segment 2 (it did not fit after the four small ones, a
    # small one would have)
    "rolled": {"settings": {"page_size_bytes": PAGE}, "sends": [[SMALL]] * 4 + [[3000]]},
}
#: what a crash leaves after the last unit: a torn tail
GARBAGE = ["unit-half-written", "unit-cut-in-its-head"]
#: what no crash leaves there: damage
DAMAGE = ["unit-one-byte-flipped", "random-bytes", "unit-head-random-body"]
ROLLED = ["first-unit-torn-small-next", "first-unit-torn-large-next", "header-half-written",
          "segment-empty"]


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> str:
    """A root with a copy of each ``FILLS`` address per test that tears it, written by a
    child process that has exited (the writer is gone, as after a crash)."""
    root = str(tmp_path_factory.mktemp("torn") / "dq")
    spec = {}
    for kind, names in (("garbage", GARBAGE + DAMAGE), ("stale-short", ["x"]),
                        ("stale-same", ["x"]),
                        ("rolled", ROLLED)):
        for name in names:
            fill = FILLS[kind]
            spec[f"{kind}--{name}"] = {"settings": {"journal": True, **fill["settings"]},
                                       "sends": fill["sends"]}
    proc = subprocess.run([sys.executable, str(_procs / "journal_child.py"), "fill", root,
                           json.dumps(spec)], env=child_env(), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return root


def pages(root: str, name: str) -> Path:
    return Path(root, name, "pages")


def fresh_messages(root: str, name: str) -> list[dict]:
    """Every message through a fresh handle and a new consumer (user columns and ``_seq``)."""
    c = DurableQueue(root).address(name).consumer(f"r-{uuid.uuid4().hex[:8]}")
    try:
        t = c.receive(max_messages=10 ** 6, max_bytes=1 << 40)
        assert not c.receive(max_messages=10 ** 6).num_rows
    finally:
        c.delete()
    return t.drop_columns(["_timestamp", "_delivery_count"]).to_pylist()


def expected(sends: list[list[int]]) -> list[dict]:
    rows = []
    for pads in sends:
        for pad in pads:
            rows.append({**child.fill_row(len(rows), pad), "_seq": len(rows)})
    return rows


def new_row(i: int, pad: int = SMALL) -> dict:
    """A message sent after the crash, told apart from the filled ones by its id."""
    return {"i": 1000 + i, "pad": child._chars(f"new{i}", pad)}


def patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def forge_next(unit: dict, data: bytes) -> bytes:
    """A copy of ``unit`` made into the unit after it (version + 1, prev = its crc) with a right
    crc: only what a test does to it afterwards can tell it from a real next unit."""
    body = data[unit["at"] + child.UNIT_HEAD.size:unit["end"]]
    _m, _c, version, _p, entry_len, frames_len = child.UNIT_HEAD.unpack_from(data, unit["at"])
    fields = child.UNIT_FIELDS.pack(version + 1, unit["crc"], entry_len, frames_len)
    crc = crc32c(body, crc32c(fields))
    return child.UNIT_HEAD.pack(child.UNIT_MAGIC, crc, version + 1, unit["crc"], entry_len,
                                frames_len) + body


def check_after_new_sends(root: str, name: str, old: list[dict], new: list[dict]) -> dict:
    """The old messages, then the new ones, dense, through a fresh handle and by the walk."""
    want = old + [{**r, "_seq": len(old) + j} for j, r in enumerate(new)]
    assert fresh_messages(root, name) == want
    walked = child.walk(pages(root, name))
    assert walked["messages"] == want
    assert_verified(root, name)
    return walked


def assert_verified(root: str, name: str) -> None:
    """A torn tail is not damage: no published range holds it, verify finds them all whole."""
    report = DurableQueue(root).address(name).repair(dry_run=True)
    assert report.clean and report.pages_checked, report


def _junk(filled: str, name: str, kind: str) -> tuple[dict, Path, int, bytes]:
    """Write ``kind`` of junk after the last unit of ``name``: (the walk before, the segment,
    where the junk starts, the junk)."""
    before = child.walk(pages(filled, name))
    assert before["messages"] == expected(FILLS["garbage"]["sends"])
    last = before["units"][-1]
    path = child.segment_path(pages(filled, name), last["segment"])
    data = path.read_bytes()
    end = last["end"]
    assert not any(data[end:end + 8192]), "the space after the last unit is not blank"
    rng = random.Random(kind)
    forged = forge_next(last, data)
    if kind == "unit-one-byte-flipped":
        junk = bytearray(forged)
        junk[rng.randrange(child.UNIT_HEAD.size + 10, len(junk))] ^= 0x01
    elif kind == "unit-half-written":
        junk = bytearray(forged[:len(forged) // 2])
    elif kind == "unit-cut-in-its-head":
        junk = bytearray(forged[:child.UNIT_HEAD.size - 13])
    elif kind == "random-bytes":
        junk = bytearray(rng.randbytes(6000))
    else:  # a head that checks (magic, version, prev, lengths) before random bytes
        junk = bytearray(forged[:child.UNIT_HEAD.size] + rng.randbytes(
            len(forged) - child.UNIT_HEAD.size))
    patch(path, end, bytes(junk))
    return before, path, end, bytes(junk)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_a_torn_unit_after_the_last_one_is_not_delivered_and_is_written_over(filled, garbage):
    name = f"garbage--{garbage}"
    old = expected(FILLS["garbage"]["sends"])
    before, path, end, junk = _junk(filled, name, garbage)
    # the torn unit is there, where the next unit would go, and is no unit
    walked = child.walk(pages(filled, name))
    assert walked["stop"]["at"] == end and walked["stop"]["bytes"] == (junk + bytes(64))[:64]
    assert fresh_messages(filled, name) == old
    assert DurableQueue(filled).address(name).state.version == len(before["units"])
    assert_verified(filled, name)

    a = DurableQueue(filled).address(name)
    new = [new_row(j) for j in range(4)]
    for j, row in enumerate(new[:2]):
        assert a.send([row]).seq == len(old) + j
    assert a.send(new[2:]).seq == len(old) + 2
    walked = check_after_new_sends(filled, name, old, new)
    # the new units went where the torn one started, which was zeroed first: nothing of it
    # is left after them
    assert walked["units"][len(before["units"])]["at"] == end
    assert not any(path.read_bytes()[walked["stop"]["at"]:end + len(junk) + 64])


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_after_the_last_unit_is_reported_and_not_written_over(filled, damage):
    name = f"garbage--{damage}"
    _before, path, end, junk = _junk(filled, name, damage)
    where = f"{path.name}@{end} "
    with pytest.raises(DamagedLogError, match=where):
        fresh_messages(filled, name)
    with pytest.raises(DamagedLogError, match=where):
        DurableQueue(filled).address(name).send([new_row(0)])
    assert path.read_bytes()[end:end + len(junk)] == junk  # not written over
    assert cli_verify(filled, name).returncode == 1


def cli_verify(root: str, name: str) -> subprocess.CompletedProcess:
    code = ("import sys; from pyspark_durable_queue.cli import main\n"
            "sys.exit(main([sys.argv[1], 'verify', sys.argv[2]]))\n")
    return subprocess.run([sys.executable, "-c", code, root, name], capture_output=True,
                          text=True, timeout=120, env=child_env())


def test_a_synced_unit_torn_before_an_intact_next_one_is_damage(filled):
    # Unit 11 cut short, but unit 12 after it is whole and chains to it: 12 was written after
    # 11 was synced, so 11 was whole once (damaged since), and writing over it would lose 12.
    name = "stale-short--x"
    before = child.walk(pages(filled, name))
    assert before["messages"] == expected(FILLS["stale-short"]["sends"])
    long_unit, stale = before["units"][-2], before["units"][-1]
    path = child.segment_path(pages(filled, name), stale["segment"])
    mid = (long_unit["at"] + long_unit["end"]) // 2
    patch(path, mid, bytes(long_unit["end"] - mid))
    where = f"{path.name}@{long_unit['at']} "
    with pytest.raises(DamagedLogError, match=where + ".*unit after it is intact"):
        fresh_messages(filled, name)
    with pytest.raises(DamagedLogError, match=where):
        DurableQueue(filled).address(name).send([new_row(0)])
    assert child.unit_at(path.read_bytes(), stale["at"]) is not None  # still there


def test_a_unit_that_does_not_chain_to_the_one_before_it_is_damage_not_delivered(filled):
    """Unit 11 replaced by another valid unit of the same length (what a writer that wrote over
    a torn unit without zeroing it first, as releases before this rule did, could leave): unit
    12 after it has the version a reader looks for there and a right crc; only its ``prev``
    (the crc of the old unit 11) tells that it is not the next commit. It is not delivered."""
    name = "stale-same--x"
    old = expected(FILLS["stale-same"]["sends"])
    before = child.walk(pages(filled, name))
    torn, stale = before["units"][-2], before["units"][-1]
    path = child.segment_path(pages(filled, name), stale["segment"])
    data = path.read_bytes()
    # unit 11 with another random id in its entry and a crc made right again
    unit = bytearray(data[torn["at"]:torn["end"]])
    at = unit.index(b'"id":"') + 6
    unit[at:at + 4] = b"0000" if unit[at:at + 4] != b"0000" else b"1111"
    _m, _c, version, prev, entry_len, frames_len = child.UNIT_HEAD.unpack_from(unit)
    fields = child.UNIT_FIELDS.pack(version, prev, entry_len, frames_len)
    crc = crc32c(bytes(unit[child.UNIT_HEAD.size:]), crc32c(fields))
    unit[:child.UNIT_HEAD.size] = child.UNIT_HEAD.pack(child.UNIT_MAGIC, crc, version, prev,
                                                       entry_len, frames_len)
    patch(path, torn["at"], bytes(unit))
    behind = child.unit_at(path.read_bytes(), stale["at"])
    assert behind is not None and behind["version"] == torn["version"] + 1
    assert behind["prev"] == torn["crc"] != child.unit_at(path.read_bytes(), torn["at"])["crc"]
    with pytest.raises(DamagedLogError, match=f"{path.name}@{stale['at']} .*prev"):
        fresh_messages(filled, name)
    walked = child.walk(pages(filled, name))
    assert walked["stop"]["at"] == stale["at"] and walked["messages"] == old[:11]


@pytest.mark.parametrize("tear", ROLLED)
def test_a_torn_roll_is_written_over_by_the_next_writer(filled, tear):
    name = f"rolled--{tear}"
    folder = pages(filled, name)
    old = expected(FILLS["rolled"]["sends"])
    before = child.walk(folder)
    assert before["messages"] == old
    first = before["units"][-1]
    # the scenario: the last unit is the first of segment 2, after a roll mark in segment 1
    assert [u["segment"] for u in before["units"]] == [1] * 4 + [2]
    assert first["at"] == child.SEGMENT_HEAD.size
    seg2 = child.segment_path(folder, 2)
    header = seg2.read_bytes()[:child.SEGMENT_HEAD.size]
    if tear.startswith("first-unit-torn"):  # a write cut short half-way through the unit
        mid = (first["at"] + first["end"]) // 2
        patch(seg2, mid, bytes(first["end"] - mid))
    elif tear == "header-half-written":  # killed while writing the header: no unit yet
        os.truncate(seg2, child.SEGMENT_HEAD.size // 2)
    else:  # killed right after creating the file
        os.truncate(seg2, 0)
    assert fresh_messages(filled, name) == old[:4]
    assert child.walk(folder)["stop"]["segment"] == 2
    assert_verified(filled, name)

    a = DurableQueue(filled).address(name)
    large = tear == "first-unit-torn-large-next"
    new = [new_row(0, 3000 if large else SMALL)]
    new += [new_row(j) for j in range(1, 12)]  # enough to fill segment 1 again and roll
    for j, row in enumerate(new):
        assert a.send([row]).seq == 4 + j
    walked = check_after_new_sends(filled, name, old[:4], new)
    segments = [u["segment"] for u in walked["units"]]
    # a small unit fits in segment 1, over the roll mark; a large one rolls again
    assert segments[4] == (2 if large else 1)
    assert max(segments) >= 3
    # segment 2 was started again: a new header (a new random id)
    assert seg2.read_bytes()[:child.SEGMENT_HEAD.size] != header
