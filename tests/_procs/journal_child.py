"""Subprocess entry points for the journal tests (not a test module): writers that are SIGKILLed
(``tests/test_journal_crash.py``) and a writer with readers in other processes
(``tests/test_journal_concurrency.py``). Also imported by those tests for the message
contents, which are a function of each message's id, and an independent reader of the journal's
files (:func:`walk`), written from the on-disk format in ``_log.journal``'s docstring without the
package's code.

Usage::

    journal_child.py send ROOT ADDRESS RUN SEED THREADS
        THREADS threads send single messages until killed. Thread t of run RUN is writer
        ``RUN * THREADS + t``; its k-th message (k = 1, 2, ...) is ``crash_row(writer, k)``.
        Threads of even t share one ``Address``, the others hold one each. stdout, one
        ``os.write`` a line (a line is never split or mixed with another):
            ready                  the threads are about to start
            sent WRITER K SEQ      send K of WRITER returned, at _seq SEQ
            stalled KIND PATH AT   stopped inside a journal append (see DQ_JOURNAL_STALL), or
                                   in the sync of its unit (KIND ``sync``, AT: the unit's end)
            ERROR text             a send raised or returned something it must not
    journal_child.py watch ROOT ADDRESS STOP_PATH
        Receives (one consumer kept open, ``receive`` with a timeout) until STOP_PATH exists
        and nothing more comes, checking each message whole (``crash_pad``) and reporting it:
            ready                  about to receive
            got SEQ WRITER K       a message received
            done N                 N messages received
            ERROR text             a message was not whole (exit status 3)
    journal_child.py fill ROOT SPEC_JSON
        Creates addresses and sends to them, then exits: SPEC is
        ``{name: {"settings": {...}, "sends": [[pad length, ...], ...]}}``; each send is a list
        of rows ``fill_row(i, pad length)`` with ``i`` counting the address's messages.
    journal_child.py stream ROOT ADDRESS SEED TOTAL
        One thread sends ``stream_row(i)`` for i = 0 .. TOTAL-1 in sends of 1 row (most) or 2
        to 60 rows (some rows are large). Every 40th journal unit is written in two parts with
        a pause in between (a writer descheduled half-way through its write), reported as
            split SEQ ROWS T_HALF T_REST    (``time.monotonic()`` after the first part and
                                            before the rest is written)
        then ``done`` (and the file DONE_PATH, env DQ_STREAM_DONE, is created).
    journal_child.py read ROOT ADDRESS WHO SEED TOTAL
        Receives until it has TOTAL messages, checking each as it comes (dense from 0, in
        order, ``stream_row(_seq)`` exactly), and acknowledges them. WHO ``a``: one handle
        and one consumer for the whole run, deferred acks; WHO ``b``: a fresh ``DurableQueue``,
        address handle and consumer for every receive, flushing acks. stdout:
            call T0 T1 FIRST N      a receive that started at T0 and returned N messages
                                    from FIRST at T1 (monotonic); N = 0: nothing
            done BEFORE             all TOTAL received; BEFORE: receives that returned
                                    messages before the writer's DONE file existed
            ERROR text              a check failed (exit status 3)

``DQ_JOURNAL_FSYNC`` (send mode): the writers' ``fsync`` setting (``always`` by default).

``DQ_JOURNAL_CHECKPOINT_EVERY=N`` (send mode): the writers checkpoint the log every N commits
instead of every 1,000, so that kills land around checkpoints and openings replay from them.

``DQ_JOURNAL_STALL=KIND[:SKIP]`` (send mode): the (SKIP+1)-th journal write of KIND stops the
process inside ``Journal.append`` with the publish lock held (reported, then a long sleep), so
that the parent kills it there, at a point a random kill rarely hits:

    roll      after the roll mark is written in the full segment, before the next segment
    segment   after the next segment file is created and allocated, before its header
    header    after the next segment's header, before its first unit
    unit      after a random part of a unit is written (a write cut short at any byte before
              its last non-zero one)
    frames    after the head and entry of a large unit, before its frames (a separate write)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
from crc32c import crc32c

from pyspark_durable_queue import DurableQueue

# -- message contents: a function of the message's id ---------------------------------------------

#: A large message's pad: its unit's frames are written apart from its head (>= 64 KiB).
BIG = 70_000


def _chars(seed: str, n: int) -> str:
    digest = hashlib.blake2b(seed.encode(), digest_size=32).hexdigest()
    return (digest * (n // len(digest) + 1))[:n]


def crash_pad(writer: int, k: int) -> str:
    """Every 25th message of a writer is large (its own segment at small page sizes)."""
    n = BIG + k % 100 if k % 25 == 0 else (writer * 31 + k * 7) % 200
    return f"{writer}:{k}:" + _chars(f"c{writer}:{k}", n)


def crash_row(writer: int, k: int) -> dict:
    return {"w": writer, "k": k, "pad": crash_pad(writer, k)}


def fill_row(i: int, pad: int) -> dict:
    return {"i": i, "pad": _chars(f"f{i}", pad)}


def stream_row(i: int) -> dict:
    n = BIG + i % 50 if i % 211 == 100 else (i * 13) % 300
    return {"id": i, "pad": _chars(f"s{i}", n), "blob": _chars(f"b{i}", i % 40).encode()}


# -- an independent reader of the journal's files --------------------------------------------------

SEGMENT_MAGIC, UNIT_MAGIC, ROLL_MAGIC = b"DQJRNL01", b"DQJU", b"DQJN"
#: a unit is b"DQJU" when its writer synced it, b"DQJu" when not (fsync=never|periodic)
UNIT_MAGICS = (UNIT_MAGIC, b"DQJu")
SEGMENT_HEAD = struct.Struct("<8s16sI4x")
UNIT_HEAD = struct.Struct("<4sIQIIQ")
UNIT_FIELDS = struct.Struct("<QIIQ")
FRAME_HEAD = struct.Struct("<4sQII")


def segment_path(pages: str | Path, number: int) -> Path:
    return Path(pages) / f"{number:020d}.dqj"


def segment_numbers(pages: str | Path) -> list[int]:
    return sorted(int(p.name[:-4]) for p in Path(pages).iterdir()
                  if p.name.endswith(".dqj") and p.name[:-4].isdigit())


def header_crc(data: bytes) -> int | None:
    """The crc of a segment's header, ``None`` when it is not a valid header."""
    if len(data) < SEGMENT_HEAD.size:
        return None
    magic, ident, crc = SEGMENT_HEAD.unpack_from(data)
    return crc if magic == SEGMENT_MAGIC and crc == crc32c(magic + ident) else None


def unit_at(data: bytes, at: int) -> dict | None:
    """The unit whose head is at ``at`` if its magic, lengths and crc hold (whatever its
    version and prev): ``{"version", "prev", "crc", "entry", "frames", "end"}``."""
    if at + UNIT_HEAD.size > len(data):
        return None
    magic, crc, version, prev, entry_len, frames_len = UNIT_HEAD.unpack_from(data, at)
    end = at + UNIT_HEAD.size + entry_len + frames_len
    if magic not in UNIT_MAGICS or end > len(data):
        return None
    body = data[at + UNIT_HEAD.size:end]
    if crc32c(body, crc32c(UNIT_FIELDS.pack(version, prev, entry_len, frames_len))) != crc:
        return None
    return {"version": version, "prev": prev, "crc": crc, "at": at, "end": end,
            "entry": json.loads(body[:entry_len]), "frames": body[entry_len:]}


def decode_frames(frames: bytes) -> list[dict]:
    """The rows of a unit's frames, every frame's crc checked."""
    rows: list[dict] = []
    at = 0
    while at < len(frames):
        magic, length, nrows, crc = FRAME_HEAD.unpack_from(frames, at)
        assert magic == b"DQFR", f"bad frame magic {magic!r}"
        payload = frames[at + FRAME_HEAD.size:at + FRAME_HEAD.size + length]
        assert len(payload) == length
        assert crc32c(payload, crc32c(struct.pack("<QI", length, nrows))) == crc, "frame crc"
        table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
        assert table.num_rows == nrows
        rows.extend(table.to_pylist())
        at += FRAME_HEAD.size + length
    return rows


def walk(pages: str | Path, *, rows: bool = True) -> dict:
    """Follow the journal from segment 1 as the format says a reader must: each unit's version
    one more than the last, its prev the crc before it, its crc right; a roll mark sends the
    walk to the start of the next segment. Returns the units (with their messages' rows when
    ``rows``) and where and why the walk stopped."""
    units: list[dict] = []
    version, segment, prev = 1, 1, None
    messages: list[dict] = []
    stop: dict = {}
    data = b""
    at = 0
    while True:
        if prev is None:  # the start of ``segment``
            path = segment_path(pages, segment)
            if not path.exists():
                stop = {"reason": "no segment", "segment": segment}
                break
            data = path.read_bytes()
            prev = header_crc(data)
            if prev is None:
                stop = {"reason": "bad header", "segment": segment, "bytes": data[:64]}
                break
            at = SEGMENT_HEAD.size
        head = data[at:at + UNIT_HEAD.size]
        if len(head) < UNIT_HEAD.size:
            stop = {"reason": "end of file", "segment": segment, "at": at}
            break
        magic, crc, v, p, entry_len, frames_len = UNIT_HEAD.unpack(head)
        if magic == ROLL_MAGIC and (v, p, entry_len, frames_len) == (version, prev, 0, 0) \
                and crc == crc32c(UNIT_FIELDS.pack(v, p, 0, 0)):
            segment, prev = segment + 1, None
            continue
        unit = unit_at(data, at)
        if unit is None or unit["version"] != version or unit["prev"] != prev:
            stop = {"reason": "no unit", "segment": segment, "at": at,
                    "bytes": data[at:at + 64], "unit": unit}
            break
        unit.update(segment=segment, at=at)
        entry = unit["entry"]
        if rows and entry.get("op") == "append":
            got = decode_frames(unit["frames"])
            assert int(entry["seq"]) == len(messages), (entry, len(messages))
            for j, row in enumerate(got):
                row["_seq"] = len(messages) + j
            messages.extend(got)
        del unit["frames"]
        units.append(unit)
        version, prev, at = version + 1, unit["crc"], unit["end"]
    return {"units": units, "messages": messages, "stop": stop,
            "segments": segment_numbers(pages)}


# -- fault injection inside Journal.append ---------------------------------------------------------

def _kind_of(data: bytes, stall: str) -> bool:
    if stall == "roll":
        return data[:4] == ROLL_MAGIC
    if stall in ("segment", "header"):
        return data[:8] == SEGMENT_MAGIC
    if stall == "unit":
        return data[:4] in UNIT_MAGICS
    if stall == "frames":  # the head and entry of a unit whose frames follow in another write
        if data[:4] not in UNIT_MAGICS or len(data) < UNIT_HEAD.size:
            return False
        _m, _c, _v, _p, entry_len, frames_len = UNIT_HEAD.unpack_from(data)
        return frames_len > 0 and len(data) == UNIT_HEAD.size + entry_len
    raise ValueError(stall)


def cut_inside(unit: bytes, rng: random.Random) -> int:
    """Where to cut the write of ``unit`` so that part of it is missing: before its last
    non-zero byte. A unit ends in zeros (the Arrow stream's end mark), and a cut among them
    into zero-filled space would leave the whole unit there, readable."""
    return rng.randint(1, len(unit.rstrip(b"\0")) - 1)


def wrap_appends(write) -> None:
    """Route every journal write through ``write(file, data, real_write)``."""
    from pyspark_durable_queue._storage.local import LocalStorage

    real_open = LocalStorage.open_append

    class Wrapped:
        def __init__(self, file) -> None:
            self._file = file

        def write(self, data) -> None:
            write(self._file, bytes(data), self._file.write)

        def __getattr__(self, name: str):
            return getattr(self._file, name)

    def open_append(self, path: str, *, at: int | None = None):
        return Wrapped(real_open(self, path, at=at))

    LocalStorage.open_append = open_append  # type: ignore[method-assign]


def install_stall(spec: str, rng: random.Random) -> None:
    kind, _, skip = spec.partition(":")
    left = [int(skip or 0)]
    lock = threading.Lock()

    def write(file, data: bytes, real_write) -> None:
        with lock:
            hit = _kind_of(data, kind) and left[0] == 0
            if _kind_of(data, kind):
                left[0] -= 1
        if not hit:
            real_write(data)
            return
        at = file.tell()
        if kind in ("roll", "header", "frames"):
            real_write(data)
        elif kind == "unit":
            real_write(data[:cut_inside(data, rng)])
        report(f"stalled {kind} {file.path} {at}")
        time.sleep(300)
        os._exit(4)  # never reached when the parent kills it

    if kind == "sync":
        # stopped in the sync of its unit, which runs after the publish lock was let go: the
        # unit is whole in the journal, the others append after it, its send never returns
        from pyspark_durable_queue._log.journal import Journal

        real_sync_unit = Journal.sync_unit

        def sync_unit(self) -> None:
            unsynced = self._unsynced
            with lock:
                hit = unsynced is not None and left[0] == 0
                left[0] -= unsynced is not None
            if hit:
                report(f"stalled sync {unsynced.file.path} {unsynced.file.tell()}")
                time.sleep(300)
                os._exit(4)
            real_sync_unit(self)

        Journal.sync_unit = sync_unit  # type: ignore[method-assign]
        return
    wrap_appends(write)


def report(line: str) -> None:
    os.write(1, (line + "\n").encode())


# -- modes -----------------------------------------------------------------------------------------

def main_send(root: str, name: str, run: int, seed: int, threads: int) -> int:
    rng = random.Random(seed)
    if os.environ.get("DQ_JOURNAL_CHECKPOINT_EVERY"):
        from pyspark_durable_queue._log import commit_log as _log

        _log.JOURNAL_CHECKPOINT_EVERY = int(os.environ["DQ_JOURNAL_CHECKPOINT_EVERY"])
    if os.environ.get("DQ_JOURNAL_STALL"):
        install_stall(os.environ["DQ_JOURNAL_STALL"], rng)
    fsync = os.environ.get("DQ_JOURNAL_FSYNC", "always")
    shared = DurableQueue(root).address(name, fsync=fsync)
    handles = [shared if t % 2 == 0 else DurableQueue(root).address(name, fsync=fsync)
               for t in range(threads)]
    # warm up: pyarrow imports pandas on the first from_pylist (slow on a loaded machine)
    pa.Table.from_pylist([crash_row(-1, 1)])
    failed = threading.Event()

    def work(t: int) -> None:
        writer = run * threads + t
        k = 0
        while not failed.is_set():
            k += 1
            try:
                r = handles[t].send([crash_row(writer, k)])
            except BaseException as exc:
                report(f"ERROR send {writer} {k} raised {exc!r}")
                failed.set()
                return
            if r.duplicate or r.dropped or r.count != 1 or r.seq < 0:
                report(f"ERROR send {writer} {k} returned {r}")
                failed.set()
                return
            report(f"sent {writer} {k} {r.seq}")

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    report("ready")
    for w in workers:
        w.start()
    failed.wait()
    return 3


def main_watch(root: str, name: str, stop: str) -> int:
    c = DurableQueue(root).address(name).consumer("watcher")
    pa.Table.from_pylist([crash_row(-1, 1)])  # warm up
    report("ready")
    n = 0
    while True:
        stopping = os.path.exists(stop)
        table = c.receive(max_messages=500, timeout_ms=50)
        if not table.num_rows:
            if stopping:
                break
            continue
        out = []
        for row in table.to_pylist():
            if row["pad"] != crash_pad(row["w"], row["k"]):
                report(f"ERROR message {row['_seq']} ({row['w']}, {row['k']}) is not whole")
                return 3
            out.append(f"got {row['_seq']} {row['w']} {row['k']}\n")
        os.write(1, "".join(out).encode())
        n += table.num_rows
    report(f"done {n}")
    return 0


def main_fill(root: str, spec: dict) -> int:
    q = DurableQueue(root)
    for name, what in spec.items():
        a = q.address(name, **what.get("settings", {}))
        i = 0
        for pads in what["sends"]:
            a.send([fill_row(i + j, pad) for j, pad in enumerate(pads)])
            i += len(pads)
    report("done")
    return 0


def main_stream(root: str, name: str, seed: int, total: int) -> int:
    rng = random.Random(seed)
    units = [0]

    def write(file, data: bytes, real_write) -> None:
        if data[:4] not in UNIT_MAGICS:
            real_write(data)
            return
        units[0] += 1
        if units[0] % 40 != 20:
            real_write(data)
            return
        _m, _c, _v, _p, entry_len, _f = UNIT_HEAD.unpack_from(data)
        entry = json.loads(data[UNIT_HEAD.size:UNIT_HEAD.size + entry_len])
        rows = sum(int(p["rows"]) for p in entry.get("pages", ()))
        cut = cut_inside(data, rng)
        real_write(data[:cut])
        t_half = time.monotonic()
        time.sleep(rng.uniform(0.04, 0.12))
        t_rest = time.monotonic()
        real_write(data[cut:])
        report(f"split {entry['seq']} {rows} {t_half} {t_rest}")

    wrap_appends(write)
    a = DurableQueue(root).address(name)
    pa.Table.from_pylist([stream_row(0)])  # warm up
    report("ready")
    i = 0
    while i < total:
        n = 1 if rng.random() < 0.85 else rng.randint(2, 60)
        n = min(n, total - i)
        r = a.send([stream_row(i + j) for j in range(n)])
        if r.seq != i or r.count != n:
            report(f"ERROR send of {i}..{i + n - 1} returned {r}")
            return 3
        i += n
    done = os.environ.get("DQ_STREAM_DONE")
    if done:
        Path(done).touch()
    report("done")
    return 0


def _check(table: pa.Table, expected: int) -> str | None:
    rows = table.to_pylist()
    for j, row in enumerate(rows):
        seq = row.pop("_seq")
        row.pop("_timestamp")
        row.pop("_delivery_count", None)
        if seq != expected + j:
            return f"got _seq {seq} where {expected + j} was next"
        if row != stream_row(seq):
            return f"message {seq} differs from what was sent: {str(row)[:200]}"
    return None


def main_read(root: str, name: str, who: str, seed: int, total: int) -> int:
    rng = random.Random(seed)
    done_file = os.environ.get("DQ_STREAM_DONE", "")
    q = DurableQueue(root)
    a = q.address(name)
    c = a.consumer(f"reader-{who}")
    pa.Table.from_pylist([stream_row(0)])  # warm up
    report("ready")
    expected = 0
    before = 0
    while expected < total:
        if who == "b":
            q = DurableQueue(root)
            a = q.address(name)
            c = a.consumer(f"reader-{who}")
        writing = not os.path.exists(done_file)
        t0 = time.monotonic()
        table = c.receive(max_messages=rng.choice([1, 3, 50, 1000, 5000]),
                          timeout_ms=rng.choice([0, 2, 20, 100]))
        t1 = time.monotonic()
        first = table.column("_seq")[0].as_py() if table.num_rows else -1
        report(f"call {t0} {t1} {first} {table.num_rows}")
        if not table.num_rows:
            if who == "b":
                c.close()
            continue
        problem = _check(table, expected)
        if problem:
            report(f"ERROR {problem}")
            return 3
        expected += table.num_rows
        before += writing
        if who == "a":
            c.ack(table, flush=False)
        else:
            c.ack(table)
            c.close()
    c.close()
    report(f"done {before}")
    return 0


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "send":
        name, run, seed, threads = sys.argv[3], *map(int, sys.argv[4:7])
        return main_send(root, name, run, seed, threads)
    if mode == "watch":
        return main_watch(root, sys.argv[3], sys.argv[4])
    if mode == "fill":
        return main_fill(root, json.loads(sys.argv[3]))
    if mode == "stream":
        return main_stream(root, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    if mode == "read":
        return main_read(root, sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
