"""A failed ``fdatasync`` of the journal (issue 38, "never silent"; PostgreSQL's "fsyncgate").

After a write-back error the kernel reports ``EIO`` once and may drop the pages it could not
write (Linux marks them clean: the file then reads back zeros, or older bytes). The journal's
rule (``_log/journal.py``, "A sync that fails"): the commit fails, naming the segment and the
errno; its bytes are written again *from memory* through a new descriptor and synced before
anything follows them, or, when that fails too, kept and written first by the next commit,
which is refused until they are. Here the sync fails at the storage layer's seam
(``_storage.local.sync_fault``) and the dropped pages are emulated by writing zeros over them
through a separate descriptor when it fails; every check reads the address afresh in another
process (``verify`` too): every acknowledged send is there, the chain holds, no damage.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
from collections.abc import Callable

import pyarrow as pa
import pytest

import pyspark_durable_queue
from pyspark_durable_queue import DurableQueue, StorageError
from pyspark_durable_queue._log import commit_log
from pyspark_durable_queue._log.commit_log import checkpoint_name
from pyspark_durable_queue._storage import local

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(pyspark_durable_queue.__file__)))
SEGMENT_1 = "00000000000000000001.dqj"
SEGMENT_2 = "00000000000000000002.dqj"


def rows(start: int, n: int, size: int = 200) -> pa.Table:
    return pa.table({"k": pa.array(range(start, start + n), pa.int64()),
                     "b": pa.array([os.urandom(size) for _ in range(n)], pa.binary())})


def _python(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": PACKAGE_PARENT}, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def consume(root, name: str = "fresh") -> list[int]:
    """What consumer ``name`` receives now, read in another process (and acknowledged); a new
    consumer starts at the earliest message."""
    return _ints(_python(
        "import sys\n"
        "from pyspark_durable_queue import DurableQueue\n"
        "c = DurableQueue(sys.argv[1]).address('a').consumer(sys.argv[2], start='earliest')\n"
        "got = []\n"
        "while (b := c.receive(max_messages=100_000, timeout_ms=0)).num_rows:\n"
        "    got += b.column('k').to_pylist()\n"
        "    c.ack(b)\n"
        "print(' '.join(map(str, got)))\n", str(root), name))


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split()]


def verify(root) -> int:
    from pyspark_durable_queue.cli import main as cli

    with contextlib.redirect_stdout(None):
        return cli([str(root), "verify", "a"])


@contextlib.contextmanager
def failing_syncs(name: str, times: int = 1, *, drop_from: int | None = None,
                  during: Callable[[], None] | None = None):
    """The next ``times`` syncs of the file ``name`` fail with ``EIO``. ``drop_from``: each
    failing sync first writes zeros over the file from that offset to its end through a
    descriptor of its own (the kernel dropped the pages it could not write; the file reads back
    zeros, as unwritten allocated space does). ``during``: called at the first failure, before
    the pages go (a reader that read them meanwhile). Yields the paths of the syncs that failed,
    then of those that went through."""
    failed: list[str] = []
    passed: list[str] = []

    def fault(path: str) -> None:
        if os.path.basename(path) != name:
            return
        if len(failed) >= times:
            passed.append(path)
            return
        if during is not None and not failed:
            during()
        failed.append(path)
        if drop_from is not None:
            fd = os.open(path, os.O_WRONLY)
            try:
                size = os.fstat(fd).st_size
                os.pwrite(fd, bytes(max(0, size - drop_from)), drop_from)
            finally:
                os.close(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    local.sync_fault = fault
    try:
        yield failed, passed
    finally:
        local.sync_fault = None


def _file_bytes(path, start: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(n)


def test_a_failed_sync_writes_the_unit_again_from_memory_and_no_reader_is_left_behind(tmp_path):
    a = DurableQueue(str(tmp_path)).address("a")
    for i in range(3):
        a.send(rows(i * 10, 10))
    assert consume(tmp_path, "early") == list(range(30))
    segment = tmp_path / "a" / "pages" / SEGMENT_1
    start = a.log.refresh().journal.offset  # where the unit whose sync fails goes
    seen: list[list[int]] = []
    with failing_syncs(SEGMENT_1, drop_from=start,
                       during=lambda: seen.append(consume(tmp_path, "early"))) as (failed, passed):
        with pytest.raises(StorageError) as info:
            a.send(rows(30, 10))
    # the fault fired once; the bytes were written again and synced through a new descriptor
    assert failed == [str(segment)] and passed == [str(segment)]
    assert info.value.errno == errno.EIO
    message = str(info.value)
    assert str(segment) in message and "Input/output error" in message
    assert "no message of this send was acknowledged" in message
    # a reader in another process applied the unit from the page cache before its sync failed
    assert seen == [list(range(30, 40))]
    # the file read back zeros there (the pages were dropped): written again from memory
    assert any(_file_bytes(segment, start, 4096))
    a.send(rows(40, 10))
    # the failed send stays (that reader delivered it), the next one follows it in the chain:
    # the reader goes on after it, a fresh one reads every message, verify finds no damage
    assert consume(tmp_path, "early") == list(range(40, 50))
    assert consume(tmp_path) == list(range(50))
    assert verify(tmp_path) == 0


def test_when_writing_again_fails_too_nothing_is_committed_until_it_is_written(tmp_path):
    a = DurableQueue(str(tmp_path)).address("a")
    for i in range(3):
        a.send(rows(i * 10, 10))
    segment = tmp_path / "a" / "pages" / SEGMENT_1
    start = a.log.refresh().journal.offset
    with failing_syncs(SEGMENT_1, times=3, drop_from=start) as (failed, passed):
        with pytest.raises(StorageError, match="Writing its bytes again from memory failed too"):
            a.send(rows(30, 10))
        with pytest.raises(StorageError, match="not proven durable") as info:
            a.send(rows(40, 10))  # the disk still fails: refused before anything is written
        assert str(segment) in str(info.value)
        assert "no message of this send was acknowledged" in str(info.value)
        assert len(failed) == 3 and passed == []
        assert not any(_file_bytes(segment, start, 1 << 16))  # nothing after the last commit
        assert consume(tmp_path) == list(range(30))
    a.send(rows(50, 10))  # the disk works again: the kept bytes first, then this send
    assert consume(tmp_path, "fresh2") == [*range(40), *range(50, 60)]
    assert verify(tmp_path) == 0


def test_kept_bytes_that_another_writer_wrote_over_are_dropped(tmp_path, caplog):
    a = DurableQueue(str(tmp_path)).address("a")
    a.send(rows(0, 10))
    start = a.log.refresh().journal.offset
    with failing_syncs(SEGMENT_1, times=2, drop_from=start) as (failed, _):
        with pytest.raises(StorageError):
            a.send(rows(10, 10))
    assert len(failed) == 2
    # another process finds zeros where the unit was (the journal's end) and writes its own
    _python("import sys, pyarrow as pa\n"
            "from pyspark_durable_queue import DurableQueue\n"
            "DurableQueue(sys.argv[1]).address('a').send(pa.table({'k': [100, 101], "
            "'b': [b'x', b'y']}))\n", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        a.send(rows(20, 10))  # the kept copy is not written over the other writer's unit
    assert "another writer's unit took their place" in caplog.text
    assert consume(tmp_path) == [*range(10), 100, 101, *range(20, 30)]
    assert verify(tmp_path) == 0


def _rolling_address(root):
    """An address of 64 KiB pages holding one ~40 KB send: the next send rolls."""
    a = DurableQueue(str(root)).address("a", page_size_bytes=64 << 10)
    a.send(rows(0, 200))
    return a


def test_a_failed_sync_of_a_roll_mark_is_written_again_and_the_next_send_rolls(tmp_path):
    a = _rolling_address(tmp_path)
    start = a.log.refresh().journal.offset
    with failing_syncs(SEGMENT_1, drop_from=start) as (failed, passed):
        with pytest.raises(StorageError, match="its roll mark") as info:
            a.send(rows(200, 200))
    assert len(failed) == 1 and len(passed) == 1 and info.value.errno == errno.EIO
    assert _file_bytes(tmp_path / "a" / "pages" / SEGMENT_1, start, 4) == b"DQJN"
    assert not (tmp_path / "a" / "pages" / SEGMENT_2).exists()  # the unit was never written
    a.send(rows(400, 200))
    assert (tmp_path / "a" / "pages" / SEGMENT_2).exists()
    assert consume(tmp_path) == [*range(200), *range(400, 600)]
    assert verify(tmp_path) == 0


def test_a_failed_first_sync_of_a_new_segment_writes_its_header_and_unit_again(tmp_path):
    a = _rolling_address(tmp_path)
    with failing_syncs(SEGMENT_2, drop_from=0) as (failed, passed):
        with pytest.raises(StorageError, match="no message of this send was acknowledged"):
            a.send(rows(200, 200))
    new = tmp_path / "a" / "pages" / SEGMENT_2
    assert failed == [str(new)] and passed == [str(new)]
    assert _file_bytes(new, 0, 8) == b"DQJRNL01"  # dropped, then written again from memory
    a.send(rows(400, 200))
    assert consume(tmp_path) == list(range(600))
    assert verify(tmp_path) == 0


def test_a_failed_sync_of_a_checkpoint_publishes_no_checkpoint_and_the_send_stands(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(commit_log, "JOURNAL_CHECKPOINT_EVERY", 4)
    a = DurableQueue(str(tmp_path)).address("a")
    k = 0
    while (a.log.refresh().version + 1) % 4:
        a.send(rows(k, 1))
        k += 1
    due = a.log.state.version + 1  # the next send's unit is due a checkpoint
    failed: list[str] = []

    def fault(path: str) -> None:
        if f"{os.sep}.tmp{os.sep}" in path and not failed:  # the checkpoint's staged file
            failed.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(local, "sync_fault", fault)
    with caplog.at_level(logging.WARNING):
        a.send(rows(k, 5))  # its unit was synced: the send stands; the checkpoint does not
    assert failed and f"could not write checkpoint {due}" in caplog.text
    log_folder = tmp_path / "a" / "log"
    assert checkpoint_name(due) not in os.listdir(log_folder)
    assert not os.path.exists(failed[0])  # the staged file is gone
    assert consume(tmp_path) == list(range(k + 5))
    for i in range(4):  # the next checkpoint is written (the disk works again)
        a.send(rows(k + 5 + i, 1))
    assert checkpoint_name(due + 4) in os.listdir(log_folder)
    assert consume(tmp_path, "fresh2") == list(range(k + 9))
    assert verify(tmp_path) == 0


def test_kept_bytes_are_not_written_into_an_address_made_again(tmp_path, caplog):
    a = DurableQueue(str(tmp_path)).address("a")
    a.send(rows(0, 10))
    start = a.log.refresh().journal.offset
    with failing_syncs(SEGMENT_1, times=2, drop_from=start), pytest.raises(StorageError):
        a.send(rows(10, 10))
    DurableQueue(str(tmp_path)).delete_address("a")
    DurableQueue(str(tmp_path)).address("a").send(rows(100, 1))
    with caplog.at_level(logging.WARNING):
        a.send(rows(200, 1))  # this handle follows the new address; the kept bytes go
    assert "whose sync failed and that were not written again" in caplog.text
    assert consume(tmp_path) == [100, 200]
    assert verify(tmp_path) == 0
