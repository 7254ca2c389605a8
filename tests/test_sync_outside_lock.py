"""A journal unit's sync runs after the publish lock is let go (issue 43): writers of other
processes append while it runs, a unit written after one whose sync had not finished says so
(``synced_to``: up to which version it knew units synced), which is what tells a torn tail
from damage after a power cut, and a sync that fails with other processes' units after it is
written again from memory.

Real files, a real second process (``subprocess``), the storage layer's one fault seam
(``_storage.local.sync_fault``) to hold or fail a sync of this process.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.unit import SYNCED_TO, Damage, judge_tail
from pyspark_durable_queue._log.commit_log import checkpoint_name
from pyspark_durable_queue._log.journal import segment_name
from pyspark_durable_queue._storage import local
from pyspark_durable_queue.errors import StorageError

_procs = Path(__file__).parent / "_procs"
_spec = importlib.util.spec_from_file_location("dq_journal_child_sync", _procs / "journal_child.py")
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

REPO = str(Path(__file__).resolve().parent.parent)
SEND = ("import sys; from pyspark_durable_queue import DurableQueue; "
        "r = DurableQueue(sys.argv[1]).address('a', fsync=sys.argv[3])"
        ".send([{'k': int(sys.argv[2])}]); print(r.seq)")


def send_elsewhere(root: Path, k: int, fsync: str = "always") -> int:
    """One send from another process (its own lock file description, its own view)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", SEND, str(root), str(k), fsync],
                         capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip())


def keys(root: Path) -> list[int]:
    c = DurableQueue(str(root)).address("a").consumer("check", start="earliest")
    return c.receive(max_messages=1000).column("k").to_pylist()


def entries(root: Path) -> list[dict]:
    walked = child.walk(root / "a" / "pages", rows=False)
    out = []
    for unit in walked["units"]:
        data = child.segment_path(root / "a" / "pages", unit["segment"]).read_bytes()
        _m, _c, _v, _p, entry_len, _f = child.UNIT_HEAD.unpack_from(data, unit["at"])
        start = unit["at"] + child.UNIT_HEAD.size
        out.append({**unit, "entry": json.loads(data[start:start + entry_len])})
    return out


@pytest.fixture
def held_sync():
    """``hold(thread)``: the next sync of a journal segment made by ``thread`` waits until
    ``release`` is set (``entered`` is set when it starts waiting), then fails with ``EIO`` if
    ``fail`` is set."""
    state = {"thread": None, "entered": threading.Event(), "release": threading.Event(),
             "fail": False, "done": False}

    def fault(path: str) -> None:
        if path.endswith(".dqj") and threading.current_thread() is state["thread"] and \
                not state["done"]:
            state["done"] = True
            state["entered"].set()
            assert state["release"].wait(120)
            if state["fail"]:
                raise OSError(errno.EIO, os.strerror(errno.EIO))

    local.sync_fault = fault
    try:
        yield state
    finally:
        local.sync_fault = None
        state["release"].set()


def send_held(a, k: int, state: dict) -> tuple[threading.Thread, dict]:
    """``a.send`` of row ``k`` in a thread whose sync is held; returns once it is held."""
    result: dict = {}

    def body() -> None:
        try:
            result["seq"] = a.send([{"k": k}]).seq
        except BaseException as exc:  # handed to the test
            result["error"] = exc

    thread = threading.Thread(target=body)
    state["thread"] = thread
    thread.start()
    assert state["entered"].wait(60), result
    return thread, result


@pytest.mark.parametrize("other", ["always", "never"])
def test_another_process_appends_while_a_sync_runs_and_says_so(tmp_path, held_sync, other):
    a = DurableQueue(str(tmp_path)).address("a")
    assert a.format.journal
    a.send([{"k": 0}])
    thread, result = send_held(a, 1, held_sync)
    # the unit of k=1 is written and its sync runs: the publish lock is free, so another
    # process's send is acknowledged meanwhile, after it (a handle that does not sync its
    # own units says it too: the unit before its may be syncing)
    assert send_elsewhere(tmp_path, 2, other) == 2
    assert "seq" not in result  # still syncing
    held_sync["release"].set()
    thread.join(60)
    assert result == {"seq": 1}
    a.send([{"k": 3}])
    assert keys(tmp_path) == [0, 1, 2, 3]
    units = entries(tmp_path)
    said = [u["entry"].get(SYNCED_TO) for u in units]
    # the other process chained to a unit whose sync had not finished (it knew units synced
    # up to k=0's); the unit after its own was written once that sync was seen (log/_synced),
    # or, after a unit that is not synced at all, says how far it knew
    assert said[-3] is None and said[-2] == units[-4]["version"], said
    assert said[-1] is None if other == "always" else said[-1] == units[-3]["version"], said
    synced = os.stat(tmp_path / "a" / "log" / "_synced")
    assert stat.S_IMODE(synced.st_mode) == 0o600, oct(synced.st_mode)  # nor read by others
    # allocated, not sparse: its mapping cannot fault on a full disk
    assert synced.st_blocks * 512 >= synced.st_size > 0


def test_a_torn_unit_followed_by_units_written_before_its_sync_is_a_torn_tail(tmp_path,
                                                                            held_sync):
    a = DurableQueue(str(tmp_path)).address("a")
    a.send([{"k": 0, "pad": "x" * 3000}])
    thread, _result = send_held(a, 1, held_sync)
    send_elsewhere(tmp_path, 2)
    held_sync["release"].set()
    thread.join(60)
    a.send([{"k": 3}])
    units = entries(tmp_path)
    before, held, other, last = units[-4:]
    assert other["entry"].get(SYNCED_TO) == before["version"] < held["version"]
    assert SYNCED_TO not in last["entry"]
    path = child.segment_path(tmp_path / "a" / "pages", held["segment"])
    data = bytearray(path.read_bytes())
    cut = held["end"] - 8  # a write cut short (its last bytes never written)
    data[cut:held["end"]] = bytes(held["end"] - cut)

    def judged(buf: bytes) -> Damage | None:
        return judge_tail(lambda lo, hi: bytes(buf[lo:hi]), held["at"], held["version"],
                          before["crc"], len(buf))

    # what a power cut can leave: the held unit torn, the other process's unit (written while
    # its sync ran) there, nothing after it: no sync covering the held unit finished, nothing
    # after it was acknowledged. A torn tail
    tail = bytearray(data)
    tail[last["at"]:last["end"]] = bytes(last["end"] - last["at"])
    assert judged(bytes(tail)) is None
    # the unit after that one was written once a sync covering the torn one had finished: the
    # torn one was whole once. Damage
    damage = judged(bytes(data))
    assert damage is not None and "proves it was synced" in damage.reason


def test_a_failed_sync_with_another_process_unit_after_it_is_written_again(tmp_path,
                                                                           held_sync):
    a = DurableQueue(str(tmp_path)).address("a")
    a.send([{"k": 0}])
    held_sync["fail"] = True
    thread, result = send_held(a, 1, held_sync)
    assert send_elsewhere(tmp_path, 2) == 2  # appended after the unit whose sync will fail
    held_sync["release"].set()
    thread.join(60)
    error = result["error"]
    assert isinstance(error, StorageError) and error.errno == errno.EIO
    assert "no message of this send was acknowledged" in str(error)
    assert "written again from memory" in str(error)
    # written again and synced before the call returned: stored (as a send whose answer was
    # lost may be), the other process's unit after it intact, the address goes on
    assert a.send([{"k": 3}]).seq == 3
    assert keys(tmp_path) == [0, 1, 2, 3]
    report = DurableQueue(str(tmp_path)).address("a").repair(dry_run=True)
    assert report.clean, report


def test_a_checkpoint_of_a_view_ending_with_a_unit_still_syncing_syncs_it_first(tmp_path,
                                                                                held_sync):
    # Cleanup checkpoints the freshest view (``checkpoint_now``) without the publish lock, and
    # that view may end with a unit whose writer is still in its sync: the checkpoint must not
    # name a state a power cut can take back, so the segment is synced before it is written.
    a = DurableQueue(str(tmp_path)).address("a")
    a.send([{"k": 0}])
    thread, result = send_held(a, 1, held_sync)
    held = held_sync["thread"]
    log_dir = tmp_path / "a" / "log"
    seen: list[tuple[str, set[str]]] = []
    hold = local.sync_fault

    def watch(path: str) -> None:
        if threading.current_thread() is not held:
            seen.append((path, {p.name for p in log_dir.glob("*.checkpoint.arrow")}))
        hold(path)

    local.sync_fault = watch
    cleanup = DurableQueue(str(tmp_path)).address("a")  # another handle: its own view
    position = cleanup.log.checkpoint_now()
    version = cleanup.log.state.version
    assert "seq" not in result  # the unit's own sync is still held
    written = checkpoint_name(version)
    assert (log_dir / written).exists()
    synced_first = [path for path, checkpoints in seen
                    if path.endswith(segment_name(position.segment))
                    and written not in checkpoints]
    assert synced_first, seen
    held_sync["release"].set()
    thread.join(60)
    assert result == {"seq": 1}
    assert keys(tmp_path) == [0, 1]
