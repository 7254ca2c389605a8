"""The Spark source: ``spark.readStream`` / ``spark.read`` ``.format("durablequeue")``.

Planning, admission, leases, filter translation and reading are checked without a JVM; the rest
goes through Spark (the session-scoped ``spark`` fixture). Test data is written with the Python
client.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import threading
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

import itertools

from pyspark.sql import datasource as ds
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes, ReadMaxRows

from pyspark_durable_queue import (
    ConsumerInUseError,
    DurableQueue,
    InvalidOptionError,
)
from pyspark_durable_queue._format.schema import SYSTEM_FIELDS, with_system_schema
from pyspark_durable_queue._log.commit_log import PageIndex
from pyspark_durable_queue._ops.lease import ConsumerLease
from pyspark_durable_queue._positions import ReadPosition
from pyspark_durable_queue._read.plan import Limits, admit, plan_tasks
from pyspark_durable_queue._read.tasks import ReadSpec, read_slices, rebatch
from pyspark_durable_queue._storage import open_storage
from pyspark_durable_queue.selector import Selector
from pyspark_durable_queue.settings import ReadSettings
from pyspark_durable_queue.spark._batch import DurableQueueBatchReader
from pyspark_durable_queue.spark._filters import filters_to_selector
from pyspark_durable_queue.spark._reader import QueuePartition, spark_schema
from pyspark_durable_queue.spark._source import DurableQueueStreamReader

REGIONS = ["EU", "US", "APAC"]


def send(root, name: str, start: int, n: int, **settings) -> None:
    """Messages ``id = start..start+n-1``; region cycles EU, US, APAC; amount = id % 100."""
    ids = list(range(start, start + n))
    DurableQueue(str(root)).address(name, **settings).send(pa.table({
        "id": pa.array(ids, pa.int64()),
        "region": [REGIONS[i % 3] for i in ids],
        "amount": pa.array([float(i % 100) for i in ids]),
    }))


def page_files(root, name: str) -> set[str]:
    return {p.name for p in (Path(root) / name / "pages").glob("*.page")}


def index_of(pages: list[tuple[int, int]]) -> PageIndex:
    """A page index of ``(rows, bytes)`` pages laid end to end from ``_seq`` 0."""
    idx = PageIndex()
    seq = 0
    for k, (rows, nbytes) in enumerate(pages):
        idx.add(f"p{k}.page", seq, rows, nbytes, 0, {"rows": rows, "columns": {}})
        seq += rows
    return idx


# -- planning (no JVM) --------------------------------------------------------------------------
def test_plan_coalesces_small_pages_and_splits_large_ones():
    small = index_of([(100, 1 << 20)] * 64)  # 64 pages of 1 MiB
    tasks = plan_tasks(small, 0, 6400, slots=2)
    assert len(tasks) == 2  # one per task slot (32 MiB each), not one per page
    assert [s.lo for t in tasks for s in t] == [k * 100 for k in range(64)]
    big = index_of([(10_000, 1 << 30)])  # one 1 GiB page
    tasks = plan_tasks(big, 0, 10_000, slots=2)
    assert len(tasks) == 8 and all(len(t) == 1 for t in tasks)  # 128 MiB at most per task
    covered = [(t[0].lo, t[0].hi) for t in tasks]
    assert covered[0][0] == 0 and covered[-1][1] == 10_000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    assert plan_tasks(big, 10_000, 10_000) == []


def test_plan_of_runs_reads_only_their_rows():
    index = index_of([(100, 1 << 20)] * 64)
    tasks = plan_tasks(index, 0, 6400, slots=2, runs=[(50, 150), (151, 152), (6300, 6400)])
    assert [(s.lo, s.hi) for t in tasks for s in t] == [(50, 100), (100, 150), (151, 152),
                                                       (6300, 6400)]
    assert plan_tasks(index, 0, 6400, runs=[]) == []


def test_plan_balances_tasks_across_page_boundaries():
    idx = index_of([(1000, 10_500_000)] * 10)
    tasks = plan_tasks(idx, 0, 10_000, slots=2)
    sizes = [sum(s.nbytes for s in t) for t in tasks]
    assert len(tasks) == 2 and max(sizes) - min(sizes) <= 10_500  # within one message
    flat = [(s.lo, s.hi) for t in tasks for s in t]
    assert flat[0][0] == 0 and flat[-1][1] == 10_000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(flat))
    assert len(plan_tasks(idx, 0, 10_000, slots=3)) == 3


def test_plan_follows_data_size_and_partial_pages():
    idx = index_of([(1000, 1 << 19)] * 10)
    tasks = plan_tasks(idx, 250, 9_500, slots=2)
    flat = [s for t in tasks for s in t]
    assert flat[0].lo == 250 and not flat[0].whole
    assert flat[-1].hi == 9_500 and not flat[-1].whole
    assert len(tasks) == 1  # under 8 MiB: one task


def test_admit_honours_each_limit():
    idx = index_of([(100, 10_000)] * 10)  # 100 bytes a message
    assert admit(idx, 0, 1000, Limits()) == 1000
    assert admit(idx, 0, 1000, Limits(rows=250)) == 250
    assert admit(idx, 0, 1000, Limits(bytes=5_050)) == 50
    assert admit(idx, 0, 1000, Limits(pages=3)) == 300
    assert admit(idx, 50, 1000, Limits(pages=1)) == 100  # a partly read page counts as one
    assert admit(idx, 0, 1000, Limits(rows=250, bytes=10_000)) == 100
    assert admit(idx, 0, 700, Limits(rows=10_000)) == 700  # never past the target
    assert admit(idx, 0, 1000, Limits(bytes=1)) == 1  # one message always goes
    assert admit(idx, 1000, 1000, Limits(rows=5)) == 1000
    assert admit(idx, 0, 1000, Limits(min_rows=2000)) == 0  # not enough yet: wait


def test_admit_skips_pages_the_selector_cannot_match_for_free():
    idx = PageIndex()
    for k in range(6):
        region = "EU" if k in (0, 5) else "US"
        idx.add(f"p{k}.page", k * 100, 100, 10_000, 0,
                {"rows": 100, "columns": {"region": {"null_count": 0, "values": [region]}}})
    schema = with_system_schema(pa.schema([("region", pa.string())]))
    sel = Selector("region = 'EU'", schema)
    assert admit(idx, 0, 600, Limits(rows=150), sel) == 100 + 400 + 50
    assert [s.name for t in plan_tasks(idx, 0, 600, selector=sel) for s in t] == [
        "p0.page", "p5.page"]


def test_gaps_are_the_ranges_no_live_page_holds():
    idx = index_of([(100, 1)] * 5)
    idx.remove(["p1.page", "p3.page"])
    assert idx.gaps(0, 500) == [(100, 200), (300, 400)]
    assert idx.gaps(150, 250) == [(150, 200)]
    assert idx.gaps(400, 500) == []
    assert idx.gaps(450, 600) == [(500, 600)]


def test_options_are_validated():
    base = {"path": "/tmp/x", "address": "a", "consumer": "c"}
    with pytest.raises(InvalidOptionError, match="consumer"):
        ReadSettings.parse({"path": "/tmp/x", "address": "a"}, streaming=True)
    with pytest.raises(InvalidOptionError, match="maxMessagesPerTriger"):
        ReadSettings.parse({**base, "maxMessagesPerTriger": "5"}, streaming=True)
    with pytest.raises(InvalidOptionError, match="startingPosition"):
        ReadSettings.parse({**base, "startingPosition": "first"}, streaming=True)
    with pytest.raises(InvalidOptionError, match="maxBytesPerTrigger"):
        ReadSettings.parse({**base, "maxBytesPerTrigger": "lots"}, streaming=True)
    opts = ReadSettings.parse({**base, "MAXMESSAGESPERTRIGGER": "7", "startingPosition": "12",
                              "consumerLeaseMs": "2000"}, streaming=True)
    assert (opts.max_messages_per_trigger, opts.start, opts.consumer_lease_ms) == \
        (7, ReadPosition("seq", 12), 2000)
    assert ReadSettings.parse({"path": "rel/dq", "address": "a"}, streaming=False).path == \
        os.path.abspath("rel/dq")


def test_spark_schema_maps_types():
    schema = spark_schema(pa.schema([("a", pa.uint32()), ("b", pa.large_string()),
                                     ("c", pa.timestamp("ms", tz="Europe/Paris"))]))
    assert schema.simpleString() == ("struct<a:bigint,b:string,c:timestamp,_seq:bigint,"
                                     "_timestamp:timestamp>")
    assert [f.nullable for f in schema.fields][-2:] == [False, False]


def test_task_slots_option_sizes_tasks_and_default_batches(tmp_path, monkeypatch):
    # On a cluster the driver's CPU count says nothing about the executors' task slots.
    import pyspark_durable_queue._read.plan as plan

    monkeypatch.setattr(plan, "MIN_TASK_BYTES", 1)
    send(tmp_path, "orders", 0, 20_000, page_size_bytes=16_384)
    schema = spark_schema(DurableQueue(str(tmp_path)).address("orders").schema)
    opts = {"path": str(tmp_path), "address": "orders"}
    for slots in (1, 7):
        batch = DurableQueueBatchReader({**opts, "taskSlots": str(slots)}, schema)
        assert len(batch.partitions()) == slots
        stream = DurableQueueStreamReader({**opts, "consumer": "c", "taskSlots": str(slots)},
                                          schema)
        assert len(stream.partitions({"seq": 0}, {"seq": 20_000})) == slots
        budget = stream.getDefaultReadLimit()
        assert isinstance(budget, ReadMaxBytes)
        assert budget.max_bytes == 5 * (16_384 * slots) * plan.TASKS_PER_SLOT
        stream.stop()
    with pytest.raises(InvalidOptionError, match="taskSlots"):
        DurableQueueBatchReader({**opts, "taskSlots": "0"}, schema)


def test_readers_and_partitions_pickle_small(tmp_path):
    send(tmp_path, "orders", 0, 10)
    opts = {"path": str(tmp_path), "address": "orders", "consumer": "c",
            "selector": "region = 'EU'"}
    schema = spark_schema(DurableQueue(str(tmp_path)).address("orders").schema)
    reader = DurableQueueStreamReader(opts, schema)
    assert not (tmp_path / "orders" / "consumers" / "c.json").exists()  # no side effects
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.opts == reader.opts and copy.output == reader.output
    assert len(pickle.dumps(reader)) < 4000
    part = reader.partitions({"seq": 0}, {"seq": 10})[0]
    assert isinstance(part, QueuePartition)
    assert len(pickle.dumps(part)) < 600
    assert pickle.loads(pickle.dumps(part)).slices == part.slices
    reader.stop()
    batch = DurableQueueBatchReader({"path": str(tmp_path), "address": "orders"}, schema)
    assert len(pickle.dumps(batch)) < 4000
    assert type(pickle.loads(pickle.dumps(batch))) is type(batch)


# -- reading (no JVM) ---------------------------------------------------------------------------
def test_split_pages_read_every_message_once(tmp_path, monkeypatch):
    import pyspark_durable_queue._read.plan as plan

    monkeypatch.setattr(plan, "MIN_TASK_BYTES", 1)
    monkeypatch.setattr(plan, "MAX_TASK_BYTES", 50_000)
    send(tmp_path, "big", 0, 60_000, page_size_bytes=4 << 20)
    address = DurableQueue(str(tmp_path)).address("big")
    state = address.log.refresh()
    assert len(state.pages) == 1
    tasks = plan_tasks(state.pages, 0, state.next_seq, slots=2)
    assert len(tasks) > 4
    spec = ReadSpec(address.storage, address.pages_folder, with_system_schema(state.schema),
                    yield_rows=4096)
    seqs = []
    for task in tasks:
        for b in read_slices(spec, task):
            assert b.schema.equals(spec.output)
            seqs.extend(b.column("_seq").to_pylist())
    assert seqs == list(range(60_000))
    sel = ReadSpec(address.storage, address.pages_folder, spec.output, "amount = 7")
    got = [v for t in tasks for b in read_slices(sel, t) for v in b.column("id").to_pylist()]
    assert got == [i for i in range(60_000) if i % 100 == 7]


def test_split_page_slices_read_only_their_frames(tmp_path, monkeypatch):
    # Tasks that each read a slice of one large page must not each read the whole page.
    import numpy as np

    import pyspark_durable_queue._read.plan as plan
    from pyspark_durable_queue._read.cache import page_cache

    monkeypatch.setattr(plan, "MIN_TASK_BYTES", 1)
    monkeypatch.setattr(plan, "MAX_TASK_BYTES", 1 << 20)
    n = 500_000
    # a page file (journal=False): its footer lists the frames a slice reads, through the cache
    address = DurableQueue(str(tmp_path)).address("big", page_size_bytes=64 << 20, journal=False)
    address.send(pa.table({"id": pa.array(np.arange(n)), "amount": pa.array(np.arange(n) % 7.0)}))
    state = address.log.refresh()
    (page_bytes,) = state.pages.bytes
    tasks = plan_tasks(state.pages, 0, state.next_seq, slots=2)
    assert len(tasks) >= 6 and not any(s.whole for t in tasks for s in t)
    spec = ReadSpec(address.storage, address.pages_folder, with_system_schema(state.schema))
    cache = page_cache()
    cache.clear()
    before = cache.stats()["bytes_read"]
    seqs = [v for t in tasks for b in read_slices(spec, t) for v in b.column("_seq").to_pylist()]
    assert seqs == list(range(n))
    read = cache.stats()["bytes_read"] - before
    # each frame once, plus the frames two neighbouring slices share, plus footers
    assert page_bytes * 0.9 < read < page_bytes * 1.6, (read, page_bytes, len(tasks))


def test_rebatch_slices_big_and_merges_small():
    def batch(n, at=0):
        return pa.record_batch({"x": pa.array(range(at, at + n))})

    out = list(rebatch([batch(10), batch(10, 10), batch(100, 20), batch(30, 120)], 40))
    assert [b.num_rows for b in out] == [20, 34, 34, 32, 30]
    assert [v for b in out for v in b.column("x").to_pylist()] == list(range(150))


# -- leases (no JVM) ----------------------------------------------------------------------------
def lease(root, ttl_ms=60_000) -> ConsumerLease:
    return ConsumerLease(open_storage(str(root)), f"{root}/leases", "c", ttl_ms)


def test_lease_excludes_a_second_owner_until_released(tmp_path, monkeypatch):
    import pyspark_durable_queue._ops.lease as lease_mod

    monkeypatch.setattr(lease_mod, "_LOCAL_GRACE_S", 0.0)
    a, b = lease(tmp_path), lease(tmp_path)
    a.acquire()
    with pytest.raises(ConsumerInUseError, match="in use by another running query"):
        b.acquire()
    a.renew(force=True)
    a.check()
    a.release()
    b.acquire()
    b.check()
    with pytest.raises(ConsumerInUseError, match="now held by another query"):
        a.check()
    assert len(list((tmp_path / "leases").iterdir())) <= 3  # old epochs pruned


def test_deleting_a_consumer_removes_its_lease_records(tmp_path):

    a = DurableQueue(str(tmp_path)).address("a")
    c = a.consumer("c")
    claim = ConsumerLease(a.storage, a.layout.leases("c"), "c", 60_000)
    claim.acquire()
    claim.release()
    assert Path(a.layout.leases("c")).exists()
    assert set(a.consumers()) == {"c"}  # lease records are not consumers
    c.delete()
    assert not Path(a.layout.leases("c")).exists()
    assert a.consumers() == {}


def test_lease_of_a_dead_process_or_expired_is_free(tmp_path, monkeypatch):
    import pyspark_durable_queue._ops.lease as lease_mod

    monkeypatch.setattr(lease_mod, "_LOCAL_GRACE_S", 0.0)
    folder = tmp_path / "leases"
    folder.mkdir()
    dead = {"owner": "x", "host": lease_mod.socket.gethostname(), "pid": 2**22 + 7,
            "renewed": time.time(), "expires": time.time() + 600}
    (folder / f"{0:020d}.json").write_text(json.dumps(dead))
    a = lease(tmp_path)
    a.acquire()  # the holder's process is gone
    assert a.epoch == 1
    remote = dict(dead, host="elsewhere", owner="y", expires=time.time() - 1)
    (folder / f"{2:020d}.json").write_text(json.dumps(remote))
    b = lease(tmp_path)
    b.acquire()  # expired
    with pytest.raises(ConsumerInUseError, match="taken over"):
        a.renew(force=True)
    live = dict(remote, owner="z", renewed=time.time(), expires=time.time() + 600)
    (folder / f"{9:020d}.json").write_text(json.dumps(live))
    with pytest.raises(ConsumerInUseError):
        lease(tmp_path).acquire()  # renewed just now on another host: in use


def test_lease_waits_for_an_abandoned_remote_claim(tmp_path):
    folder = tmp_path / "leases"
    folder.mkdir()
    stale = {"owner": "x", "host": "elsewhere", "pid": 1, "renewed": time.time() - 30,
             "expires": time.time() + 1.0}
    (folder / f"{0:020d}.json").write_text(json.dumps(stale))
    a = lease(tmp_path, ttl_ms=3000)
    t0 = time.monotonic()
    a.acquire()
    assert a.epoch == 1 and time.monotonic() - t0 >= 0.5


def test_lease_race_has_one_winner(tmp_path, monkeypatch):
    import pyspark_durable_queue._ops.lease as lease_mod

    monkeypatch.setattr(lease_mod, "_LOCAL_GRACE_S", 0.0)
    leases = [lease(tmp_path) for _ in range(8)]
    won, lost = [], []
    barrier = threading.Barrier(len(leases))

    def go(x: ConsumerLease) -> None:
        barrier.wait()
        try:
            x.acquire()
            won.append(x)
        except ConsumerInUseError:
            lost.append(x)

    threads = [threading.Thread(target=go, args=(x,)) for x in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 7


def test_lease_is_never_pickled(tmp_path):
    with pytest.raises(TypeError):
        pickle.dumps(lease(tmp_path))


# -- filter translation (no JVM) ----------------------------------------------------------------
FILTER_SCHEMA = pa.schema([("id", pa.int64()), ("region", pa.string()), ("amount", pa.float64()),
                           ("ok", pa.bool_()), ("f32", pa.float32()), *SYSTEM_FIELDS])


@pytest.mark.parametrize(("flt", "text"), [
    (ds.EqualTo(("id",), 5), '"id" = 5'),
    (ds.GreaterThan(("_seq",), 10), '"_seq" > 10'),
    (ds.LessThanOrEqual(("amount",), 2.5), '"amount" <= 2.5'),
    (ds.GreaterThan(("amount",), 2.5), None),  # NaN > 2.5 in Spark, not in Arrow
    (ds.EqualTo(("f32",), 0.1), None),
    (ds.EqualTo(("region",), "it's"), "\"region\" = 'it''s'"),
    (ds.GreaterThan(("region",), "EU"), None),  # selectors do not order strings
    (ds.In(("region",), ("EU", "US")), "\"region\" IN ('EU', 'US')"),
    (ds.In(("id",), (1, -2)), '"id" IN (1, -2)'),
    (ds.EqualTo(("ok",), True), '"ok" = TRUE'),
    (ds.IsNull(("region",)), '"region" IS NULL'),
    (ds.Not(ds.EqualTo(("id",), 5)), 'NOT ("id" = 5)'),
    (ds.StringStartsWith(("region",), "E_%"), "\"region\" LIKE 'E!_!%%' ESCAPE '!'"),
    (ds.StringContains(("region",), "U"), "\"region\" LIKE '%U%' ESCAPE '!'"),
    (ds.EqualTo(("nested", "x"), 1), None),
    (ds.EqualTo(("missing",), 1), None),
    (ds.EqualNullSafe(("id",), 1), None),
], ids=lambda v: type(v).__name__ if isinstance(v, ds.Filter) else None)
def test_filters_translate_to_selectors(flt, text):
    got, used = filters_to_selector([flt], FILTER_SCHEMA)
    assert got == (None if text is None else f"({text})")
    assert used == ([] if text is None else [flt])


def test_timestamp_filters_are_widened_not_narrowed():
    when = dt.datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=dt.timezone.utc)
    got, _ = filters_to_selector([ds.GreaterThan(("_timestamp",), when),
                                  ds.Not(ds.LessThan(("_timestamp",), when))], FILTER_SCHEMA)
    ms = int(when.timestamp() * 1000)
    assert got == f'("_timestamp" >= {ms - 1})'  # NOT of a widened filter is not pushed
    selector = Selector(got, FILTER_SCHEMA)
    ts = pa.array([when - dt.timedelta(microseconds=1), when + dt.timedelta(microseconds=1)],
                  pa.timestamp("us", tz="UTC"))
    batch = pa.record_batch({"_timestamp": ts})
    assert selector.mask(batch).to_pylist() == [True, True]  # a superset: Spark rechecks


# -- Spark end to end ---------------------------------------------------------------------------
def stream(spark, root, consumer, **options):
    reader = (spark.readStream.format("durablequeue").option("address", "orders")
              .option("consumer", consumer))
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load(str(root))


def finish(q, timeout: float = 180) -> None:
    """Wait for a query that should end by itself (``availableNow``), stop it whatever
    happens, and check that it ended in time and without an error."""
    try:
        ended = q.awaitTermination(timeout)
    finally:
        q.stop()
    assert ended, f"the query did not finish in {timeout} s"
    assert q.exception() is None


def fail(q, timeout: float = 120) -> str:
    """Wait for a query that should fail, stop it whatever happens; returns its error."""
    try:
        with pytest.raises(Exception) as info:
            q.awaitTermination(timeout)  # returns False (no error: the test fails) on time-out
    finally:
        q.stop()
    assert q.exception() is not None
    return f"{info.value}\n{q.exception()}"


def run_to_memory(spark, df, ckpt: Path, **trigger):
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (df.writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(ckpt)).trigger(**(trigger or {"availableNow": True}))
         .start())
    finish(q)
    return spark.table(name), q


def ids(df) -> list[int]:
    return sorted(r.id for r in df.select("id").collect())


def position(root, consumer: str) -> int:
    return DurableQueue(str(root)).address("orders").consumers()[consumer]["position"]


def test_two_consumers_with_selectors_get_exactly_their_messages(spark, tmp_path):
    for k in range(4):
        send(tmp_path, "orders", k * 300, 300, page_size_bytes=8192)
    address = DurableQueue(str(tmp_path)).address("orders")
    address.consumer("big")  # exists before "eu" runs, so cleanup keeps its pages
    eu, _q = run_to_memory(spark, stream(spark, tmp_path, "eu", selector="region = 'EU'"),
                          tmp_path / "ck-eu")
    big, _ = run_to_memory(spark, stream(spark, tmp_path, "big",
                                         selector="amount >= 90 AND region <> 'EU'"),
                           tmp_path / "ck-big")
    assert ids(eu) == [i for i in range(1200) if i % 3 == 0]
    assert ids(big) == [i for i in range(1200) if i % 100 >= 90 and i % 3 != 0]
    assert eu.schema.fieldNames() == ["id", "region", "amount", "_seq", "_timestamp"]
    row = eu.orderBy("_seq").first()
    assert row._seq == 0 and row._timestamp.year >= 2024
    assert position(tmp_path, "eu") == position(tmp_path, "big") == 1200
    consumers = DurableQueue(str(tmp_path)).address("orders").consumers()
    assert consumers["eu"]["selector"] == "region = 'EU'"


def test_restart_resumes_without_loss_or_duplicates(spark, tmp_path):
    send(tmp_path, "orders", 0, 500, page_size_bytes=8192)
    out, ck = tmp_path / "out", tmp_path / "ck"

    def run():
        q = (stream(spark, tmp_path, "etl", maxMessagesPerTrigger=120).select("id", "_seq")
             .writeStream.format("parquet").option("path", str(out))
             .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())
        finish(q)

    run()
    assert position(tmp_path, "etl") == 500
    send(tmp_path, "orders", 500, 300)
    run()  # restart from the checkpoint
    got = ids(spark.read.parquet(str(out)))
    assert got == list(range(800))
    send(tmp_path, "orders", 800, 50)
    # a new query (new checkpoint) on the same consumer resumes from its watermark
    fresh, _ = run_to_memory(spark, stream(spark, tmp_path, "etl"), tmp_path / "ck2")
    assert ids(fresh) == list(range(800, 850))


def test_available_now_runs_several_bounded_batches(spark, tmp_path):
    send(tmp_path, "orders", 0, 1000, page_size_bytes=8192)
    df, q = run_to_memory(spark, stream(spark, tmp_path, "slow", maxMessagesPerTrigger=300),
                          tmp_path / "ck")
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sizes == [300, 300, 300, 100]
    assert ids(df) == list(range(1000))
    assert "1000" in str(q.recentProgress[-1]["sources"][0].get("latestOffset"))


def test_default_read_limit_is_the_memory_budget(spark, tmp_path):
    from pyspark_durable_queue._read.plan import TASKS_PER_SLOT

    for k in range(40):
        send(tmp_path, "orders", k * 200, 200, page_size_bytes=4096)
    reader = DurableQueueStreamReader(
        {"path": str(tmp_path), "address": "orders", "consumer": "budget",
         "pageMaxCacheSize": "1"}, spark_schema(
            DurableQueue(str(tmp_path)).address("orders").schema))
    limit = reader.getDefaultReadLimit()
    reader.stop()
    assert isinstance(limit, ReadMaxBytes)
    assert limit.max_bytes == 4096 * (os.cpu_count() or 1) * TASKS_PER_SLOT
    df, q = run_to_memory(spark, stream(spark, tmp_path, "budget", pageMaxCacheSize=1),
                          tmp_path / "ck")
    assert len([p for p in q.recentProgress if p["numInputRows"]]) > 2
    assert ids(df) == list(range(8000))


def test_limits_spark_passes_are_honoured(tmp_path):
    send(tmp_path, "orders", 0, 100)
    opts = {"path": str(tmp_path), "address": "orders", "consumer": "lim",
            "maxMessagesPerTrigger": "10", "consumerLeaseMs": "5000"}
    schema = spark_schema(DurableQueue(str(tmp_path)).address("orders").schema)
    reader = DurableQueueStreamReader(opts, schema)
    try:
        start = reader.initialOffset()
        assert reader.latestOffset(start, reader.getDefaultReadLimit()) == {"seq": 10}
        assert reader.latestOffset(start, ReadAllAvailable()) == {"seq": 100}
        assert reader.latestOffset(start, ReadMaxRows(3)) == {"seq": 3}
        reader.commit({"seq": 40})
        assert position(tmp_path, "lim") == 40
        reader.commit({"seq": 20})  # never backwards
        assert position(tmp_path, "lim") == 40
        reader.prepareForTriggerAvailableNow()
        send(tmp_path, "orders", 100, 50)
        assert reader.latestOffset({"seq": 95}, ReadAllAvailable()) == {"seq": 100}
        assert position(tmp_path, "lim") == 95  # the batch ending at start is committed
        send(tmp_path, "orders", 150, 5)
        # the end latestOffset just saw (no second look at the log), then a fresh look
        assert reader.reportLatestOffset() == {"seq": 150}
        assert reader.reportLatestOffset() == {"seq": 155}
    finally:
        reader.stop()


def _read_ids(reader, start, end) -> list[int]:
    """The ``id``s of the batch ``[start, end)``, read as Spark's executors read it."""
    return sorted(i for p in reader.partitions(start, end) for b in reader.read(p)
                  for i in pa.Table.from_batches([b]).column("id").to_pylist())


def _pending(root, consumer: str) -> int:
    """How many rows consumer ``consumer``'s window file holds pending (0 without a file)."""
    record = DurableQueue(str(root)).address("orders").load_consumer_window(consumer)
    return 0 if record is None else len(record["pending"])


def test_a_commit_settles_the_rows_a_python_client_nacked_below_its_end(tmp_path):
    # issue 43: a Python client nacked rows (due now, and in ten minutes) and acknowledged the
    # rest; a query of that consumer reads from its watermark, the lowest nacked row, and
    # delivers them in its range: its commit settles them, or they hold the watermark forever
    send(tmp_path, "orders", 0, 10, cleanup_interval_ms=0, journal=False)
    address = DurableQueue(str(tmp_path)).address("orders")
    with address.consumer("mix") as c:
        assert c.receive(10).num_rows == 10
        c.nack(2)
        c.nack(5, delay_ms=600_000)
        c.ack()
    assert position(tmp_path, "mix") == 2 and _pending(tmp_path, "mix") == 2
    opts = {"path": str(tmp_path), "address": "orders", "consumer": "mix"}
    reader = DurableQueueStreamReader(opts, spark_schema(address.schema))
    try:
        start = reader.initialOffset()
        assert start == {"seq": 2}
        end = reader.latestOffset(start, ReadAllAvailable())
        assert end == {"seq": 10}
        assert _read_ids(reader, start, end) == [2, 5]  # never the rows acknowledged between
        reader.commit(end)
        assert position(tmp_path, "mix") == 10
        assert reader.latestOffset(end, ReadAllAvailable()) == end  # nothing left
    finally:
        reader.stop()
    assert _pending(tmp_path, "mix") == 0
    assert DurableQueue(str(tmp_path)).address("orders").stats()["consumers"]["mix"][
        "position"] == 10
    with DurableQueue(str(tmp_path)).address("orders").consumer("mix") as again:
        assert again.receive(10, timeout_ms=0).num_rows == 0
    assert address.cleanup(dry_run=False) is not None
    assert page_files(tmp_path, "orders") == set()


def test_a_commit_settles_nacked_rows_below_its_end_and_keeps_those_above(tmp_path):
    # a batch ending below a nacked row settles the rows below it only: the row above stays
    # pending (holding the watermark) until a batch past it commits
    send(tmp_path, "orders", 0, 10)
    address = DurableQueue(str(tmp_path)).address("orders")
    with address.consumer("part") as c:
        c.receive(10)
        c.nack(1, delay_ms=600_000)
        c.nack(7, delay_ms=600_000)
        c.ack()
    opts = {"path": str(tmp_path), "address": "orders", "consumer": "part",
            "maxMessagesPerTrigger": "4"}
    reader = DurableQueueStreamReader(opts, spark_schema(address.schema))
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        assert (start, end) == ({"seq": 1}, {"seq": 5})
        assert _read_ids(reader, start, end) == [1]
        reader.commit(end)
        assert position(tmp_path, "part") == 7  # the row nacked above the batch waits
        end2 = reader.latestOffset(end, reader.getDefaultReadLimit())
        assert end2 == {"seq": 9}
        assert _read_ids(reader, end, end2) == [7]
        reader.commit(end2)
        assert position(tmp_path, "part") == 10  # 9 was acknowledged by the Python client
    finally:
        reader.stop()
    assert _pending(tmp_path, "part") == 0


def test_a_query_skips_rows_a_python_client_settled_one_by_one(tmp_path):
    # row 4 was dead-lettered by a Python client (settled one by one above its ack point),
    # the rest left unacknowledged: the query reads every row but that one
    send(tmp_path, "orders", 0, 10, max_delivery_attempts=1, dead_letter_address="DLQ")
    address = DurableQueue(str(tmp_path)).address("orders")
    with address.consumer("one") as c:
        c.receive(10)
        c.nack(4)
    record = address.load_consumer_window("one")
    assert record is not None and record["settled"] == [4]
    opts = {"path": str(tmp_path), "address": "orders", "consumer": "one"}
    reader = DurableQueueStreamReader(opts, spark_schema(address.schema))
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        assert (start, end) == ({"seq": 0}, {"seq": 10})
        assert _read_ids(reader, start, end) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
        assert _read_ids(reader, start, end) == [0, 1, 2, 3, 5, 6, 7, 8, 9]  # a replay
        reader.commit(end)
    finally:
        reader.stop()
    assert position(tmp_path, "one") == 10


def test_a_dead_letter_move_a_crash_stopped_is_finished_before_a_commit_passes_it(tmp_path):
    from pyspark_durable_queue._ops.window import DeliveryWindow

    # a Python client died during a dead-letter move of row 0 (the window file as it left
    # it, written by its own writer): the query's commit finishes the move (once) and
    # settles past it, as the next receive would
    send(tmp_path, "orders", 0, 5, max_delivery_attempts=3, dead_letter_address="DLQ")
    address = DurableQueue(str(tmp_path)).address("orders")
    address.consumer("dl").close()
    window = DeliveryWindow(0)
    window.begin_move({0: 3}, "DLQ", "max_delivery_attempts (3) reached")
    address.save_consumer_window("dl", window.record(0))
    assert position(tmp_path, "dl") == 0
    opts = {"path": str(tmp_path), "address": "orders", "consumer": "dl"}
    reader = DurableQueueStreamReader(opts, spark_schema(address.schema))
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, ReadAllAvailable())
        assert end == {"seq": 5}
        assert _read_ids(reader, start, end) == [1, 2, 3, 4]  # the moving row is a dead letter
        reader.commit(end)
    finally:
        reader.stop()
    stats = DurableQueue(str(tmp_path)).address("orders").stats()["consumers"]["dl"]
    assert stats["position"] == 5 and stats["dead_lettered"] == 1
    dlq = DurableQueue(str(tmp_path)).address("DLQ", create=False)
    letters = [r for b, _ in dlq.snapshot().messages(0) if b is not None for r in b.to_pylist()]
    assert [r["origin_seq"] for r in letters] == [0]  # stored once


def test_a_query_settles_the_rows_a_python_client_nacked_on_its_consumer(spark, tmp_path):
    # issue 43 through Spark: nacked rows (due now, and in ten minutes) are read by the query
    # in its range and settled by its commit; a new Python client of the name gets nothing
    send(tmp_path, "orders", 0, 300, page_size_bytes=4096, cleanup_interval_ms=0,
         journal=False)
    address = DurableQueue(str(tmp_path)).address("orders")
    with address.consumer("etl") as c:
        assert c.receive(300).num_rows == 300
        c.nack(3)
        c.nack(150, delay_ms=600_000)
        c.ack()
    assert position(tmp_path, "etl") == 3
    df, _ = run_to_memory(spark, stream(spark, tmp_path, "etl"), tmp_path / "ck")
    assert ids(df) == [3, 150]  # the rows acknowledged between them are not read again
    address = DurableQueue(str(tmp_path)).address("orders")
    assert address.stats()["consumers"]["etl"]["position"] == 300
    assert _pending(tmp_path, "etl") == 0
    with address.consumer("etl") as again:
        assert again.receive(300, timeout_ms=0).num_rows == 0
    address.cleanup(dry_run=False)
    assert page_files(tmp_path, "orders") == set()


def test_pages_go_only_after_every_consumer_committed_past_them(spark, tmp_path):
    # page files (journal=False): cleanup removes every one (a journal keeps the segment
    # being written)
    send(tmp_path, "orders", 0, 400, page_size_bytes=4096, cleanup_interval_ms=0, journal=False)
    address = DurableQueue(str(tmp_path)).address("orders")
    address.consumer("b", start="earliest")
    before = page_files(tmp_path, "orders")
    assert len(before) > 3
    run_to_memory(spark, stream(spark, tmp_path, "a", cleanupIntervalMs=0), tmp_path / "ck-a")
    assert page_files(tmp_path, "orders") == before  # b has not read them
    df, _ = run_to_memory(spark, stream(spark, tmp_path, "b", maxMessagesPerTrigger=150,
                                        cleanupIntervalMs=0), tmp_path / "ck-b")
    assert ids(df) == list(range(400))
    assert page_files(tmp_path, "orders") == set()  # both committed past every page
    assert position(tmp_path, "a") == position(tmp_path, "b") == 400


def test_second_query_on_a_consumer_fails_fast(spark, tmp_path):
    send(tmp_path, "orders", 0, 100)
    name = f"t_{uuid.uuid4().hex[:10]}"
    first = (stream(spark, tmp_path, "solo").writeStream.format("memory").queryName(name)
             .option("checkpointLocation", str(tmp_path / "ck1"))
             .trigger(processingTime="1 second").start())
    try:
        deadline = time.monotonic() + 120
        while not first.recentProgress and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.recentProgress and first.exception() is None
        second = (stream(spark, tmp_path, "solo").writeStream.format("noop")
                  .option("checkpointLocation", str(tmp_path / "ck2"))
                  .trigger(availableNow=True).start())
        error = fail(second)
        assert "ConsumerInUseError" in error
        assert "in use by another running query" in str(second.exception())
        assert first.isActive and first.exception() is None  # the owner keeps running
    finally:
        first.stop()
    assert first.exception() is None
    send(tmp_path, "orders", 100, 10)
    df, _ = run_to_memory(spark, stream(spark, tmp_path, "solo"), tmp_path / "ck3")
    assert ids(df) == list(range(100, 110))  # the first query acknowledged what it read


def test_starting_position_for_a_new_consumer(spark, tmp_path):
    send(tmp_path, "orders", 0, 100)
    latest = stream(spark, tmp_path, "late", startingPosition="latest")
    at = stream(spark, tmp_path, "at", startingPosition=60)
    df_latest, _ = run_to_memory(spark, latest, tmp_path / "ck1")
    df_at, _ = run_to_memory(spark, at, tmp_path / "ck2")
    assert ids(df_latest) == [] and ids(df_at) == list(range(60, 100))
    assert position(tmp_path, "late") == 100


def test_user_given_schema_selects_columns(spark, tmp_path):
    send(tmp_path, "orders", 0, 20)
    df = (spark.readStream.format("durablequeue").schema("_seq long, id long, extra string")
          .option("address", "orders").option("consumer", "narrow")
          .option("selector", "region = 'US'").load(str(tmp_path)))
    out, _ = run_to_memory(spark, df, tmp_path / "ck")
    rows = sorted(out.collect())
    assert [(r._seq, r.id, r.extra) for r in rows] == [(i, i, None) for i in range(1, 20, 3)]


def test_missing_address_is_a_clear_error(spark, tmp_path):
    DurableQueue(str(tmp_path)).address("other").send([{"x": 1}])
    with pytest.raises(Exception, match="address 'orders' does not exist"):
        stream(spark, tmp_path, "c")


def test_fail_on_data_loss(spark, tmp_path):
    for k in range(3):  # a page file per send (journal=False), one of which goes by hand
        send(tmp_path, "orders", k * 100, 100, journal=False)
    state = DurableQueue(str(tmp_path)).address("orders").log.refresh()
    os.unlink(tmp_path / "orders" / "pages" / state.pages.names[1])  # deleted by hand
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (stream(spark, tmp_path, "strict").writeStream.format("memory").queryName(name)
         .option("checkpointLocation", str(tmp_path / "ck1")).trigger(availableNow=True).start())
    assert "DataLossError" in fail(q)
    assert "failOnDataLoss" in str(q.exception())
    df, _ = run_to_memory(spark, stream(spark, tmp_path, "lax", failOnDataLoss="false"),
                          tmp_path / "ck2")
    assert ids(df) == list(range(100)) + list(range(200, 300))


def test_pages_repair_removed_are_data_loss_for_a_selective_consumer(spark, tmp_path):
    # A selective consumer cannot tell a hole from pages cleanup dropped because its selector
    # could not match them; what repair removed is recorded, so the loss is still reported.
    for k in range(3):  # a page file per send (journal=False), one of which goes by hand
        send(tmp_path, "orders", k * 100, 100, journal=False)
    address = DurableQueue(str(tmp_path)).address("orders")
    address.consumer("strict")
    address.consumer("lax")
    os.unlink(tmp_path / "orders" / "pages" / address.state.pages.names[1])
    assert address.repair(dry_run=False).lost == [(100, 200)]
    name = f"t_{uuid.uuid4().hex[:10]}"
    q = (stream(spark, tmp_path, "strict", selector="region = 'EU'").writeStream
         .format("memory").queryName(name).option("checkpointLocation", str(tmp_path / "ck1"))
         .trigger(availableNow=True).start())
    assert "DataLossError" in fail(q)
    assert "100..199" in str(q.exception()) and "repair" in str(q.exception())
    df, _ = run_to_memory(spark, stream(spark, tmp_path, "lax", selector="region = 'EU'",
                                        failOnDataLoss="false"), tmp_path / "ck2")
    assert ids(df) == [i for i in [*range(100), *range(200, 300)] if i % 3 == 0]


def test_selector_skips_pages_that_cannot_match_without_reading_them(spark, tmp_path):
    # a page file per send with its column statistics (journal=False: a journal row has none)
    DurableQueue(str(tmp_path)).address("orders", journal=False).send(pa.table({
        "id": pa.array(range(100), pa.int64()), "region": ["US"] * 100,
        "amount": pa.array([1.0] * 100)}))
    send(tmp_path, "orders", 100, 30)
    state = DurableQueue(str(tmp_path)).address("orders").log.refresh()
    os.unlink(tmp_path / "orders" / "pages" / state.pages.names[0])  # only US messages
    df, _ = run_to_memory(spark, stream(spark, tmp_path, "eu", selector="region = 'EU'"),
                          tmp_path / "ck")
    assert ids(df) == [i for i in range(100, 130) if i % 3 == 0]


def test_batch_read_browses_without_acknowledging(spark, tmp_path):
    send(tmp_path, "orders", 0, 300, page_size_bytes=4096)
    address = DurableQueue(str(tmp_path)).address("orders")
    address.consumer("c", start=100)
    reader = spark.read.format("durablequeue").option("address", "orders")
    assert ids(reader.load(str(tmp_path))) == list(range(300))
    assert ids(reader.option("consumer", "c").load(str(tmp_path))) == list(range(100, 300))
    assert ids(reader.option("selector", "region = 'US'").load(str(tmp_path))) == [
        i for i in range(100, 300) if i % 3 == 1]
    assert position(tmp_path, "c") == 100  # browsing never acknowledges


def test_batch_read_pushes_where_into_page_pruning(spark, tmp_path):
    for k in range(5):  # a page file per send with its statistics (journal=False)
        send(tmp_path, "orders", k * 100, 100, journal=False)
    state = DurableQueue(str(tmp_path)).address("orders").log.refresh()
    os.unlink(tmp_path / "orders" / "pages" / state.pages.names[0])  # _seq 0..99, by hand

    def load():  # a fresh DataFrame per query: see the next test
        return spark.read.format("durablequeue").option("address", "orders").load(str(tmp_path))

    # the pushed conditions skip the deleted page without opening it, and filter rows
    got = load().where("_seq >= 100 AND region = 'EU' AND amount < 50").collect()
    assert sorted(r.id for r in got) == [i for i in range(100, 500)
                                         if i % 3 == 0 and i % 100 < 50]
    assert load().where("id IN (101, 102, 450)").count() == 3
    assert load().where("region LIKE 'AP%' AND _seq BETWEEN 120 AND 130").count() == 3
    assert load().where("NOT (id < 480) AND amount <= 90").count() == 11
    with pytest.raises(Exception, match="DataLossError"):
        load().count()  # a full read does need the deleted page


@pytest.mark.xfail(strict=True, reason="Spark 4.3 keeps a DataFrame's last pushed-down reader "
                   "and reuses it for a later query on that DataFrame that pushes no filters")
def test_spark_reuses_pushed_reader_for_a_query_without_filters(spark, tmp_path):
    send(tmp_path, "orders", 0, 100)
    df = spark.read.format("durablequeue").option("address", "orders").load(str(tmp_path))
    assert df.where("id < 10").count() == 10
    assert df.count() == 100  # Spark returns 10: the stale reader still filters id < 10


def test_batch_read_without_pushdown_setting(spark, tmp_path):
    send(tmp_path, "orders", 0, 50)
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "false")
    try:
        df = spark.read.format("durablequeue").option("address", "orders").load(str(tmp_path))
        assert df.where("id < 10").count() == 10
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
