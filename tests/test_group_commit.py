"""Group commit: an Address is thread-safe, and concurrent sends share commits while each caller
keeps its own _seq range, transaction result, schema error and full-policy outcome."""

from __future__ import annotations

import collections
import datetime as dt
import decimal
import json
import os
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest

from pyspark_durable_queue import (
    AddressFullError,
    DurableQueue,
    InvalidMessageError,
    SchemaMismatchError,
)
from pyspark_durable_queue._format.frame import FRAME_HEAD, FRAME_MAGIC
from pyspark_durable_queue._log.journal import _UNIT_HEAD, HEAD, UNITS, is_segment
from pyspark_durable_queue._log.meta import Format
from pyspark_durable_queue._ops.group_commit import SendQueue, SendRequest

NAME = "orders"


def _read_all(address):
    consumer = address.consumer(f"audit-{time.monotonic_ns()}", start="earliest")
    tables = list(consumer.batches(max_messages=100_000))
    consumer.delete()
    return pa.concat_tables(tables) if tables else None


def _units(address):
    """The journal's units, walked from each segment's header in the files: ``(entry JSON,
    frames bytes)`` each."""
    for name in sorted(os.listdir(address.pages_folder)):
        if not is_segment(name):
            continue
        with open(os.path.join(address.pages_folder, name), "rb") as f:
            data = f.read()
        at = HEAD
        while at + _UNIT_HEAD.size <= len(data):
            magic, _crc, _v, _prev, entry_len, frames_len = _UNIT_HEAD.unpack_from(data, at)
            if magic not in UNITS:
                break
            body = at + _UNIT_HEAD.size
            yield data[body:body + entry_len], data[body + entry_len:body + entry_len + frames_len]
            at = body + entry_len + frames_len


def _entries(address):
    """The commit-log entries, read from the files: ``log/<N>.json``, or the units of the
    journal's segments (a local disk's default)."""
    folder = os.path.join(address.folder, "log")
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                out.append(json.load(f))
    out.extend(json.loads(entry) for entry, _frames in _units(address))
    return out


@pytest.mark.parametrize("handles", ["one shared Address", "a handle per thread"])
def test_threads_sending_single_rows_share_commits_and_each_gets_its_own_seq(tmp_path, handles):
    root = str(tmp_path)
    shared = DurableQueue(root).address(NAME)
    threads, per_thread = 12, 25
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        a = shared if handles == "one shared Address" else DurableQueue(root).address(NAME)
        got = []
        start.wait()
        try:
            for i in range(per_thread):
                got.append((i, a.send([{"thread": t, "i": i}])))
        except BaseException as exc:
            errors.append(exc)
        results[t] = got

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors
    assert not any(w.is_alive() for w in workers)

    table = _read_all(DurableQueue(root).address(NAME))
    assert table.num_rows == threads * per_thread
    by_seq = {s: (t, i) for s, t, i in zip(table.column("_seq").to_pylist(),
                                           table.column("thread").to_pylist(),
                                           table.column("i").to_pylist(), strict=True)}
    assert sorted(by_seq) == list(range(threads * per_thread))  # dense, each row once
    for t, got in results.items():
        assert [r.count for _, r in got] == [1] * per_thread
        for i, r in got:
            assert by_seq[r.seq] == (t, i)  # the _seq returned is where the caller's row is
        seqs = [r.seq for _, r in got]
        assert seqs == sorted(seqs)  # a thread's sends keep their order
    commits = [e for e in _entries(shared) if e["op"] == "append"]
    assert len(commits) < threads * per_thread  # sends were grouped


def lead(queue, address):
    """Lead one group of ``queue`` as a send of ``address`` would (its handle's committer)."""
    return queue.lead(address._committer, many_txns=address.format.txns)


def _queued(address, *payloads, txns=None, merge=None):
    """Requests queued on a fresh SendQueue, as concurrent senders would have left them (made
    as ``send`` makes them: a few dicts are left for the leader to convert)."""
    queue = SendQueue()
    requests = []
    for k, rows in enumerate(payloads):
        txn = None if txns is None or txns[k] is None else ("app:" + txns[k][0], txns[k][1])
        requests.append(SendRequest.of(rows, txn, bool(merge and merge[k]),
                                       time.monotonic() + 60, "always"))
    queue._queue.extend(requests)
    address._sends = queue
    return queue, requests


def test_a_group_is_one_entry_and_members_get_consecutive_ranges(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    queue, reqs = _queued(a, [{"x": 1}], [{"x": 2}, {"x": 3}], [{"x": 4}])
    assert lead(queue, a) is False
    assert [(r.result.seq, r.result.count) for r in reqs] == [(0, 1), (1, 2), (3, 1)]
    assert len({r.result.version for r in reqs}) == 1
    assert len(_entries(a)) == 1
    assert len(os.listdir(a.pages_folder)) == 1
    assert _read_all(a).column("x").to_pylist() == [1, 2, 3, 4]


def test_a_member_that_does_not_fit_the_schema_fails_alone(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0}])
    queue, reqs = _queued(a, [{"x": 1}], [{"x": "not a number"}], [{"x": 3}], [{"y": 1}])
    lead(queue, a)
    assert isinstance(reqs[1].error, SchemaMismatchError)
    assert isinstance(reqs[3].error, SchemaMismatchError) and "merge_schema" in str(reqs[3].error)
    assert [(r.result.seq, r.result.count) for r in (reqs[0], reqs[2])] == [(1, 1), (2, 1)]
    assert _read_all(a).column("x").to_pylist() == [0, 1, 3]


def _frames_per_unit(address):
    """How many frames each journal unit holds, read from the segment files."""
    out = []
    for _entry, frames in _units(address):
        at = count = 0
        while at < len(frames):
            magic, length, _rows, _crc = FRAME_HEAD.unpack_from(frames, at)
            assert magic == FRAME_MAGIC
            at += FRAME_HEAD.size + length
            count += 1
        out.append(count)
    return out


def test_a_groups_single_sends_are_converted_together_into_one_frame(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0, "s": "a"}])
    queue, reqs = _queued(a, *[[{"x": i, "s": f"m{i}"}] for i in range(1, 17)])
    assert all(r.table is None for r in reqs)  # left as dicts for the leader
    lead(queue, a)
    assert [r.result.seq for r in reqs] == list(range(1, 17))
    assert _frames_per_unit(a) == [1, 1]  # the first send's unit, then the group's
    table = _read_all(a)
    assert table.column("x").to_pylist() == list(range(17))
    assert table.column("s").to_pylist() == ["a"] + [f"m{i}" for i in range(1, 17)]


def test_a_group_of_single_sends_written_without_arrow_stores_what_arrow_would(
        tmp_path, monkeypatch):
    import pyspark_durable_queue._ops.group_commit as group
    from pyspark_durable_queue._format.page import encode_frames
    from pyspark_durable_queue._format.schema import typed_table

    written = []
    encode = group.typed_stream
    monkeypatch.setattr(group, "typed_stream",
                        lambda rows, schema: written.append(len(rows)) or encode(rows, schema))
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0, "s": "a", "f": 0.0}])  # fixes the schema (inferred: the Arrow path)
    sends = [[{"x": i, "s": None if i % 3 else f"m{i}", "f": i / 2}] for i in range(1, 12)]
    queue, reqs = _queued(a, *sends)
    lead(queue, a)
    assert written == [11]  # the group went through the encoder, in one call
    assert [r.result.seq for r in reqs] == list(range(1, 12))
    *_, (_entry, frames) = _units(a)
    arrow = typed_table([row for rows in sends for row in rows], a.schema)
    assert frames == bytes(encode_frames(arrow, target=1 << 20))
    assert _read_all(a).column("s").to_pylist() == ["a"] + [r[0]["s"] for r in sends]


@pytest.mark.parametrize("case", [
    pytest.param("more rows than a frame holds", id="rows-over-FRAME_MAX_ROWS"),
    pytest.param("a frame of a small page", id="pageSizeBytes-1024"),
    pytest.param("a compressed address", id="zstd"),
])
def test_a_group_that_arrow_would_cut_or_compress_is_stored_as_arrow_stores_it(tmp_path,
                                                                                  case):
    # The leader skips Arrow only for a group that encode_frames would write as one plain
    # frame; these groups it would cut into frames or compress.
    from pyspark_durable_queue._format.page import FRAME_MAX_ROWS, FRAME_TARGET_BYTES, encode_frames
    from pyspark_durable_queue._format.schema import typed_table

    options = {"page_size_bytes": 1024} if case == "a frame of a small page" else \
        {"compression": "zstd"} if case == "a compressed address" else {}
    a = DurableQueue(str(tmp_path)).address(NAME, fsync="never", **options)
    a.send([{"x": 0, "t": True}])  # fixes the schema (inferred: the Arrow path)
    per_send = 64 if case == "more rows than a frame holds" else 8
    sends = [[{"x": k * per_send + i, "t": i % 2 == 0} for i in range(per_send)]
             for k in range((FRAME_MAX_ROWS // per_send + 1) if per_send == 64 else 16)]
    queue, reqs = _queued(a, *sends)
    assert all(r.table is None for r in reqs)  # left as dicts for the leader
    lead(queue, a)
    rows = [row for rows in sends for row in rows]
    assert reqs[-1].result.seq + reqs[-1].result.count == 1 + len(rows)
    *_, (_entry, frames) = _units(a)
    settings = a.settings
    expected = encode_frames(typed_table(rows, a.schema),
                             target=min(FRAME_TARGET_BYTES, settings.page_size_bytes // 2),
                             compression=settings.compression)
    assert frames == bytes(expected)
    if case != "a compressed address":
        assert _frames_per_unit(a)[-1] > 1  # the scenario: Arrow cut the group's rows
    assert _read_all(a).column("x").to_pylist() == [0, *range(len(rows))]


def test_a_process_sending_to_many_addresses_makes_each_schemas_encoder_once(tmp_path,
                                                                              monkeypatch):
    import pyspark_durable_queue._format.ipc as ipc
    import pyspark_durable_queue._format.schema as schema_module
    from pyspark_durable_queue._bounded import BoundedLRU

    # encoders made in this test only (earlier tests made some for this schema)
    monkeypatch.setattr(schema_module, "_ENCODERS", BoundedLRU("test encoders", 64,
                                                                listed=False))
    monkeypatch.setattr(schema_module, "_PLANS", {})
    made = []
    init = ipc.BatchEncoder.__init__

    def counted(self, struct_type):
        made.append(struct_type)
        init(self, struct_type)

    monkeypatch.setattr(ipc.BatchEncoder, "__init__", counted)
    q = DurableQueue(str(tmp_path))
    addresses = [q.address(f"{NAME}-{i}", fsync="never") for i in range(20)]
    for a in addresses:
        a.send({"x": 0, "s": "a"})  # fixes each schema (inferred: the Arrow path)
    for r in range(1, 4):
        for a in addresses:
            a.send({"x": r, "s": "b"})
    assert len(made) == 1  # one schema: one encoder, whichever address and plan asks


def test_rows_converted_together_keep_the_values_each_would_get_alone(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"f": 0.5, "n": None}])  # f: double, n: null
    big = 2 ** 53  # the largest int a double holds exactly
    queue, reqs = _queued(a, [{"f": 1, "n": None}], [{"f": 2.5, "n": None}],
                          [{"f": big, "n": None}], [{"f": None, "n": None}])
    lead(queue, a)
    assert all(r.error is None for r in reqs)
    assert _read_all(a).column("f").to_pylist() == [0.5, 1.0, 2.5, float(big), None]
    # an int a double cannot hold exactly fails its own send, converted alone or together
    queue, reqs = _queued(a, [{"f": 1.5, "n": None}], [{"f": big + 1, "n": None}])
    lead(queue, a)
    assert reqs[0].result.seq == 5 and reqs[1].error is not None
    assert _read_all(a).column("f").to_pylist()[-1] == 1.5


_TYPED = pa.schema([("i", pa.int64()), ("f", pa.float64()), ("s", pa.string()),
                    ("b", pa.binary()), ("t", pa.bool_())])


@pytest.mark.parametrize(("rows", "schema", "typed"), [
    pytest.param([{"i": 1, "f": 0.5, "s": "a", "b": b"x", "t": True},
                  {"i": None, "f": None, "s": None, "b": None, "t": None},
                  {"t": False, "b": b"", "s": "", "f": float("nan"), "i": -(2 ** 63)}],
                 _TYPED, True, id="every-exact-type-nulls-and-another-key-order"),
    pytest.param([{"i": 1.0, "f": 1, "s": "a", "b": b"x", "t": True}], _TYPED, False,
                 id="a-float-for-an-int-and-an-int-for-a-float"),
    pytest.param([{"i": True, "f": 0.5, "s": "a", "b": b"x", "t": 1}], _TYPED, False,
                 id="a-bool-for-an-int-and-an-int-for-a-bool"),
    pytest.param([{"i": 1, "f": 0.5, "s": b"a", "b": "x", "t": True}], _TYPED, False,
                 id="bytes-for-a-string-and-a-string-for-bytes"),
    pytest.param([{"i": 2 ** 64, "f": 0.5, "s": "a", "b": b"x", "t": True}], _TYPED, False,
                 id="an-int-past-int64"),
    pytest.param([{"i": 1, "f": 0.5, "s": "a", "b": b"x"}], _TYPED, False,
                 id="a-missing-column"),
    pytest.param([{"i": 1, "f": 0.5, "s": "a", "b": b"x", "t": True, "z": 1}], _TYPED, False,
                 id="an-extra-column"),
    pytest.param([{"i": 1, "f": 0.5, "s": "a", "b": b"x", "u": True}], _TYPED, False,
                 id="another-column-of-the-same-count"),
    pytest.param([{"x": 1}], pa.schema([("x", pa.int32())]), False, id="an-int32-column"),
    pytest.param([{"x": 1}], pa.schema([pa.field("x", pa.int64(), nullable=False)]), False,
                 id="a-column-without-nulls"),
])
def test_a_typed_conversion_is_exactly_inference_then_conforming(rows, schema, typed):
    # Sends of exact Python types skip Arrow's inference (the address schema gives the
    # types); anything else goes the usual way, with its usual result or error.
    from pyspark_durable_queue._format.schema import (
        conform_schema,
        rows_to_table,
        typed_stream,
        typed_table,
    )

    table = typed_table(rows, schema)
    assert (table is not None) == typed
    # what a group's leader writes without Arrow (tests/test_ipc.py: the same bytes)
    assert (typed_stream(rows, schema) is not None) == typed
    if table is not None:
        expected, _ = conform_schema(rows_to_table(rows), schema, False)
        assert table.schema.equals(schema) and expected.schema.equals(schema)
        assert repr(table.to_pylist()) == repr(expected.to_pylist())  # NaN is not == NaN


@pytest.mark.parametrize("make", [
    pytest.param(lambda: collections.defaultdict(int, {"x": 1, "c": 2}), id="defaultdict"),
    pytest.param(lambda: collections.Counter({"x": 1, "c": 2}), id="Counter"),
])
def test_a_dict_subclass_with_a_wrong_column_is_refused_as_before(tmp_path, make):
    # A defaultdict answers row["y"] for a column it does not hold: the typed conversion
    # must not take it (it would store y=0 and drop c), the usual path refuses column c.
    from pyspark_durable_queue._format.schema import typed_table

    schema = pa.schema([("x", pa.int64()), ("y", pa.int64())])
    row = make()
    assert typed_table([row], schema) is None and dict(row) == {"x": 1, "c": 2}
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0, "y": 0}])
    with pytest.raises(SchemaMismatchError, match="'c'"):
        a.send([make()])
    assert _read_all(a).num_rows == 1


def test_a_transaction_another_process_committed_is_not_stored_again(tmp_path):
    # A leader decides with its process's view of the log (it reads the log again only under
    # the publish lock): a member whose transaction another process committed meanwhile must
    # still come out a duplicate, and nothing is stored twice.
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0}])
    code = ("from pyspark_durable_queue import DurableQueue; import sys; "
            f"a = DurableQueue({str(tmp_path)!r}).address({NAME!r}); "
            "r = a.send([{'x': 1}], txn=('loader', 7)); sys.exit(0 if r.seq == 1 else 3)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert a._sends._log.state.version == 1  # this process has not looked since
    again = a.send([{"x": 1}], txn=("loader", 7))
    assert again.duplicate
    assert a.send([{"x": 2}]).seq == 2
    assert _read_all(a).column("x").to_pylist() == [0, 1, 2]


@pytest.mark.parametrize("bad", [
    pytest.param({"x": 7.5}, id="a-float-for-an-int-column"),
    pytest.param({"x": "7"}, id="a-string-for-an-int-column"),
    pytest.param({"x": 2 ** 70}, id="an-int-past-int64"),
    pytest.param({}, id="a-message-without-columns"),
])
def test_a_bad_message_in_a_group_of_single_sends_fails_only_its_own_send(tmp_path, bad):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0}])
    queue, reqs = _queued(a, [{"x": 1}], [bad], [{"x": 3}], [{"x": 4}])
    lead(queue, a)
    assert isinstance(reqs[1].error, SchemaMismatchError | InvalidMessageError)
    assert [r.result.seq for r in (reqs[0], reqs[2], reqs[3])] == [1, 2, 3]
    assert _read_all(a).column("x").to_pylist() == [0, 1, 3, 4]


@pytest.mark.parametrize(("first", "bad"), [
    pytest.param({"v": dt.datetime(2024, 1, 1)}, {"v": 1700000000.5},
                 id="a-float-after-a-datetime"),
    pytest.param({"v": dt.date(2024, 1, 1)}, {"v": 3}, id="an-int-after-a-date"),
    pytest.param({"v": 0.5}, {"v": True}, id="a-bool-after-a-float"),
    pytest.param({"v": b"raw"}, {"v": "text"}, id="a-str-after-bytes"),
    pytest.param({"v": decimal.Decimal("1.25")}, {"v": 7}, id="an-int-after-a-decimal"),
])
def test_a_send_refused_alone_is_refused_in_a_group_whatever_comes_before_it(tmp_path, first,
                                                                               bad):
    # Arrow's inference lets a column's first value decide its type and coerces the others
    # into it (a float after a datetime would be stored as microseconds): rows are converted
    # together only when each column's values have one type.
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([first])
    with pytest.raises(SchemaMismatchError):
        a.send([bad])
    queue, reqs = _queued(a, [first], [bad], [first])
    lead(queue, a)
    assert reqs[0].result.seq == 1 and reqs[2].result.seq == 2
    assert isinstance(reqs[1].error, SchemaMismatchError)
    assert _read_all(a).num_rows == 3


def test_large_or_nested_sends_are_converted_by_their_sender_and_bound_the_group(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    small, = _queued(a, [{"v": "x" * 10}])[1]
    nested, = _queued(a, [{"v": list(range(100_000))}])[1]
    big, = _queued(a, [{"v": "x" * 100_000}])[1]
    assert small.table is None and 10 <= small.nbytes <= 64
    assert nested.table is not None and nested.nbytes == nested.table.nbytes > 800_000
    assert big.table is not None and big.nbytes >= 100_000
    with pytest.raises(InvalidMessageError, match="cannot convert"):  # fails in its sender
        _queued(a, [{"v": object()}])


def test_single_sends_with_their_columns_in_another_order_are_stored_by_name(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0, "y": "a"}])
    queue, reqs = _queued(a, [{"y": "b", "x": 1}], [{"x": 2}], [{"x": 3, "y": "d"}])
    lead(queue, a)
    assert all(r.error is None for r in reqs)
    table = _read_all(a)
    assert table.column("x").to_pylist() == [0, 1, 2, 3]
    assert table.column("y").to_pylist() == ["a", "b", None, "d"]


def test_the_first_member_fixes_the_schema_of_a_new_address(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    queue, reqs = _queued(a, [{"x": 1}], [{"x": 2, "z": "extra"}], [{"x": 3}])
    lead(queue, a)
    assert isinstance(reqs[1].error, SchemaMismatchError)
    assert a.schema.names == ["x"]
    assert _read_all(a).column("x").to_pylist() == [1, 3]


def test_a_merge_schema_send_commits_in_a_group_of_its_own(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0}])
    queue, reqs = _queued(a, [{"x": 1, "y": "new"}], [{"x": 2}], merge=[True, False])
    lead(queue, a)
    assert reqs[0].done and not reqs[1].done  # the next group takes it
    lead(queue, a)
    assert reqs[1].done and reqs[1].result.seq == 2
    assert a.schema.names == ["x", "y"]


def test_each_member_keeps_its_own_transaction(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0}], txn=("loader", 5))
    queue, reqs = _queued(a, [{"x": 1}], [{"x": 2}], [{"x": 3}], [{"x": 4}], [{"x": 5}],
                          txns=[("loader", 5), ("loader", 6), ("other", 1), ("loader", 6),
                                None])
    lead(queue, a)
    assert reqs[0].result.duplicate  # already in the log
    assert reqs[3].result.duplicate  # an earlier member of the same group has it
    assert [r.result.seq for r in (reqs[1], reqs[2], reqs[4])] == [1, 2, 3]
    entry = _entries(a)[-1]
    assert entry["txns"] == [{"id": "app:loader", "batch": 6}, {"id": "app:other", "batch": 1}]
    b = DurableQueue(str(tmp_path)).address(NAME)  # the log remembers both, also when reopened
    assert b.send([{"x": 9}], txn=("other", 1)).duplicate
    assert b.send([{"x": 9}], txn=("loader", 6)).duplicate
    assert b.state.txns == {"app:loader": 6, "app:other": 1}


def test_a_format_1_address_takes_one_transaction_per_group(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.format = Format(1)
    queue, reqs = _queued(a, [{"x": 1}], [{"x": 2}], [{"x": 3}], txns=[("a", 1), None, ("b", 1)])
    lead(queue, a)
    assert reqs[0].done and reqs[1].done and not reqs[2].done
    lead(queue, a)
    assert reqs[2].result.seq == 2
    assert all("txns" not in e for e in _entries(a))


@pytest.mark.parametrize("policy", ["FAIL", "DROP", "BLOCK"])
def test_members_are_admitted_in_order_until_the_address_is_full(tmp_path, policy):
    a = DurableQueue(str(tmp_path)).address(NAME, max_size_messages=3,
                                            address_full_policy=policy, block_timeout_ms=200)
    a.consumer("slow")  # the backlog counts against this consumer
    queue, reqs = _queued(a, [{"x": 1}], [{"x": 2}, {"x": 3}], [{"x": 4}], [{"x": 5}])
    waiting = lead(queue, a)
    assert [r.result.seq for r in reqs[:2]] == [0, 1]
    assert _read_all(a).column("x").to_pylist() == [1, 2, 3]
    if policy == "FAIL":
        assert all(isinstance(r.error, AddressFullError) for r in reqs[2:])
        assert not waiting
    elif policy == "DROP":
        assert all(r.result.dropped for r in reqs[2:])
        assert a.stats()["dropped_sends"] == 2
    else:
        assert waiting and not reqs[2].done and not reqs[3].done  # queued for a later group
        for r in reqs[2:]:  # past their deadlines (block_timeout_ms after their sends)
            r.deadline = time.monotonic() - 0.001
        lead(queue, a)
        assert all(isinstance(r.error, AddressFullError) for r in reqs[2:])
        assert "blockTimeoutMs=200" in str(reqs[2].error)


def test_a_blocked_sender_goes_through_once_a_consumer_acknowledges(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME, max_size_messages=2,
                                            address_full_policy="BLOCK", block_timeout_ms=10_000)
    c = a.consumer("worker")
    a.send([{"x": 1}, {"x": 2}])
    outcome: list = []
    sender = threading.Thread(target=lambda: outcome.append(a.send([{"x": 3}])))
    sender.start()
    time.sleep(0.2)
    assert sender.is_alive()  # blocked: the backlog is full
    c.ack(c.receive(max_messages=10))
    sender.join(timeout=10)
    assert outcome and outcome[0].seq == 2


def test_a_consumer_shared_by_threads_hands_each_message_to_one_of_them(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": i} for i in range(2000)])
    c = a.consumer("shared")
    seen: list[list[int]] = [[], []]

    def work(k: int) -> None:
        while True:
            batch = c.receive(max_messages=7)
            if batch.num_rows == 0:
                return
            seen[k].extend(batch.column("x").to_pylist())
            c.ack(batch)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert sorted(seen[0] + seen[1]) == list(range(2000))
    assert c.position == 2000
    assert DurableQueue(str(tmp_path)).address(NAME).consumers()["shared"]["position"] == 2000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_inherit_the_parents_queued_sends(tmp_path):
    # gunicorn forks workers from a parent that may have a send waiting (here one blocked on a
    # full address): the child must get a queue, a log view and locks of its own, not a copy
    # whose front request belongs to a thread the child does not have. (Forking while another
    # thread is inside Arrow is unsafe whatever this package does: Arrow's own locks.)
    a = DurableQueue(str(tmp_path)).address(NAME, max_size_messages=2,
                                            address_full_policy="BLOCK", block_timeout_ms=20_000)
    c = a.consumer("worker")
    a.send([{"who": "parent"}, {"who": "parent"}])  # the address is full now
    outcome: list = []

    def send_blocked() -> None:
        try:
            outcome.append(a.send([{"who": "blocked"}]))
        except AddressFullError as exc:
            outcome.append(exc)

    blocked = threading.Thread(target=send_blocked)
    blocked.start()
    time.sleep(0.3)  # queued, waiting for room
    pid = os.fork()
    if pid == 0:  # the child: makes room for two, then sends through the same handle
        code = 1
        try:
            c.ack(c.receive(max_messages=10))
            r = a.send([{"who": "child"}])
            code = 0 if r.count == 1 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            spy = os.path.join(os.path.dirname(sys.executable), "py-spy")  # where it stuck
            stack = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                   text=True).stdout if os.path.exists(spy) else ""
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child's send is stuck:\n{stack}")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    blocked.join(timeout=30)
    # the room was the child's and the parent's to take in either order: both went in
    assert not isinstance(outcome[0], AddressFullError) and outcome[0].count == 1
    who = _read_all(DurableQueue(str(tmp_path)).address(NAME)).column("who").to_pylist()
    # (the child's ack may have let cleanup take the "parent" rows)
    assert who.count("child") == 1 and who.count("blocked") == 1


def test_lone_single_sends_store_dense_seqs_and_the_entries_json_would_write(tmp_path):
    # One thread of send([row]): each send alone in its group (the lean path of
    # group_commit._commit_lone, entries from _format.entry.entry_bytes's template)
    a = DurableQueue(str(tmp_path)).address(NAME)
    results = [a.send([{"x": i, "s": f"v{i}", "b": b"\x00" * i}]) for i in range(30)]
    assert [(r.seq, r.count) for r in results] == [(i, 1) for i in range(30)]
    assert [r.version for r in results] == sorted({r.version for r in results})
    units = [entry for entry, _frames in _units(a)]
    assert len(units) >= 30
    for entry in units:  # byte for byte what the JSON encoder writes for the parsed entry
        assert entry == json.dumps(json.loads(entry), separators=(",", ":")).encode()
    # and each send's frame (written without Arrow) byte for byte what Arrow's path writes
    from pyspark_durable_queue._format.page import encode_frames
    from pyspark_durable_queue._format.schema import typed_table

    frames = [f for _entry, f in _units(a) if f]
    assert len(frames) == 30
    for i, got in enumerate(frames):
        row = {"x": i, "s": f"v{i}", "b": b"\x00" * i}
        assert got == bytes(encode_frames(typed_table([row], a.schema), target=1 << 20))
    again = DurableQueue(str(tmp_path)).address(NAME)
    table = _read_all(again)
    assert table.column("_seq").to_pylist() == list(range(30))
    assert table.column("s").to_pylist() == [f"v{i}" for i in range(30)]
    assert table.column("b").to_pylist() == [b"\x00" * i for i in range(30)]


def _entry(change: str | None) -> dict:
    """A unit's entry: a plain send's (``None``), or one ``change`` makes other than plain."""
    from pyspark_durable_queue._log.journal import unit_page
    from pyspark_durable_queue._log.state import append_entry

    page = unit_page(3, 120)
    entry = {**append_entry(7, [page]), "v": 1, "ts": 1_700_000_000_000_000, "id": "ab12" * 8,
             "pages": [dict(page)]}
    if change == "extra":
        entry["pages"][0]["stats"] = {"x": {"min": 1, "max": 2}}
    elif change == "schema":
        entry = {"op": "append", "seq": 7, "pages": [page], "schema": "x: int64", "v": 1,
                 "ts": 1, "id": "ab"}
    elif change == "txn":
        entry = {**append_entry(7, [page], txns=[("app", 1)]), "v": 1, "ts": 1, "id": "ab"}
    elif change == "bool-rows":
        entry["pages"][0]["rows"] = True
    elif change == "quote-id":
        entry["id"] = 'a"b'
    return entry


@pytest.mark.parametrize("change", [
    pytest.param("extra", id="the-page-lists-statistics"),
    pytest.param("schema", id="the-entry-sets-the-schema"),
    pytest.param("txn", id="the-entry-has-a-transaction"),
    pytest.param("bool-rows", id="a-count-that-is-a-bool"),
    pytest.param("quote-id", id="an-id-with-a-quote"),
])
def test_an_entry_that_is_not_a_plain_send_is_written_by_the_json_encoder(change):
    from pyspark_durable_queue._format.entry import ENTRY_JSON, entry_bytes

    plain = _entry(None)
    assert entry_bytes(plain) == ENTRY_JSON.encode(plain).encode()
    entry = _entry(change)
    assert entry_bytes(entry) == ENTRY_JSON.encode(entry).encode()
    json.loads(entry_bytes(entry))


@pytest.mark.parametrize("row", [
    pytest.param({"x": 5}, id="a-row-of-the-old-columns"),
    pytest.param({"x": 5, "y": "new"}, id="a-row-with-the-added-column"),
])
def test_a_lone_send_after_another_process_grew_the_schema_goes_the_general_way(tmp_path, row):
    # This process's view still has the old schema: the lone path's frame was built for it;
    # under the publish lock the fresh schema differs, so nothing is written by the lone path
    # and the general one conforms the row to the grown schema.
    a = DurableQueue(str(tmp_path)).address(NAME)
    a.send([{"x": 0}])
    code = ("from pyspark_durable_queue import DurableQueue; import sys; "
            f"a = DurableQueue({str(tmp_path)!r}).address({NAME!r}); "
            "r = a.send([{'x': 1, 'y': 'grown'}], merge_schema=True); "
            "sys.exit(0 if r.seq == 1 else 3)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert a._sends._log.state.schema.names == ["x"]  # this process has not looked since
    result = a.send([row])
    assert (result.seq, result.count) == (2, 1)
    assert a.send([{"x": 6}]).seq == 3
    table = _read_all(a)
    assert table.column("_seq").to_pylist() == [0, 1, 2, 3]
    assert table.column("x").to_pylist() == [0, 1, 5, 6]
    assert table.column("y").to_pylist() == [None, "grown", row.get("y"), None]


@pytest.mark.parametrize("change", [
    pytest.param(None, id="a-plain-send"),
    pytest.param("synced_to", id="written-while-the-sync-before-it-ran"),
    pytest.param("extra", id="with-statistics"),
    pytest.param("schema", id="the-entry-sets-the-schema"),
    pytest.param("txn", id="the-entry-has-a-transaction"),
    pytest.param("quote-id", id="an-id-with-a-quote"),
    pytest.param("zero-led", id="a-number-json-would-not-write"),
])
def test_a_unit_entry_reads_back_as_json_reads_it(change):
    # _format.entry.entry_of reads a plain send's entry without the JSON decoder: the same dict
    from pyspark_durable_queue._format.entry import entry_bytes, entry_of

    data = entry_bytes(_entry(None if change in ("synced_to", "zero-led") else change))
    if change == "synced_to":
        data = data[:-1] + b',"synced_to":6}'
    elif change == "zero-led":
        data = data.replace(b'"seq":7', b'"seq":07')  # not JSON: the decoder says so
        with pytest.raises(ValueError):
            entry_of(data)
        return
    got = entry_of(data)
    assert got == json.loads(data)
    assert list(got) == list(json.loads(data))  # keys in the same order
