"""The on-disk format check: addresses record their format, and a release refuses formats it
does not know instead of misreading them."""

from __future__ import annotations

import json
import os

import pytest

from pyspark_durable_queue import DurableQueue, UnsupportedFormatError
from pyspark_durable_queue._log.meta import CURRENT, KNOWN, Format
from pyspark_durable_queue.errors import DamagedMetadataError


def _meta_path(root, name="orders"):
    return os.path.join(root, name, "address.json")


def _set_format(root, value, name="orders"):
    path = _meta_path(root, name)
    with open(path) as f:
        meta = json.load(f)
    meta["format"] = value
    with open(path, "w") as f:
        json.dump(meta, f)


def test_a_new_address_is_written_in_the_current_format(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders")  # a local disk: the journal by default
    with open(_meta_path(tmp_path)) as f:
        meta = json.load(f)  # still plain JSON, its checksum a member of its own
    assert (meta["format"], meta["journal"]) == (CURRENT, True) and len(meta["crc32c"]) == 8
    assert a.format == CURRENT and a.format.journal and a.format.checksums
    DurableQueue(str(tmp_path)).address("flat", journal=False)
    with open(_meta_path(tmp_path, "flat")) as f:
        meta = json.load(f)
    assert (meta["format"], meta["journal"]) == (CURRENT, False)
    assert CURRENT == max(KNOWN) and set(KNOWN) == {1, 2, 3, 4, 5}


# what each format added, as _log/meta.py's table states it: (txns, watermark_files, journal,
# checksums, journal_field) of a format created without asking for the journal
FEATURES = {1: (False, False, False, False, False), 2: (True, False, False, False, False),
            3: (True, True, False, False, False), 4: (True, True, True, False, False),
            5: (True, True, False, True, True)}


@pytest.mark.parametrize("number", sorted(FEATURES))
def test_each_format_has_the_features_its_table_names(number):
    fmt = Format(number)
    assert set(FEATURES) == set(KNOWN)
    assert (fmt.txns, fmt.watermark_files, fmt.journal, fmt.checksums,
            fmt.journal_field) == FEATURES[number]
    # the fields address.json records: journal as its own field only where the format has it
    assert fmt.to_meta() == ({"format": number, "journal": False} if number == 5 else
                             {"format": number})
    assert Format(number, journal=True).journal
    assert Format.of(fmt.to_meta(), "address.json", "orders") == number
    assert Format.of(fmt.to_meta(), "address.json", "orders").journal == (number == 4)


def test_an_address_of_a_newer_format_is_refused_and_left_untouched(tmp_path):
    q = DurableQueue(str(tmp_path))
    q.address("orders").send([{"a": 1}])
    _set_format(tmp_path, max(KNOWN) + 1)
    before = open(_meta_path(tmp_path), "rb").read()
    newer = max(KNOWN) + 1
    with pytest.raises(UnsupportedFormatError, match=rf"format {newer}.*newer release.*Upgrade"):
        q.address("orders", page_size_bytes=1 << 20)  # a settings change must not be written
    with pytest.raises(RuntimeError):  # also a RuntimeError for callers that catch built-ins
        q.address("orders", create=False)
    assert open(_meta_path(tmp_path), "rb").read() == before


def test_format_1_addresses_still_open_and_take_sends(tmp_path):
    q = DurableQueue(str(tmp_path))
    q.address("orders", journal=False).send([{"a": 1}])  # format 1 had a file per commit
    _set_format(tmp_path, 1)
    a = q.address("orders")
    assert a.format == 1
    a.send([{"a": 2}], txn=("loader", 1))
    assert a.consumer("c").receive(max_messages=10).column("a").to_pylist() == [1, 2]


def test_an_address_without_a_format_is_format_1(tmp_path):
    q = DurableQueue(str(tmp_path))
    q.address("orders")
    path = _meta_path(tmp_path)
    with open(path) as f:
        meta = json.load(f)
    del meta["format"]
    with open(path, "w") as f:
        json.dump(meta, f)
    assert q.address("orders").format == 1


@pytest.mark.parametrize("value", ["2", 0, True, None])
def test_a_format_that_is_not_a_number_is_damaged_metadata(tmp_path, value):
    q = DurableQueue(str(tmp_path))
    q.address("orders")
    _set_format(tmp_path, value)
    with pytest.raises(DamagedMetadataError, match="not a format number"):
        q.address("orders")
