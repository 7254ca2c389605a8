"""Consumer watermarks rewritten in place (on-disk format 3): the two-slot file, what a torn
write leaves, the state file's part, deletion, older formats, storages without in-place writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pyspark_durable_queue import ConsumerNotFoundError, DurableQueue
from pyspark_durable_queue._format.watermark import SLOT_BYTES, WatermarkFile, decode, initial
from pyspark_durable_queue._storage import open_storage


def rows(n):
    return [{"id": i} for i in range(n)]


def wm_path(address, name="c") -> Path:
    return Path(address.layout.consumer_watermark(name))


def state_path(address, name="c") -> Path:
    return Path(address.layout.consumer_state(name))


@pytest.fixture
def address(tmp_path):
    a = DurableQueue(str(tmp_path / "q")).address("orders")
    a.send(rows(50))
    return a


def test_new_addresses_keep_positions_in_watermark_files(address):
    assert address.format.watermark_files and address.format.journal  # a local disk
    c = address.consumer("c")
    assert not wm_path(address).exists()  # made by the first acknowledgement
    c.ack(c.receive(10))
    assert wm_path(address).stat().st_size == 2 * SLOT_BYTES
    assert decode(wm_path(address).read_bytes()).position == 10
    assert json.loads(state_path(address).read_bytes())["position"] == 0  # its first position
    c.ack(c.receive(5))
    assert address.consumers()["c"]["position"] == 15
    assert address.consumer("c").position == 15


def test_writes_alternate_slots_and_a_reader_takes_the_newer(address):
    c = address.consumer("c")
    for n in (3, 4, 5):
        c.ack(c.receive(n))
    data = wm_path(address).read_bytes()
    first, second = decode(data[:SLOT_BYTES] + bytes(SLOT_BYTES)), decode(
        bytes(SLOT_BYTES) + data[SLOT_BYTES:])
    assert {first.position, second.position} == {7, 12}
    assert decode(data).position == 12


@pytest.mark.parametrize("cut", [0, 1, 8, 20, 31, 35])
def test_a_torn_write_leaves_the_previous_watermark(address, cut):
    c = address.consumer("c")
    c.ack(c.receive(3))
    c.ack(c.receive(4))  # generation 2 in slot 0, generation 1 (position 3) in slot 1
    data = bytearray(wm_path(address).read_bytes())
    newer = 0 if decode(bytes(data[:SLOT_BYTES]) + bytes(SLOT_BYTES)).position == 7 else 1
    at = newer * SLOT_BYTES + cut
    data[at] ^= 0xFF  # a write torn or damaged anywhere in the newer slot's record
    wm_path(address).write_bytes(bytes(data))
    assert address.consumers()["c"]["position"] == 3
    again = address.consumer("c")
    assert again.receive(1).column("_seq")[0].as_py() == 3
    again.ack(again.receive(1))  # and writing goes on over the damaged slot
    assert address.consumer("c").position == 5


def test_a_damaged_slot_is_reported_by_the_reader_and_by_verify(address, caplog):
    from pyspark_durable_queue._ops.repair import verify_metadata

    c = address.consumer("c")
    c.ack(c.receive(3))
    c.ack(c.receive(4))
    data = bytearray(wm_path(address).read_bytes())
    newer = 0 if decode(bytes(data[:SLOT_BYTES]) + bytes(SLOT_BYTES)).position == 7 else 1
    data[newer * SLOT_BYTES + 20] ^= 0x04  # a bit of the newer position, after its sync
    wm_path(address).write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        assert address.consumers()["c"]["position"] == 3  # the other slot, delivered again
    assert "c.wm: slot" in caplog.text and "damaged" in caplog.text
    _, problems = verify_metadata(address.storage, address.layout, address.log,
                                  checksums=address.format.checksums)
    assert [p.page.rsplit("/", 1)[1] for p in problems] == ["c.wm"]
    again = address.consumer("c")
    again.ack(again.receive(1))  # the next write replaces the damaged slot
    assert verify_metadata(address.storage, address.layout, address.log,
                           checksums=True)[1] == []


def test_an_empty_or_garbage_watermark_file_falls_back_to_the_state(address):
    address.consumer("c", start=5)
    wm_path(address).write_bytes(b"\0" * 100)
    assert address.consumer("c").position == 5


def test_seek_back_moves_the_watermark_file(address):
    c = address.consumer("c")
    c.ack(c.receive(20))
    c.seek(4)
    assert address.consumer("c").position == 4


def test_deleting_a_consumer_removes_its_watermark_and_a_new_one_starts_fresh(address):
    c = address.consumer("c")
    c.ack(c.receive(20))
    address.consumer("c").delete()
    assert not wm_path(address).exists() and not state_path(address).exists()
    with pytest.raises(ConsumerNotFoundError):
        c.ack(25)  # the old handle cannot bring it back
    assert not wm_path(address).exists() and not state_path(address).exists()
    assert address.consumer("c", start="earliest").position == 0


def test_a_stale_watermark_left_by_a_killed_deletion_is_not_taken_by_a_new_consumer(address):
    c = address.consumer("c")
    c.ack(c.receive(20))
    state_path(address).unlink()  # as if a deletion had been killed after its first step
    assert address.consumer("c", start=2).position == 2


def test_format_2_addresses_keep_positions_in_the_state_file(tmp_path):
    root = tmp_path / "q"
    DurableQueue(str(root)).address("orders")
    meta = root / "orders" / "address.json"
    doc = json.loads(meta.read_text())
    doc["format"] = 2
    meta.write_text(json.dumps(doc))
    a = DurableQueue(str(root)).address("orders")
    a.send(rows(10))
    c = a.consumer("c")
    c.ack(c.receive(4))
    assert not wm_path(a).exists()
    assert json.loads(state_path(a).read_bytes())["position"] == 4
    assert a.consumer("c").position == 4


def test_storages_without_in_place_writes_replace_the_watermark_file(tmp_path):
    storage = open_storage("memory://wm-" + os.urandom(4).hex())
    assert not storage.capabilities.overwrite
    path = storage.join("consumers", "c.wm")
    storage.makedirs(storage.join("consumers"))
    wm = WatermarkFile(storage, path)
    assert wm.write(5, lambda: True)
    assert wm.write(9, lambda: True)
    assert wm.read().position == 9 and wm.read().generation == 2
    assert not wm.write(11, lambda: False)  # the consumer is gone: nothing written
    assert wm.read().position == 9


def test_a_second_writer_is_not_hidden_behind_a_stale_generation(tmp_path):
    storage = open_storage(str(tmp_path))
    path = storage.join("c.wm")
    one, two = WatermarkFile(storage, path), WatermarkFile(storage, path)
    for p in range(1, 6):
        one.write(p, lambda: True)
    two.write(3, lambda: True)  # a seek back by another handle
    assert one.read().position == 3
    one.write(4, lambda: True)
    assert two.read().position == 4


def test_initial_file_layout():
    data = initial(42, generation=1, time_us=7)
    assert len(data) == 2 * SLOT_BYTES
    mark = decode(data)
    assert (mark.generation, mark.position, mark.time_us) == (1, 42, 7)
    assert data[:SLOT_BYTES] == bytes(SLOT_BYTES)  # generation 1 lives in slot 1


def test_watermarks_on_every_backend(root):
    """Flushing, deferred and seeking acknowledgements on a local disk, memory://, S3 and Azure
    (the last three replace the watermark file whole)."""
    q = DurableQueue(root)
    a = q.address("orders")
    a.send(rows(30))
    c = a.consumer("c", ack_flush_ms=60_000)
    c.ack(c.receive(1))
    c.ack(c.receive(4), flush=False)
    assert DurableQueue(root).address("orders").consumers()["c"]["position"] == 1
    c.flush()
    again = DurableQueue(root).address("orders").consumer("c")
    assert again.position == 5
    assert again.receive(1).column("id").to_pylist() == [5]
    again.seek(2)
    assert DurableQueue(root).address("orders").consumer("c").position == 2
    again.delete()
    assert "c" not in DurableQueue(root).address("orders").consumers()
