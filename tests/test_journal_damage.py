"""Damage versus a torn tail (issue 38): the rule of ``_format/unit.py``, from both sides.

A power cut keeps any subset of the 4 KiB pages of an unsynced unit, and a write cut short
keeps a prefix of it: every such remains of the journal's last unit must read as a torn tail
(the journal's end), never as damage. A flipped byte leaves every page written: in a synced
last unit, in a unit written without a sync, or in a unit that is not the last, it is damage,
which readers report, writers refuse to write over, and verify fails on.

The sweeps judge the bytes of a real segment in memory (``judge_tail``), then check a few of
the cases end to end through a fresh handle. ``DQ_DAMAGE_FULL=1`` judges every prefix and
flip of the unit instead of a sample (~20,000 of each, about a minute).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import subprocess
import sys

import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.unit import HEAD, PIECE, UNIT_HEAD, UNITS, judge_tail
from pyspark_durable_queue.errors import DamagedLogError

FULL = os.environ.get("DQ_DAMAGE_FULL", "") not in ("", "0")
#: every STEP-th byte of the last unit is a prefix end / a flipped byte (and all bytes near its
#: ends and page boundaries); every byte with DQ_DAMAGE_FULL
STEP = 1 if FULL else 61


def _rows(k: int, n: int = 40, width: int = 480) -> list[dict]:
    """Rows whose strings do not compress and hold no zeros: ``n * width`` bytes or so."""
    return [{"k": k, "i": i, "s": (hashlib.sha256(f"{k}:{i}".encode()).hexdigest() * 20)[:width]}
            for i in range(n)]


def _units(data: bytes) -> list[tuple[int, int, int, int]]:
    """``(offset, end, version, crc)`` of each unit of a segment, walked from its bytes."""
    at, out = HEAD, []
    while at + UNIT_HEAD.size <= len(data):
        magic, crc, version, _prev, entry_len, frames_len = UNIT_HEAD.unpack_from(data, at)
        if magic not in UNITS:
            break
        end = at + UNIT_HEAD.size + entry_len + frames_len
        out.append((at, end, version, crc))
        at = end
    return out


@pytest.fixture(scope="module", params=["never", "always"])
def written(request, tmp_path_factory):
    """An address of 3 sends on the journal, the last unit ~20 KiB over 5-6 pages; its
    segment's bytes, and the last unit's place, version and ``prev``."""
    root = tmp_path_factory.mktemp(f"damage-{request.param}")
    a = DurableQueue(str(root)).address("a", journal=True, fsync=request.param)
    for k in range(3):
        a.send(_rows(k, n=40 if k == 2 else 3))
    path = os.path.join(root, "a", "pages", a.state.pages.names[0])
    data = open(path, "rb").read()
    units = _units(data)
    assert len(units) == 3
    at, end, version, _crc = units[-1]
    assert end - at > 4 * PIECE, "the last unit spans several pages"
    # (what follows it is zeros allocated ahead: two pages of them are enough to judge it)
    return {"root": str(root), "path": path, "data": data[:end + 2 * PIECE], "at": at,
            "end": end,
            "version": version, "prev": units[-2][3], "fsync": request.param}


def _judge(w: dict, data: bytes | bytearray):
    data = bytes(data)
    return judge_tail(lambda lo, hi: data[lo:hi], w["at"], w["version"], w["prev"], len(data))


def _positions(w: dict) -> list[int]:
    """Byte offsets of the last unit to cut at or flip: a sample (every one with FULL), and
    every one near its start, its end and each page boundary inside it."""
    at, end = w["at"], w["end"]
    chosen = set(range(at, end, STEP))
    for edge in [at, end, *range((at // PIECE + 1) * PIECE, end, PIECE)]:
        chosen.update(p for p in range(edge - 40, edge + 40) if at <= p < end)
    return sorted(chosen)


def test_the_untouched_last_unit_is_whole(written):
    # (judge_tail is only asked about what is not a unit: a whole one is not damage)
    assert _judge(written, written["data"]) is None


def test_every_prefix_of_the_last_unit_is_a_torn_tail_not_damage(written):
    # A write cut short (a killed writer, a power cut) leaves the unit's first bytes and the
    # zeros that were there before it
    data, at, end = written["data"], written["at"], written["end"]
    cuts = [c for c in _positions(written) if c > at]
    for cut in cuts:
        torn = data[:cut] + bytes(end - cut) + data[end:]
        assert _judge(written, torn) is None, f"a cut at {cut - at} of {end - at} bytes"
    assert len(cuts) > 300


def test_every_subset_of_the_last_units_pages_is_a_torn_tail_not_damage(written):
    # A power cut keeps any subset of the pages of an unsynced unit (the others stay zeros)
    data, at, end = written["data"], written["at"], written["end"]
    pages = list(range(at // PIECE, (end - 1) // PIECE + 1))
    assert 5 <= len(pages) <= 8
    subsets = 0
    for kept in itertools.chain.from_iterable(
            itertools.combinations(pages, n) for n in range(len(pages))):  # not all of them
        torn = bytearray(data)
        for page in set(pages) - set(kept):
            lo, hi = max(at, page * PIECE), min(end, (page + 1) * PIECE)
            torn[lo:hi] = bytes(hi - lo)
        assert _judge(written, torn) is None, f"pages {kept} of {pages} kept"
        subsets += 1
    assert subsets == 2 ** len(pages) - 1


def test_a_prefix_of_a_subset_of_pages_is_a_torn_tail_too(written):
    # the pages written before a power cut, of a write that was itself cut short
    data, at, end = written["data"], written["at"], written["end"]
    rng = random.Random(38)
    pages = list(range(at // PIECE, (end - 1) // PIECE + 1))
    for _ in range(200):
        cut = rng.randrange(at + 1, end)
        torn = bytearray(data[:cut] + bytes(end - cut) + data[end:])
        for page in rng.sample(pages, rng.randrange(1, len(pages))):
            lo, hi = max(at, page * PIECE), min(end, (page + 1) * PIECE)
            torn[lo:hi] = bytes(hi - lo)
        assert _judge(written, torn) is None, cut


def test_a_flipped_byte_anywhere_in_the_last_unit_is_damage(written):
    # every page written: no crash leaves that, synced (DQJU) or not (DQJu)
    data, at = written["data"], written["at"]
    flips = _positions(written)
    for pos in flips:
        damaged = bytearray(data)
        damaged[pos] ^= 0x40
        found = _judge(written, damaged)
        assert found is not None and found.offset == at, f"a flip at {pos - at}"
    assert len(flips) > 300


def test_a_flip_in_the_lengths_of_the_head_is_damage_not_a_unit_past_the_end(written):
    # a length made larger would put zeros (space allocated ahead) inside the unit: its bytes
    # are still a whole unit of the lengths that make its checksum right
    data, at = written["data"], written["at"]
    for byte in range(20, 32):  # entry length, frames length
        for bit in (0x01, 0x10, 0x80):
            damaged = bytearray(data)
            damaged[at + byte] ^= bit
            assert _judge(written, damaged) is not None, (byte, bit)


def _open_fresh(w: dict, data: bytes):
    with open(w["path"], "r+b") as f:
        f.write(data)
    return DurableQueue(w["root"]).address("a", fsync=w["fsync"])


def _verify(root: str) -> subprocess.CompletedProcess:
    code = ("import sys; from pyspark_durable_queue.cli import main\n"
            "sys.exit(main([sys.argv[1], 'verify', 'a']))\n")
    return subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True,
                          timeout=120)


def test_a_torn_last_unit_opens_as_the_journal_end_and_is_written_over(written, tmp_path):
    # end to end, on a copy: the pages of the last unit after its second are lost
    w = dict(written, root=str(tmp_path / "copy"))
    subprocess.run(["cp", "-a", written["root"], w["root"]], check=True)
    w["path"] = written["path"].replace(written["root"], w["root"])
    data, at, end = w["data"], w["at"], w["end"]
    cut = (at // PIECE + 2) * PIECE
    a = _open_fresh(w, data[:cut] + bytes(end - cut))
    assert a.stats()["messages"] == 6  # the two sends before it
    assert _verify(w["root"]).returncode == 0
    assert a.repair(dry_run=True).clean
    a.send([{"k": 9, "i": 0, "s": "after"}])  # zeroes what is left of it, then writes there
    c = DurableQueue(w["root"]).address("a").consumer("c", start="earliest")
    got = c.receive(max_messages=100).column("k").to_pylist()
    assert got == [0, 0, 0, 1, 1, 1, 9]
    tail = open(w["path"], "rb").read()
    last = _units(tail)[-1]
    assert not any(tail[last[1]:end + PIECE]), "the torn unit's bytes are zeroed"


def test_a_flipped_byte_in_the_last_unit_is_reported_by_every_reader_and_writer(written,
                                                                                tmp_path):
    w = dict(written, root=str(tmp_path / "copy"))
    subprocess.run(["cp", "-a", written["root"], w["root"]], check=True)
    w["path"] = written["path"].replace(written["root"], w["root"])
    damaged = bytearray(w["data"])
    pos = w["at"] + (w["end"] - w["at"]) // 2
    damaged[pos] ^= 0x01
    a = _open_fresh(w, bytes(damaged))
    where = f"{os.path.basename(w['path'])}@{w['at']}"
    with pytest.raises(DamagedLogError, match=where):
        a.stats()
    with pytest.raises(DamagedLogError, match="repair ADDRESS"):
        a.send([{"k": 9, "i": 0, "s": "refused"}])
    verify = _verify(w["root"])
    assert verify.returncode == 1 and where in verify.stdout, verify.stdout
    # nothing was written over it
    assert open(w["path"], "rb").read()[:len(damaged)] == bytes(damaged)


# -- what readers, writers and repair do with damage --------------------------------------------

def _address(root, sends: int, **settings):
    settings.setdefault("fsync", "always")
    a = DurableQueue(str(root)).address("a", journal=True, **settings)
    for k in range(sends):
        a.send(_rows(k, n=10, width=200))
    return a


def _flip_unit(root, k: int, segment: int = 1) -> tuple[str, int]:
    """Flip a byte in the middle of unit ``k`` (0-based) of a segment: ``(name@offset)``."""
    name = f"{segment:020d}.dqj"
    path = os.path.join(root, "a", "pages", name)
    data = open(path, "rb").read()
    at, end, _v, _crc = _units(data)[k]
    with open(path, "r+b") as f:
        f.seek((at + end) // 2)
        byte = f.read(1)
        f.seek((at + end) // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    return f"{name}@{at}"


def test_readers_get_everything_before_the_damage_then_the_error(tmp_path):
    _address(tmp_path, 3)
    where = _flip_unit(tmp_path, 2)
    a = DurableQueue(str(tmp_path)).address("a")  # opening is no error
    assert a.state.next_seq == 20
    c = a.consumer("c", start="earliest")
    got = c.receive(max_messages=15)
    assert got.column("_seq").to_pylist() == list(range(15))  # read on up to the damage
    got = c.receive(max_messages=100)
    assert got.column("_seq").to_pylist() == list(range(15, 20))
    with pytest.raises(DamagedLogError, match=where):
        c.receive(max_messages=100)
    with pytest.raises(DamagedLogError, match=where):
        c.receive(max_messages=100, timeout_ms=5_000)  # no wait for what cannot come
    with pytest.raises(DamagedLogError, match=where):
        a.stats()
    with pytest.raises(DamagedLogError, match=f"{where}.*repair ADDRESS"):
        a.send(_rows(9, n=1, width=200))


def test_repair_takes_out_damage_in_the_last_unit_and_the_address_works_again(tmp_path):
    _address(tmp_path, 3)
    where = _flip_unit(tmp_path, 2)
    path = os.path.join(tmp_path, "a", "pages", where.split("@")[0])
    at = int(where.split("@")[1])
    damaged_bytes = open(path, "rb").read()[at:at + 64]
    a = DurableQueue(str(tmp_path)).address("a")
    dry = a.repair(dry_run=True)
    assert not dry.clean and dry.journal_damage is not None
    assert (dry.journal_damage.where, dry.journal_damage.lost) == (where, (20, 30))
    assert dry.journal_damage.known and not dry.journal_damage.units_after
    with pytest.raises(DamagedLogError):  # a dry run changes nothing
        a.stats()
    done = a.repair(dry_run=False)
    assert done.journal_damage.lost == (20, 30)
    kept = list((tmp_path / "a" / "damaged").iterdir())  # repair never deletes
    assert len(kept) == 1 and kept[0].name.endswith(f"{where}.damaged")
    assert kept[0].read_bytes()[:64] == damaged_bytes
    fresh = DurableQueue(str(tmp_path)).address("a")
    st = fresh.stats()
    assert (st["messages"], st["next_seq"], st["lost_messages"]) == (20, 30, 10)
    assert fresh.send(_rows(7, n=1, width=200)).seq == 30
    got = fresh.consumer("c", start="earliest").receive(max_messages=100)
    assert got.column("_seq").to_pylist() == [*range(20), 30]
    assert _verify(str(tmp_path)).returncode == 0
    assert fresh.repair(dry_run=True).clean


@pytest.mark.parametrize("page_size", [10 << 20, 8192], ids=["one segment", "rolled"])
def test_repair_takes_out_damage_in_a_middle_unit_and_keeps_the_units_after_it(tmp_path,
                                                                              page_size):
    a = _address(tmp_path, 6, page_size_bytes=page_size)
    segments = sorted(n for n in os.listdir(tmp_path / "a" / "pages") if n.endswith(".dqj"))
    assert (len(segments) > 1) == (page_size == 8192)
    # the last unit of the first segment: with a roll, the units after it are in the next one
    units = _units(open(tmp_path / "a" / "pages" / segments[0], "rb").read())
    where = _flip_unit(tmp_path, len(units) - 1 if page_size == 8192 else 2)
    first = 10 * (len(units) - 1 if page_size == 8192 else 2)
    verify = _verify(str(tmp_path))
    assert verify.returncode == 1 and where in verify.stdout, verify.stdout
    a = DurableQueue(str(tmp_path)).address("a")
    assert a.state.next_seq == first
    done = a.repair(dry_run=False)
    assert done.journal_damage.lost == (first, first + 10)
    assert done.journal_damage.units_after
    fresh = DurableQueue(str(tmp_path)).address("a")
    assert fresh.stats()["next_seq"] == 60 and fresh.stats()["lost_messages"] == 10
    got = fresh.consumer("c", start="earliest").receive(max_messages=100)
    assert got.column("_seq").to_pylist() == [*range(first), *range(first + 10, 60)]
    assert got.column("k").to_pylist() == [s // 10 for s in got.column("_seq").to_pylist()]
    assert fresh.send(_rows(8, n=1, width=200)).seq == 60
    assert _verify(str(tmp_path)).returncode == 0


def test_a_consumer_past_damage_whose_record_is_unreadable_tells_how_much_was_lost(tmp_path):
    # The damaged unit's record does not parse, so it cannot tell how many messages it held;
    # a consumer that acknowledged them can. Their _seq are not given again (the consumer
    # would skip new messages under them). And the handle that wrote the unit before it was
    # damaged (its view ends after it) appends after the entry repair put in its place.
    a = _address(tmp_path, 3)
    c = a.consumer("c", start="earliest")
    c.ack(c.receive(max_messages=100))
    path = os.path.join(tmp_path, "a", "pages", f"{1:020d}.dqj")
    at = _units(open(path, "rb").read())[2][0]
    with open(path, "r+b") as f:  # the record's first byte: '{' no more
        f.seek(at + UNIT_HEAD.size)
        f.write(b"\x00")
    fresh = DurableQueue(str(tmp_path)).address("a")
    done = fresh.repair(dry_run=False)
    assert done.journal_damage.lost == (20, 30) and not done.journal_damage.known
    assert a.send(_rows(5, n=1, width=200)).seq == 30  # the stale view
    got = DurableQueue(str(tmp_path)).address("a").consumer("c").receive(max_messages=100)
    assert got.column("_seq").to_pylist() == [30]


@pytest.mark.parametrize("byte", [0, 6, 9, 17, 25], ids=["magic", "crc", "version", "prev",
                                                          "lengths"])
def test_a_damaged_roll_mark_is_damage_and_repair_writes_it_again(tmp_path, byte):
    # A roll mark sends readers to the next segment; read as a torn tail, the segments after
    # it would be lost (and the next roll would write over them)
    _address(tmp_path, 6, page_size_bytes=8192)
    path = os.path.join(tmp_path, "a", "pages", f"{1:020d}.dqj")
    data = open(path, "rb").read()
    units = _units(data)
    mark = units[-1][1]
    assert data[mark:mark + 4] == b"DQJN"
    with open(path, "r+b") as f:
        f.seek(mark + byte)
        f.write(bytes([data[mark + byte] ^ 0x04]))
    where = f"{1:020d}.dqj@{mark}"
    a = DurableQueue(str(tmp_path)).address("a")
    before = 10 * len(units)
    assert a.state.next_seq == before
    with pytest.raises(DamagedLogError, match=where):
        a.send(_rows(9, n=1, width=200))
    done = a.repair(dry_run=False)
    assert done.journal_damage.where == where and done.journal_damage.lost == (before, before)
    fresh = DurableQueue(str(tmp_path)).address("a")
    assert fresh.stats()["next_seq"] == 60 and fresh.stats()["lost_messages"] == 0
    got = fresh.consumer("c", start="earliest").receive(max_messages=100)
    assert got.column("_seq").to_pylist() == list(range(60))
    assert fresh.send(_rows(9, n=1, width=200)).seq == 60


# -- what proves a unit committed: a consumer past it, a checkpoint covering it -----------------

def _zero_a_page_of_the_last_unit(root) -> tuple[str, int]:
    """Zeros over one 4 KiB page inside the last unit (neither its first nor its last): what a
    power cut leaves of an unsynced unit, and what a disk that lost a block leaves of a synced
    one. ``(segment name@offset of the unit, its version)``."""
    path = os.path.join(root, "a", "pages", f"{1:020d}.dqj")
    at, end, version, _crc = _units(open(path, "rb").read())[-1]
    page = (at // PIECE + 2) * PIECE
    assert at < page and page + PIECE < end
    with open(path, "r+b") as f:
        f.seek(page)
        f.write(bytes(PIECE))
    return f"{1:020d}.dqj@{at}", version


def _in_a_copy(built) -> str:
    """A copy of the address under ``built`` (a new root): no handle of this process has a view
    of it (a view that applied the last unit before it was damaged appends after it)."""
    copy = f"{built}-copy"
    subprocess.run(["cp", "-a", str(built), copy], check=True)
    return copy


@pytest.mark.parametrize("acknowledged", [False, True], ids=["no consumer", "consumer past it"])
def test_a_consumer_past_a_torn_looking_last_unit_proves_it_damaged(tmp_path, acknowledged):
    a = DurableQueue(str(tmp_path / "built")).address("a", journal=True, fsync="always")
    for k in range(3):
        a.send(_rows(k, n=40 if k == 2 else 3))  # the last unit: ~20 KiB over 5-6 pages
    if acknowledged:
        c = a.consumer("c", start="earliest")
        c.ack(c.receive(max_messages=100))  # its watermark: _seq 46, past the last unit
        c.close()
    root = _in_a_copy(tmp_path / "built")
    where, _version = _zero_a_page_of_the_last_unit(root)
    fresh = DurableQueue(root).address("a")
    if not acknowledged:  # nothing proves it committed: the journal's end, as a crash leaves it
        assert fresh.stats()["messages"] == 6
        assert _verify(root).returncode == 0
        return
    with pytest.raises(DamagedLogError, match=f"{where}.*acknowledged messages up to _seq 46"):
        fresh.stats()
    with pytest.raises(DamagedLogError, match="repair ADDRESS"):
        fresh.send(_rows(9, n=1, width=200))  # nothing is written over it
    verify = _verify(root)
    assert verify.returncode == 1 and where in verify.stdout, verify.stdout
    done = fresh.repair(dry_run=False)
    assert done.journal_damage.lost == (6, 46)  # the consumer tells how many were committed
    again = DurableQueue(root).address("a")
    st = again.stats()
    assert (st["next_seq"], st["lost_messages"]) == (46, 40)
    assert again.send(_rows(9, n=1, width=200)).seq == 46
    assert _verify(root).returncode == 0


def test_a_checkpoint_covering_a_torn_looking_last_unit_proves_it_damaged(tmp_path,
                                                                           monkeypatch):
    from pyspark_durable_queue._log import commit_log
    from pyspark_durable_queue._log.commit_log import checkpoint_name

    a = DurableQueue(str(tmp_path / "built")).address("a", journal=True, fsync="always")
    for k in range(2):
        a.send(_rows(k, n=3))
    last = a.log.refresh().version + 1
    monkeypatch.setattr(commit_log, "JOURNAL_CHECKPOINT_EVERY", last)
    a.send(_rows(2, n=40))  # its unit is covered by checkpoint `last`
    root = _in_a_copy(tmp_path / "built")
    checkpoint = os.path.join(root, "a", "log", checkpoint_name(last))
    data = bytearray(open(checkpoint, "rb").read())
    data[len(data) // 2] ^= 0x01  # unreadable (format 5: checksummed): replayed from the start
    with open(checkpoint, "wb") as f:
        f.write(data)
    where, version = _zero_a_page_of_the_last_unit(root)
    assert version == last
    fresh = DurableQueue(root).address("a")
    with pytest.raises(DamagedLogError, match=f"{where}.*names version {last}"):
        fresh.stats()
    with pytest.raises(DamagedLogError, match="repair ADDRESS"):
        fresh.send(_rows(9, n=1, width=200))
