"""Address names and the Spark option ``address`` as a list: a comma separates names, so a new
address name may not hold one; an existing one still opens, and a read names it quoted with
backticks. Artemis wildcards (``*`` one word, ``#`` any number of words) match names word by
word. No JVM: the option parsing and the client only.
"""

from __future__ import annotations

import os

import pytest

from pyspark_durable_queue import DurableQueue, InvalidNameError, InvalidOptionError
from pyspark_durable_queue.settings import AddressSelection, ReadSettings, WriteSettings


def legacy_comma_address(root, name: str = "a,b") -> None:
    """An address whose name holds a comma, as releases before names were lists made it: made
    under another name, then its folder renamed (nothing inside names the folder)."""
    DurableQueue(str(root)).address("legacy").send([{"id": 1}, {"id": 2}])
    os.rename(os.path.join(root, "legacy"), os.path.join(root, name))


def test_a_new_address_name_may_not_hold_a_comma(tmp_path):
    with pytest.raises(InvalidNameError, match=r"'orders,returns'.*','.*separates address "
                                               r"names"):
        DurableQueue(str(tmp_path)).address("orders,returns")
    assert not (tmp_path / "orders,returns").exists()


def test_an_existing_address_with_a_comma_still_opens_and_reads(tmp_path):
    legacy_comma_address(tmp_path)
    q = DurableQueue(str(tmp_path))
    assert "a,b" in q.addresses()
    address = q.address("a,b")  # create=True, but it exists: no refusal
    address.send([{"id": 3}])
    consumer = address.consumer("c", start="earliest")
    assert consumer.receive(10).column("id").to_pylist() == [1, 2, 3]


@pytest.mark.parametrize(("text", "names", "patterns"), [
    ("orders", ("orders",), ()),
    ("orders,returns", ("orders", "returns"), ()),
    (" orders , returns ,orders", ("orders", "returns"), ()),
    ("`a,b`", ("a,b",), ()),
    ("`a,b`, c ,`d`", ("a,b", "c", "d"), ()),
    ("orders.*", (), ("orders.*",)),
    ("orders.#,eu.*.x,returns", ("returns",), ("orders.#", "eu.*.x")),
    ("#", (), ("#",)),
], ids=["one", "two", "spaces-and-duplicates", "quoted-comma", "quoted-mixed", "one-word",
        "patterns-and-names", "everything"])
def test_address_option_lists_names_and_patterns(text, names, patterns):
    selection = AddressSelection.parse(text)
    assert (selection.names, selection.patterns) == (names, patterns)
    assert selection.several == (len(names) + len(patterns) > 1 or bool(patterns))


@pytest.mark.parametrize(("text", "message"), [
    ("orders,", "empty name"),
    (",orders", "empty name"),
    ("`a,b", "not closed"),
    ("`a,b`x", "after the quoted name"),
    ("orders*", "inside the word 'orders\\*'"),
    ("orders.#x", "inside the word"),
    ("orders/x", "'/'"),
    ("_orders", "starts with"),
], ids=["trailing-comma", "leading-comma", "unclosed-quote", "junk-after-quote",
        "wildcard-in-word", "hash-in-word", "slash", "underscore"])
def test_a_malformed_address_option_names_the_problem(text, message):
    with pytest.raises(InvalidOptionError, match=message):
        AddressSelection.parse(text)


@pytest.mark.parametrize(("pattern", "name", "expected"), [
    ("orders.*", "orders.eu", True),
    ("orders.*", "orders", False),
    ("orders.*", "orders.eu.x", False),
    ("orders.#", "orders", True),
    ("orders.#", "orders.eu", True),
    ("orders.#", "orders.eu.x", True),
    ("orders.#", "ordersx", False),
    ("*.eu", "orders.eu", True),
    ("*.eu", "eu", False),
    ("#.eu", "eu", True),
    ("a.#.z", "a.z", True),
    ("a.#.z", "a.b.c.z", True),
    ("a.#.z", "a.b.c", False),
    ("#", "anything.at.all", True),
])
def test_wildcards_match_whole_words(pattern, name, expected):
    assert AddressSelection.parse(pattern).matches(name) is expected


def test_resolve_lists_names_then_matches_sorted():
    selection = AddressSelection.parse("returns,orders.*")
    got = selection.resolve(["orders.us", "orders", "returns", "orders.eu", "other"])
    assert got == ["returns", "orders.eu", "orders.us"]


def test_read_and_write_options_take_a_quoted_comma_name(tmp_path):
    read = ReadSettings.parse({"path": str(tmp_path), "address": "`a,b`"}, streaming=False)
    assert read.selection.single == "a,b"
    write = WriteSettings.parse({"path": str(tmp_path), "address": "`a,b`"}, streaming=False,
                                overwrite=False)
    assert write.address == "a,b"
    with pytest.raises(InvalidOptionError, match=r"write goes to one address.*`a,b`"):
        WriteSettings.parse({"path": str(tmp_path), "address": "a,b"}, streaming=False,
                            overwrite=False)
