"""Shared consumers: many handles of one subscription receive disjoint messages, each row
leased to its handle and settled one by one; leases run out, are renewed, go back on close;
nacks and dead letters as for an exclusive consumer.

State written by one handle is read by another (each has its own view of the chain), never
taken from the handle that wrote it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pyspark_durable_queue import DurableQueue, LeaseExpiredError, SharedConsumer, shared_consumer
from pyspark_durable_queue._format import shared as shared_file
from pyspark_durable_queue._ops.shared import SharedLog, SharedState
from pyspark_durable_queue.errors import DamagedMetadataError, InvalidOptionError


def jobs(root, n=10, **settings):
    a = DurableQueue(root).address("jobs", **settings)
    a.send([{"id": i} for i in range(n)])
    return a


@pytest.fixture
def clock(monkeypatch):
    """The module's clock (epoch ms, what every lease and due time reads), moved by the test:
    leases run out without sleeping, and never early on a slow test server (the real clock's
    lease expiry across processes: test_shared_takeover.py)."""
    now = [int(time.time() * 1000)]
    monkeypatch.setattr(shared_consumer, "now_ms", lambda: now[0])
    return now


def seqs(table):
    return table.column("_seq").to_pylist()


def counts(table):
    return table.column("_delivery_count").to_pylist()


def test_handles_receive_disjoint_rows_and_ack_settles_exactly_those(root):
    a = jobs(root)
    one = a.consumer("pool", shared=True, prefetch=3)
    two = a.consumer("pool", shared=True, prefetch=3)
    assert isinstance(one, SharedConsumer)
    first, second = one.receive(2), two.receive(2)
    assert seqs(first) == [0, 1] and seqs(second) == [3, 4]  # one's claim took 0..2
    assert counts(first) == [1, 1]
    two.ack(second)  # rows 3 and 4 settled; 0..2 still one's
    fresh = a.consumer("pool", shared=True)
    state = fresh.state()
    assert sorted(state.leases) == [0, 1, 2, 5]
    assert state.ack_point == 0
    one.ack(first[0:1])
    assert fresh.state().ack_point == 1  # 1, 2 (one's) and 5 (two's) still leased
    one.ack(1)
    one.ack(one.receive(5))
    two.ack(two.receive(10))
    assert fresh.state().ack_point == fresh.state().cursor == 10
    for c in (one, two, fresh):
        c.close()
    assert a.consumers()["pool"]["position"] == 10  # the watermark file, for cleanup


def test_a_row_goes_to_one_handle_only(root):
    a = jobs(root, 50)
    handles = [a.consumer("pool", shared=True, prefetch=4) for _ in range(3)]
    got: list[int] = []
    while True:
        tables = [h.receive(3) for h in handles]
        if not any(t.num_rows for t in tables):
            break
        for h, t in zip(handles, tables, strict=True):
            got += seqs(t)
            h.ack(t)
    assert sorted(got) == list(range(50))
    for h in handles:
        h.close()


def test_open_as_the_other_kind_is_refused(tmp_path):
    a = jobs(str(tmp_path / "dq"))
    a.consumer("solo").close()
    with pytest.raises(InvalidOptionError, match="exclusive: open it with shared=False"):
        a.consumer("solo", shared=True)
    a.consumer("pool", shared=True, selector="id > 3").close()
    with pytest.raises(InvalidOptionError, match="shared: open it with shared=True"):
        a.consumer("pool")
    with pytest.raises(InvalidOptionError, match="share its selector"):
        a.consumer("pool", shared=True, selector="id > 4")
    for bad in ({"lease_ms": 0}, {"prefetch": 0}, {"lease_ms": True}):
        with pytest.raises(InvalidOptionError):
            a.consumer("pool", shared=True, **bad)


def test_a_selector_applies_to_every_handle(tmp_path):
    a = jobs(str(tmp_path / "dq"), 20)
    odd = "id IN (1, 3, 5, 7, 9, 11, 13, 15, 17, 19)"
    one = a.consumer("odd", shared=True, selector=odd, prefetch=2)
    two = a.consumer("odd", shared=True, prefetch=2)
    got = []
    for h in (one, two, one, two, one, two):
        t = h.receive(2)
        got += t.column("id").to_pylist()
        h.ack(t)
    assert sorted(got) == list(range(1, 20, 2))


def test_a_lease_that_runs_out_delivers_the_row_again_to_another_handle(root, clock):
    a = jobs(root, 3)
    slow = a.consumer("pool", shared=True, lease_ms=3000, prefetch=1)
    fast = a.consumer("pool", shared=True, lease_ms=3000, prefetch=1)
    held = slow.receive(1)
    assert seqs(held) == [0]
    clock[0] += 2999
    assert seqs(fast.receive(1)) == [1]  # not yet
    clock[0] += 1
    again = fast.receive(1)
    assert seqs(again) == [0] and counts(again) == [2]
    with pytest.raises(LeaseExpiredError, match="passed to another handle"):
        slow.renew(held)
    with pytest.raises(LeaseExpiredError, match="ran out"):
        slow.ack(held)
    fast.ack(again)
    assert fast.state().ack_point == 1
    slow.close()
    fast.close()


def test_renew_keeps_a_row_past_its_first_lease(root, clock):
    a = jobs(root, 2)
    worker = a.consumer("pool", shared=True, lease_ms=3000, prefetch=1)
    other = a.consumer("pool", shared=True, lease_ms=3000, prefetch=1)
    held = worker.receive(1)
    for _ in range(3):
        clock[0] += 1100
        worker.renew(held, lease_ms=3000)
    assert seqs(other.receive(5)) == [1]  # row 0 is still the worker's
    worker.ack(held)
    assert other.state().leased_to(worker.holder) == []
    with pytest.raises(InvalidOptionError, match="does not hold it"):
        worker.renew(held)
    worker.close()
    other.close()


def test_nack_delivers_again_after_its_delay(root, clock):
    now = clock
    a = jobs(root, 3)
    one = a.consumer("pool", shared=True, prefetch=1)
    two = a.consumer("pool", shared=True, prefetch=1)
    first = one.receive(1)
    one.nack(first, delay_ms=300)
    now[0] += 299
    assert seqs(two.receive(1)) == [1]  # row 0 waits
    now[0] += 1
    again = one.receive(1)
    assert seqs(again) == [0] and counts(again) == [2]
    with pytest.raises(InvalidOptionError, match="does not hold it"):
        two.nack(again)


def test_max_delivery_attempts_moves_a_row_to_the_dead_letter_address(root):
    a = jobs(root, 3, max_delivery_attempts=2, dead_letter_address="jobs.dlq")
    one = a.consumer("pool", shared=True, prefetch=1)
    for expected in (1, 2):
        got = one.receive(1)
        assert seqs(got) == [0] and counts(got) == [expected]
        one.nack(got, delay_ms=0)
    dlq = DurableQueue(root).address("jobs.dlq")
    with dlq.consumer("check") as check:
        letters = check.receive(10)
    assert letters.column("origin_seq").to_pylist() == [0]
    assert letters.column("origin_consumer").to_pylist() == ["pool"]
    assert letters.column("delivery_count").to_pylist() == [2]
    state = one.state()
    assert state.moving is None and state.counters["dead_lettered"] == 1
    assert seqs(one.receive(5)) == [1, 2]
    stats = a.stats()["consumers"]["pool"]
    assert stats["shared"] and stats["dead_lettered"] == 1


def test_close_gives_back_prefetched_rows_without_counting_them(root):
    a = jobs(root, 5)
    one = a.consumer("pool", shared=True, prefetch=5)
    handed = one.receive(2)  # 0, 1 handed out; 2..4 prefetched
    one.close()
    two = a.consumer("pool", shared=True)
    got = two.receive(10)
    assert seqs(got) == [0, 1, 2, 3, 4]
    assert counts(got) == [2, 2, 1, 1, 1]  # handed out once before, or never
    assert seqs(handed) == [0, 1]
    two.close()


def test_deferred_acks_are_written_by_flush(root):
    a = jobs(root, 4)
    one = a.consumer("pool", shared=True, ack_flush_ms=60_000)
    for _ in range(4):
        one.ack(one.receive(1), flush=False)
    other = a.consumer("pool", shared=True)
    assert other.state().ack_point == 0  # not written yet: still leased
    one.flush()
    assert other.state().ack_point == 4
    one.close()
    other.close()


def test_a_dead_handles_rows_are_delivered_at_once_on_its_host(tmp_path):
    root = str(tmp_path / "dq")
    jobs(root, 6)
    child = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from pyspark_durable_queue import DurableQueue\n"
        f"c = DurableQueue({root!r}).address('jobs').consumer('pool', shared=True, "
        "prefetch=4, lease_ms=600000)\n"
        "print(c.receive(1).column('_seq').to_pylist(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert child.stdout.strip() == "[0]"
    other = DurableQueue(root).address("jobs").consumer("pool", shared=True)
    got = other.receive(10)  # the dead process's leases (10 min) count for nothing
    assert seqs(got) == [0, 1, 2, 3, 4, 5]
    assert counts(got) == [2, 2, 2, 2, 1, 1]  # its four were claimed: counted as delivered
    other.ack(got)
    assert other.state().ack_point == 6


def test_stats_show_leases_and_handles(root):
    a = jobs(root, 6)
    one = a.consumer("pool", shared=True, prefetch=2)
    two = a.consumer("pool", shared=True, prefetch=2)
    one.receive(1)
    two.ack(two.receive(2))
    row = a.stats()["consumers"]["pool"]
    assert row["shared"] and row["leased"] == 2 and row["in_flight"] == 2
    assert row["handles"] == 2 and row["position"] == 0 and row["cursor"] == 4
    assert row["first_lease_expiry_ms"] > time.time() * 1000
    assert row["acknowledged"] == 2 and row["delivered"] == 4
    one.close()
    two.close()


def test_cleanup_sees_what_a_shared_consumer_settled(tmp_path):
    a = DurableQueue(str(tmp_path / "dq")).address("jobs")
    for i in range(4):
        a.send([{"id": i}])
    one = a.consumer("pool", shared=True, prefetch=4)
    got = one.receive(4)
    one.ack(got[0:2])
    one.close()  # rows 2 and 3 go back: the watermark stays below them
    assert a.backlog() == (2, a.backlog()[1]) and a.consumers()["pool"]["position"] == 2
    two = a.consumer("pool", shared=True)
    two.ack(two.receive(4))
    two.close()
    assert a.backlog()[0] == 0


def test_a_damaged_epoch_is_reported(tmp_path):
    a = jobs(str(tmp_path / "dq"), 2)
    one = a.consumer("pool", shared=True)
    one.receive(1)
    folder = tmp_path / "dq" / "jobs" / "consumers" / "_shared" / "pool"
    newest = max(p for p in folder.iterdir() if p.name[:20].isdigit())
    data = bytearray(newest.read_bytes())
    data[40] ^= 0x01
    newest.write_bytes(bytes(data))
    with pytest.raises(DamagedMetadataError, match="shared consumer state"):
        a.consumer("pool", shared=True).state()


def test_state_bytes_round_trip():
    state = SharedState(7, {3: ("a", 1, 100), 5: ("b", 2, 200)}, {4: (1, 50)},
                        {"a": ["a", "h", 1, "9", 10], "b": ["b", "h", 2, None, 20]},
                        None, {"acked": 3})
    assert SharedState.decode(state.encode()) == state


def test_delete_removes_the_shared_state(tmp_path):
    a = jobs(str(tmp_path / "dq"), 2)
    one = a.consumer("pool", shared=True)
    one.receive(1)
    one.delete()
    assert "pool" not in a.consumers()
    assert not (tmp_path / "dq" / "jobs" / "consumers" / "_shared" / "pool").exists()
    fresh = a.consumer("pool", shared=True)
    assert seqs(fresh.receive(5)) == [0, 1]


def test_a_torn_change_at_the_end_of_the_log_is_skipped_then_left_behind(tmp_path):
    a = jobs(str(tmp_path / "dq"), 6)
    one = a.consumer("pool", shared=True, prefetch=2)
    one.ack(one.receive(1))
    before = a.consumer("pool", shared=True).state()
    folder = tmp_path / "dq" / "jobs" / "consumers" / "_shared" / "pool"
    (log_file,) = [p for p in folder.iterdir() if p.name.endswith(".log")]
    whole = log_file.read_bytes()
    torn = shared_file.encode_change({"cursor": 99, "unleased": [1]})
    log_file.write_bytes(whole + torn[:-3])  # a writer killed mid-append
    assert a.consumer("pool", shared=True).state() == before
    one.ack(one.receive(1))  # the next generation: the torn bytes go with the old file
    after = a.consumer("pool", shared=True).state()
    assert after.cursor == 2 and sorted(after.leases) == []
    (now,) = [p for p in folder.iterdir() if p.name.endswith(".log")]
    assert now.name > log_file.name


def test_the_log_starts_a_new_generation_past_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(SharedLog, "ROTATE_BYTES", 600)
    a = jobs(str(tmp_path / "dq"), 40)
    one = a.consumer("pool", shared=True, prefetch=3)
    for _ in range(40):
        one.ack(one.receive(1))
    folder = tmp_path / "dq" / "jobs" / "consumers" / "_shared" / "pool"
    logs = sorted(p.name for p in folder.iterdir() if p.name.endswith(".log"))
    assert len(logs) == 1 and int(logs[0][:20]) > 3  # older generations deleted
    state = a.consumer("pool", shared=True).state()
    assert state.cursor == 40 and not state.leases and state.counters["acked"] == 40


def test_a_change_is_the_difference_of_two_states():
    before = SharedState(5, {1: ("a", 1, 10), 2: ("a", 1, 10)}, {3: (1, 0)},
                         {"a": ["a", "h", 1, None, 0]}, None, {"acked": 1}).copy()
    after = before.copy()
    del after.leases[1]
    after.leases[2] = ("a", 1, 20)
    after.pending.pop(3)
    after.leases[4] = ("b", 2, 30)
    after.holders["b"] = ["b", "h", 2, None, 1]
    after.cursor = 6
    after.counters["acked"] = 2
    change = after.diff(before)
    assert before.apply(change) == after
    assert after.copy().diff(after) == {}


def test_a_forked_child_leaves_its_parents_rows_alone(tmp_path):
    a = jobs(str(tmp_path / "dq"), 4)
    one = a.consumer("pool", shared=True, prefetch=4)
    held = one.receive(2)
    pid = os.fork()
    if pid == 0:  # the child runs the module's exit handler, as a forked worker's exit does
        try:  # (not every handler: those of threads the fork left behind would hang)
            shared_consumer._close_all()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    state = a.consumer("pool", shared=True).state()
    assert sorted(state.leased_to(one.holder)) == [0, 1, 2, 3]
    one.ack(held)


def test_receive_hands_out_no_more_bytes_than_asked_from_what_it_prefetched(tmp_path):
    a = DurableQueue(str(tmp_path / "dq")).address("jobs")
    a.send([{"id": i, "body": "x" * 1000} for i in range(20)])
    pool = a.consumer("pool", shared=True, prefetch=20)
    first = pool.receive(10, max_bytes=3500)  # ~1 kB a row: three fit
    assert seqs(first) == [0, 1, 2] and first.nbytes <= 3500
    assert seqs(pool.receive(10)) == list(range(3, 13))  # from memory: nothing claimed
    assert pool.state().counters["delivered"] == 20
    assert seqs(pool.receive(1, max_bytes=1)) == [13]  # at least one row, whatever its size
    pool.close()


def _hold_publish_lock(root, address):
    """Hold ``address``'s publish lock (the flock a send takes) until the returned fd is
    closed: a send there waits meanwhile, as a slow dead-letter send does."""
    import fcntl

    path = os.path.join(root, address, "log", "_publish.lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_claim_waits_for_the_dead_letter_move_in_flight_instead_of_replacing_it(tmp_path):
    import threading

    root = str(tmp_path / "dq")
    a = jobs(root, 4, max_delivery_attempts=2, dead_letter_address="jobs.dlq")
    DurableQueue(root).address("jobs.dlq")
    one = a.consumer("pool", shared=True, prefetch=1, lease_ms=60_000)
    two = a.consumer("pool", shared=True, prefetch=1, lease_ms=60_000)
    watch = a.consumer("pool", shared=True)
    for handle, row in ((one, 0), (two, 1)):  # each row delivered twice, to its handle
        got = handle.receive(1)
        handle.nack(got, delay_ms=0)
        got = handle.receive(1)
        assert seqs(got) == [row] and counts(got) == [2]
    fd = _hold_publish_lock(root, "jobs.dlq")
    try:
        # one's nack begins a move of row 0, whose send waits for the lock
        first = threading.Thread(target=one.nack, args=(0,), kwargs={"delay_ms": 0})
        first.start()
        deadline = time.monotonic() + 30
        while watch.state().moving is None:
            assert time.monotonic() < deadline and first.is_alive()
            time.sleep(0.01)
        two.nack(1, delay_ms=0)  # row 1 is dead too: it waits for the move in flight
        second = threading.Thread(target=two.receive, args=(1,))
        second.start()
        while watch.state().counters.get("moves", 0) < 2 and second.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        state = watch.state()
        # row 0 is not settled before its dead letter is sent
        assert state.moving is not None and [0, 2] in state.moving["rows"]
        assert state.ack_point == 0
    finally:
        os.close(fd)
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    while two.receive(5).num_rows:  # row 1's move, once row 0's is done
        pass
    with DurableQueue(root).address("jobs.dlq").consumer("check") as check:
        letters = check.receive(10)
    assert sorted(letters.column("origin_seq").to_pylist()) == [0, 1]
    state = watch.state()
    assert state.moving is None and state.counters["dead_lettered"] == 2
    for handle in (one, two, watch):
        handle.close()


def test_a_lost_lease_does_not_stop_renewals_of_the_rows_still_held(root, clock):
    a = jobs(root, 6)
    worker = a.consumer("pool", shared=True, lease_ms=1500, prefetch=4)
    other = a.consumer("pool", shared=True, lease_ms=60_000, prefetch=1)
    held = worker.receive(2)  # rows 0 and 1 handed out, 2 and 3 prefetched
    worker.renew(held[1:2], lease_ms=60_000)
    clock[0] += 1600  # row 0's lease ran out, and the prefetched rows' in memory
    assert seqs(other.receive(3)) == [0, 2, 3]
    with pytest.raises(LeaseExpiredError, match=r"_seq 0\.\.0 of"):
        worker.renew(lease_ms=120_000)  # row 0 is other's: named, and forgotten
    lease = other.state().leases[1]
    assert lease[0] == worker.holder and lease[2] == clock[0] + 120_000
    worker.renew(lease_ms=120_000)  # the rows still held (row 1): nothing raises again
    assert seqs(worker.receive(5)) == [4, 5]  # never 2 or 3: other's now
    clock[0] += 1600  # rows 4 and 5 run out in the worker's hands
    assert seqs(other.receive(5)) == [4, 5]
    with pytest.raises(LeaseExpiredError, match=r"_seq 4\.\.4 of"):
        worker.nack([1, 4], delay_ms=0)  # row 1 is given back all the same
    assert other.state().pending.keys() == {1}
    with pytest.raises(LeaseExpiredError, match=r"_seq 5\.\.5 of"):
        worker.renew()
    worker.renew()  # holds nothing now: nothing to raise for
    other.ack([0, 2, 3, 4, 5])
    worker.close()
    other.close()


def test_prefetched_rows_that_ran_out_in_memory_keep_their_delivery_count(root, clock):
    a = jobs(root, 3, max_delivery_attempts=2, dead_letter_address="jobs.dlq")
    one = a.consumer("pool", shared=True, lease_ms=1500, prefetch=3)
    one.ack(one.receive(1))  # row 0; rows 1 and 2 wait in memory ...
    clock[0] += 1600  # ... where their leases run out: they were never handed out
    got = one.receive(1)
    assert seqs(got) == [1] and counts(got) == [1]
    one.ack(got)
    clock[0] += 1600  # row 2 runs out in memory a second time
    got = one.receive(1)  # not dead-lettered: it was never delivered
    assert seqs(got) == [2] and counts(got) == [1]
    one.ack(got)
    state = one.state()
    assert state.ack_point == 3 and state.counters.get("dead_lettered", 0) == 0
    one.close()


def test_a_record_after_a_torn_one_is_never_applied_after_the_tear_is_written_over(tmp_path):
    # a power cut can keep a later record and lose part of the one before it (neither was
    # synced): the writer that goes on after the tear must not leave that later record
    # behind its own, where readers would apply it to a state it was not made from
    a = DurableQueue(str(tmp_path / "dq")).address("jobs")
    a.consumer("pool", shared=True).close()
    log = a.shared_chain("pool", 0)
    assert isinstance(log, SharedLog)

    def cursor(n):
        def change(state):
            state.cursor = n
        return change

    log.update(cursor(5))  # the generation's whole state
    log.update(cursor(6))  # a change record
    (path,) = [p for p in (tmp_path / "dq" / "jobs" / "consumers" / "_shared" / "pool").iterdir()
               if p.name.endswith(".log")]
    torn = bytearray(shared_file.encode_change({"cursor": 7}))
    torn[-1] ^= 0xFF
    with open(path, "ab") as f:
        f.write(bytes(torn) + shared_file.encode_change({"cursor": 100}))
    other = a.shared_chain("pool", 0)
    assert other.current().cursor == 6  # the tear ends the log
    other.update(cursor(8))  # as long as the torn record: written where it was
    assert a.shared_chain("pool", 0).current().cursor == 8


def test_a_handle_read_from_another_thread_while_it_writes_keeps_its_log_whole(tmp_path):
    import threading

    a = jobs(str(tmp_path / "dq"), 60)
    one = a.consumer("pool", shared=True, prefetch=1)
    done = threading.Event()
    seen: list[int] = []

    def watch():  # a monitoring thread: position, backlog and state of the same handle
        while not done.is_set():
            seen.append(one.position)
            one.state()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(60):
            one.ack(one.receive(1))
    finally:
        done.set()
        watcher.join()
        sys.setswitchinterval(switch)
    assert seen and seen == sorted(seen)
    state = a.consumer("pool", shared=True).state()  # read from the files alone
    assert state.cursor == 60 and state.ack_point == 60 and not state.leases
    assert state.counters["acked"] == 60
    one.close()


def test_a_forked_child_that_drops_its_copy_of_a_handle_leaves_its_rows_alone(tmp_path):
    import gc

    a = jobs(str(tmp_path / "dq"), 6)
    one = a.consumer("pool", shared=True, prefetch=4)
    holder = one.holder
    held = one.receive(2)
    pid = os.fork()
    if pid == 0:  # the child drops the parent's handle (collected), then works on its own
        code = 1
        try:
            del one
            gc.collect()
            mine = a.consumer("pool", shared=True, prefetch=1)
            code = 0 if seqs(mine.receive(1)) == [4] else 2
            mine.ack([4])
            mine.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    state = a.consumer("pool", shared=True).state()
    assert sorted(state.leased_to(holder)) == [0, 1, 2, 3]
    one.ack(held)
    one.close()


def test_a_handle_of_a_deleted_consumer_stops_instead_of_making_its_state_again(root):
    from pyspark_durable_queue.errors import ConsumerNotFoundError

    a = jobs(root, 4)
    one = a.consumer("pool", shared=True, prefetch=1)
    two = a.consumer("pool", shared=True, prefetch=1)
    assert seqs(one.receive(1)) == [0] and seqs(two.receive(1)) == [1]
    one.delete()
    with pytest.raises(ConsumerNotFoundError, match="pool"):
        two.receive(1)  # before: a new state (from its old start) in the deleted folder
    fresh = a.consumer("pool", shared=True)  # a new consumer of the name starts afresh
    assert seqs(fresh.receive(10)) == [0, 1, 2, 3]
    fresh.close()


def test_a_lease_shorter_than_the_hand_out_margin_still_delivers(tmp_path):
    a = jobs(str(tmp_path / "dq"), 2)
    one = a.consumer("pool", shared=True, lease_ms=150)
    got = one.receive(1, timeout_ms=10_000)  # before: every row skipped as running out
    assert seqs(got) == [0] and counts(got) == [1]
    one.ack(got)
    one.close()


def test_deferred_acks_are_written_before_their_leases_run_out(tmp_path):
    a = jobs(str(tmp_path / "dq"), 2)
    one = a.consumer("pool", shared=True, lease_ms=2000, prefetch=1, ack_flush_ms=10_000)
    other = a.consumer("pool", shared=True, prefetch=1)
    one.ack(one.receive(1), flush=False)
    time.sleep(2.2)  # row 0's lease ran out; its deferred ack was due at half of it
    assert seqs(other.receive(5)) == [1]  # not row 0 again: it was acknowledged in time
    other.ack([1])
    assert other.state().ack_point == 2
    one.close()
    other.close()


def test_threads_racing_on_an_object_store_chain_settle_each_row_once():
    # memory:// has no locks: the handles race for each epoch (a conditional create); a
    # writer whose epoch others built on at once must not take it for a stale one
    import threading
    import uuid

    import fsspec

    root = f"memory://dq-{uuid.uuid4().hex}"
    a = jobs(root, 200)
    got: list[int] = []
    errors: list[BaseException] = []

    def work():
        handle = a.consumer("pool", shared=True, prefetch=1, lease_ms=120_000)
        try:
            while True:
                t = handle.receive(1)
                if not t.num_rows:
                    return
                got.extend(seqs(t))
                handle.ack(t)
        except BaseException as exc:
            errors.append(exc)
        finally:
            handle.close()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(switch)
        fsspec.filesystem("memory").rm(root.replace("memory://", "/"), recursive=True)
    assert not errors, errors
    assert sorted(got) == list(range(200))


def test_a_handle_waiting_on_an_empty_queue_writes_nothing(tmp_path):
    a = jobs(str(tmp_path / "dq"), 1)
    waiter = a.consumer("pool", shared=True)
    waiter.ack(waiter.receive(1))
    folder = tmp_path / "dq" / "jobs" / "consumers" / "_shared" / "pool"

    def written():
        return sorted((p.name, p.stat().st_size) for p in folder.iterdir()
                      if p.name.endswith(".log"))

    before = written()
    assert seqs(waiter.receive(1, timeout_ms=600)) == []  # it looks again every ~50 ms
    assert written() == before  # before: a state (its 'last seen' time) per look, synced
    waiter.close()


DRAIN_WORKER = """
import json, sys
from pyspark_durable_queue import DurableQueue
c = DurableQueue(sys.argv[1]).address("jobs").consumer("pool", shared=True, prefetch=10,
                                                       ack_flush_ms=600_000)
print("ready", flush=True)
sys.stdin.readline()
got = []
while True:
    t = c.receive(1)
    if not t.num_rows:
        break
    got += t.column("_seq").to_pylist()
    c.ack(t, flush=False)
cursor = c.state().cursor  # at the first empty receive: every row claimed by then
c.close()
print(json.dumps({"got": got, "cursor": cursor}), flush=True)
"""


def test_receive_comes_back_empty_only_once_every_row_was_claimed(tmp_path):
    # deferred acks keep their rows leased: before, the rows one handle had received and
    # acknowledged without a flush filled max_in_flight and receive() came back empty with
    # most of the backlog unclaimed (bench_delivery's "the backlog ran out")
    import json

    root = str(tmp_path / "dq")
    jobs(root, 1500, max_in_flight=100)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    workers = [subprocess.Popen([sys.executable, "-c", DRAIN_WORKER, root], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for w in workers:
        assert w.stdout.readline().strip() == "ready", w.communicate()[1]
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    results = []
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["cursor"] for r in results] == [1500] * 3
    assert sorted(s for r in results for s in r["got"]) == list(range(1500))


def test_rows_read_before_the_lock_are_taken_only_past_the_cursor(tmp_path):
    # a claim reads new rows before it takes the lock, and under it takes only those at or
    # past the state's cursor: rows the other handles claimed meanwhile are never taken twice
    a = jobs(str(tmp_path / "dq"), 60)
    third = f"id IN ({', '.join(str(i) for i in range(0, 60, 3))})"
    handles = [a.consumer("thirds", shared=True, selector=third, prefetch=2)
               for _ in range(3)]
    got: list[int] = []
    for round_ in range(12):
        for i, h in enumerate(handles):
            t = h.receive(1 + (round_ + i) % 3)
            assert counts(t) == [1] * t.num_rows
            got += t.column("id").to_pylist()
            h.ack(t, flush=bool(i % 2))
    for h in handles:
        h.close()
    assert sorted(got) == list(range(0, 60, 3))
    check = a.consumer("thirds", shared=True)
    assert check.state().ack_point == 60 and not check.state().leases
    check.close()


def test_candidates_take_the_rows_past_the_cursor_and_say_where_it_goes():
    import pyarrow as pa

    from pyspark_durable_queue.shared_consumer import _Candidates

    # rows 10, 12, 15 matched in [10, 20): 11, 13, 14, 16..19 did not
    table = pa.table({"_seq": pa.array([10, 12, 15], pa.int64()), "v": ["a", "b", "c"]})
    rows = _Candidates(table, 10, 20, None, None)
    assert rows.take(9, 5, 1 << 20) is None and rows.take(20, 5, 1 << 20) is None
    part, after, _ = rows.take(11, 1, 1 << 20)  # 10 went to another handle
    assert part.column("_seq").to_pylist() == [12] and after == 15
    part, after, _ = rows.take(13, 5, 1 << 20)  # every row left: the cursor goes to the end
    assert part.column("_seq").to_pylist() == [15] and after == 20
    part, after, _ = rows.take(16, 5, 1 << 20)  # none left that matched
    assert part.num_rows == 0 and after == 20
    part, after, _ = rows.take(10, 5, 1)  # about max_bytes, one row at least
    assert part.column("_seq").to_pylist() == [10] and after == 12
    assert rows.left(11) == 2 and rows.joined(13, _Candidates(table.slice(0, 0), 20, 25,
                                                             None, None)).left(13) == 1
    # the earliest expiry of the two goes with the rows; past it they are not used
    soon = _Candidates(table.slice(0, 0), 20, 25, None, 5)
    joined = rows.joined(13, soon)
    assert joined.until == 5
    assert not joined.usable(13, type("S", (), {"schema": None})())


def test_a_holder_is_judged_dead_only_in_this_boot_and_pid_namespace():
    from pyspark_durable_queue._ops import shared as ops

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is free now (not reused this soon)
    me = ops.holder_record("live", 0)
    dead = ["dead", ops.HOST, gone.pid, None, 0]
    state = SharedState(0, holders={
        "live": me,
        "dead": [*dead, ops.BOOT_ID, ops.PID_NAMESPACE],
        "old": list(dead),  # a record of an older release: host and pid only
        "other-ns": [*dead, ops.BOOT_ID, -1],  # a container with its own pids
        "other-boot": [*dead, "another-boot", ops.PID_NAMESPACE],
        "other-host": ["x", "another-host.invalid", gone.pid, None, 0],
    })
    judged = {h: state.dead(h) for h in state.holders}
    assert judged == {"live": False, "dead": True, "old": True, "other-ns": False,
                      "other-boot": False, "other-host": False}
    assert me[5:] == [ops.BOOT_ID, ops.PID_NAMESPACE]
    if os.path.exists("/proc/self/ns/pid"):
        assert ops.BOOT_ID and ops.PID_NAMESPACE == os.stat("/proc/self/ns/pid").st_ino
    # a record of an older release is noted again in the new form at the next change
    old = SharedState(0, holders={"live": me[:5]})
    old.seen("live", 1)
    assert old.holders["live"][5:] == [ops.BOOT_ID, ops.PID_NAMESPACE]
