"""``durablequeue export`` and ``import``: a portable dump of an address (Parquet or JSON lines)
that round-trips, streamed batch by batch.

Every test runs the real command line (``cli.main`` or a subprocess) against real stores under
``tmp_path``."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_cli as run

from pyspark_durable_queue import DurableQueue

SCHEMA = pa.schema([("id", pa.int64()), ("region", pa.string()), ("amount", pa.float64()),
                    ("at", pa.timestamp("us", tz="UTC")), ("price", pa.decimal128(10, 2)),
                    ("tags", pa.list_(pa.string())), ("blob", pa.binary())])


def rows(first, n):
    base = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    return [{"id": i, "region": "EU" if i % 2 else "US", "amount": i / 4,
             "at": base + dt.timedelta(seconds=i), "price": Decimal(i) / 100,
             "tags": [f"t{i % 3}"] * (i % 3), "blob": bytes([i % 256])}
            for i in range(first, first + n)]


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders", page_size_bytes=4096)
    for i in range(5):
        a.send(pa.Table.from_pylist(rows(i * 200, 200), schema=SCHEMA))
    return root


def user_table(root, name):
    a = DurableQueue(root).address(name, create=False)
    table = pa.Table.from_batches(
        [b for b, _ in a.snapshot().messages(a.stats()["first_seq"]) if b is not None])
    return table.drop_columns(["_seq", "_timestamp"])


def test_parquet_round_trip_keeps_every_type_and_the_order(store, tmp_path, capsys):
    path = str(tmp_path / "orders.parquet")
    code, out, err = run(capsys, store, "export", "orders", path, "--json")
    assert code == 0, err
    assert json.loads(out) == {"address": "orders", "file": path, "format": "parquet",
                               "messages": 1000, "first_seq": 0, "last_seq": 999}
    dumped = pq.read_table(path)
    assert dumped.column_names == [*SCHEMA.names, "_seq", "_timestamp"]
    assert dumped.column("_seq").to_pylist() == list(range(1000))
    assert pq.ParquetFile(path).metadata.num_rows == 1000
    assert not [f for f in os.listdir(tmp_path) if ".partial" in f]

    code, out, err = run(capsys, store, "import", "copy", path, "--batch-size", "300")
    assert code == 0, err
    assert "imported 1000 messages" in out
    copy = DurableQueue(store).address("copy", create=False)
    assert copy.stats()["commits"] == 4  # 300 + 300 + 300 + 100: one commit per batch
    assert copy.schema == SCHEMA
    assert user_table(store, "copy").equals(user_table(store, "orders"))
    assert user_table(store, "copy").to_pylist() == rows(0, 1000)


def test_jsonl_round_trip(tmp_path, capsys):
    root = str(tmp_path / "dq")
    sent = [{"id": i, "name": f"n{i}", "score": i * 1.5, "ok": i % 2 == 0,
             "tags": ["a"] * (i % 3), "nested": {"k": i}} for i in range(500)]
    DurableQueue(root).address("events").send(sent)
    path = str(tmp_path / "events.jsonl")
    code, out, err = run(capsys, root, "export", "events", path)
    assert code == 0, err
    assert "exported 500 messages (_seq 0..499)" in out and "(jsonl)" in out
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert [r["_seq"] for r in lines] == list(range(500))
    assert all("_timestamp" in r for r in lines)
    code, _, err = run(capsys, root, "import", "events2", path, "--batch-size", "128")
    assert code == 0, err
    assert user_table(root, "events2").to_pylist() == sent
    assert DurableQueue(root).address("events2").stats()["commits"] == 4


def test_export_a_range(store, tmp_path, capsys):
    path = str(tmp_path / "part.parquet")
    code, out, _ = run(capsys, store, "export", "orders", path, "--from", "150", "--to", "420",
                       "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["messages"], report["first_seq"], report["last_seq"]) == (270, 150, 419)
    assert pq.read_table(path).column("id").to_pylist() == list(range(150, 420))
    code, out, _ = run(capsys, store, "export", "orders", path, "--from", "990", "--to", "5000",
                       "--json")
    assert json.loads(out)["messages"] == 10
    code, out, _ = run(capsys, store, "export", "orders", path, "--from", "5000", "--json")
    assert code == 0 and json.loads(out)["messages"] == 0
    assert pq.read_table(path).num_rows == 0
    assert pq.read_table(path).column_names[-2:] == ["_seq", "_timestamp"]


def test_export_starts_at_the_first_retained_message(store, tmp_path, capsys):
    a = DurableQueue(store).address("orders", orphan_grace_ms=0)
    a.consumer("c").ack(499)
    a.cleanup(dry_run=False)
    first = a.stats()["first_seq"]
    assert first > 0
    path = str(tmp_path / "rest.parquet")
    code, out, _ = run(capsys, store, "export", "orders", path, "--from", "0", "--json")
    assert code == 0 and json.loads(out)["first_seq"] == first
    assert pq.read_table(path).column("_seq").to_pylist() == list(range(first, 1000))


def test_import_into_an_existing_address_appends(store, tmp_path, capsys):
    path = str(tmp_path / "d.parquet")
    run(capsys, store, "export", "orders", path, "--to", "100")
    code, _, err = run(capsys, store, "import", "orders", path)
    assert code == 0, err
    a = DurableQueue(store).address("orders")
    assert a.stats()["next_seq"] == 1100
    assert user_table(store, "orders").slice(1000).to_pylist() == rows(0, 100)


def test_import_that_does_not_fit_the_address_exits_2(store, tmp_path, capsys):
    path = str(tmp_path / "other.jsonl")
    with open(path, "w") as f:
        f.write('{"id": "not a number"}\n')
    code, _, err = run(capsys, store, "import", "orders", path)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'id'" in err and "0 messages were imported before it" in err
    assert DurableQueue(store).address("orders").stats()["next_seq"] == 1000


def test_import_stops_at_a_line_that_is_not_json(tmp_path, capsys):
    root = str(tmp_path / "dq")
    path = str(tmp_path / "bad.jsonl")
    with open(path, "w") as f:
        f.write("".join(f'{{"i": {i}}}\n' for i in range(5)) + "oops\n" + '{"i": 9}\n')
    code, _, err = run(capsys, root, "import", "x", path, "--batch-size", "2")
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: line 6 of {path} is not JSON: Expecting value: line 1 column 1 (char 0); "
        "4 messages were imported before it"]
    assert DurableQueue(root).address("x").stats()["messages"] == 4


def test_missing_file_and_missing_address_exit_1(store, tmp_path, capsys):
    code, _, err = run(capsys, store, "import", "orders", str(tmp_path / "nope.parquet"))
    assert code == 1
    assert err.strip().splitlines() == [
        f"error: cannot read {tmp_path / 'nope.parquet'}: no such file"]
    assert DurableQueue(store).addresses() == ["orders"]
    code, _, err = run(capsys, store, "export", "orders", str(tmp_path / "no" / "x.parquet"))
    assert code == 1
    assert err.strip().splitlines() == [
        f"error: cannot write {tmp_path / 'no' / 'x.parquet'}: the folder {tmp_path / 'no'} "
        "does not exist"]
    code, _, err = run(capsys, store, "export", "nope", str(tmp_path / "x.parquet"))
    assert code == 1 and "address 'nope' does not exist" in err
    assert not os.path.exists(tmp_path / "x.parquet")


def test_export_of_an_address_without_messages_fails(tmp_path, capsys):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("empty")
    code, _, err = run(capsys, root, "export", "empty", str(tmp_path / "e.parquet"))
    assert code == 1 and "nothing to export" in err
    assert os.listdir(tmp_path) == ["dq"]


def test_format_by_suffix_option_or_content(store, tmp_path, capsys):
    odd = str(tmp_path / "dump.bin")
    assert run(capsys, store, "export", "orders", odd, "--to", "10")[0] == 0
    assert open(odd, "rb").read(4) == b"PAR1"  # parquet unless told
    code, out, _ = run(capsys, store, "import", "a", odd, "--json")
    assert code == 0 and json.loads(out)["format"] == "parquet"  # recognised by content
    assert run(capsys, store, "export", "orders", odd, "--to", "10", "--format", "jsonl")[0] == 0
    code, out, _ = run(capsys, store, "import", "b", odd, "--json")
    assert code == 0 and json.loads(out)["format"] == "jsonl"


def test_export_to_stdout_and_import_from_stdin(tmp_path):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("src").send([{"k": i} for i in range(50)])
    cmd = [sys.executable, "-m", "pyspark_durable_queue", root]
    out = subprocess.run([*cmd, "export", "src", "-"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["k"] for line in out.stdout.splitlines()] == list(range(50))
    back = subprocess.run([*cmd, "import", "dst", "-"], input=out.stdout, capture_output=True,
                          text=True, timeout=60)
    assert back.returncode == 0, back.stderr
    assert "imported 50 messages" in back.stdout
    assert user_table(root, "dst").to_pylist() == [{"k": i} for i in range(50)]
    bad = subprocess.run([*cmd, "export", "src", "-", "--format", "parquet"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "parquet cannot go to standard output" in bad.stderr
