"""Contract tests of the storage engine, run on ``file://`` and ``memory://``.

Every test works through the public client (``DurableQueue`` / ``Address`` / ``Consumer``) on a
real filesystem (local disk or fsspec's memory filesystem), and reopens the store with a fresh
``DurableQueue(root).address(name)`` after each mutating operation to check that the state was
persisted, not just held in memory.
"""

from __future__ import annotations

import threading
import time

import pandas as pd
import pyarrow as pa
import pytest
from conftest import raw_read, raw_write

from pyspark_durable_queue import (
    AddressFullError,
    AddressNotFoundError,
    ConsumerNotFoundError,
    CorruptPageError,
    DurableQueue,
    InvalidOptionError,
    SchemaMismatchError,
)
from pyspark_durable_queue._log.commit_log import CHECKPOINT_EVERY, checkpoint_name, entry_name
from pyspark_durable_queue._log.journal import is_segment
from pyspark_durable_queue._ops.group_commit import SendQueue

NAME = "orders"


# -- helpers ------------------------------------------------------------------------------------
def reopen(root: str, name: str = NAME, **settings):
    """A fresh handle on an address, sharing nothing with earlier handles but the files."""
    return DurableQueue(root).address(name, **settings)


def rows(n: int, start: int = 0, text: str = "x") -> list[dict]:
    return [{"i": i, "s": f"{text}{i}"} for i in range(start, start + n)]


def page_files(addr, segments: bool = True) -> set[str]:
    """The files that hold messages: pages, and journal segments (a local disk's default)
    unless ``segments`` is false."""
    return {n for n in addr.storage.list(addr.pages_folder)
            if n.endswith(".page") or (segments and is_segment(n))}


def live_pages(addr) -> list[str]:
    return list(addr.state.pages.names)


def read_all(addr, consumer: str = "_reader", start="earliest") -> pa.Table:
    """Every retained message from ``start``, through a throwaway consumer."""
    c = addr.consumer("reader-tmp", start=start)
    try:
        parts = list(c.batches(max_messages=100_000, max_bytes=1 << 30))
        return pa.concat_tables(parts) if parts else c.receive()
    finally:
        c.delete()


# -- addresses and settings ---------------------------------------------------------------------
def test_address_open_or_create(root):
    q = DurableQueue(root)
    with pytest.raises(AddressNotFoundError):
        q.address(NAME, create=False)
    assert q.addresses() == []
    a = q.address(NAME)
    assert a.schema is None
    assert DurableQueue(root).addresses() == [NAME]
    # opening again does not recreate or lose anything
    a.send(rows(3))
    b = DurableQueue(root).address(NAME, create=False)
    assert b.state.next_seq == 3
    assert DurableQueue(root).addresses() == [NAME]


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_settings_persisted(root, compression):
    settings = dict(page_size_bytes=4096, max_size_bytes=1_000_000, max_size_messages=500,
                    address_full_policy="block", block_timeout_ms=1234,
                    compression=compression, archive_data_logs=True,
                    directory_archive="old", cleanup_interval_ms=10, orphan_grace_ms=99)
    DurableQueue(root).address(NAME, **settings)
    s = reopen(root).settings
    assert s.page_size_bytes == 4096
    assert s.max_size_bytes == 1_000_000
    assert s.max_size_messages == 500
    assert s.address_full_policy == "BLOCK"  # normalised
    assert s.block_timeout_ms == 1234
    assert s.compression == compression
    assert s.archive_data_logs is True
    assert s.directory_archive == "old"
    assert s.cleanup_interval_ms == 10
    assert s.orphan_grace_ms == 99
    # data written with this compression reads back
    reopen(root).send(rows(50, text="compressible " * 10))
    t = read_all(reopen(root))
    assert t.column("i").to_pylist() == list(range(50))
    assert t.column("s").to_pylist() == [f"{'compressible ' * 10}{i}" for i in range(50)]


def test_compression_shrinks_pages(root):
    sizes = {}
    for comp in ("none", "lz4", "zstd"):
        a = DurableQueue(root).address(f"c-{comp}", compression=comp)
        a.send([{"s": "abcdefgh" * 200} for _ in range(200)])
        sizes[comp] = sum(reopen(root, f"c-{comp}").state.pages.bytes)
    assert sizes["lz4"] < sizes["none"] / 4
    assert sizes["zstd"] < sizes["none"] / 4


def test_settings_updated_on_reopen(root):
    DurableQueue(root).address(NAME, page_size_bytes=4096, address_full_policy="DROP",
                               max_size_messages=10)
    reopen(root, page_size_bytes=8192)
    s = reopen(root).settings
    assert s.page_size_bytes == 8192
    # settings not given are kept
    assert s.address_full_policy == "DROP"
    assert s.max_size_messages == 10
    reopen(root, address_full_policy="FAIL", compression="zstd")
    s = reopen(root).settings
    assert (s.page_size_bytes, s.address_full_policy, s.compression) == (8192, "FAIL", "zstd")


# -- schema -------------------------------------------------------------------------------------
def test_schema_fixed_by_first_send(root):
    a = DurableQueue(root).address(NAME)
    a.send([{"region": "EU", "amount": 120}])
    schema = reopen(root).schema
    assert schema.names == ["region", "amount"]
    assert schema.field("region").type == pa.string()
    assert schema.field("amount").type == pa.int64()
    # compatible sends are accepted: same columns, column order free, safe numeric cast
    reopen(root).send([{"amount": 5.0, "region": "US"}])
    reopen(root).send(pa.table({"region": ["X"], "amount": pa.array([7], pa.int32())}))
    t = read_all(reopen(root))
    assert t.column("amount").to_pylist() == [120, 5, 7]
    assert reopen(root).schema.equals(schema)


@pytest.mark.parametrize("bad, column", [
    ({"region": 5, "amount": 1}, "region"),         # number into a string column
    ({"region": "EU", "amount": "many"}, "amount"),  # string into a number column
    ({"region": "EU", "amount": 1.5}, "amount"),     # lossy float -> int
    ({"region": "EU", "amount": 1, "extra": 2}, "extra"),  # new column without merge
], ids=["int-into-string", "string-into-int", "lossy-float", "new-column"])
def test_incompatible_schema_rejected(root, bad, column):
    a = DurableQueue(root).address(NAME)
    a.send([{"region": "EU", "amount": 120}])
    before = page_files(a)
    with pytest.raises(SchemaMismatchError, match=column):
        reopen(root).send([bad])
    b = reopen(root)
    assert b.state.next_seq == 1
    assert b.state.version == 1
    assert page_files(b) == before
    assert b.schema.names == ["region", "amount"]


def test_missing_non_nullable_column_rejected(root):
    schema = pa.schema([pa.field("k", pa.int64(), nullable=False), pa.field("v", pa.string())])
    DurableQueue(root).address(NAME).send(pa.table({"k": [1], "v": ["a"]}, schema=schema))
    with pytest.raises(SchemaMismatchError, match="'k'"):
        reopen(root).send([{"v": "b"}])
    # a missing nullable column is filled with nulls
    reopen(root).send([{"k": 2}])
    t = read_all(reopen(root))
    assert t.column("v").to_pylist() == ["a", None]


def test_commit_checks_page_schema(root):
    """Spark tasks write pages and the driver commits them; the commit re-checks the schema."""
    a = DurableQueue(root).address(NAME)
    a.send([{"a": 1}])
    w = a.page_writer()
    bad = pa.table({"a": ["text"]})
    w.write(bad)
    pages = w.close()
    with pytest.raises(SchemaMismatchError, match="'a'"):
        reopen(root).commit(pages, bad.schema)
    b = reopen(root)
    assert b.state.next_seq == 1
    assert not {p.name for p in pages} & page_files(b)


def test_merge_schema_adds_nullable_columns(root):
    a = DurableQueue(root).address(NAME)
    a.send(rows(3))
    with pytest.raises(SchemaMismatchError, match="merge_schema"):
        reopen(root).send([{"i": 3, "s": "s3", "region": "EU"}])
    reopen(root).send([{"i": 3, "s": "s3", "region": "EU"}], merge_schema=True)
    b = reopen(root)
    assert b.schema.names == ["i", "s", "region"]
    assert b.schema.field("region").nullable
    # a later send without the new column is fine (null), and the grown schema stays
    b.send([{"i": 4, "s": "s4"}])
    t = read_all(reopen(root))
    assert t.column("i").to_pylist() == [0, 1, 2, 3, 4]
    assert t.column("region").to_pylist() == [None, None, None, "EU", None]
    assert t.column("_seq").to_pylist() == [0, 1, 2, 3, 4]


# -- sending ------------------------------------------------------------------------------------
def test_send_forms(root):
    a = DurableQueue(root).address(NAME)
    r = a.send([{"i": 0, "s": "a"}, {"i": 1, "s": "b"}])
    assert (r.seq, r.count) == (0, 2)
    r = reopen(root).send({"i": 2, "s": "c"})
    assert (r.seq, r.count) == (2, 1)
    r = reopen(root).send(pa.table({"i": [3, 4], "s": ["d", "e"]}))
    assert (r.seq, r.count) == (3, 2)
    r = reopen(root).send(pa.record_batch({"i": [5], "s": ["f"]}))
    assert (r.seq, r.count) == (5, 1)
    df = pd.DataFrame({"i": [6, 7], "s": ["g", "h"]}, index=[10, 11])
    r = reopen(root).send(df)
    assert (r.seq, r.count) == (6, 2)
    assert reopen(root).send([]).count == 0
    assert reopen(root).send(pa.table({"i": pa.array([], pa.int64())})).count == 0
    t = read_all(reopen(root))
    assert t.column_names == ["i", "s", "_seq", "_timestamp", "_delivery_count"]
    assert t.column("i").to_pylist() == list(range(8))
    assert t.column("s").to_pylist() == list("abcdefgh")
    assert t.column("_seq").to_pylist() == list(range(8))
    assert reopen(root).state.next_seq == 8


def test_system_columns(root):
    a = DurableQueue(root).address(NAME)
    before = pa.scalar(int(time.time() * 1e6) - 1_000_000, pa.timestamp("us", tz="UTC"))
    for k in range(3):
        reopen(root).send(rows(2, start=2 * k))
    t = read_all(reopen(root))
    assert t.schema.field("_seq").type == pa.int64()
    assert t.schema.field("_timestamp").type == pa.timestamp("us", tz="UTC")
    ts = t.column("_timestamp").to_pylist()
    assert ts == sorted(ts)
    assert ts[0] >= before.as_py()
    assert ts[0] == ts[1] and ts[2] == ts[3]  # one commit, one timestamp
    assert a.state.next_seq == 6


def test_page_rolling(root):
    a = DurableQueue(root).address(NAME, journal=False, page_size_bytes=4096)  # pages per commit
    a.send([{"i": i, "s": "y" * 40} for i in range(500)])
    b = reopen(root)
    idx = b.state.pages
    assert len(idx) >= 3
    assert sum(idx.rows) == 500
    for i in range(len(idx)):
        assert idx.bytes[i] <= 4096, f"page {i} is {idx.bytes[i]} bytes"
    # ranges are contiguous and the files are the size the log says
    assert idx.seq[0] == 0
    for i in range(1, len(idx)):
        assert idx.seq[i] == idx.ends[i - 1]
    for name, nbytes in zip(idx.names, idx.bytes, strict=True):
        assert b.storage.size(f"{b.pages_folder}/{name}") == nbytes
    assert page_files(b) == set(idx.names)


def test_large_message_gets_own_page(root):
    a = DurableQueue(root).address(NAME, journal=False, page_size_bytes=2048)  # pages per commit
    a.send([{"i": 0, "s": "a"}, {"i": 1, "s": "B" * 10_000}, {"i": 2, "s": "c"}])
    idx = reopen(root).state.pages
    big = [i for i in range(len(idx)) if idx.seq[i] <= 1 < idx.ends[i]]
    assert len(big) == 1
    assert idx.rows[big[0]] == 1
    assert idx.bytes[big[0]] > 10_000
    t = read_all(reopen(root))
    assert t.column("s").to_pylist() == ["a", "B" * 10_000, "c"]


def test_per_page_stats(root):
    a = DurableQueue(root).address(NAME, journal=False, page_size_bytes=2048)  # pages per commit
    for k in range(4):
        a.send([{"i": i, "region": "EU" if i < 40 else "US"} for i in range(20 * k, 20 * k + 20)])
    idx = reopen(root).state.pages
    assert len(idx) > 1
    for p in range(len(idx)):
        st = idx.stats(p)
        assert st["rows"] == idx.rows[p]
        col = st["columns"]["i"]
        assert col["min"] == idx.seq[p]  # i == _seq here
        assert col["max"] == idx.ends[p] - 1
        assert col["null_count"] == 0
        regions = st["columns"]["region"]
        assert regions["min"] <= regions["max"]
    first, last = idx.stats(0)["columns"]["region"], idx.stats(len(idx) - 1)["columns"]["region"]
    assert (first["min"], first["max"]) == ("EU", "EU")
    assert (last["min"], last["max"]) == ("US", "US")


# -- consumers ----------------------------------------------------------------------------------
def test_consumer_start_positions(root):
    a = DurableQueue(root).address(NAME)
    a.send(rows(10))
    a.consumer("early", start="earliest")
    a.consumer("late", start="latest")
    a.consumer("given", start=7)
    a.consumer("given-text", start="4")
    b = reopen(root)
    assert {n: c["position"] for n, c in b.consumers().items()} == {
        "early": 0, "late": 10, "given": 7, "given-text": 4}
    assert b.consumer("early").receive().column("i").to_pylist() == list(range(10))
    assert b.consumer("late").receive().num_rows == 0
    assert b.consumer("given").receive().column("_seq").to_pylist() == [7, 8, 9]
    # an existing consumer resumes at its watermark; start is only for new consumers
    assert reopen(root).consumer("late", start="earliest").position == 10
    b.send(rows(2, start=10))
    assert reopen(root).consumer("late").receive().column("i").to_pylist() == [10, 11]


def test_consumer_on_empty_address(root):
    a = DurableQueue(root).address(NAME)
    c = a.consumer("c")
    t = c.receive()
    assert t.num_rows == 0
    assert t.column_names == ["_seq", "_timestamp", "_delivery_count"]
    a.send(rows(2))
    t = reopen(root).consumer("c").receive()
    assert t.column("i").to_pylist() == [0, 1]


def test_receive_limits_and_order(root):
    a = DurableQueue(root).address(NAME, page_size_bytes=2048)
    for k in range(5):
        a.send(rows(20, start=20 * k))
    c = reopen(root).consumer("c")
    got = []
    t = c.receive(max_messages=7)
    assert t.num_rows == 7
    assert t.column_names == ["i", "s", "_seq", "_timestamp", "_delivery_count"]
    got += t.column("_seq").to_pylist()
    t = c.receive(max_messages=1000, max_bytes=200)
    assert 1 <= t.num_rows < 93
    got += t.column("_seq").to_pylist()
    t = c.receive(max_messages=1, max_bytes=1)  # one message always goes
    assert t.num_rows == 1
    got += t.column("_seq").to_pylist()
    while (t := c.receive(max_messages=13)).num_rows:
        assert t.num_rows <= 13
        got += t.column("_seq").to_pylist()
    assert got == list(range(100))
    # nothing was acknowledged: a reopened consumer starts over
    assert reopen(root).consumers()["c"]["position"] == 0
    assert reopen(root).consumer("c").receive(max_messages=3).column("i").to_pylist() == [0, 1, 2]


def test_iterating_a_consumer_receives_until_nothing_is_left(root):
    a = reopen(root)
    for k in range(3):
        a.send(rows(10, start=10 * k))
    c = a.consumer("it", selector="i >= 5")
    sizes = [t.num_rows for t in c.batches(max_messages=7)]
    assert sizes == [7, 7, 7, 4] and c.cursor == 30
    assert c.position == 0  # iterating acknowledges nothing
    assert reopen(root).consumers()["it"]["position"] == 0
    again = reopen(root).consumer("it")
    got = []
    for batch in again:
        got += batch.column("i").to_pylist()
        again.ack(batch)
    assert got == list(range(5, 30))
    assert reopen(root).consumers()["it"]["position"] == 30
    assert list(again) == []


def test_ack_and_resume(root):
    a = DurableQueue(root).address(NAME)
    a.send(rows(10))
    c = reopen(root).consumer("c")
    t1 = c.receive(max_messages=4)
    c.receive(max_messages=3)  # delivered, not acknowledged
    c.ack(t1)
    assert reopen(root).consumers()["c"]["position"] == 4
    # unacknowledged messages are delivered again after a reopen
    c = reopen(root).consumer("c")
    assert c.receive(max_messages=100).column("_seq").to_pylist() == list(range(4, 10))
    c.ack()  # everything received
    assert reopen(root).consumers()["c"]["position"] == 10
    c = reopen(root).consumer("c")
    c.ack(2)  # never backwards
    assert reopen(root).consumers()["c"]["position"] == 10
    reopen(root).send(rows(3, start=10))
    c = reopen(root).consumer("c")
    c.ack(11)  # up to and including a _seq
    assert reopen(root).consumers()["c"]["position"] == 12
    assert reopen(root).consumer("c").receive().column("i").to_pylist() == [12]


def test_consumers_are_independent(root):
    a = DurableQueue(root).address(NAME)
    a.send(rows(6))
    x, y = a.consumer("x"), a.consumer("y")
    x.ack(x.receive(max_messages=4))
    assert y.receive(max_messages=2).column("i").to_pylist() == [0, 1]
    b = reopen(root)
    assert b.consumer("x").receive().column("i").to_pylist() == [4, 5]
    assert b.consumer("y").receive().column("i").to_pylist() == list(range(6))


def test_seek(root):
    a = DurableQueue(root).address(NAME)
    a.send(rows(10))
    c = a.consumer("c")
    c.ack(c.receive(max_messages=8))
    reopen(root).consumer("c").seek(3)  # backwards
    c = reopen(root).consumer("c")
    assert c.position == 3
    assert c.receive(max_messages=2).column("_seq").to_pylist() == [3, 4]
    c.seek("latest")
    assert reopen(root).consumers()["c"]["position"] == 10
    assert c.receive().num_rows == 0
    c.seek("earliest")
    c = reopen(root).consumer("c")
    assert c.position == 0
    assert c.receive(max_messages=1).column("_seq").to_pylist() == [0]


def test_delete_consumer(root):
    # pages per commit
    a = DurableQueue(root).address(NAME, journal=False, page_size_bytes=1024,
                                   cleanup_interval_ms=0)
    a.send(rows(5))
    keep = a.consumer("keep")
    gone = a.consumer("gone")
    assert set(reopen(root).consumers()) == {"keep", "gone"}
    gone.delete()
    assert set(reopen(root).consumers()) == {"keep"}
    with pytest.raises(ConsumerNotFoundError):
        reopen(root).consumer("gone", create=False)
    gone.receive()
    with pytest.raises(ConsumerNotFoundError):
        gone.ack()
    # a deleted consumer holds nothing back
    keep.ack(keep.receive())
    assert reopen(root).cleanup(dry_run=True).pages == []
    assert reopen(root).state.first_seq == 5
    assert len(reopen(root).state.pages) == 0


def test_delete_address(root):
    q = DurableQueue(root)
    q.address("a1").send(rows(2))
    q.address("a2").send(rows(2))
    DurableQueue(root).delete_address("a1")
    assert DurableQueue(root).addresses() == ["a2"]
    with pytest.raises(AddressNotFoundError):
        DurableQueue(root).address("a1", create=False)
    with pytest.raises(AddressNotFoundError):
        DurableQueue(root).delete_address("a1")
    # recreated from scratch
    assert DurableQueue(root).address("a1").state.next_seq == 0
    assert read_all(reopen(root, "a2")).num_rows == 2


# -- full policies ------------------------------------------------------------------------------
def test_policy_page_accepts_beyond_limit(root):
    a = DurableQueue(root).address(NAME, max_size_messages=5, address_full_policy="PAGE")
    for k in range(4):
        assert reopen(root).send(rows(3, start=3 * k)).count == 3
    b = reopen(root)
    assert b.state.next_seq == 12
    assert b.stats()["dropped_messages"] == 0
    assert a.settings.address_full_policy == "PAGE"


def test_policy_drop(root):
    a = DurableQueue(root).address(NAME, max_size_messages=5, address_full_policy="DROP")
    a.send(rows(5))
    before = page_files(reopen(root))
    r = reopen(root).send(rows(2, start=5))
    assert r.dropped and r.count == 0
    reopen(root).send(rows(3, start=7))
    b = reopen(root)
    st = b.stats()
    assert st["dropped_messages"] == 5
    assert st["dropped_sends"] == 2
    assert st["dropped_bytes"] > 0
    assert st["messages"] == 5 and b.state.next_seq == 5
    assert page_files(b) == before
    # a consumer acks: room again
    c = b.consumer("c")
    c.ack(c.receive(max_messages=3))
    assert reopen(root).send(rows(2, start=10)).count == 2
    assert reopen(root).stats()["dropped_messages"] == 5


def test_policy_fail_stores_nothing(root):
    a = DurableQueue(root).address(NAME, max_size_messages=5, address_full_policy="FAIL")
    a.send(rows(4))
    a.send(rows(1, start=4))
    b = reopen(root)
    files, version = page_files(b), b.state.version
    with pytest.raises(AddressFullError, match="full"):
        b.send(rows(1, start=5))
    with pytest.raises(AddressFullError):
        reopen(root).send(rows(50, start=5))
    b = reopen(root)
    assert b.state.next_seq == 5
    assert b.state.version == version
    assert page_files(b) == files  # no leaked page files
    assert b.stats()["dropped_messages"] == 0


def test_policy_fail_by_bytes(root):
    a = DurableQueue(root).address(NAME, max_size_bytes=4096, address_full_policy="FAIL")
    a.send(rows(5))
    with pytest.raises(AddressFullError, match="maxSizeBytes"):
        for k in range(50):
            reopen(root).send(rows(5, start=5 * (k + 1), text="z" * 100))
    b = reopen(root)
    assert page_files(b) == set(b.state.pages.names)
    assert b.state.next_seq % 5 == 0


def test_policy_block_waits_for_ack(root):
    a = DurableQueue(root).address(NAME, max_size_messages=10, address_full_policy="BLOCK",
                                   block_timeout_ms=10_000)
    a.send(rows(10))
    c = DurableQueue(root).address(NAME).consumer("c")
    acked = threading.Event()

    def consume():
        time.sleep(0.3)
        c.ack(c.receive(max_messages=5))
        acked.set()

    th = threading.Thread(target=consume)
    t0 = time.monotonic()
    th.start()
    r = reopen(root).send(rows(3, start=10))
    elapsed = time.monotonic() - t0
    th.join()
    assert acked.is_set()
    assert r.count == 3 and r.seq == 10
    assert 0.25 <= elapsed < 9
    assert reopen(root).state.next_seq == 13


def test_policy_block_times_out(root):
    a = DurableQueue(root).address(NAME, max_size_messages=10, address_full_policy="BLOCK",
                                   block_timeout_ms=300)
    a.send(rows(10))
    files = page_files(a)
    t0 = time.monotonic()
    with pytest.raises(AddressFullError, match="blockTimeoutMs=300"):
        reopen(root).send(rows(1, start=10))
    assert time.monotonic() - t0 >= 0.3
    b = reopen(root)
    assert b.state.next_seq == 10
    assert page_files(b) == files


@pytest.mark.parametrize("policy", ["FAIL", "DROP", "BLOCK"])
def test_limit_holds_when_another_writer_takes_the_room_first(root, policy):
    # Writer A passes the limit check; writer B (another handle, as another process would be)
    # commits in the moment before A publishes. A must apply its policy, not overshoot.
    a = DurableQueue(root).address(NAME, max_size_messages=10, address_full_policy=policy,
                                   block_timeout_ms=300)
    a.send(rows(4))
    b = DurableQueue(root).address(NAME)
    b._sends = SendQueue()  # not this process's queue of the address: as another process's
    publish = a.log.publish

    def b_commits_first(build, *args, **kwargs):  # a journal's publish also takes the frames
        if b.state.next_seq == 4:
            b.send(rows(5, start=4))
        return publish(build, *args, **kwargs)

    a.log.publish = b_commits_first  # runs between A's check and its publish
    if policy == "DROP":
        assert a.send(rows(5, start=100)).dropped
    else:
        with pytest.raises(AddressFullError):
            a.send(rows(5, start=100))
    c = reopen(root)
    assert c.state.next_seq == 9
    assert page_files(c) == set(c.state.pages.names)  # A's page did not leak


def test_send_larger_than_limit_into_empty_backlog(root):
    a = DurableQueue(root).address(NAME, max_size_messages=3, address_full_policy="FAIL")
    assert a.send(rows(10)).count == 10  # alone over the limit, but nothing is waiting
    with pytest.raises(AddressFullError):
        reopen(root).send(rows(1))


# -- cleanup ------------------------------------------------------------------------------------
def _paged(root, **settings):
    """An address with 4 sends -> several pages each, and two consumers at 0. Pages per commit
    (``journal=False``): cleanup here removes pages one by one."""
    a = DurableQueue(root).address(NAME, page_size_bytes=1024, cleanup_interval_ms=3_600_000,
                                   journal=False, **settings)
    for k in range(4):
        a.send(rows(10, start=10 * k))
    a.consumer("x")
    a.consumer("y")
    return reopen(root)


def test_cleanup_after_every_consumer(root):
    a = _paged(root)
    idx = a.state.pages
    assert len(idx) >= 4
    first_page_end = idx.ends[0]
    x = a.consumer("x")
    x.ack(x.receive(max_messages=1000))
    assert reopen(root).cleanup(dry_run=False).pages == []  # y still needs everything
    y = reopen(root).consumer("y")
    y.ack(first_page_end - 2)  # not past the first page yet
    assert reopen(root).cleanup(dry_run=False).pages == []
    y.ack(first_page_end - 1)  # now past exactly the first page
    b = reopen(root)
    report = b.cleanup(dry_run=False)
    assert report.pages == [idx.names[0]]
    assert report.bytes == idx.bytes[0]
    b = reopen(root)
    assert b.state.first_seq == first_page_end
    assert idx.names[0] not in page_files(b)
    assert page_files(b) == set(b.state.pages.names)
    # y reads on from its watermark; nothing it needs is gone
    assert b.consumer("y").receive(max_messages=1000).column("_seq").to_pylist() == list(
        range(first_page_end, 40))
    y.ack(39)
    reopen(root).cleanup(dry_run=False)
    b = reopen(root)
    assert len(b.state.pages) == 0 and b.state.first_seq == 40
    assert page_files(b) == set()
    # new sends continue the _seq
    assert b.send(rows(1, start=40)).seq == 40


def test_cleanup_dry_run_removes_nothing(root):
    a = _paged(root)
    for name in ("x", "y"):
        c = a.consumer(name)
        c.ack(c.receive(max_messages=25))
    files = page_files(a)
    version = a.state.version
    w = a.page_writer()
    w.write(pa.table({"i": [1], "s": ["orphan"]}))
    orphan = w.close()[0].name
    report = reopen(root).cleanup(now=time.time() + 10 ** 6)  # dry run by default
    assert report.dry_run
    assert report.pages and report.orphans == [orphan]
    assert report.bytes > 0
    b = reopen(root)
    assert page_files(b) == files | {orphan}
    assert b.state.version == version
    real = b.cleanup(dry_run=False, now=time.time() + 10 ** 6)
    assert (real.pages, real.orphans) == (report.pages, report.orphans)
    b = reopen(root)
    assert not set(report.pages) & page_files(b)
    assert report.to_dict()["dry_run"] is True


def test_cleanup_without_consumers_keeps_everything(root):
    a = DurableQueue(root).address(NAME, page_size_bytes=1024)
    a.send(rows(30))
    assert reopen(root).cleanup(dry_run=False).pages == []
    assert reopen(root).state.next_seq - reopen(root).state.first_seq == 30


def test_cleanup_archive(root):
    a = _paged(root, archive_data_logs=True, directory_archive="attic")
    idx = a.state.pages
    for name in ("x", "y"):
        c = a.consumer(name)
        c.ack(idx.ends[1] - 1)
    report = reopen(root).cleanup(dry_run=False)
    assert report.archived
    assert report.pages == idx.names[:2]
    b = reopen(root)
    archived = set(b.storage.list(f"{b.folder}/attic"))
    assert archived == set(idx.names[:2])
    assert not archived & page_files(b)
    # archived pages are intact page files
    from pyspark_durable_queue._format.page import read_page
    page = read_page(b.storage, f"{b.folder}/attic/{idx.names[0]}")
    assert page.rows == idx.rows[0]


def test_cleanup_archive_deletes_orphans_instead_of_archiving(root):
    a = _paged(root, archive_data_logs=True, directory_archive="attic", orphan_grace_ms=0)
    w = a.page_writer()
    w.write(pa.table({"i": [1], "s": ["orphan"]}))
    orphan = w.close()[0].name
    report = reopen(root).cleanup(dry_run=False)
    assert report.orphans == [orphan]
    b = reopen(root)
    assert orphan not in page_files(b)
    assert orphan not in set(b.storage.list(f"{b.folder}/attic"))


def test_cleanup_interval_for_ack_triggered_runs(root):
    # pages per commit
    a = DurableQueue(root).address(NAME, journal=False, page_size_bytes=1024,
                                   cleanup_interval_ms=3_600_000)
    a.send(rows(40))
    c = a.consumer("c")
    n_pages = len(a.state.pages)
    c.ack(0)  # first ack in this process runs cleanup (nothing to remove yet)
    c.ack(39)  # within the interval: no automatic cleanup
    assert len(reopen(root).state.pages) == n_pages
    assert reopen(root).cleanup(dry_run=False).pages  # an explicit cleanup does it
    assert len(reopen(root).state.pages) == 0

    b = reopen(root, cleanup_interval_ms=0)
    b.send(rows(40, start=40))
    c = b.consumer("c")
    first_end = b.state.pages.ends[0]
    c.ack(first_end - 1)
    assert reopen(root).state.first_seq == first_end  # ran right away
    c.ack(79)
    assert len(reopen(root).state.pages) == 0


def test_cleanup_interval_shared_across_handles(root):
    """A cleanup run by one handle (another process) counts for the interval of all."""
    # pages per commit
    a = DurableQueue(root).address(NAME, journal=False, page_size_bytes=1024,
                                   cleanup_interval_ms=3_600_000)
    a.send(rows(40))
    a.consumer("c")
    reopen(root).cleanup(dry_run=False)
    n_pages = len(reopen(root).state.pages)
    reopen(root).consumer("c").ack(39)  # a fresh handle: the last cleanup was just now
    assert len(reopen(root).state.pages) == n_pages
    reopen(root, cleanup_interval_ms=0).consumer("c").ack(39)  # already acked: no-op
    assert len(reopen(root).state.pages) == n_pages
    reopen(root).cleanup(dry_run=False)
    assert len(reopen(root).state.pages) == 0


def test_cleanup_interval_elapses(root):
    # pages per commit
    a = DurableQueue(root).address(NAME, journal=False, page_size_bytes=1024,
                                   cleanup_interval_ms=700)
    a.send(rows(40))
    c = a.consumer("c")
    c.ack(0)
    c.ack(20)
    assert reopen(root).state.first_seq == 0
    time.sleep(0.75)
    c.ack(39)
    assert len(reopen(root).state.pages) == 0


def test_orphan_pages_after_grace(root):
    a = DurableQueue(root).address(NAME)
    a.send(rows(3))
    w = a.page_writer()
    w.write(pa.table({"i": [99], "s": ["never committed"]}))
    orphan = w.close()[0].name
    live = set(a.state.pages.names)
    assert page_files(reopen(root)) == live | {orphan}
    # young orphans may belong to a writer still at work
    assert reopen(root).cleanup(dry_run=False).orphans == []
    assert orphan in page_files(reopen(root))
    report = reopen(root).cleanup(dry_run=False, now=time.time() + 3601)
    assert report.orphans == [orphan]
    assert page_files(reopen(root)) == live
    # orphan_grace_ms is a setting
    w = reopen(root).page_writer()
    w.write(pa.table({"i": [100], "s": ["again"]}))
    orphan = w.close()[0].name
    assert reopen(root, orphan_grace_ms=60_000).cleanup(dry_run=False).orphans == []
    time.sleep(0.05)
    assert reopen(root, orphan_grace_ms=10).cleanup(dry_run=False).orphans == [orphan]
    assert page_files(reopen(root)) == live
    assert read_all(reopen(root)).column("i").to_pylist() == [0, 1, 2]


# -- reporting ----------------------------------------------------------------------------------
def test_stats(root):
    a = DurableQueue(root).address(NAME, page_size_bytes=1024)
    empty = a.stats()
    assert (empty["messages"], empty["pages"], empty["next_seq"], empty["schema"]) == (
        0, 0, 0, None)
    a.send(rows(20))
    c = a.consumer("c")
    c.ack(9)
    st = reopen(root).stats()
    assert st["address"] == NAME
    assert st["messages"] == 20
    assert st["pages"] == len(a.state.pages)
    assert st["bytes"] == sum(a.state.pages.bytes) > 0
    assert (st["first_seq"], st["next_seq"], st["commits"]) == (0, 20, 1)
    assert st["dropped_messages"] == st["dropped_bytes"] == st["dropped_sends"] == 0
    assert "i: int64" in st["schema"]
    assert st["settings"]["page_size_bytes"] == 1024
    cst = st["consumers"]["c"]
    assert cst["position"] == 10
    assert cst["selector"] is None
    assert cst["backlog_messages"] == 10
    assert 0 < cst["backlog_bytes"] < st["bytes"]
    assert reopen(root).consumer("c").backlog()[0] == 10
    import json
    json.dumps(st)  # JSON-safe


# -- corruption ---------------------------------------------------------------------------------
def test_corrupted_page_detected(root):
    a = DurableQueue(root).address(NAME, journal=False)  # damages a page file
    a.send(rows(50))
    name = a.state.pages.names[0]
    path = f"{a.pages_folder}/{name}"
    data = bytearray(raw_read(a.storage, path))
    at = 8 + 20 + 40  # inside the first frame's payload (frame at 8, 20-byte header)
    data[at] ^= 0xFF
    raw_write(a.storage, path, bytes(data))
    c = reopen(root).consumer("c")
    with pytest.raises(CorruptPageError) as info:
        c.receive()
    err = info.value
    assert err.path.endswith(name)
    assert err.offset == 8
    assert name in str(err) and "byte 8" in str(err)
    assert "checksum" in str(err)
    assert isinstance(err, OSError)


@pytest.mark.parametrize("where", ["magic", "footer", "trailer"])
def test_corrupted_page_structure(root, where):
    a = DurableQueue(root).address(NAME, journal=False)  # damages a page file
    a.send(rows(5))
    name = a.state.pages.names[0]
    path = f"{a.pages_folder}/{name}"
    data = bytearray(raw_read(a.storage, path))
    at = {"magic": 2, "footer": len(data) - 30, "trailer": len(data) - 3}[where]
    data[at] ^= 0x01
    raw_write(a.storage, path, bytes(data))
    with pytest.raises(CorruptPageError) as info:
        reopen(root).consumer("c").receive()
    assert name in str(info.value)
    assert 0 <= info.value.offset < len(data)


@pytest.mark.parametrize("keep", [0.5, 0.99, 10], ids=["half", "tail", "head"])
def test_truncated_page_detected(root, keep):
    a = DurableQueue(root).address(NAME, journal=False)  # damages a page file
    a.send(rows(200))
    name = a.state.pages.names[0]
    path = f"{a.pages_folder}/{name}"
    data = raw_read(a.storage, path)
    cut = int(len(data) * keep) if keep < 1 else int(keep)
    raw_write(a.storage, path, data[:cut])
    with pytest.raises(CorruptPageError) as info:
        reopen(root).consumer("c").receive()
    assert name in str(info.value)
    assert 0 <= info.value.offset <= cut


# -- commit log ---------------------------------------------------------------------------------
def _state_snapshot(addr):
    st = addr.state
    return st.header(), st.pages.to_table().to_pydict()


def test_checkpoints(root):
    # checkpoints of log entry files
    a = DurableQueue(root).address(NAME, journal=False, fsync=False, page_size_bytes=1024,
                                   cleanup_interval_ms=0)
    c = a.consumer("c")
    for k in range(CHECKPOINT_EVERY + 7):
        a.send({"i": k, "s": "m"})
        if k % 10 == 9:
            c.ack(k - 5)  # interleave remove entries
    a.commit([], pa.schema([]))  # no-op
    log_folder = f"{a.folder}/log"
    names = set(a.storage.list(log_folder))
    assert checkpoint_name(CHECKPOINT_EVERY) in names
    expected = _state_snapshot(a)
    assert expected[0]["version"] > CHECKPOINT_EVERY
    assert _state_snapshot(reopen(root)) == expected
    # opening really uses the checkpoint: entries before it are no longer needed
    for v in range(1, CHECKPOINT_EVERY + 1):
        a.storage.delete(f"{log_folder}/{entry_name(v)}")
    assert _state_snapshot(reopen(root)) == expected
    # a damaged hint only costs a listing
    raw_write(a.storage, f"{log_folder}/_last_checkpoint", b"{not json")
    assert _state_snapshot(reopen(root)) == expected
    a.storage.delete(f"{log_folder}/_last_checkpoint")
    b = reopen(root)
    assert _state_snapshot(b) == expected
    b.send({"i": 1000, "s": "after"})
    assert read_all(reopen(root)).column("i").to_pylist()[-1] == 1000


def test_exactly_once_txn(root):
    a = DurableQueue(root).address(NAME)
    table = pa.table({"i": [1, 2, 3]})

    def write():
        w = reopen(root).page_writer()
        w.write(table)
        return w.close()

    first = write()
    r1 = reopen(root).commit(first, table.schema, txn=("q", 5))
    assert (r1.seq, r1.count, r1.duplicate) == (0, 3, False)
    second = write()
    r2 = reopen(root).commit(second, table.schema, txn=("q", 5))
    assert r2.duplicate and r2.count == 0
    b = reopen(root)
    assert b.state.next_seq == 3
    assert b.state.txns == {"q": 5}
    # the duplicate left no page file (a journal's segment holds only the commit records here)
    assert page_files(b, segments=False) == {p.name for p in first}
    # an older batch is a duplicate too; a newer batch and another query are appended
    assert reopen(root).commit(write(), table.schema, txn=("q", 4)).duplicate
    assert reopen(root).commit(write(), table.schema, txn=("q", 6)).count == 3
    assert reopen(root).commit(write(), table.schema, txn=("other", 0)).count == 3
    b = reopen(root)
    assert b.state.txns == {"q": 6, "other": 0}
    assert b.state.next_seq == 9
    assert page_files(b, segments=False) == set(b.state.pages.names)
    assert a.state.next_seq == 9


def test_exactly_once_same_pages_retried(root):
    """A driver retrying the commit of the very same pages must not lose them."""
    a = DurableQueue(root).address(NAME)
    table = pa.table({"i": [1, 2, 3]})
    w = a.page_writer()
    w.write(table)
    pages = w.close()
    assert not a.commit(pages, table.schema, txn=("q", 0)).duplicate
    assert reopen(root).commit(pages, table.schema, txn=("q", 0)).duplicate
    b = reopen(root)
    assert page_files(b, segments=False) == {p.name for p in pages}
    assert read_all(b).column("i").to_pylist() == [1, 2, 3]


def test_txn_with_drop_policy_is_recorded(root):
    a = DurableQueue(root).address(NAME, max_size_messages=2, address_full_policy="DROP")
    a.send(rows(2))
    table = pa.table({"i": [7], "s": ["x"]})
    w = a.page_writer()
    w.write(table)
    r = a.commit(w.close(), table.schema, txn=("q", 1))
    assert r.dropped
    w = reopen(root).page_writer()
    w.write(table)
    pages = w.close()
    assert reopen(root).commit(pages, table.schema, txn=("q", 1)).duplicate
    b = reopen(root)
    assert b.stats()["dropped_messages"] == 1
    assert page_files(b) == set(b.state.pages.names)


# -- idempotent sends: send(txn=(app id, version)) -------------------------------------------
def test_send_with_txn_stores_each_transaction_once(root):
    a = DurableQueue(root).address(NAME)
    first = a.send(rows(3), txn=("loader", 17))
    assert (first.seq, first.count, first.duplicate) == (0, 3, False)
    stored_pages = page_files(a)
    # the same pair again, and lower versions, store nothing and leave no page file behind
    for version in (17, 16, 0):
        r = reopen(root).send(rows(3, start=100), txn=("loader", version))
        assert (r.seq, r.count, r.version, r.duplicate) == (-1, 0, -1, True)
    b = reopen(root)
    assert page_files(b) == stored_pages
    assert read_all(b).column("i").to_pylist() == [0, 1, 2]
    # a higher version is stored; another app id has versions of its own
    assert reopen(root).send(rows(2, start=10), txn=("loader", 18)).count == 2
    assert reopen(root).send(rows(1, start=20), txn=("other", 0)).count == 1
    assert reopen(root).send(rows(1, start=30), txn=("other", 0)).duplicate
    assert reopen(root).send(rows(1, start=40)).count == 1  # no txn: always stored
    b = reopen(root)
    assert read_all(b).column("i").to_pylist() == [0, 1, 2, 10, 11, 20, 40]
    assert page_files(b) == set(b.state.pages.names)
    assert b.state.txns == {"app:loader": 18, "app:other": 0}
    # a fresh DurableQueue knows both transactions
    assert reopen(root).send(rows(1), txn=("loader", 18)).duplicate
    assert reopen(root).send(rows(1), txn=("other", 0)).duplicate
    assert reopen(root).state.next_seq == 7


def test_send_txn_ids_never_collide_with_the_spark_sinks_keys(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address(NAME)
    table = pa.table({"i": [1], "s": ["x"]})
    w = a.page_writer()
    w.write(table)
    a.commit(w.close(), table.schema, txn=("spark-query:q1", 5))  # as the streaming sink does
    r = reopen(root).send(rows(1), txn=("spark-query:q1", 5))
    assert not r.duplicate and r.count == 1
    assert reopen(root).state.txns == {"spark-query:q1": 5, "app:spark-query:q1": 5}


def test_send_txn_duplicate_found_at_commit_leaves_no_page(tmp_path, monkeypatch):
    """Two senders of one transaction race: both pass the early check, one publishes, the
    other's commit finds the transaction and deletes the pages it wrote."""
    import pyspark_durable_queue._ops.group_commit as group_module

    root = str(tmp_path / "dq")
    a = DurableQueue(root).address(NAME)
    a.send(rows(1, start=-1))  # fixes the schema
    real = group_module._fresh_members
    raced: list = []
    other = reopen(root)
    other._sends = SendQueue()  # another process's sends, not in this process's groups

    def check_then_lose_the_race(*args, **kwargs):
        members = real(*args, **kwargs)
        if not raced:  # the other sender publishes between our check and our commit
            raced.append(None)
            raced[0] = other.send(rows(2, start=10), txn=("loader", 1))
        return members

    monkeypatch.setattr(group_module, "_fresh_members", check_then_lose_the_race)
    r = a.send(rows(3), txn=("loader", 1))
    assert raced and raced[0].count == 2  # the race happened
    assert r.duplicate and r.count == 0
    b = reopen(root)
    assert read_all(b).column("i").to_pylist() == [-1, 10, 11]
    assert page_files(b) == set(b.state.pages.names)


def test_send_txn_survives_a_checkpoint(tmp_path):
    root = str(tmp_path / "dq")
    # checkpoints of log entry files
    a = DurableQueue(root).address(NAME, journal=False, fsync=False)
    a.send(rows(1), txn=("early", 3))  # entry 1: only the checkpoint will remember it
    for k in range(CHECKPOINT_EVERY + 4):
        a.send(rows(1, start=k + 1), txn=("loader", k))
    log_folder = f"{a.folder}/log"
    assert checkpoint_name(CHECKPOINT_EVERY) in set(a.storage.list(log_folder))
    for v in range(1, CHECKPOINT_EVERY + 1):  # opening must now rely on the checkpoint
        a.storage.delete(f"{log_folder}/{entry_name(v)}")
    b = reopen(root)
    assert b.state.checkpoint == CHECKPOINT_EVERY
    assert b.state.txns == {"app:early": 3, "app:loader": CHECKPOINT_EVERY + 3}
    assert b.send(rows(1), txn=("early", 3)).duplicate
    assert reopen(root).send(rows(1), txn=("loader", 50)).duplicate
    assert reopen(root).send(rows(1), txn=("loader", CHECKPOINT_EVERY + 3)).duplicate
    assert reopen(root).send(rows(1), txn=("early", 4)).count == 1
    assert reopen(root).state.next_seq == CHECKPOINT_EVERY + 6


@pytest.mark.parametrize(
    ("txn", "error"),
    [
        pytest.param("loader", TypeError, id="not-a-pair"),
        pytest.param(("loader",), TypeError, id="one-element"),
        pytest.param(("loader", 1, 2), TypeError, id="three-elements"),
        pytest.param((17, "loader"), TypeError, id="swapped"),
        pytest.param(("loader", "17"), TypeError, id="version-str"),
        pytest.param(("loader", 1.0), TypeError, id="version-float"),
        pytest.param(("loader", True), TypeError, id="version-bool"),
        pytest.param(("", 1), InvalidOptionError, id="empty-app-id"),
        pytest.param(("loader", -1), InvalidOptionError, id="negative-version"),
    ],
)
def test_send_txn_is_validated(tmp_path, txn, error):
    root = str(tmp_path / "dq")
    with pytest.raises(error, match="txn"):
        DurableQueue(root).address(NAME).send(rows(1), txn=txn)
    b = reopen(root)
    assert b.state.next_seq == 0 and not page_files(b)


# -- threads sharing one process ----------------------------------------------------------------
def test_threads_share_one_address(root):
    """A producer thread and a consumer thread on the same Address object."""
    a = DurableQueue(root).address(NAME, page_size_bytes=1024, cleanup_interval_ms=0,
                                   fsync=False)
    c = a.consumer("c")
    n_sends, per_send = 60, 3
    errors: list[BaseException] = []
    got: list[int] = []

    def produce():
        try:
            for k in range(n_sends):
                a.send(rows(per_send, start=per_send * k))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def consume():
        try:
            deadline = time.monotonic() + 120  # generous: a loaded CI machine
            while len(got) < n_sends * per_send and time.monotonic() < deadline:
                t = c.receive(max_messages=7)
                if t.num_rows:
                    got.extend(t.column("i").to_pylist())
                c.ack(t)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert got == list(range(n_sends * per_send))
    b = reopen(root)
    assert b.state.next_seq == n_sends * per_send
    assert b.consumers()["c"]["position"] == n_sends * per_send


@pytest.mark.parametrize("shared", [False, True], ids=["own-address", "shared-address"])
def test_threads_send_concurrently(root, shared):
    n_threads, n_sends = 4, 25
    one = DurableQueue(root).address(NAME, fsync=False, page_size_bytes=1024)
    errors: list[BaseException] = []

    def produce(t: int):
        try:
            a = one if shared else DurableQueue(root).address(NAME)
            for k in range(n_sends):
                if k % 5 == 0:
                    a.stats()  # a concurrent reader of the shared fold
                a.send([{"i": t * 1000 + k, "s": str(t)}, {"i": t * 1000 + k, "s": str(t)}])
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    t = read_all(reopen(root))
    assert t.column("_seq").to_pylist() == list(range(2 * n_threads * n_sends))
    values = t.column("i").to_pylist()
    assert sorted(set(values)) == sorted(t * 1000 + k for t in range(n_threads)
                                         for k in range(n_sends))
    assert all(values[j] == values[j + 1] for j in range(0, len(values), 2))  # sends stay whole
