"""fsync = always | periodic | never: a setting of each handle, never persisted."""

from __future__ import annotations

import json
import os
import time

import pytest

from pyspark_durable_queue import DurableQueue, InvalidOptionError
from pyspark_durable_queue._log import durability as _durability

NAME = "orders"


@pytest.mark.parametrize(("given", "mode"), [
    (True, "always"), (False, "never"), ("true", "always"), ("false", "never"),
    ("always", "always"), ("PERIODIC", "periodic"), ("never", "never")])
def test_fsync_modes_and_the_booleans_they_replace(tmp_path, given, mode):
    a = DurableQueue(str(tmp_path)).address(NAME, fsync=given)
    assert a.settings.fsync == mode
    assert a.storage.fsync is (mode == "always")  # only `always` syncs inside the commit


def test_a_bad_fsync_mode_names_the_accepted_values(tmp_path):
    with pytest.raises(InvalidOptionError, match="always, periodic, never"):
        DurableQueue(str(tmp_path)).address(NAME, fsync="sometimes")


def test_one_handles_fsync_never_does_not_lower_another_writers_durability(tmp_path):
    q = DurableQueue(str(tmp_path))
    careless = q.address(NAME, fsync="never", fsync_interval_ms=50)
    careless.send([{"x": 1}])
    with open(os.path.join(careless.folder, "address.json")) as f:
        persisted = json.load(f)["settings"]
    assert "fsync" not in persisted and "fsync_interval_ms" not in persisted
    other = q.address(NAME)
    assert other.settings.fsync == "always" and other.storage.fsync is True
    assert careless.settings.fsync == "never"  # its own choice stays its own


def test_an_fsync_persisted_by_an_older_release_is_ignored(tmp_path):
    q = DurableQueue(str(tmp_path))
    q.address(NAME)
    path = os.path.join(str(tmp_path), NAME, "address.json")
    with open(path) as f:
        meta = json.load(f)
    meta["settings"]["fsync"] = False  # what `address(..., fsync=False)` persisted before
    with open(path, "w") as f:
        json.dump(meta, f)
    assert q.address(NAME).settings.fsync == "always"


def test_periodic_commits_return_written_and_are_synced_within_the_interval(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME, fsync="periodic", fsync_interval_ms=100)
    assert a.send([{"x": 1}]).seq == 0
    syncer = _durability._SYNCER
    root = syncer._roots[a.storage.root]
    assert root.interval_s == 0.1
    deadline = time.monotonic() + 5
    while root.dirty_since is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert root.dirty_since is None  # the background thread synced it
    assert a.consumer("c").receive().column("x").to_pylist() == [1]


def test_a_group_holds_sends_of_one_fsync_mode(tmp_path):
    import pyarrow as pa

    from pyspark_durable_queue._ops.group_commit import SendQueue, SendRequest

    a = DurableQueue(str(tmp_path)).address(NAME)
    queue = SendQueue()
    reqs = [SendRequest(pa.table({"x": [i]}), None, False, time.monotonic() + 1, mode)
            for i, mode in enumerate(["always", "always", "never", "always"])]
    queue._queue.extend(reqs)
    queue.lead(a._committer, many_txns=True)
    assert [r.done for r in reqs] == [True, True, False, False]


def test_a_syncing_handle_never_publishes_through_a_non_syncing_handles_log(tmp_path):
    q = DurableQueue(str(tmp_path))
    careless = q.address(NAME, fsync="never")
    careless.send([{"x": 1}])  # its view of the log is the one this process's groups share
    careful = q.address(NAME)
    careful.send([{"x": 2}])
    assert careless.log._state.version == 1  # the shared, non-syncing view did not publish it
    assert careful.log._state.version == 2  # its own, syncing one did
    assert careless.log.storage.fsync is False and careful.log.storage.fsync is True


def test_a_periodic_drop_entry_is_synced_too(tmp_path):
    a = DurableQueue(str(tmp_path)).address(NAME, fsync="periodic", fsync_interval_ms=60_000,
                                            max_size_messages=1, address_full_policy="DROP")
    a.consumer("slow")
    a.send([{"x": 1}])
    root = _durability._SYNCER._roots[a.storage.root]
    _durability._SYNCER.sync_now()
    assert root.dirty_since is None
    assert a.send([{"x": 2}]).dropped
    assert root.dirty_since is not None  # the drop entry waits for the background sync
