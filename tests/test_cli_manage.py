"""The CLI's managing commands: consumers (create, delete, seek), settings, deleting an address.

Every test runs the real command line (``cli.main``) against a real store under ``tmp_path`` and
checks the result by reopening the store."""

from __future__ import annotations

import datetime as dt
import json
import os
import time

import pytest
from conftest import run_cli as run

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue.cli import main


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders", page_size_bytes=4096)
    for i in range(3):
        a.send([{"id": i * 100 + j, "region": "EU" if j % 2 else "US"} for j in range(100)])
    return root


def consumers(root):
    return DurableQueue(root).address("orders", create=False).consumers()


def test_consumer_create_with_selector_and_start(store, capsys):
    code, out, err = run(capsys, store, "consumer", "create", "orders", "eu",
                         "--selector", "region = 'EU'", "--start", "150", "--json")
    assert code == 0, err
    assert json.loads(out) == {"address": "orders", "consumer": "eu", "position": 150,
                               "selector": "region = 'EU'"}
    state = consumers(store)["eu"]
    assert state["position"] == 150 and state["selector"] == "region = 'EU'"
    c = DurableQueue(store).address("orders").consumer("eu")
    got = c.receive(max_messages=1000).to_pylist()
    assert [r["id"] for r in got] == list(range(151, 300, 2))


@pytest.mark.parametrize(("start", "expected"), [("earliest", 0), ("latest", 300),
                                                 ("LATEST", 300), ("0", 0)])
def test_consumer_create_starts_where_told(store, capsys, start, expected):
    code, out, err = run(capsys, store, "consumer", "create", "orders", "c", "--start", start)
    assert code == 0, err
    assert f"created consumer c of orders at _seq {expected}" in out
    assert consumers(store)["c"]["position"] == expected


def test_consumer_create_refuses_an_existing_consumer(store, capsys):
    assert run(capsys, store, "consumer", "create", "orders", "c", "--start", "latest")[0] == 0
    code, _, err = run(capsys, store, "consumer", "create", "orders", "c", "--start", "0")
    assert code == 1
    assert err.strip().splitlines() == [
        "error: consumer 'c' of orders already exists (at _seq 300); move it with "
        "`consumer seek`, or delete it first"]
    assert consumers(store)["c"]["position"] == 300


def test_consumer_create_rejects_a_bad_selector_and_creates_nothing(store, capsys):
    code, _, err = run(capsys, store, "consumer", "create", "orders", "c",
                       "--selector", "region = = 'EU'")
    assert code == 2 and "^" in err
    assert consumers(store) == {}


@pytest.mark.parametrize("argv", [["--start", "-1"], ["--start", "soon"],
                                  ["--start", "2026-13-01"]],
                         ids=["negative seq", "a word", "not a date"])
def test_a_bad_position_is_a_usage_error(store, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main([store, "consumer", "create", "orders", "c", *argv])
    assert exc.value.code == 2
    assert "is not a position: use earliest, latest, a _seq" in capsys.readouterr().err
    assert consumers(store) == {}


def test_consumer_seek_to_seq_earliest_latest(store, capsys):
    run(capsys, store, "consumer", "create", "orders", "c")
    code, out, _ = run(capsys, store, "consumer", "seek", "orders", "c", "250", "--json")
    assert code == 0
    assert json.loads(out) == {"address": "orders", "consumer": "c", "previous_position": 0,
                               "position": 250}
    assert consumers(store)["c"]["position"] == 250
    code, out, _ = run(capsys, store, "consumer", "seek", "orders", "c", "earliest")
    assert code == 0 and "moved from _seq 250 to _seq 0" in out
    assert consumers(store)["c"]["position"] == 0
    assert run(capsys, store, "consumer", "seek", "orders", "c", "latest")[0] == 0
    assert consumers(store)["c"]["position"] == 300


def test_consumer_seek_to_an_iso_time(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("orders")
    a.send([{"id": i} for i in range(10)])
    time.sleep(0.05)
    middle = dt.datetime.now(dt.timezone.utc)
    time.sleep(0.05)
    a.send([{"id": i} for i in range(10, 15)])
    a.consumer("c")
    for text in (middle.isoformat(), middle.isoformat().replace("+00:00", "Z"),
                 middle.replace(tzinfo=None).isoformat()):  # without a zone: UTC
        run(capsys, root, "consumer", "seek", "orders", "c", "earliest")
        code, _, err = run(capsys, root, "consumer", "seek", "orders", "c", text)
        assert code == 0, err
        assert a.consumers()["c"]["position"] == 10, text
    code, _, _ = run(capsys, root, "consumer", "seek", "orders", "c", "2000-01-01T00:00:00")
    assert code == 0 and a.consumers()["c"]["position"] == 0
    code, _, _ = run(capsys, root, "consumer", "seek", "orders", "c", "2999-01-01")
    assert code == 0 and a.consumers()["c"]["position"] == 15


def test_consumer_delete(store, capsys):
    run(capsys, store, "consumer", "create", "orders", "c", "--start", "42")
    code, out, _ = run(capsys, store, "consumer", "delete", "orders", "c", "--json")
    assert code == 0
    assert json.loads(out) == {"address": "orders", "consumer": "c", "deleted": True,
                               "position": 42}
    assert consumers(store) == {}
    code, _, err = run(capsys, store, "consumer", "delete", "orders", "c")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "'c'" in err


def test_consumer_commands_need_an_existing_address(store, capsys):
    for argv in (["create", "nope", "c"], ["delete", "nope", "c"], ["seek", "nope", "c", "0"]):
        code, _, err = run(capsys, store, "consumer", *argv)
        assert code == 1, argv
        assert err.strip().splitlines() == [
            f"error: address 'nope' does not exist under {store}"]
    assert DurableQueue(store).addresses() == ["orders"]


def test_settings_show(store, capsys):
    code, out, _ = run(capsys, store, "settings", "orders", "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["settings"]["page_size_bytes"] == 4096
    assert shown["settings"] == DurableQueue(store).address("orders").settings.to_json()
    assert shown["changed"] == {}
    code, out, _ = run(capsys, store, "settings", "orders")
    assert code == 0 and "page_size_bytes = 4096" in out.splitlines()


def test_settings_set_by_key_option_name_or_alias(store, capsys):
    code, out, err = run(capsys, store, "settings", "orders", "--set", "max_size_bytes=1MiB",
                         "--set", "addressFullPolicy=block", "--set", "page-size-bytes=8192",
                         "--json")
    assert code == 0, err
    changed = json.loads(out)["changed"]
    assert changed == {"max_size_bytes": {"from": -1, "to": 1 << 20},
                       "address_full_policy": {"from": "PAGE", "to": "BLOCK"},
                       "page_size_bytes": {"from": 4096, "to": 8192}}
    settings = DurableQueue(store).address("orders").settings
    assert (settings.max_size_bytes, settings.address_full_policy,
            settings.page_size_bytes) == (1 << 20, "BLOCK", 8192)
    code, out, _ = run(capsys, store, "settings", "orders", "--set", "page_size_bytes=8192")
    assert code == 0 and "nothing changed" in out


@pytest.mark.parametrize(("item", "message"), [
    ("colour=blue", "unknown option 'colour'; accepted options are: "),
    ("maxMessagesPerTrigger=5", "unknown option 'maxMessagesPerTrigger'"),  # a read option
    ("page_size_bytes=tiny", "option page_size_bytes='tiny' (pageSizeBytes) is invalid"),
    ("compression=zip", "expected one of none, lz4, zstd"),
    ("fsync=never", "fsync is a setting of each writer, not of the address"),
], ids=["unknown", "another scope", "not a size", "not a choice", "per writer"])
def test_settings_set_refuses_bad_keys_and_values(store, capsys, item, message):
    before = json.loads(open(os.path.join(store, "orders", "address.json")).read())
    code, _, err = run(capsys, store, "settings", "orders", "--set", item)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err
    after = json.loads(open(os.path.join(store, "orders", "address.json")).read())
    assert after == before


def test_settings_set_needs_key_value(store, capsys):
    with pytest.raises(SystemExit) as exc:
        main([store, "settings", "orders", "--set", "compression"])
    assert exc.value.code == 2
    assert "'compression' is not KEY=VALUE" in capsys.readouterr().err


def test_delete_address_refuses_without_yes(store, capsys):
    code, out, err = run(capsys, store, "delete-address", "orders")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: this would delete address orders with its 300 messages ("
        + str(DurableQueue(store).address("orders").stats()["bytes"])
        + " bytes) and 0 consumers; pass --yes to do it"]
    assert DurableQueue(store).addresses() == ["orders"]
    assert DurableQueue(store).address("orders", create=False).stats()["messages"] == 300


def test_delete_address_with_yes(store, capsys):
    DurableQueue(store).address("keep").send([{"x": 1}])
    run(capsys, store, "consumer", "create", "orders", "c")
    code, out, _ = run(capsys, store, "--json", "delete-address", "orders", "--yes")
    assert code == 0
    report = json.loads(out)
    assert report["deleted"] and report["messages"] == 300 and report["consumers"] == ["c"]
    assert DurableQueue(store).addresses() == ["keep"]
    assert not os.path.exists(os.path.join(store, "orders"))
    assert DurableQueue(store).address("keep").stats()["messages"] == 1
    code, _, err = run(capsys, store, "delete-address", "orders", "--yes")
    assert code == 1 and "address 'orders' does not exist" in err


def test_global_options_work_after_consumer_verbs(store, capsys):
    code, out, _ = run(capsys, store, "consumer", "create", "orders", "c", "--json",
                       "--compact")
    assert code == 0 and len(out.splitlines()) == 1
    code, out, _ = run(capsys, store, "--json", "consumer", "seek", "orders", "c", "7")
    assert code == 0 and json.loads(out)["position"] == 7
