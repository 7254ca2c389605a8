"""``durablequeue transfer SRC DST``: each message once, through a consumer or from where the
last transfer stopped, resumable after a run that died between sending and acknowledging.

Every test runs the real command line (``cli.main``) against a real store under ``tmp_path``."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from conftest import run_cli as run

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue.cli.data import TRANSFER_APP


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "dq")
    a = DurableQueue(root).address("src", page_size_bytes=4096)
    for i in range(3):
        a.send([{"id": i * 100 + j, "region": "EU" if j % 2 else "US"} for j in range(100)])
    return root


def ids(root, name):
    a = DurableQueue(root).address(name, create=False)
    return [r["id"] for b, _ in a.snapshot().messages(a.stats()["first_seq"]) if b is not None
            for r in b.to_pylist()]


def test_transfer_copies_matching_messages_once(store, capsys):
    code, out, err = run(capsys, store, "transfer", "src", "dst", "--selector", "region = 'EU'",
                         "--batch-size", "40", "--json")
    assert code == 0, err
    assert json.loads(out) == {"source": "src", "destination": "dst", "consumer": None,
                               "selector": "region = 'EU'", "messages": 150, "dropped": 0}
    assert ids(store, "dst") == list(range(1, 300, 2))
    dst = DurableQueue(store).address("dst")
    assert dst.schema == pa.schema([("id", pa.int64()), ("region", pa.string())])
    # again: nothing new to send
    code, out, _ = run(capsys, store, "transfer", "src", "dst", "--selector", "region = 'EU'")
    assert code == 0 and "transferred 0 messages from src to dst" in out
    # new messages in the source: only they go
    DurableQueue(store).address("src").send([{"id": 301, "region": "EU"},
                                             {"id": 302, "region": "US"}])
    code, out, _ = run(capsys, store, "transfer", "src", "dst", "--selector", "region = 'EU'")
    assert code == 0 and "transferred 1 messages" in out
    assert ids(store, "dst") == [*range(1, 300, 2), 301]
    assert DurableQueue(store).address("src").consumers() == {}  # no consumer was left behind


def test_transfer_through_a_consumer_acknowledges(store, capsys):
    DurableQueue(store).address("src").consumer("retry", selector="id >= 250")
    code, out, err = run(capsys, store, "transfer", "src", "dst", "--consumer", "retry",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["messages"] == 50 and json.loads(out)["selector"] == "id >= 250"
    assert ids(store, "dst") == list(range(250, 300))
    assert DurableQueue(store).address("src").consumers()["retry"]["position"] == 300
    code, out, _ = run(capsys, store, "transfer", "src", "dst", "--consumer", "retry")
    assert code == 0 and "transferred 0 messages" in out


def test_transfer_creates_a_missing_consumer_with_the_selector(store, capsys):
    code, _, err = run(capsys, store, "transfer", "src", "dst", "--consumer", "new",
                       "--selector", "id < 10")
    assert code == 0, err
    assert ids(store, "dst") == list(range(10))
    state = DurableQueue(store).address("src").consumers()["new"]
    assert state["selector"] == "id < 10" and state["position"] == 300


def test_transfer_refuses_another_selector_for_an_existing_consumer(store, capsys):
    DurableQueue(store).address("src").consumer("c", selector="id < 10")
    code, _, err = run(capsys, store, "transfer", "src", "dst", "--consumer", "c",
                       "--selector", "id > 10")
    assert code == 2 and "has the selector 'id < 10'" in err
    assert DurableQueue(store).addresses() == ["src"]


def test_a_run_that_died_before_acknowledging_is_not_sent_again(store, capsys):
    """What a run killed between its send and its ack leaves: the batch in the destination
    with its transaction, and the consumer before it."""
    src = DurableQueue(store).address("src")
    c = src.consumer("retry")
    batch = c.receive(max_messages=120)
    app_id = f"{TRANSFER_APP} src consumer retry"
    sent = batch.drop_columns(["_seq", "_timestamp", "_delivery_count"])
    DurableQueue(store).address("dst").send(sent.replace_schema_metadata(None),
                                            txn=(app_id, c.cursor))
    assert src.consumers()["retry"]["position"] == 0  # not acknowledged
    code, out, err = run(capsys, store, "transfer", "src", "dst", "--consumer", "retry",
                         "--batch-size", "50")
    assert code == 0, err
    assert "transferred 180 messages" in out
    assert ids(store, "dst") == list(range(300))  # each once


def test_transfer_errors(store, capsys):
    code, _, err = run(capsys, store, "transfer", "src", "src")
    assert code == 2 and "the same address" in err
    code, _, err = run(capsys, store, "transfer", "nope", "dst")
    assert code == 1 and "address 'nope' does not exist" in err
    assert DurableQueue(store).addresses() == ["src"]
    DurableQueue(store).address("other").send([{"id": "text"}])
    code, _, err = run(capsys, store, "transfer", "src", "other")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "['region']" in err and "0 messages were transferred before it" in err
