"""Full disks and failing syncs (issue 38, "full disks").

On a small filesystem the test mounts (a 4 MiB tmpfs; skipped, with the reason, where mounting
is refused): a send fits into what is left, a disk that sends filled refuses them with
:class:`StoreFullError` (an ``OSError`` with errno ``ENOSPC`` and a ``DurableQueueError``),
every message a send acknowledged reads back exactly, and sends and acknowledgements go on by
themselves once cleanup freed space. A failing ``fdatasync`` (``EIO``, injected at the storage
layer's one seam, ``_storage.local.sync_fault``) fails its call and poisons the handle: it
writes nothing more until the file is opened again, and no acknowledged message is lost.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys

import pyarrow as pa
import pytest

import pyspark_durable_queue
from pyspark_durable_queue import (
    DurableQueue,
    DurableQueueError,
    StorageError,
    StoreFullError,
)
from pyspark_durable_queue._read.cache import page_cache
from pyspark_durable_queue._storage import HEADROOM_BYTES, LocalStorage, local

FORMATS = {"journal": {}, "page-files": {"journal": False}}
ROW_BYTES = 200
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(pyspark_durable_queue.__file__)))


def rows(start: int, n: int) -> pa.Table:
    """``n`` messages ``k = start...`` of random bytes (they do not compress)."""
    return pa.table({"k": pa.array(range(start, start + n), pa.int64()),
                     "b": pa.array([os.urandom(ROW_BYTES) for _ in range(n)], pa.binary())})


def free(folder) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def fill(disk, leave: int) -> None:
    """A file on ``disk`` that leaves about ``leave`` bytes free."""
    with open(os.path.join(disk, "filler"), "ab") as f:
        f.write(bytes(max(0, free(disk) - leave)))


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted for the test (unmounted after it, whatever happened)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the full-disk tests needs root (CI runs as "
                    "root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a 4 MiB tmpfs was refused: {mounted.stderr.strip()}")
    try:
        assert free(disk) <= 4 << 20
        yield disk
    finally:
        page_cache().clear()  # decoded pages may map files of the disk
        if subprocess.run(["umount", str(disk)], capture_output=True,
                          check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], check=True)  # still open somewhere


def read_all(root, name: str = "a") -> list[int]:
    """Every message of address ``name`` as a process that read none would see it."""
    page_cache().clear()
    c = DurableQueue(str(root)).address(name).consumer("reader", start="earliest")
    got: list[int] = []
    while (batch := c.receive(max_messages=100_000, timeout_ms=0)).num_rows:
        got += batch.column("k").to_pylist()
    c.delete()  # it keeps no pages from cleanup
    return got


def test_a_small_send_fits_when_a_whole_page_does_not(small_disk):
    # A page is 10 MiB, the disk 4 MiB: the segment grows by what fits.
    root = small_disk / "root"
    a = DurableQueue(str(root)).address("a")
    assert a.settings.page_size_bytes > 4 << 20
    fill(small_disk, 3 << 20)
    a.send([{"k": 7, "b": b"x" * 100}])
    assert read_all(root) == [7]
    [segment] = os.listdir(root / "a" / "pages")
    assert os.path.getsize(root / "a" / "pages" / segment) <= 2 << 20  # not a whole page


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_disk_refuses_sends_and_they_go_on_after_ack_and_cleanup(small_disk, fmt):
    root = small_disk / "root"
    a = DurableQueue(str(root)).address("a", page_size_bytes=256 << 10,
                                         cleanup_interval_ms=3_600_000, **FORMATS[fmt])
    c = a.consumer("c")
    sent: list[int] = []
    with pytest.raises(StoreFullError) as info:
        for _ in range(1000):
            a.send(rows(len(sent), 100))
            sent += range(len(sent), len(sent) + 100)
    error = info.value
    assert isinstance(error, OSError) and isinstance(error, StorageError)
    assert isinstance(error, DurableQueueError)
    assert error.errno == errno.ENOSPC
    assert f"{root}/a/" in str(error) and "cleanup" in str(error)
    assert len(sent) > 5_000  # the disk was filled by sends
    # what is left is kept for acknowledgements and cleanup: smaller sends are refused too
    with pytest.raises(StoreFullError):
        for _ in range(100):
            a.send(rows(len(sent), 1))
            sent.append(len(sent) - 1 + 1)
    assert free(small_disk) > HEADROOM_BYTES // 2
    # every acknowledged message reads back exactly, nothing of the refused sends
    assert read_all(root) == sent
    assert not [n for n in os.listdir(root / ".tmp") if n.endswith(".tmp")]
    # acknowledging works on the full disk (its first acknowledgement makes a file), and
    # cleanup frees the pages
    got = c.receive(max_messages=len(sent) + 1)
    assert got.column("k").to_pylist() == sent
    before = free(small_disk)
    c.ack()  # (its cleanup, best effort, may already remove what it can)
    a.cleanup(dry_run=False)
    assert free(small_disk) > before + (2 << 20)
    # the same handles go on: no reopening
    a.send(rows(len(sent), 100))
    assert c.receive(max_messages=1000).column("k").to_pylist() == list(range(len(sent),
                                                                             len(sent) + 100))
    c.ack()
    assert DurableQueue(str(root)).address("a").consumer("c").receive(timeout_ms=0).num_rows == 0


def test_every_write_of_the_storage_raises_store_full_error(small_disk):
    s = LocalStorage(str(small_disk / "root"))
    s.makedirs(s.join("a"))
    journal = s.open_append(s.join("a", "segment"))
    journal.write(b"x" * 100)
    fill(small_disk, 0)
    attempts = {
        "create": lambda: s.create(s.join("a", "entry"), os.urandom(64 << 10)),
        "replace": lambda: s.replace(s.join("a", "state"), os.urandom(64 << 10)),
        "page file (headroom)": lambda: s.begin_write(s.join("a", "page")),
        "append": lambda: journal.write(os.urandom(256 << 10)),
        "allocate": lambda: journal.preallocate(1 << 20),
    }
    for what, attempt in attempts.items():
        with pytest.raises(StoreFullError) as info:
            attempt()
        assert info.value.errno == errno.ENOSPC, what
    # nothing staged is left behind
    assert not [n for n in os.listdir(s.join(".tmp")) if n.endswith(".tmp")]
    # a page file whose writes find the disk full (below the headroom check)
    os.unlink(small_disk / "filler")
    fill(small_disk, HEADROOM_BYTES + (64 << 10))
    f = s.begin_write(s.join("a", "page"))
    with pytest.raises(StoreFullError):
        f.write(os.urandom(2 * HEADROOM_BYTES))
        f.flush()
    with contextlib.suppress(StorageError):
        f.close()
    journal.close()


def test_checkpoints_consumers_and_compaction_raise_store_full_error(small_disk):
    root = small_disk / "root"
    a = DurableQueue(str(root)).address("a", journal=False, page_size_bytes=256 << 10,
                                         compact_small_pages=1_000_000)
    for i in range(20):
        a.send(rows(i * 10, 10))
    fill(small_disk, 0)
    with pytest.raises(StoreFullError):
        a.log.write_checkpoint(a.log.refresh())
    with pytest.raises(StoreFullError):
        a.consumer("new")
    with pytest.raises(StoreFullError):
        a.compact()
    with pytest.raises(StoreFullError):
        a.send(rows(200, 1))
    os.unlink(small_disk / "filler")
    assert read_all(root) == list(range(200))


# -- failing syncs ------------------------------------------------------------------------------
@contextlib.contextmanager
def failing_syncs(suffix: str, times: int = 1):
    """The next ``times`` syncs of files whose path ends with ``suffix`` fail with ``EIO``;
    yields the paths of the syncs that failed, then of those that went through."""
    failed: list[str] = []
    passed: list[str] = []

    def fault(path: str) -> None:
        if path.endswith(suffix):
            if len(failed) < times:
                failed.append(path)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            passed.append(path)

    local.sync_fault = fault
    try:
        yield failed, passed
    finally:
        local.sync_fault = None


def test_a_failed_sync_poisons_the_file_until_it_is_opened_again(tmp_path):
    s = LocalStorage(str(tmp_path))
    path = s.join("f")
    f = s.open_append(path)
    f.write(b"abc")
    f.sync()
    f.write(b"def")
    with failing_syncs("/f") as (failed, _):
        with pytest.raises(StorageError) as info:
            f.sync()
    assert failed == [path] and info.value.errno == errno.EIO
    assert f.poisoned and f.unsynced() == (3, 6)
    for later in (lambda: f.write(b"ghi"), f.sync, lambda: f.preallocate(10)):
        with pytest.raises(StorageError, match="a sync of this file failed"):
            later()  # never retried into a success, although the disk works again
    f.close()
    g = s.open_append(path)
    g.write(b"ghi")
    g.sync()
    assert not g.poisoned and s.read(path) == b"abcdefghi"
    g.close()

    s.replace(s.join("w"), bytes(16))
    w = s.open_inplace(s.join("w"))
    w.write(b"1", 0)
    with failing_syncs("/w") as (failed, _), pytest.raises(StorageError):
        w.sync()
    assert failed and w.poisoned
    with pytest.raises(StorageError, match="a sync of this file failed"):
        w.write(b"2", 0)
    w.close()


def test_a_send_whose_sync_fails_fails_and_its_unit_is_written_again_from_memory(tmp_path):
    # (tests/test_failed_sync.py: the same with the pages dropped, on a roll, and when writing
    # again fails too)
    a = DurableQueue(str(tmp_path)).address("a")
    for i in range(3):
        a.send(rows(i * 10, 10))
    with failing_syncs(".dqj") as (failed, passed), pytest.raises(StorageError) as info:
        a.send(rows(30, 10))
    assert len(failed) == 1 and info.value.errno == errno.EIO
    assert "no message of this send was acknowledged" in str(info.value)
    # before the call returned, a new descriptor wrote the unit again and synced it
    assert passed == failed and not a.log.journal._file.poisoned
    a.send(rows(40, 10))
    got = read_all(tmp_path)
    # the failed send was not acknowledged, but it is stored (as any commit whose answer was
    # lost may be); every acknowledged one is, exactly once, in order
    assert got == list(range(50))
    check = [sys.executable, "-c", (
        "import sys; from pyspark_durable_queue import DurableQueue; "
        "c = DurableQueue(sys.argv[1]).address('a').consumer('x', start='earliest'); "
        "print(c.receive(max_messages=1000).column('k').to_pylist())"), str(tmp_path)]
    out = subprocess.run(check, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": PACKAGE_PARENT})
    assert out.stdout.strip() == str(got)


def test_an_acknowledgement_whose_sync_fails_fails_and_the_next_one_reopens(tmp_path):
    a = DurableQueue(str(tmp_path)).address("a")
    a.send(rows(0, 10))
    c = a.consumer("c")
    c.ack(c.receive(max_messages=3))
    c.receive(max_messages=3)
    with failing_syncs(".wm") as (failed, _), pytest.raises(StorageError) as info:
        c.ack()
    assert failed and info.value.errno == errno.EIO
    c.ack()  # a new descriptor
    c.ack(c.receive(max_messages=2))
    again = DurableQueue(str(tmp_path)).address("a").consumer("c")
    assert again.receive(max_messages=10).column("k").to_pylist() == [8, 9]


def test_a_unit_whose_write_finds_the_disk_full_is_zeroed_and_never_read(small_disk,
                                                                         monkeypatch):
    # Without posix_fallocate (macOS) space made ahead is only a file size: a write into it
    # can still find the disk full half-way through a unit.
    monkeypatch.delattr(os, "posix_fallocate")
    root = small_disk / "root"
    a = DurableQueue(str(root)).address("a", page_size_bytes=2 << 20)
    a.send(rows(0, 10))
    [segment] = os.listdir(root / "a" / "pages")
    end = a.log.refresh().journal.offset
    fill(small_disk, 64 << 10)
    with pytest.raises(StoreFullError):
        a.send(rows(10, 2000))  # ~400 KB: more than is left
    with open(root / "a" / "pages" / segment, "rb") as f:
        f.seek(end)
        assert not f.read(512 << 10).strip(b"\0")  # what it wrote of the unit is zeros again
    os.unlink(small_disk / "filler")  # (the write took what was left: a reader needs a file)
    assert read_all(root) == list(range(10))
    a.send(rows(2010, 10))  # where the refused unit began
    assert read_all(root) == [*range(10), *range(2010, 2020)]


def test_a_full_quota_is_a_store_full_error_too():
    from pyspark_durable_queue._storage.base import translated_error

    error = translated_error("append", "/r/a/pages/1.dqj", OSError(errno.EDQUOT, "quota"))
    assert isinstance(error, StoreFullError) and error.quota and error.errno == errno.ENOSPC
    assert "quota" in str(error)
    import pickle

    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, StoreFullError) and again.path == "/r/a/pages/1.dqj"
    assert str(again) == str(error)


def test_a_failed_periodic_sync_is_reported_not_papered_over(tmp_path, caplog):
    from pyspark_durable_queue._log import durability

    a = DurableQueue(str(tmp_path)).address("a", fsync="periodic", fsync_interval_ms=3_600_000)
    a.send(rows(0, 3))
    with failing_syncs(str(tmp_path), times=2) as (failed, _):
        with pytest.raises(StorageError) as info:
            a.storage.sync_all()
        assert info.value.errno == errno.EIO
        durability._SYNCER.sync_now()  # the background syncer logs it (the sends returned)
    assert len(failed) == 2
    assert "periodic sync" in caplog.text and "Input/output error" in caplog.text
