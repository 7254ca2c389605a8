"""The batching producer (``Address.producer``): futures, batching, failures, lifetime.

Real stores in ``tmp_path``, real threads and real subprocesses; what a test expects is read back
with a consumer, independently of the producer's own futures.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pyspark_durable_queue import (
    AddressFullError,
    BufferFullError,
    DurableQueue,
    InvalidMessageError,
    MessageDroppedError,
    ProducerClosedError,
    SchemaMismatchError,
)

CHILD = str(Path(__file__).parent / "_procs" / "producer_child.py")


def read_all(address) -> dict[str, list]:
    """Every message of the address, as columns, read by a fresh consumer."""
    consumer = address.consumer(f"check-{random.randrange(1 << 30)}", start="earliest")
    table = consumer.receive(max_messages=10_000_000, max_bytes=1 << 40)
    return table.to_pydict()


@pytest.fixture
def address(tmp_path):
    return DurableQueue(str(tmp_path / "dq")).address("orders")


def test_futures_resolve_with_dense_seqs_in_send_order(address):
    address.send([{"k": -1}])  # the producer's rows come after what is there
    with address.producer(linger_ms=1) as p:
        futures = [p.send({"k": i}) for i in range(1000)]
        seqs = [f.result(timeout=30) for f in futures]
    assert seqs == list(range(1, 1001))
    assert all(f.done() and f.exception() is None for f in futures)
    data = read_all(address)
    assert data["k"] == list(range(-1, 1000))
    assert data["_seq"] == list(range(1001))


def test_flush_makes_everything_readable(address):
    p = address.producer(linger_ms=60_000)  # nothing lingers out during the test
    futures = [p.send({"k": i, "name": f"n{i}"}) for i in range(5000)]
    assert not futures[-1].done()
    p.flush()
    assert all(f.done() for f in futures)  # flush returned: every row is resolved
    data = read_all(address)
    assert data["k"] == list(range(5000))
    assert data["_seq"] == [f.result() for f in futures]
    p.close()


def test_linger_sends_without_flush(address):
    p = address.producer(linger_ms=20)
    started = time.monotonic()
    f = p.send({"k": 1})
    assert f.result(timeout=10) == 0
    assert time.monotonic() - started >= 0.015  # it waited for the linger, no flush was called
    assert read_all(address)["k"] == [1]
    p.close()


def test_max_batch_messages_splits_batches(address):
    with address.producer(linger_ms=60_000, max_batch_messages=100) as p:
        futures = [p.send({"k": i}) for i in range(1050)]
        # ten full batches go without linger or flush; the last 50 wait for the flush
        assert all(f.result(timeout=30) == i for i, f in enumerate(futures[:1000]))
        assert not futures[-1].done()
    assert futures[-1].result() == 1049
    assert address.stats()["commits"] == 11  # one per batch: 10 full ones, the flushed rest


def test_concurrent_sends_from_many_threads(address):
    threads, per_thread = 8, 2000
    p = address.producer(linger_ms=1, max_batch_messages=700)
    futures: dict[tuple[int, int], object] = {}
    barrier = threading.Barrier(threads)

    def run(t: int) -> None:
        barrier.wait()
        mine = {(t, i): p.send({"t": t, "i": i}) for i in range(per_thread)}
        futures.update(mine)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    p.close()
    seqs = {key: f.result(timeout=0) for key, f in futures.items()}
    assert len(seqs) == threads * per_thread
    assert sorted(seqs.values()) == list(range(threads * per_thread))  # unique and dense
    data = read_all(address)
    stored = list(zip(data["t"], data["i"], strict=True))
    assert len(stored) == len(set(stored)) == threads * per_thread  # each exactly once
    assert {key: seq for key, seq in zip(stored, data["_seq"], strict=True)} == seqs
    for t in range(threads):  # one thread's rows keep their order
        assert [i for tt, i in stored if tt == t] == list(range(per_thread))


def test_a_bad_row_fails_alone_and_the_others_are_stored(address):
    address.send([{"k": 0, "name": "a"}])  # the schema: k int64, name string
    with address.producer(linger_ms=60_000) as p:
        futures = [p.send({"k": i, "name": f"n{i}"}) for i in range(1, 200)]
        bad_type = p.send({"k": "not a number", "name": "bad"})
        futures += [p.send({"k": i, "name": f"n{i}"}) for i in range(200, 300)]
        bad_column = p.send({"k": 1, "name": "x", "extra": 1.5})
        mixed = p.send({"k": [1, 2], "name": "nested"})  # does not convert with the others
        futures += [p.send({"k": i, "name": f"n{i}"}) for i in range(300, 400)]
    assert isinstance(bad_type.exception(), SchemaMismatchError)
    assert isinstance(bad_column.exception(), SchemaMismatchError)
    assert "extra" in str(bad_column.exception())
    assert isinstance(mixed.exception(), InvalidMessageError | SchemaMismatchError)
    with pytest.raises(SchemaMismatchError):
        bad_type.result()
    seqs = [f.result() for f in futures]
    assert seqs == list(range(1, 400))  # the good rows, dense and in send order
    data = read_all(address)
    assert data["k"] == list(range(400))
    assert "bad" not in data["name"] and "nested" not in data["name"]
    assert address.stats()["commits"] == 2  # the good rows of the split batch in one commit


def test_fail_policy_resolves_futures_with_address_full(tmp_path):
    a = DurableQueue(str(tmp_path / "dq")).address(
        "small", max_size_messages=5, address_full_policy="FAIL")
    with a.producer(linger_ms=60_000) as p:
        stored = [p.send({"k": i}) for i in range(5)]
        p.flush()
        refused = [p.send({"k": i}) for i in range(5, 8)]
    assert [f.result() for f in stored] == list(range(5))
    for f in refused:
        assert isinstance(f.exception(), AddressFullError)
        assert not isinstance(f.exception(), MessageDroppedError)
    assert read_all(a)["k"] == list(range(5))


def test_a_shared_error_keeps_its_traceback_short(tmp_path):
    """The futures of a batch share one exception; raising it again and again must not grow
    its traceback (each raise would add a frame)."""
    a = DurableQueue(str(tmp_path / "dq")).address(
        "small", max_size_messages=1, address_full_policy="FAIL")
    a.send([{"k": 0}])
    with a.producer(linger_ms=60_000) as p:
        futures = [p.send({"k": i}) for i in range(1, 50)]
    depths = set()
    for _ in range(20):
        for f in futures:
            try:
                f.result()
            except AddressFullError as exc:
                tb, depth = exc.__traceback__, 0
                while tb is not None:
                    tb, depth = tb.tb_next, depth + 1
                depths.add(depth)
    assert len(depths) == 1 and depths.pop() < 30, depths


def test_drop_policy_resolves_futures_with_message_dropped(tmp_path):
    a = DurableQueue(str(tmp_path / "dq")).address(
        "small", max_size_messages=5, address_full_policy="DROP")
    with a.producer(linger_ms=60_000) as p:
        stored = [p.send({"k": i}) for i in range(5)]
        p.flush()
        dropped = [p.send({"k": i}) for i in range(5, 8)]
    assert [f.result() for f in stored] == list(range(5))
    for f in dropped:
        with pytest.raises(MessageDroppedError, match="DROP"):
            f.result()
        assert isinstance(f.exception(), AddressFullError)  # MessageDroppedError is one
    assert read_all(a)["k"] == list(range(5))
    assert a.stats()["dropped_messages"] == 3


def test_a_full_buffer_blocks_send_then_raises(tmp_path):
    # BLOCK with a full address: the sender's commit waits block_timeout_ms, so the buffer fills
    a = DurableQueue(str(tmp_path / "dq")).address(
        "slow", max_size_messages=1, address_full_policy="BLOCK", block_timeout_ms=1500)
    p = a.producer(linger_ms=0, max_buffer_bytes=2000, max_block_ms=200)
    assert p.send({"k": 0, "s": "first"}).result(timeout=10) == 0  # measures the row size
    futures = []
    with pytest.raises(BufferFullError, match="max_buffer_bytes=2000") as info:
        for i in range(1, 100_000):
            started = time.monotonic()
            futures.append(p.send({"k": i, "s": "later"}))
    blocked = time.monotonic() - started
    assert isinstance(info.value, TimeoutError)
    assert 0.19 <= blocked < 1.4  # waited max_block_ms, and gave up before the commit did
    assert 1 < len(futures) < 1000  # the buffer held a bounded number of rows
    p.close()
    for f in futures:  # the commit that blocked failed after block_timeout_ms, and the rest too
        assert isinstance(f.exception(), AddressFullError)
    assert read_all(a)["k"] == [0]


def test_close_twice_and_send_after_close(address):
    p = address.producer()
    f = p.send({"k": 1})
    p.close()
    assert f.result(timeout=0) == 0  # close flushed
    p.close()
    assert p.closed
    with pytest.raises(ProducerClosedError, match="closed"):
        p.send({"k": 2})
    with address.producer() as q:
        pass
    with pytest.raises(ProducerClosedError):
        q.send({"k": 3})
    assert read_all(address)["k"] == [1]


def test_send_refuses_what_is_not_a_dict(address):
    with address.producer() as p, pytest.raises(InvalidMessageError, match="list"):
        p.send([{"k": 1}])  # type: ignore[arg-type]


def test_done_callbacks_run_once_resolved_and_at_once_when_already_done(address):
    seen: list[tuple[str, int]] = []
    with address.producer(linger_ms=60_000) as p:
        f = p.send({"k": 1})
        f.add_done_callback(lambda fut: seen.append(("before", fut.result())))
        assert seen == []
        p.flush()
        assert seen == [("before", 0)]
        f.add_done_callback(lambda fut: seen.append(("after", fut.result())))
        assert seen == [("before", 0), ("after", 0)]


def test_a_result_waits_at_most_its_timeout(address):
    with address.producer(linger_ms=60_000) as p:
        f = p.send({"k": 1})
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            f.result(timeout=0.05)
        assert 0.04 <= time.monotonic() - started < 5
        assert p.flush()
        assert f.exception(timeout=0) is None


def test_flush_from_a_done_callback_fails_instead_of_deadlocking(address):
    errors: list[BaseException] = []

    def callback(_f):
        try:
            p.flush()
        except RuntimeError as exc:
            errors.append(exc)

    with address.producer() as p:
        p.send({"k": 1}).add_done_callback(callback)
    assert len(errors) == 1 and "done-callback" in str(errors[0])


def test_a_producer_is_not_picklable(address):
    import pickle

    with address.producer() as p, pytest.raises(TypeError, match=r"Address\.producer"):
        pickle.dumps(p)


def test_rows_are_flushed_at_interpreter_exit(tmp_path):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("exit")
    proc = subprocess.run([sys.executable, CHILD, "exit", root, "exit", "3000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert read_all(DurableQueue(root).address("exit"))["k"] == list(range(3000))


def test_a_forked_child_starts_empty_and_works(tmp_path):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("fork")
    proc = subprocess.run([sys.executable, CHILD, "fork", root, "fork", "500"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout, proc.stdout
    assert "child 0" in proc.stdout, proc.stdout  # the forked child ran its checks
    data = read_all(DurableQueue(root).address("fork"))
    stored = list(zip(data["who"], data["k"], strict=True))
    assert len(stored) == len(set(stored))  # nothing the parent had pending was stored twice
    assert sorted(k for who, k in stored if who == "parent") == list(range(1000))
    assert sorted(k for who, k in stored if who == "child") == list(range(500))


@pytest.mark.crash
def test_sigkill_loses_nothing_that_was_reported_stored(tmp_path):
    """A child produces without end, printing each stored row's _seq once its future resolved;
    SIGKILLed at random moments, several times on one store: every printed row is in the
    address exactly once, with that _seq, and no row is stored twice."""
    root = str(tmp_path / "dq")
    DurableQueue(root).address("crash")
    rng = random.Random(4321)
    printed: dict[tuple[int, int], int] = {}
    for run in range(3):
        out = tmp_path / f"run-{run}.out"
        with open(out, "w") as f:
            proc = subprocess.Popen([sys.executable, CHILD, "crash", root, "crash", str(run)],
                                    stdout=f, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while out.read_text().count("\n") < 200:  # ready, and a few groups stored
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the child printed nothing stored"
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.3))
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        stderr = proc.stderr.read().decode()
        proc.stderr.close()
        # the kill landed on a live child: it did not die on its own
        assert proc.returncode == -signal.SIGKILL, (run, proc.returncode, stderr[-2000:])
        lines = out.read_text().split("\n")[:-1]  # the last line may be cut short
        assert lines[0] == "ready"
        errors = [line for line in lines if line.startswith("ERROR")]
        assert not errors, errors[:5]
        for line in lines[1:]:
            seq, k = map(int, line.split())
            printed[(run, k)] = seq
        assert len(lines) > 200
    data = read_all(DurableQueue(root).address("crash"))
    stored = list(zip(data["run"], data["k"], strict=True))
    assert len(stored) == len(set(stored)), "a row was stored twice"
    assert data["_seq"] == list(range(len(stored)))
    where = dict(zip(stored, data["_seq"], strict=True))
    missing = [key for key in printed if key not in where]
    assert not missing, f"{len(missing)} rows reported stored are not, e.g. {missing[:5]}"
    assert all(where[key] == seq for key, seq in printed.items())
