"""Format 5: every metadata file an address reads back carries a checksum, so a changed byte
is reported (naming the file) instead of silently changing what readers see. Formats 1-4
keep working without them, and say so."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from conftest import older_format

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format import checked
from pyspark_durable_queue._log.commit_log import CHECKPOINT_EVERY, checkpoint_name, entry_name
from pyspark_durable_queue.errors import DamagedLogError, DamagedMetadataError


def _verify(root, name="orders") -> subprocess.CompletedProcess:
    code = ("import sys; from pyspark_durable_queue.cli import main\n"
            "sys.exit(main([sys.argv[1], '--json', 'verify', sys.argv[2]]))\n")
    return subprocess.run([sys.executable, "-c", code, str(root), name], capture_output=True,
                          text=True, timeout=120)


def _replace(path, old: bytes, new: bytes) -> None:
    with open(path, "rb") as f:
        data = f.read()
    assert data.count(old) == 1, (old, data)
    with open(path, "wb") as f:
        f.write(data.replace(old, new))


# -- the codec ----------------------------------------------------------------------------------
@pytest.mark.parametrize("indent", [None, 1])
def test_checked_json_round_trips_and_stays_plain_json(indent):
    for obj in ({}, {"a": 1}, {"s": 'x"crc32c":"00000000"}', "n": [1.5, None, True]}):
        data = checked.dumps(obj, indent=indent)
        assert checked.loads(data, required=True) == obj
        assert len(json.loads(data)[checked.KEY]) == 8


def test_every_changed_byte_of_a_checked_file_is_found():
    data = checked.dumps({"op": "append", "seq": 29, "pages": [{"stats": {"max": 29}}]})
    for at in range(len(data)):
        for bit in (0x01, 0x10, 0x80):
            flipped = bytearray(data)
            flipped[at] ^= bit
            with pytest.raises((ValueError, TypeError)):
                checked.loads(bytes(flipped), required=True)


def test_a_missing_checksum_is_damage_only_where_the_format_has_them():
    plain = json.dumps({"a": 1}).encode()
    assert checked.loads(plain, required=False) == {"a": 1}
    with pytest.raises(checked.ChecksumError, match="no crc32c"):
        checked.loads(plain, required=True)
    with pytest.raises(ValueError, match="checksum's member"):
        checked.dumps({"crc32c": "x"})


# -- the cases of issue 38 ----------------------------------------------------------------------
def _filled(root, **settings):
    q = DurableQueue(str(root))
    a = q.address("orders", journal=False, **settings)
    a.consumer("eu", selector="i = 25")
    for start in (0, 10, 20):
        a.send([{"i": i} for i in range(start, start + 10)])
    return q


def test_a_changed_statistic_in_a_log_entry_is_reported_not_obeyed(tmp_path):
    # Before format 5: "max":29 -> "max":22 made the consumer skip the page holding i = 25,
    # and verify said OK.
    _filled(tmp_path)
    entry = tmp_path / "orders" / "log" / entry_name(3)
    _replace(entry, b'"max":29', b'"max":22')
    with pytest.raises(DamagedLogError, match=rf"{entry_name(3)}.*checksum") as err:
        DurableQueue(str(tmp_path)).address("orders").consumer("eu").receive(max_messages=10)
    assert not err.value.partial  # complete JSON that changed: damage, not a torn write
    verify = _verify(tmp_path)
    assert verify.returncode == 1 and entry_name(3) in verify.stdout


def test_damaged_address_json_is_refused_naming_the_file(tmp_path):
    _filled(tmp_path)
    meta = tmp_path / "orders" / "address.json"
    _replace(meta, b'"page_max_cache_size": 5', b'"page_max_cache_size": 9')
    with pytest.raises(DamagedMetadataError, match=r"address\.json.*checksum"):
        DurableQueue(str(tmp_path)).address("orders")
    # a format-5 file that lost its checksum member is damaged too, not an old format
    data = json.loads(meta.read_bytes())
    del data["crc32c"]
    meta.write_text(json.dumps(data))
    with pytest.raises(DamagedMetadataError, match="no crc32c"):
        DurableQueue(str(tmp_path)).address("orders")


def test_damaged_consumer_state_is_refused_naming_the_file(tmp_path):
    q = _filled(tmp_path)
    _replace(tmp_path / "orders" / "consumers" / "eu.json", b"i = 25", b"i = 26")
    with pytest.raises(DamagedMetadataError, match=r"eu\.json.*checksum"):
        q.address("orders").consumer("eu")
    assert _verify(tmp_path).returncode == 1


def test_a_damaged_checkpoint_is_passed_over_and_verify_reports_it(tmp_path, caplog):
    q = DurableQueue(str(tmp_path))
    a = q.address("orders", journal=False, fsync="never")
    for i in range(CHECKPOINT_EVERY + 1):
        a.send([{"i": i}])
    path = tmp_path / "orders" / "log" / checkpoint_name(CHECKPOINT_EVERY)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the Arrow file: it may still read, but not as written
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        fresh = DurableQueue(str(tmp_path)).address("orders")
        assert fresh.stats()["messages"] == CHECKPOINT_EVERY + 1  # replayed from the entries
    assert "unreadable" in caplog.text and checkpoint_name(CHECKPOINT_EVERY) in caplog.text
    verify = _verify(tmp_path)
    assert verify.returncode == 1 and checkpoint_name(CHECKPOINT_EVERY) in verify.stdout


def test_a_damaged_lease_claim_is_reported_and_never_trusted(tmp_path, caplog):
    a = DurableQueue(str(tmp_path)).address("orders")
    lease = a.consumer_lease("eu", 60_000)
    lease.acquire()
    try:
        folder = tmp_path / "orders" / "consumers" / "_leases" / "eu"
        claim = folder / sorted(os.listdir(folder))[-1]
        data = json.loads(claim.read_bytes())
        assert len(data["crc32c"]) == 8
        _replace(claim, b'"released":false', b'"released":true ')
        other = DurableQueue(str(tmp_path)).address("orders").consumer_lease("eu", 60_000)
        with caplog.at_level(logging.WARNING):
            assert other._newest()[1] == {}
        assert "is damaged" in caplog.text
        assert _verify(tmp_path).returncode == 1
    finally:
        lease.release()


def test_verify_checks_every_metadata_file_and_passes_a_sound_address(tmp_path):
    _filled(tmp_path)
    verify = _verify(tmp_path)
    report = json.loads(verify.stdout)
    assert verify.returncode == 0 and report["ok"] and report["metadata_checksums"]
    # address.json, three entries, a consumer's state
    assert report["metadata_files_checked"] >= 5


# -- older formats ------------------------------------------------------------------------------
@pytest.mark.parametrize("number, journal", [(3, False), (4, True)])
def test_older_formats_keep_working_and_say_their_metadata_is_unchecked(tmp_path, number,
                                                                        journal):
    q = DurableQueue(str(tmp_path))
    q.address("orders", journal=journal)
    older_format(tmp_path, "orders", number)
    a = q.address("orders")
    assert (int(a.format), a.format.journal, a.format.checksums) == (number, journal, False)
    c = a.consumer("c")
    a.send([{"i": i} for i in range(5)])
    batch = c.receive(max_messages=10)
    c.ack(batch)
    assert batch.column("i").to_pylist() == list(range(5))
    stats = a.stats()
    assert stats["format"] == number and stats["metadata_checksums"] is False
    for name in os.listdir(tmp_path / "orders" / "consumers"):
        if name.endswith(".json"):  # written as that format wrote them: no checksum member
            assert "crc32c" not in json.loads((tmp_path / "orders" / "consumers" /
                                               name).read_bytes())
    verify = _verify(tmp_path)
    assert verify.returncode == 0 and json.loads(verify.stdout)["metadata_checksums"] is False


def test_a_pickled_address_writes_checksums_too(tmp_path):
    # what the Spark sink's executors do: their commits must be readable by the driver
    import pickle

    a = DurableQueue(str(tmp_path)).address("orders", journal=False)
    copy = pickle.loads(pickle.dumps(a))
    copy.send([{"i": 1}])
    entry = json.loads((tmp_path / "orders" / "log" / entry_name(1)).read_bytes())
    assert len(entry["crc32c"]) == 8
    assert DurableQueue(str(tmp_path)).address("orders").stats()["messages"] == 1
