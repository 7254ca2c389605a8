"""Retention (``retentionMs`` / ``retentionBytes``, Kafka's names): cleanup removes the oldest
whole pages past either bound, read or not; consumers behind them report the range as lost,
consumers past them see nothing; ``stats()`` counts what retention removed.

Run on a local journal (segments are the unit), local page files and ``memory://``, with real
files: no mocks. The other-process reader and the SIGKILL during retention cleanups are at the
end.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue, InvalidOptionError
from pyspark_durable_queue._options import parse_options

NAME = "events"
PAGE = 4096
ROWS = 100
REPO = str(Path(__file__).resolve().parent.parent)
CHILD = Path(__file__).parent / "_procs" / "retention_child.py"


@pytest.fixture(params=["journal", "pages", "memory"])
def store(request, tmp_path):
    """``(root, journal)``: a local journal, local page files, fsspec's memory filesystem."""
    if request.param == "memory":
        import fsspec

        url = f"memory://dq-{uuid.uuid4().hex}"
        yield url, False
        fs = fsspec.filesystem("memory")
        if fs.exists(url[len("memory:/"):]):
            fs.rm(url[len("memory:/"):], recursive=True)
    else:
        yield str(tmp_path / "dq"), request.param == "journal"


def open_address(store, **settings):
    root, journal = store
    a = DurableQueue(root).address(NAME, journal=journal, page_size_bytes=PAGE, **settings)
    assert a.format.journal == journal
    return a


def send(a, k: int) -> None:
    """Send ``k`` of 100 rows: ``i`` is the ``_seq`` each row gets (one sender)."""
    a.send(pa.table({"i": pa.array(range(k * ROWS, (k + 1) * ROWS), pa.int64())}))


def received(consumer) -> list[int]:
    out: list[int] = []
    while True:
        t = consumer.receive(max_messages=10**6)
        if not t.num_rows:
            return out
        assert t.column("i").to_pylist() == t.column("_seq").to_pylist()
        out += t.column("i").to_pylist()


# -- settings -----------------------------------------------------------------------------------
def test_retention_options_have_kafkas_names_and_default_to_unbounded():
    assert parse_options({"retentionMs": "7d", "retentionBytes": "50MiB"}, "address") == {
        "retention_ms": 7 * 86_400_000, "retention_bytes": 50 << 20}
    assert parse_options({"retention.ms": -1, "retention_bytes": "-1"}, "write") == {
        "retention_ms": -1, "retention_bytes": -1}
    for bad in ({"retentionMs": 0}, {"retentionBytes": 0}, {"retentionMs": "soon"}):
        with pytest.raises(InvalidOptionError, match="retention"):
            parse_options(bad, "address")


def test_without_retention_nothing_unread_goes(store):
    a = open_address(store)
    a.consumer("idle")
    for k in range(20):
        send(a, k)
    report = a.cleanup(dry_run=False, now=time.time() + 10**6)
    assert report.pages == [] and report.retention_messages == 0
    assert a.stats()["messages"] == 20 * ROWS


# -- by bytes -----------------------------------------------------------------------------------
def test_retention_bytes_removes_the_oldest_whole_pages_even_unread(store, caplog):
    bound = 4 * PAGE
    a = open_address(store, retention_bytes=bound, cleanup_interval_ms=3_600_000)
    idle = a.consumer("idle", start="earliest")
    for k in range(40):
        send(a, k)
    total = a.stats()["bytes"]
    assert total > 3 * bound
    dry = a.cleanup()  # a dry run reports, removes nothing
    assert dry.retention_messages > 0 and a.stats()["bytes"] == total

    report = a.cleanup(dry_run=False)
    stats = a.stats()
    first = stats["first_seq"]
    # Kafka's rule: at least the bound is kept, at most the bound and one page
    assert bound <= stats["bytes"] <= bound + PAGE + 2048, stats["bytes"]
    assert first > 0
    assert a.format.journal or first % ROWS == 0  # a page file holds whole sends
    assert report.retention_messages == first == stats["retention_removed_messages"]
    assert stats["retention_removed_bytes"] == total - stats["bytes"] == report.retention_bytes
    assert report.retention_lost == [(0, first)]
    assert stats["lost_messages"] == 0  # repair's figure stays repair's
    # a fresh opener (and a checkpoint of the state) agrees
    fresh = open_address(store)
    assert fresh.state.retention_lost == [(0, first)]
    assert fresh.stats()["retention_removed_messages"] == first

    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        got = received(idle)
    assert got == list(range(first, 40 * ROWS))
    assert f"_seq 0..{first - 1} are lost (retention" in caplog.text
    if store[0].startswith("memory://"):
        return
    files = os.listdir(Path(store[0], NAME, "pages"))
    kept = sum(os.path.getsize(Path(store[0], NAME, "pages", f)) for f in files)
    assert kept <= bound + 3 * PAGE, (kept, files)  # the files went too, not only the rows


def test_a_consumer_that_keeps_up_loses_nothing_and_sees_no_loss(store, caplog):
    a = open_address(store, retention_bytes=2 * PAGE, cleanup_interval_ms=0)
    fast = a.consumer("fast", start="earliest")
    got: list[int] = []
    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        for k in range(30):
            send(a, k)  # over retention: the send runs cleanup itself
            t = fast.receive(max_messages=10**6)
            got += t.column("i").to_pylist()
            fast.ack(t, flush=True)
    assert got == list(range(30 * ROWS))
    assert "are lost" not in caplog.text
    assert a.stats()["first_seq"] > 0  # pages did go
    assert a.stats()["retention_removed_messages"] == 0  # but only what it had read


def test_a_consumer_past_the_removed_range_sees_nothing_one_behind_reports_it(store, caplog):
    a = open_address(store, retention_bytes=2 * PAGE, cleanup_interval_ms=3_600_000)
    behind = a.consumer("behind", start="earliest")
    for k in range(10):
        send(a, k)
    ahead = a.consumer("ahead", start="earliest")
    ahead.ack(10 * ROWS - 50, flush=True)
    passed = ahead.position
    for k in range(10, 20):
        send(a, k)
    a.cleanup(dry_run=False)
    first = a.stats()["first_seq"]
    assert first > passed
    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        ahead_got = received(ahead)
    assert ahead_got == list(range(first, 20 * ROWS))
    assert f"_seq {passed}..{first - 1} are lost" in caplog.text  # only its own part
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        assert received(behind) == list(range(first, 20 * ROWS))
    assert f"_seq 0..{first - 1} are lost (retention" in caplog.text


# -- by time ------------------------------------------------------------------------------------
def test_retention_ms_removes_pages_whose_newest_message_is_older(store, caplog):
    a = open_address(store, retention_ms=60_000, cleanup_interval_ms=3_600_000)
    idle = a.consumer("idle")
    for k in range(20):
        send(a, k)
    assert a.cleanup(dry_run=False).pages == []  # nothing is a minute old yet
    report = a.cleanup(dry_run=False, now=time.time() + 120)
    stats = a.stats()
    if a.format.journal:  # the segment being written stays
        assert 0 < stats["messages"] <= PAGE // 8
    else:
        assert stats["messages"] == 0
    first = stats["first_seq"]
    assert report.retention_messages == first == stats["retention_removed_messages"] > 0
    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.consumer"):
        assert received(idle) == list(range(first, 20 * ROWS))
    assert f"_seq 0..{first - 1} are lost (retention" in caplog.text


# -- the send trigger ---------------------------------------------------------------------------
def test_a_send_over_retention_runs_cleanup_itself_at_most_every_interval(store):
    a = open_address(store, retention_bytes=2 * PAGE, cleanup_interval_ms=0)
    a.consumer("idle")
    for k in range(30):
        send(a, k)
        if a._cleaner.background is not None:  # the cleanup the send started
            a._cleaner.background.join(timeout=30)
        assert a.stats()["bytes"] <= 2 * PAGE + PAGE + 2048
    assert a.stats()["retention_removed_messages"] > 0
    # with a long interval, a cleanup just run holds the next one back
    b = open_address(store, retention_bytes=2 * PAGE, cleanup_interval_ms=3_600_000)
    b.cleanup(dry_run=False)
    before = b.stats()["bytes"]
    for k in range(30, 40):
        send(b, k)
    assert b.stats()["bytes"] > before + 8 * ROWS * 8 // 2


# -- other processes ----------------------------------------------------------------------------
def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def covered(ranges: list[tuple[int, int]]) -> list[int]:
    return [s for a, b in ranges for s in range(a, b)]


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "pages"])
def test_a_reader_in_another_process_gets_whole_messages_and_the_lost_ranges(tmp_path, journal):
    """The parent sends (each send over retention starts a cleanup), then tells the reader
    where the log ends. A page that goes in the middle of one of the reader's reads makes it
    start that read over (printed; rare: ~1 in 6 runs of 120 sends on a journal, as the
    reader keeps segments it reads open), which must not change what it returns."""
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address(NAME, page_size_bytes=PAGE, retention_bytes=3 * PAGE,
                                   cleanup_interval_ms=0, journal=journal)
    assert a.format.journal == journal
    a.consumer("reader", start="earliest")
    out, done, progress = (tmp_path / n for n in ("reader.json", "end", "reader.out"))
    with open(progress, "w") as f:
        proc = subprocess.Popen([sys.executable, str(CHILD), "read", root, NAME, str(done),
                                 str(out)], env=child_env(), stdout=f, stderr=subprocess.PIPE,
                                text=True)
    try:
        k = 0
        while k < 150:
            send(a, k)  # over retention: the send starts a cleanup, pages go under the reader
            k += 1
            assert proc.poll() is None, proc.stderr.read()[-3000:]
        done.write_text(str(a.state.next_seq))
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.read_text())
    seqs, lost = got["seqs"], [tuple(r) for r in got["lost"]]
    assert seqs == sorted(set(seqs)), "a message twice or out of order"
    assert got["bad"] == 0  # every row's value is its _seq: no wrong or partial data
    assert lost, "retention never overtook the reader: the test proved nothing"
    print(f"{k} sends; reads started over because a page went under them: {got['again']}")
    # what it read and what it was told it lost are every message, once
    assert sorted(seqs + covered(lost)) == list(range(k * ROWS))
    assert a.stats()["retention_removed_messages"] >= len(covered(lost))


@pytest.mark.crash
def test_sigkill_during_retention_cleanups_loses_nothing_not_due(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address(NAME, page_size_bytes=PAGE, retention_bytes=3 * PAGE,
                                   cleanup_interval_ms=3_600_000)
    assert a.format.journal
    idle = a.consumer("idle", start="earliest")
    progress = tmp_path / "child.out"
    with open(progress, "w") as f:
        proc = subprocess.Popen([sys.executable, str(CHILD), "clean", root, NAME], stdout=f,
                                stderr=subprocess.PIPE, env=child_env())
    try:
        deadline = time.monotonic() + 30
        # killed once it has removed pages several times, in the middle of whatever it does
        while progress.read_text().count("\n") < 5:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the child made no progress"
            time.sleep(0.01)
        time.sleep(0.05)
        assert proc.poll() is None, "the child died on its own"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    proc.stderr.close()

    b = DurableQueue(root).address(NAME)
    state = b.state
    end = state.next_seq
    assert end > 5 * ROWS
    got = received(b.consumer("idle"))
    lost = list(state.retention_lost)
    # nothing twice; every message either retained and read, or removed by retention
    assert got == sorted(set(got))
    assert sorted(got + covered(lost)) == list(range(end))
    # nothing was removed that was not due: at least the bound is kept
    assert b.stats()["bytes"] >= 3 * PAGE
    # a cleanup after the kill finishes what was interrupted and keeps the bound
    b.cleanup(dry_run=False)
    assert 3 * PAGE <= b.stats()["bytes"] <= 4 * PAGE + 2048
    files = os.listdir(Path(root, NAME, "pages"))
    assert sum(os.path.getsize(Path(root, NAME, "pages", f)) for f in files) <= 8 * PAGE
    assert received(DurableQueue(root).address(NAME).consumer("late", start="earliest")) == \
        list(range(b.stats()["first_seq"], end))
    del idle


# -- Spark --------------------------------------------------------------------------------------
@pytest.mark.spark
def test_the_spark_source_applies_fail_on_data_loss_to_what_retention_removed(spark, tmp_path):
    from conftest import finish_query

    root = str(tmp_path / "dq")
    a = DurableQueue(root).address(NAME, journal=False)
    for k in range(3):  # a page file per send
        ids = list(range(k * ROWS, (k + 1) * ROWS))
        a.send(pa.table({"i": pa.array(ids, pa.int64()),
                         "region": ["EU" if i % 3 == 0 else "US" for i in ids]}))
    for c in ("strict", "strict_eu", "lax_eu"):  # each read (and acknowledged) _seq 0..9
        with a.consumer(c, start="earliest") as consumer:  # closed: the queries may own it
            consumer.ack(9, flush=True)
    last = a.state.pages.bytes[-1]
    a = DurableQueue(root).address(NAME, retention_bytes=last)  # keeps the last page only
    assert a.cleanup(dry_run=False).retention_lost == [(0, 2 * ROWS)]

    def stream(consumer, **options):
        reader = (spark.readStream.format("durablequeue").option("address", NAME)
                  .option("consumer", consumer))
        for k, v in options.items():
            reader = reader.option(k, v)
        return reader.load(root)

    for consumer, options in (("strict", {}), ("strict_eu", {"selector": "region = 'EU'"})):
        q = (stream(consumer, **options).writeStream.format("memory")
             .queryName(f"t_{uuid.uuid4().hex[:10]}")
             .option("checkpointLocation", str(tmp_path / f"ck-{consumer}"))
             .trigger(availableNow=True).start())
        try:
            with pytest.raises(Exception):  # noqa: B017 (Spark wraps it)
                q.awaitTermination(120)
        finally:
            q.stop()
        error = str(q.exception())
        assert "DataLossError" in error and f"10..{2 * ROWS - 1}" in error, error
        assert "retention" in error
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (stream("lax_eu", selector="region = 'EU'", failOnDataLoss="false").writeStream
         .format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck-lax")).trigger(availableNow=True)
         .start())
    finish_query(q)
    got = sorted(r.i for r in spark.table(name).select("i").collect())
    assert got == [i for i in range(2 * ROWS, 3 * ROWS) if i % 3 == 0]
