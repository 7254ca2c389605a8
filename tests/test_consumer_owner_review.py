"""Review findings on one owner per consumer (issue 39): what a new owner reads, and what a
process's exit writes before it gives the consumer up."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading

import pytest

from pyspark_durable_queue import ConsumerInUseError, DurableQueue
from pyspark_durable_queue._format import checked
from pyspark_durable_queue._format.watermark import decode
from pyspark_durable_queue._ops.lease import OWNERS

#: owns consumer "c" of "jobs": receives ``n`` messages, acknowledges them (written), says so,
#: holds the consumer until its stdin closes, then closes it
_ACKER = """
import sys
import pytest

from pyspark_durable_queue import ConsumerInUseError, DurableQueue
root, n = sys.argv[1], int(sys.argv[2])
c = DurableQueue(root).address("jobs").consumer("c")
got = c.receive(n)
c.ack(got)
print("acked", got.column("n").to_pylist(), flush=True)
sys.stdin.read()
c.close()
"""

#: receives and acknowledges 3 messages with a deferred ack, then exits without close()
_DEFERRED = """
import sys
import pytest

from pyspark_durable_queue import ConsumerInUseError, DurableQueue
c = DurableQueue(sys.argv[1]).address("jobs").consumer("c", ack_flush_ms=600_000)
c.ack(c.receive(3), flush=False)
"""


def _filled(root: str, n: int = 10):
    a = DurableQueue(root).address("jobs")
    a.consumer("c")
    a.send([{"n": i} for i in range(n)])
    return a


def test_a_handle_that_waited_for_the_owner_goes_on_from_its_acknowledgements(tmp_path):
    root = str(tmp_path)
    a = _filled(root)
    waiting = a.consumer("c", wait_ms=30_000)  # opened before the owner acknowledged
    owner = subprocess.Popen([sys.executable, "-c", _ACKER, root, "3"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdin is not None
        assert owner.stdout.readline() == "acked [0, 1, 2]\n"
        owner.stdin.close()  # the owner closes its consumer: the waiting handle takes over
        got = waiting.receive(2)
        # the owner's acknowledged messages are not delivered again...
        assert got.column("n").to_pylist() == [3, 4]
        waiting.ack(got)
        # ...and the watermark does not move back below them
        assert a.consumers()["c"]["position"] == 5
        waiting.close()
        assert owner.wait(timeout=60) == 0
    finally:
        owner.kill()
        owner.wait()


def test_the_exit_writes_deferred_acks_before_it_gives_the_consumer_up(tmp_path):
    root = str(tmp_path)
    a = _filled(root)
    run = subprocess.run([sys.executable, "-c", _DEFERRED, root], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert a.consumers()["c"]["position"] == 3  # the deferred acks were written at exit
    wm = decode((tmp_path / "jobs" / "consumers" / "c.wm").read_bytes())
    assert wm is not None and wm.position == 3
    folder = tmp_path / "jobs" / "consumers" / "_leases" / "c"
    last = max(folder.glob("*.json"))
    claim = checked.loads(last.read_bytes(), required=a.format.checksums)
    assert claim["released"], json.dumps(claim)
    # the release came after the write: another process taking the consumer over the moment
    # it is released reads the acknowledged position, not an older one
    assert wm.time_us / 1e6 <= claim["renewed"], (wm.time_us / 1e6, claim["renewed"])


def test_a_lease_taken_again_after_one_was_lost_stays_while_a_handle_uses_it(tmp_path):
    a = _filled(str(tmp_path))
    one = a.consumer("c")
    one.receive(1)
    lost = one._lease
    assert lost is not None and lost.held
    lost._stop.set()
    # another owner took the consumer over while this process stalled, then gave it up
    thief = a.consumer_lease("c", 60_000)
    thief.owner, thief.epoch = "thief", lost.epoch
    assert a.storage.create(lost._path(lost.epoch + 1), thief._claim())
    thief.epoch = lost.epoch + 1
    thief.release()
    with pytest.raises(ConsumerInUseError):
        lost.check()  # what the heartbeat's next renewal finds
    with pytest.raises(ConsumerInUseError):
        one.receive(1)  # this handle's lease is lost for good
    two = a.consumer("c")
    assert two.receive(1).num_rows == 1  # a new handle owns the consumer again
    one.close()  # the handle of the lost lease gives its share back...
    assert two._lease is not None and two._lease.held  # ...not the new handle's
    with pytest.raises(ConsumerInUseError):
        a.consumer_lease("c", 60_000).acquire(wait_s=0)  # still owned by this process
    two.close()
    a.consumer_lease("c", 60_000).acquire(wait_s=0)  # the last handle gave it up


def test_a_handle_collected_while_this_thread_takes_a_lease_does_not_deadlock(tmp_path):
    a = _filled(str(tmp_path))
    a.consumer("d")
    gc.disable()  # the dropped handle is collected where the test says, not before
    try:
        dropped = a.consumer("c")
        dropped.receive(1)
        dropped.cycle = dropped  # only the cycle collector frees it
        del dropped

        def make():
            gc.collect()  # the collector runs the dropped handle's finalizer in this thread
            return a.consumer_lease("d", 60_000)

        taken: list[object] = []
        thread = threading.Thread(target=lambda: taken.append(
            OWNERS.take(a.consumer_state_path("d"), make, 0)), daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "take() deadlocked on its own lock"
    finally:
        gc.enable()
    assert taken
    # the finalizer only noted "c"; the next call into OWNERS gives its share back
    OWNERS.give_back(a.consumer_state_path("d"))
    a.consumer_lease("c", 60_000).acquire(wait_s=0)  # the dropped handle gave "c" up


def test_an_abandoned_handle_gives_its_lease_back_on_the_next_heartbeat(tmp_path, monkeypatch):
    # a handle dropped without close() while no other call reaches OWNERS (a worker that only
    # sleeps): the lease's own heartbeat thread gives the share back and stops renewing
    import pyspark_durable_queue.consumer as consumer_module

    monkeypatch.setattr(consumer_module, "OWNER_LEASE_MS", 600)  # a beat every 200 ms
    a = _filled(str(tmp_path))
    dropped = a.consumer("c")
    dropped.receive(1)
    lease = dropped._lease
    del dropped  # no cycle: the finalizer runs here and only notes the key
    lease._thread.join(10)
    assert not lease._thread.is_alive() and not lease.held
    a.consumer_lease("c", 60_000).acquire(wait_s=0)  # released, not merely expired


def test_deleting_an_owned_consumer_leaves_no_lease_folder_behind(tmp_path, monkeypatch):
    # the owner's heartbeat renews while the consumer is deleted: deletion pauses it (a claim
    # written into the folder being removed failed rmtree with "Directory not empty" in the
    # store state machine; that interleaving is not forced here), and no later renewal
    # recreates the folder
    import time

    import pyspark_durable_queue.consumer as consumer_module

    monkeypatch.setattr(consumer_module, "OWNER_LEASE_MS", 300)  # a beat every 100 ms
    a = _filled(str(tmp_path))
    for _ in range(5):
        c = a.consumer("c")
        c.receive(1)
        time.sleep(0.15)
        c.delete()
        time.sleep(0.25)  # a beat or two after the deletion
        assert not (tmp_path / "jobs" / "consumers" / "_leases" / "c").exists()
        c.close()
        a.consumer("c")  # recreated for the next round


def test_a_deleted_consumers_lease_writes_no_claim_when_the_process_exits():
    # the lease of a consumer deleted while owned was released at exit: a claim written into
    # the deleted folder (an object store recreates it), or a warning once the store's client
    # had closed ("could not release its lease: HTTP transport has already been closed")
    import uuid

    import fsspec

    root = f"memory://dq-{uuid.uuid4().hex}"
    a = _filled(root)
    c = a.consumer("c")
    c.receive(1)
    assert OWNERS.lease_of(c.path) is not None
    c.delete()
    assert OWNERS.lease_of(c.path) is None
    OWNERS.release_all()  # what the process's exit does
    c.close()
    folder = root.replace("memory://", "/") + "/jobs/consumers/_leases/c"
    assert not fsspec.filesystem("memory").exists(folder)
    again = a.consumer("c")  # a new consumer of the same name is free to own at once
    assert again.receive(1).num_rows == 1
    again.close()


def test_thousands_of_collected_handles_are_given_back_without_recursion():
    # each collected handle notes its key; the next call gave them back one stack frame per key
    # (RecursionError in a long process that dropped many handles)
    owners = type(OWNERS)()
    for k in range(5000):
        owners.collected(f"gone-{k}")
    owners.give_back("other")
    assert owners.give_back_collected() is False  # all were given back by the call above
