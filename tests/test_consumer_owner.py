"""One owner per exclusive consumer (issue 39): the first ``receive`` makes its process the
owner (the Spark source's lease); handles in that process share it; another process gets
``ConsumerInUseError`` at once, or waits when asked; ``close()``, the process's exit and, on
this host, the owner's death give it up. Handles of one process are tested on every backend
(``root``), a killed owner on every store that processes share (``shared_root``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pyspark_durable_queue import ConsumerInUseError, DurableQueue

#: a process that owns consumer "c" of address "jobs": it receives one message, says so, then
#: holds the consumer for ``hold`` seconds and closes it (or exits without closing)
_OWNER = """
import sys, time
from pyspark_durable_queue import DurableQueue
root, hold, how = sys.argv[1], float(sys.argv[2]), sys.argv[3]
c = DurableQueue(root).address("jobs").consumer("c")
got = c.receive(1)
print("owner", got.column("n").to_pylist(), flush=True)
time.sleep(hold)
if how == "close":
    c.close()
    print("closed", flush=True)
    time.sleep(hold)
"""


def _filled(root: str, n: int = 10):
    a = DurableQueue(root).address("jobs")
    a.consumer("c")  # created before any owner: opening takes nothing
    a.send([{"n": i} for i in range(n)])
    return a


def _start_owner(root: str, hold: float, how: str = "exit") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, root, str(hold), how],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("owner [0]"), line
    return proc


def test_handles_in_one_process_share_the_ownership(root):
    a = _filled(root)
    one, two = a.consumer("c"), DurableQueue(root).address("jobs").consumer("c")
    assert one.receive(1).column("n").to_pylist() == [0]
    assert two.receive(1).column("n").to_pylist() == [0]  # a handle of its own: its cursor
    one.close()
    assert two.receive(1).column("n").to_pylist() == [1]  # still owned: two holds it
    two.close()


def test_another_process_is_refused_at_once_and_may_wait(tmp_path):
    root = str(tmp_path)
    a = _filled(root)
    owner = _start_owner(root, hold=2.0, how="close")
    try:
        c = a.consumer("c")
        began = time.monotonic()
        with pytest.raises(ConsumerInUseError, match=rf"process {owner.pid} on host"):
            c.receive(1)
        assert time.monotonic() - began < 1.5  # at once, not after a grace period
        waiting = a.consumer("c", wait_ms=20_000)
        assert waiting.receive(1).column("n").to_pylist() == [0]  # once the owner closed
        assert owner.stdout is not None and owner.stdout.readline() == "closed\n"
        waiting.close()
    finally:
        owner.kill()
        owner.wait()


def test_a_killed_owner_on_this_host_frees_the_consumer_at_once(shared_root):
    # on every store processes share: the claim's host and pid tell a dead owner at once
    root = shared_root
    a = _filled(root)
    owner = _start_owner(root, hold=60.0)
    owner.send_signal(signal.SIGKILL)
    assert owner.wait(timeout=30) == -signal.SIGKILL  # the kill landed: no release was written
    c = a.consumer("c")
    began = time.monotonic()
    assert c.receive(1).column("n").to_pylist() == [0]  # its pid is gone: the claim is free
    assert time.monotonic() - began < 2.0
    c.close()


def test_process_exit_and_close_give_the_consumer_up(tmp_path):
    root = str(tmp_path)
    a = _filled(root)
    owner = _start_owner(root, hold=0.1)  # exits without closing its consumer
    assert owner.wait(timeout=60) == 0
    c = a.consumer("c")
    assert c.receive(1).column("n").to_pylist() == [0]
    c.close()
    owner = _start_owner(root, hold=0.1)  # this process closed it: another takes it at once
    assert owner.wait(timeout=60) == 0


def test_a_forked_child_does_not_inherit_the_ownership(tmp_path):
    root = str(tmp_path)
    a = _filled(root)
    c = a.consumer("c")
    c.receive(1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a handle of its own is a second process's, refused
        try:
            DurableQueue(root).address("jobs").consumer("c").receive(1)
            os.write(write, b"received")
        except ConsumerInUseError:
            os.write(write, b"refused")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"refused"
    c.close()


def test_acknowledging_after_the_lease_was_taken_over_is_refused(tmp_path):
    a = _filled(str(tmp_path))
    c = a.consumer("c")
    c.receive(2)
    lease = c._lease
    assert lease is not None and lease.held
    # another owner took the consumer over while this process stalled past the lease
    lease._stop.set()
    thief = a.consumer_lease("c", 60_000)
    thief.owner, thief.epoch = "thief", lease.epoch
    assert a.storage.create(lease._path(lease.epoch + 1), thief._claim())
    with pytest.raises(ConsumerInUseError, match="now held by another"):
        lease.check()  # what the heartbeat's next renewal finds
    with pytest.raises(ConsumerInUseError, match="now held by another"):
        c.ack()
    assert a.consumers()["c"]["position"] == 0  # the other owner's watermark was not moved


def test_a_lease_whose_store_fails_warns_once_and_is_not_released_at_exit(tmp_path, caplog):
    import logging
    import shutil

    from pyspark_durable_queue._ops.lease import _release_quietly

    a = _filled(str(tmp_path))
    lease = a.consumer_lease("c", 1500)  # renewed every 0.5 s
    lease.acquire()
    folder = tmp_path / "jobs" / "consumers" / "_leases" / "c"
    shutil.rmtree(folder)
    folder.write_text("not a folder")  # every renewal now fails (not "the consumer is gone")
    with caplog.at_level(logging.DEBUG, logger="pyspark_durable_queue._ops.lease"):
        lease.start_heartbeat()
        deadline = time.monotonic() + 20
        while sum("renewal failed" in r.message for r in caplog.records) < 3:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.1)
    warnings = [r for r in caplog.records if "renewal failed" in r.message
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and lease.failing  # the others at debug level
    began = time.monotonic()
    _release_quietly(lease)  # what process exit does: skipped, the claim expires by itself
    assert time.monotonic() - began < 0.5 and lease._stop.is_set()


def test_only_the_owner_acknowledges_nacks_or_seeks(tmp_path):
    # a process that never received cannot move another owner's watermark or window
    root = str(tmp_path)
    a = _filled(root)
    owner = _start_owner(root, hold=60.0)
    try:
        c = a.consumer("c")
        for move in (lambda: c.ack(4), lambda: c.nack(0), lambda: c.seek("latest")):
            with pytest.raises(ConsumerInUseError, match=rf"process {owner.pid} on host"):
                move()
        assert DurableQueue(root).address("jobs").consumers()["c"]["position"] == 0
    finally:
        owner.kill()
        owner.wait()
    c.ack(4)  # the killed owner's claim is free at once on this host: c owns it now
    assert DurableQueue(root).address("jobs").consumers()["c"]["position"] == 5
    c.close()


def test_a_renewal_after_the_consumer_was_deleted_writes_no_claim():
    import uuid

    import fsspec

    from pyspark_durable_queue.errors import NotFoundError

    root = f"memory://dq-{uuid.uuid4().hex}"
    a = _filled(root)
    lease = a.consumer_lease("c", 60_000)
    lease.acquire()
    fs = fsspec.filesystem("memory")
    path = root.replace("memory://", "/")
    fs.rm(path, recursive=True)  # the store went (a test's fixture, a deleted address)
    with pytest.raises(NotFoundError, match="is gone"):
        lease.renew(force=True)  # what the heartbeat's next beat does: then it stops
    assert not fs.exists(path)
