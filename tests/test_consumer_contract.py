"""The contract between ``Consumer`` and ``Address``, and the immutability of ``Snapshot``.

A consumer uses an address only through ``consumer.CONSUMER_SURFACE``, the names of its Protocol
``ConsumerAddress`` (checked on the source of
``consumer.py``, so a new reach into ``log``, ``registry``, ``layout``, ``storage`` or
``settings`` fails here); a snapshot is a view of the log as it was when it was taken, which
later sends, schema changes and cleanups of the same handle do not move.
"""

from __future__ import annotations

import ast
import datetime as dt
import inspect
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue, consumer
from pyspark_durable_queue._log.state import LogState
from pyspark_durable_queue._positions import LATEST, parse_position
from pyspark_durable_queue.address import Address
from pyspark_durable_queue.consumer import CONSUMER_SURFACE

CONSUMER_SOURCE = Path(inspect.getfile(consumer))


def address_uses(source: Path) -> dict[str, list[int]]:
    """Attributes read of an address in ``source``: ``address.x`` (a variable or parameter
    named ``address``) and ``<anything>.address.x``, with their line numbers."""
    uses: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "address") or (
                isinstance(owner, ast.Attribute) and owner.attr == "address"):
            uses.setdefault(node.attr, []).append(node.lineno)
    return uses


def test_the_scan_sees_the_consumers_uses_of_its_address():
    # an independent check that the scan finds something: these uses are in consumer.py today
    uses = address_uses(CONSUMER_SOURCE)
    assert {"snapshot", "wait_for_commit", "name"} <= set(uses)


def test_consumer_uses_only_the_documented_address_surface():
    outside = {attr: lines for attr, lines in address_uses(CONSUMER_SOURCE).items()
               if attr not in CONSUMER_SURFACE}
    assert not outside, (
        f"consumer.py uses Address attributes outside consumer.CONSUMER_SURFACE: {outside} "
        "(lines); add a documented Address method for it instead")


def test_the_scan_catches_a_reach_into_address_internals(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self, address):\n"
                   "    address.log.refresh()\n"
                   "    self.address.registry.save('c', {})\n")
    assert set(address_uses(bad)) == {"log", "registry"}


def test_the_surface_is_the_names_of_the_consumers_protocol():
    # written out here, independently of the Protocol it is derived from
    assert CONSUMER_SURFACE == {
        "name", "schema", "snapshot", "wait_for_commit", "read_cache", "consumer_state_path",
        "load_consumer_state", "create_consumer_state", "save_consumer_state",
        "save_consumer_position", "delete_consumer_state", "maybe_cleanup", "backlog",
        "consumer_lease", "load_consumer_window", "save_consumer_window", "delivery_settings",
        "send_dead_letters"}


def test_every_name_of_the_consumer_surface_exists_on_an_address(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders")
    missing = sorted(n for n in CONSUMER_SURFACE if not hasattr(a, n))
    assert not missing
    for name in CONSUMER_SURFACE - {"name", "schema"}:
        assert getattr(Address, name).__doc__, f"Address.{name} has no docstring"


#: Engine modules a consumer would bypass its address through.
BYPASSES = {"_read.cache", "_format.layout", "_ops.registry", "_storage", "_read.scan",
            "_ops.commit", "_ops.cleanup", "_format.watermark"}


def runtime_imports(source: str) -> set[str]:
    """Modules ``source`` imports from at run time: an import under ``if TYPE_CHECKING:`` names
    a type (the Protocol's return types) and reaches nothing."""
    tree = ast.parse(source)
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and \
                node.test.id == "TYPE_CHECKING":
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and id(node) not in typing_only}


def test_the_import_scan_tells_runtime_imports_from_type_only_ones():
    source = ("from typing import TYPE_CHECKING\n"
              "from ._read.cache import page_cache\n"
              "if TYPE_CHECKING:\n"
              "    from ._read.scan import Snapshot\n")
    assert runtime_imports(source) == {"typing", "_read.cache"}


def test_consumer_imports_no_engine_module_that_would_bypass_the_address():
    assert not runtime_imports(CONSUMER_SOURCE.read_text()) & BYPASSES


# -- Snapshot -----------------------------------------------------------------------------------
def snapshot_view(snap):
    return {"version": snap.version, "end": snap.end, "first_seq": snap.first_seq,
            "schema": snap.schema, "lost": snap.lost, "refs": list(snap.refs(0)),
            "gaps": snap.gaps(0)}


def messages(snap):
    batches = [b for b, _ in snap.messages(snap.first_seq) if b is not None]
    return pa.Table.from_batches(batches).to_pylist() if batches else []


def test_a_snapshot_holds_no_live_log_state(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders")
    a.send([{"id": 1}])
    snap = a.snapshot()
    assert not any(isinstance(v, LogState) for v in vars(snap).values())
    with pytest.raises(AttributeError):
        snap.end = 0  # type: ignore[misc]


def test_a_snapshot_does_not_move_with_sends_schema_changes_and_cleanup(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders", page_size_bytes=1024)
    for i in range(4):
        a.send([{"id": i * 10 + k} for k in range(10)])
    reader = a.consumer("reader")
    snap = a.snapshot()
    before = snapshot_view(snap)
    rows_before = messages(snap)
    assert [r["id"] for r in rows_before] == list(range(40))
    assert len(before["refs"]) >= 4

    # the address moves on: more messages, a wider schema
    a.send([{"id": 100 + k} for k in range(10)])
    a.send([{"id": 200, "note": "wider"}], merge_schema=True)
    assert a.state.next_seq == 51 and "note" in a.state.schema.names  # it did move
    assert snapshot_view(snap) == before
    assert messages(snap) == rows_before  # no new rows, no new column
    assert snap.seek_time(2 ** 62) == before["end"]
    assert parse_position(LATEST).resolve(snap) == before["end"]

    # ... and cleans up what every consumer passed (through this very handle)
    reader.ack(reader.receive(max_messages=45))  # may clean up (cleanup_interval_ms)
    a.cleanup(dry_run=False)
    assert a.state.first_seq > before["first_seq"]  # pages did go
    assert a.state.pages.names[0] not in {r.name for r in before["refs"][:1]}
    assert snapshot_view(snap) == before


def test_a_snapshot_of_an_empty_address_stays_empty(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders")
    snap = a.snapshot()
    a.send([{"id": 1}, {"id": 2}])
    assert (snap.end, snap.first_seq, snap.schema, list(snap.refs(0))) == (0, 0, None, [])
    assert messages(snap) == []
    when = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    assert parse_position(when).resolve(snap) == 0
    assert parse_position(when).resolve(a.snapshot()) == 0 and a.snapshot().end == 2
