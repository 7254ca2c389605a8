"""``durablequeue verify`` checks shared consumers' states (``consumers/_shared/<name>/``) by
the rule of ``_ops/verify_shared.py``: damage is what a reader refuses or no crash leaves
(exit 1), a torn tail is a note (exit 0). Real bytes are changed in real files, and each case
checks that the consumer's own readers agree with verify's verdict.
"""

from __future__ import annotations

import json
import os

import fsspec
import pytest
from conftest import object_store_root, raw_read, raw_write, run_cli

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format import shared as shared_file
from pyspark_durable_queue._format.layout import numbered
from pyspark_durable_queue.errors import DamagedMetadataError


def pool(root, n=6):
    """An address with a shared consumer whose state has a whole state and change records:
    two handles claimed, one acknowledged."""
    a = DurableQueue(root).address("jobs")
    a.send([{"id": i} for i in range(n)])
    one = a.consumer("pool", shared=True, prefetch=2)
    two = a.consumer("pool", shared=True, prefetch=2)
    one.ack(one.receive(2))
    two.receive(1)
    return a, [one, two]


def generations(root):
    folder = os.path.join(root, "jobs", "consumers", "_shared", "pool")
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".log"))


def verify(capsys, root):
    code, out, _ = run_cli(capsys, root, "--json", "verify", "jobs")
    return code, json.loads(out)


def flip(path, at):
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x40
    with open(path, "wb") as f:
        f.write(bytes(data))


def whole_state_length(path):
    return shared_file.state_length(open(path, "rb").read())


def close(handles):
    for h in handles:
        h.close()


def test_a_sound_shared_state_verifies_with_no_notes(tmp_path, capsys):
    root = str(tmp_path / "dq")
    _, handles = pool(root)
    code, report = verify(capsys, root)
    assert code == 0 and report["ok"] and report["notes"] == []
    bare = verify(capsys, root)[1]["metadata_files_checked"]
    close(handles)
    assert bare >= 4  # address.json, an entry, the consumer's state ... and the log


@pytest.mark.parametrize("how", ["short", "bad checksum"])
def test_a_torn_tail_of_the_newest_generation_is_a_note_and_readers_pass_over_it(
        tmp_path, capsys, how):
    root = str(tmp_path / "dq")
    a, handles = pool(root)
    [log] = generations(root)
    size = os.path.getsize(log)
    change = shared_file.encode_change({"cursor": 6})
    with open(log, "ab") as f:  # a change half written, or whole with a wrong checksum
        f.write(change[:-5] if how == "short" else change[:-1] + bytes([change[-1] ^ 1]))
    code, report = verify(capsys, root)
    assert code == 0 and report["ok"]
    [note] = report["notes"]
    assert "torn tail" in note and f"byte {size}" in note
    # readers agree: the state before the tear; the next change starts a new generation
    fresh = a.consumer("pool", shared=True)
    assert fresh.state().cursor == 4
    fresh.receive(1)
    assert [os.path.basename(p) for p in generations(root)] == [f"{numbered(2)}.log"]
    assert verify(capsys, root)[1]["notes"] == []
    close([*handles, fresh])


def test_whole_records_after_a_bad_one_in_the_newest_generation_are_a_torn_tail(
        tmp_path, capsys):
    # what a power cut may leave: a later append kept, an earlier one not
    root = str(tmp_path / "dq")
    _, handles = pool(root)
    [log] = generations(root)
    first = whole_state_length(log)
    flip(log, first + 10)  # inside the first change record; two more follow it
    code, report = verify(capsys, root)
    assert code == 0 and "torn tail" in report["notes"][0] and f"byte {first}" in report[
        "notes"][0]
    close(handles)


@pytest.mark.parametrize("at", [0, 5, 40, -2])
def test_a_damaged_first_state_of_the_newest_generation_is_damage(tmp_path, capsys, at):
    root = str(tmp_path / "dq")
    a, handles = pool(root)
    close(handles)
    [log] = generations(root)
    flip(log, at if at >= 0 else whole_state_length(log) + at)
    code, report = verify(capsys, root)
    assert code == 1 and not report["ok"]
    [problem] = report["problems"]
    assert problem["page"].endswith(os.path.basename(log))
    assert "first state is not whole" in problem["detail"]
    assert "cannot be opened" in problem["detail"]
    with pytest.raises(DamagedMetadataError):  # readers refuse it too
        a.consumer("pool", shared=True).receive(1)
    text = run_cli(capsys, root, "verify", "jobs")[1]
    assert "PROBLEMS FOUND" in text and os.path.basename(log) in text


def test_a_checksummed_change_that_does_not_apply_is_damage(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a, handles = pool(root)
    close(handles)
    [log] = generations(root)
    with open(log, "ab") as f:  # sound bytes, but row 999 was never leased
        f.write(shared_file.encode_change({"unleased": [999]}))
    code, report = verify(capsys, root)
    assert code == 1
    assert "does not apply" in report["problems"][0]["detail"]
    with pytest.raises(DamagedMetadataError):
        a.consumer("pool", shared=True).receive(1)


def older_generation(root):
    """A copy of the newest generation as the one before it: what a crash between starting a
    generation and deleting the older one leaves."""
    [log] = generations(root)
    number = int(os.path.basename(log)[:-4])
    older = os.path.join(os.path.dirname(log), f"{numbered(number - 1)}.log")
    with open(older, "wb") as f:
        f.write(open(log, "rb").read())
    return older


def test_an_older_generation_with_a_damaged_first_state_is_damage(tmp_path, capsys):
    root = str(tmp_path / "dq")
    a, handles = pool(root)
    close(handles)
    older = older_generation(root)
    assert verify(capsys, root)[0] == 0  # a whole older generation: nothing to say
    flip(older, 3)
    code, report = verify(capsys, root)
    assert code == 1
    detail = report["problems"][0]["detail"]
    assert "older generation" in detail and "loses nothing" in detail
    a.consumer("pool", shared=True).receive(1)  # readers read the newest only


def test_a_torn_tail_of_an_older_generation_is_a_note(tmp_path, capsys):
    root = str(tmp_path / "dq")
    _, handles = pool(root)
    close(handles)
    older = older_generation(root)
    flip(older, whole_state_length(older) + 10)
    code, report = verify(capsys, root)
    assert code == 0
    assert "older generation" in report["notes"][0] and "torn tail" in report["notes"][0]


@pytest.fixture(params=["memory", "s3", "abfs"])
def epoch_root(request):
    """A root whose shared states are write-once epochs: memory://, S3 (moto), Azurite."""
    if request.param != "memory":
        yield object_store_root(request, request.param)
        return
    import uuid

    url = f"memory://dq-vs-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    path = url.replace("memory://", "/")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_a_damaged_epoch_is_damage(epoch_root, capsys):
    a, handles = pool(epoch_root)
    close(handles)
    folder = a.layout.shared("pool")
    epochs = sorted(n for n in a.storage.list(folder) if n.isdigit())
    assert len(epochs) >= 3
    code, report = verify(capsys, epoch_root)
    assert code == 0 and report["notes"] == []
    for name, newest in ((epochs[0], False), (epochs[-1], True)):
        path = f"{folder}/{name}"
        data = bytearray(raw_read(a.storage, path))
        data[len(data) // 2] ^= 0x40
        raw_write(a.storage, path, bytes(data))
        code, report = verify(capsys, epoch_root)
        assert code == 1
        damaged = {p["page"].rsplit("/", 1)[-1]: p["detail"] for p in report["problems"]}
        assert name in damaged
        assert ("it is the newest" in damaged[name]) == newest
    with pytest.raises(DamagedMetadataError):  # readers refuse the newest too
        DurableQueue(epoch_root).address("jobs").consumer("pool", shared=True).receive(1)
