"""The journal (on-disk format 4) under concurrency: readers in other processes while a writer
appends, and many threads of one process sending single messages.

Readers: a writer process (``_procs/journal_child.py stream``) sends messages whose contents
are a function of their id (mostly single sends, some of up to 60 rows, now and then a large
message), with 16 KiB pages so segments roll all the time; every 40th unit it writes in two
parts with a pause between them (a writer descheduled in the middle of its write). Two reader
processes receive meanwhile, one through a consumer kept open, one through a new handle and
consumer for every receive, and check each message as it comes: dense, in order, exactly what
was sent. Both acknowledge, so cleanup removes segments they passed while they read. The test
then checks, from the times both sides report, that no reader had a unit before its writer
began writing its second part, and that readers did look while a unit was half written.

Threads: 8 threads send 20,000 single messages through one ``Address`` or a handle each, with
1 MiB pages, while two consumers of the same process read along: ``_seq`` dense, every
message there once and whole, each thread's in its order, the consumers got exactly that, and
the threads shared their segments (at most ``ceil(bytes / pageSizeBytes) + 5`` files).

``DQ_JOURNAL_STREAM_MESSAGES`` (default 8,000) sizes the readers' test.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pyspark_durable_queue import DurableQueue

_procs = Path(__file__).parent / "_procs"
_spec = importlib.util.spec_from_file_location("dq_journal_child", _procs / "journal_child.py")
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

REPO = str(Path(__file__).resolve().parent.parent)
TOTAL = int(os.environ.get("DQ_JOURNAL_STREAM_MESSAGES", 8000))


def small_row(t: int, k: int) -> dict:
    return {"w": t, "k": k, "pad": child._chars(f"t{t}:{k}", (t * 31 + k * 7) % 200)}


def child_env(**extra: str) -> dict:
    """The children import this checkout's package (``PYTHONPATH``), whatever is installed."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return env


def lines(out: Path) -> list[list[str]]:
    text = out.read_text() if out.exists() else ""
    return [line.split() for line in text.split("\n")[:-1] if line]


def start(tmp_path: Path, name: str, args: list[str], env: dict) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{name}.out"
    with open(out, "w") as f, open(out.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen([sys.executable, str(_procs / "journal_child.py"), *args],
                                stdout=f, stderr=err, env=env)
    return proc, out


def wait_ready(proc: subprocess.Popen, out: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while ["ready"] not in lines(out):
        assert proc.poll() is None, out.with_suffix(".err").read_text()[-3000:]
        assert time.monotonic() < deadline, f"{out.name} not ready in {timeout} s"
        time.sleep(0.01)


def finish(proc: subprocess.Popen, out: Path, timeout: float = 300) -> list[list[str]]:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = lines(out)
    errors = [" ".join(line) for line in got if line[0] == "ERROR"]
    assert not errors, (out.name, errors)
    assert proc.returncode == 0, (out.name, out.with_suffix(".err").read_text()[-3000:])
    return got


@pytest.mark.slow
def test_readers_in_other_processes_get_only_whole_published_units(tmp_path):
    root = str(tmp_path / "dq")
    name = "streamed"
    a = DurableQueue(root).address(name, journal=True, page_size_bytes=16384,
                                   cleanup_interval_ms=200)
    assert a.format.journal
    a.consumer("reader-a")
    a.consumer("reader-b")
    done = tmp_path / "writer.done"
    env = child_env(DQ_STREAM_DONE=str(done))
    readers = [start(tmp_path, f"reader-{who}",
                     ["read", root, name, who, str(seed), str(TOTAL)], env)
               for who, seed in (("a", 11), ("b", 22))]
    for proc, out in readers:
        wait_ready(proc, out)
    writer = start(tmp_path, "writer", ["stream", root, name, "33", str(TOTAL)], env)
    wrote = finish(*writer)
    assert wrote[-1] == ["done"]
    splits = [(int(s), int(n), float(t0), float(t1)) for _, s, n, t0, t1 in
              (line for line in wrote if line[0] == "split")]
    reports = {}
    for (proc, out), who in zip(readers, "ab", strict=True):
        got = finish(proc, out, timeout=120)
        assert got[-1][0] == "done", got[-3:]
        calls = [(float(t0), float(t1), int(first), int(n))
                 for _, t0, t1, first, n in (line for line in got if line[0] == "call")]
        reports[who] = {"calls": calls, "while_writing": int(got[-1][1])}

    for who, report in reports.items():
        calls = report["calls"]
        # what the reader checked as it went, once more from its log: dense, all of it
        taken = [(first, n) for _, _, first, n in calls if n]
        assert [f for f, _ in taken] == [sum(n for _, n in taken[:i]) for i in range(len(taken))]
        assert sum(n for _, n in taken) == TOTAL
        # it read while the writer was appending, in many receives
        assert report["while_writing"] >= 10, (who, report["while_writing"])
        # no receive had a unit before its writer had begun writing the unit's second part
        for seq, rows, _t_half, t_rest in splits:
            for _t0, t1, first, n in calls:
                if n and first < seq + rows and seq < first + n:
                    assert t1 >= t_rest, (who, seq, rows, t_rest, t1)
    # the scenario: units were half written while readers looked for the next one (a
    # receive inside the pause that found nothing new, or one of reader b, which opens the
    # log afresh each time)
    looked = sum(any(t0 >= t_half and t1 <= t_rest and (who == "b" or not n)
                     for who, c in reports.items() for t0, t1, _f, n in c["calls"])
                 for _s, _r, t_half, t_rest in splits)
    assert len(splits) >= 10 and looked >= len(splits) // 4, (len(splits), looked)
    # segments rolled, and cleanup removed some the readers had passed (once a checkpoint,
    # every 1,000 commits, had passed them too) while they read
    state = DurableQueue(root).address(name).state
    assert state.next_seq == TOTAL and state.version > 1000
    listed = child.segment_numbers(Path(root, name, "pages"))
    assert max(listed) >= 20 and min(listed) > 1, listed
    print(f"splits {len(splits)}, looked during {looked}; segments {min(listed)}..{max(listed)}"
          f" ({len(listed)} files); commits {state.version}")


@pytest.mark.slow
@pytest.mark.parametrize("handles", ["one shared Address", "a handle per thread"])
def test_threads_of_single_sends_share_segments_and_keep_seq_dense(tmp_path, handles):
    threads, per_thread, page = 8, 2500, 1 << 20
    root = str(tmp_path / "dq")
    shared = DurableQueue(root).address("t", journal=True, page_size_bytes=page)
    assert shared.format.journal
    addresses = [shared if handles == "one shared Address" else DurableQueue(root).address("t")
                 for _ in range(threads)]
    total = threads * per_thread
    got: dict[tuple[int, int], int] = {}
    errors: list[BaseException] = []
    go = threading.Barrier(threads + 2)
    # two consumers read along in the same process, one through a sender's handle
    consumers = [addresses[0].consumer("along-0"), DurableQueue(root).address("t").consumer(
        "along-1")]
    read_along: list[list[tuple[int, int, int]]] = [[], []]

    def work(t: int) -> None:
        try:
            go.wait()
            for k in range(per_thread):
                r = addresses[t].send([small_row(t, k)])
                assert r.count == 1 and not r.duplicate, r
                got[(t, k)] = r.seq
        except BaseException as exc:
            errors.append(exc)

    def read(i: int) -> None:
        try:
            go.wait()
            sizes = [1, 7, 300]
            while len(read_along[i]) < total:
                t = consumers[i].receive(max_messages=sizes[len(read_along[i]) % 3],
                                         timeout_ms=50)
                for r in t.drop_columns(["_timestamp", "_delivery_count"]).to_pylist():
                    assert r == {**small_row(r["w"], r["k"]), "_seq": len(read_along[i])}, r
                    read_along[i].append((r["_seq"], r["w"], r["k"]))
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    workers += [threading.Thread(target=read, args=(i,)) for i in range(2)]
    started = time.monotonic()
    for w in workers:
        w.start()
    for w in workers[:threads]:
        w.join()
    took = time.monotonic() - started
    for w in workers[threads:]:
        w.join(timeout=120)
        assert not w.is_alive(), "a consumer did not get every message"
    assert not errors, errors[:3]
    assert sorted(got.values()) == list(range(total))
    for t in range(threads):  # each thread's sends in its order
        seqs = [got[(t, k)] for k in range(per_thread)]
        assert seqs == sorted(seqs)

    a = DurableQueue(root).address("t")
    c = a.consumer("all")
    table = c.receive(max_messages=10 ** 6, max_bytes=1 << 40)
    assert not c.receive(max_messages=10).num_rows
    rows = table.drop_columns(["_timestamp", "_delivery_count"]).to_pylist()
    assert [r["_seq"] for r in rows] == list(range(total))
    for r in rows:
        assert got[(r["w"], r["k"])] == r["_seq"]
        assert r == {**small_row(r["w"], r["k"]), "_seq": r["_seq"]}
    walked = child.walk(Path(root, "t", "pages"))
    assert walked["messages"] == rows
    for along in read_along:  # what the consumers got while the threads sent: the same
        assert along == [(r["_seq"], r["w"], r["k"]) for r in rows]
    stats = a.stats()
    assert stats["messages"] == total
    files = len(child.segment_numbers(Path(root, "t", "pages")))
    # threads share the open segment instead of each keeping one half empty
    assert files <= math.ceil(stats["bytes"] / page) + 5, (files, stats["bytes"])
    assert files >= 2, "no segment rolled"
    print(f"{handles}: {total} sends in {took:.1f} s ({total / took:.0f}/s), "
          f"{walked['units'][-1]['version']} commits, {files} segments")


@pytest.mark.parametrize(("first", "other", "then"), [
    pytest.param({"v": 1}, {"v": 2, "c": "x"}, {"v": 3, "c": "y"}, id="a column added"),
    pytest.param(None, {"v": 1.5}, {"v": 2}, id="the schema set (an int cast to double)"),
])
def test_a_send_fits_the_schema_another_process_gave_the_address(tmp_path, first, other, then):
    """What another process did to the schema is what this process's send is conformed to,
    as on an address without a journal (where this passes)."""
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("a", journal=True)
    if first is not None:
        a.send(first)
    else:
        assert a.state.schema is None  # this process's view: empty
    code = ("import sys; from pyspark_durable_queue import DurableQueue as Q; "
            "Q(sys.argv[1]).address('a').send(eval(sys.argv[2]), merge_schema=True)")
    subprocess.run([sys.executable, "-c", code, root, repr(other)], env=child_env(),
                   check=True, timeout=120)
    assert a.send(then).count == 1
