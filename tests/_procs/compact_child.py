"""Subprocess entry points for the compaction crash tests (``tests/test_compact_crash.py``; not a
test module): a compactor that is SIGKILLed and consumers that receive and acknowledge meanwhile.
The writers are ``journal_child.py send`` (single messages ``crash_row(writer, k)``).

Usage::

    compact_child.py compact ROOT ADDRESS SEED
        After a random pause (0.1 to 0.6 s, for small pages to pile up), loops
        ``Address.compact()`` then ``Address.cleanup(dry_run=False)`` until killed.
        stdout, one ``os.write`` a line:
            ready                      about to start
            compact N                  compaction N starts (planning)
            reading N DONE TOTAL       compaction N read its first small page of TOTAL bytes
            compacted N RUNS BEFORE AFTER MESSAGES ABANDONED VERSION PAGES...
                                       compaction N returned (its swaps are published; the
                                       log was at VERSION after it); PAGES: the new pages
            cleanup N                  its cleanup starts
            cleaned N PAGES ORPHANS    its cleanup returned
            stalled KIND DETAIL...     stopped at KIND (see DQ_COMPACT_STALL) to be killed
            ERROR text                 something raised (exit status 3)
    compact_child.py consume ROOT ADDRESS WHO SEED STOP_PATH
        The durable consumer WHO receives (random sizes, a timeout) and acknowledges (flushing
        or deferred, ``ack_flush_ms=20``) until STOP_PATH exists and nothing more comes,
        checking each message whole (``crash_pad``) and each batch dense after the last;
        cleanup runs after its acknowledgements (``cleanup_interval_ms`` of the address) and
        may compact. Each batch is reported before it is acknowledged:
            start POSITION             the watermark it resumes from
            got SEQ WRITER K TS        a message received (TS: its _timestamp, microseconds)
            flushed POSITION           a flushing ack returned (the watermark written)
            resolved FIRST END         a read found a page gone and asked the log where
                                       ``[FIRST, END)`` is now (the reader fallback)
            done N                     drained after STOP_PATH appeared; N messages received
            ERROR text                 a check failed (exit status 3)

``DQ_COMPACT_STALL=KIND[:SKIP]`` (compact mode): the (SKIP+1)-th time the compactor reaches KIND
it reports ``stalled`` and sleeps, so that the parent kills it exactly there. Points, reached
through ``compact()``'s and ``cleanup()``'s ``progress`` callbacks and the compactor's own
loop; ``written`` wraps ``_ops.compact._page_rows``, which ``Compactor._compact_run`` calls between
syncing the new pages (and their folder) and publishing the swap:

    read       a run is half read: some small pages read, its new pages being written
    written    a run's new pages are written and synced, its swap not published
               (DETAIL: the new pages' names)
    swapped    compact() returned with swaps published, cleanup not started
               (DETAIL: the new pages' names)
    cleanup    cleanup is deleting files: some went, some not (DETAIL: done, total)

``DQ_JOURNAL_CHECKPOINT_EVERY=N``: checkpoint a journal's log every N commits (as the writers).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import time
from pathlib import Path

import pyarrow as pa

from pyspark_durable_queue import DurableQueue

_spec = importlib.util.spec_from_file_location(
    "dq_journal_child", Path(__file__).with_name("journal_child.py"))
assert _spec is not None and _spec.loader is not None
_journal_child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_journal_child)
crash_pad = _journal_child.crash_pad
report = _journal_child.report

KINDS = ("read", "written", "swapped", "cleanup")


def parse(out: Path) -> dict:
    """What a compactor or consumer reported before it died (complete lines only)."""
    text = out.read_text() if out.exists() else ""
    got: list[tuple[int, int, int, int]] = []
    result: dict = {"ready": False, "start": None, "got": got, "flushed": -1, "resolved": [],
                    "stalled": None, "done": None, "last": None, "compacted": [],
                    "reading": 0, "cleaned": 0, "errors": []}
    for line in text.split("\n")[:-1]:
        parts = line.split()
        if not parts:
            continue
        kind = parts[0]
        if kind == "got":
            seq, writer, k, ts = map(int, parts[1:])
            got.append((seq, writer, k, ts))
            continue
        if kind in ("compact", "reading", "compacted", "cleanup", "cleaned"):
            result["last"] = kind  # where a compactor was when killed (its last line)
        if kind == "ready":
            result["ready"] = True
        elif kind == "start":
            result["start"] = int(parts[1])
        elif kind == "flushed":
            result["flushed"] = max(result["flushed"], int(parts[1]))
        elif kind == "resolved":
            result["resolved"].append((int(parts[1]), int(parts[2])))
        elif kind == "stalled":
            result["stalled"] = (parts[1], parts[2:])
        elif kind == "done":
            result["done"] = int(parts[1])
        elif kind == "compacted":
            numbers = [int(p) for p in parts[1:8]]
            result["compacted"].append({
                "runs": numbers[1], "before": numbers[2], "after": numbers[3],
                "messages": numbers[4], "abandoned": numbers[5], "version": numbers[6],
                "pages": parts[8:]})
        elif kind == "reading":
            result["reading"] += 1
        elif kind == "cleaned":
            result["cleaned"] += 1
        elif kind not in ("compact", "cleanup"):
            result["errors"].append(line)
    return result


# -- compact ---------------------------------------------------------------------------------------

def main_compact(root: str, name: str, seed: int) -> int:
    from pyspark_durable_queue._log import commit_log as _log
    from pyspark_durable_queue._ops import compact as _compact

    rng = random.Random(seed)
    if os.environ.get("DQ_JOURNAL_CHECKPOINT_EVERY"):
        _log.JOURNAL_CHECKPOINT_EVERY = int(os.environ["DQ_JOURNAL_CHECKPOINT_EVERY"])
    stall, _, skip = os.environ.get("DQ_COMPACT_STALL", "").partition(":")
    assert stall in ("", *KINDS), stall
    left = [int(skip or 0)]

    def reached(kind: str, *detail: object) -> None:
        if kind != stall:
            return
        if left[0] > 0:
            left[0] -= 1
            return
        report(" ".join(["stalled", kind, *map(str, detail)]))
        time.sleep(300)
        os._exit(4)  # never reached when the parent kills it

    real_page_rows = _compact._page_rows

    def page_rows(pages, pieces, first):  # type: ignore[no-untyped-def]
        reached("written", *(p.name for p in pages))
        return real_page_rows(pages, pieces, first)

    _compact._page_rows = page_rows
    a = DurableQueue(root).address(name)
    report("ready")
    time.sleep(rng.uniform(0.1, 0.6))  # small pages pile up (the writer starts with it)
    n = 0
    while True:
        n += 1
        report(f"compact {n}")
        seen = [False]

        def progress(done: int, total: int, n: int = n, seen: list = seen) -> None:
            if done and not seen[0]:
                seen[0] = True
                report(f"reading {n} {done} {total}")
            if 0 < done < total:
                reached("read", done, total)

        try:
            r = a.compact(progress=progress)
        except Exception as exc:
            report(f"ERROR compact {n} raised {exc!r}")
            return 3
        version = a.log.refresh().version
        report(f"compacted {n} {r.runs} {r.pages_before} {r.pages_after} {r.messages} "
               f"{r.abandoned} {version} {' '.join(r.pages)}".rstrip())
        if r.runs:
            reached("swapped", *r.pages)
        report(f"cleanup {n}")

        def cleaning(done: int, total: int) -> None:
            if 0 < done < total:
                reached("cleanup", done, total)

        try:
            c = a.cleanup(dry_run=False, progress=cleaning)
        except Exception as exc:
            report(f"ERROR cleanup {n} raised {exc!r}")
            return 3
        report(f"cleaned {n} {len(c.pages)} {len(c.orphans)}")
        time.sleep(rng.uniform(0, 0.05))


# -- consume ---------------------------------------------------------------------------------------

def main_consume(root: str, name: str, who: str, seed: int, stop: str) -> int:
    from pyspark_durable_queue._log import commit_log as _log
    from pyspark_durable_queue.address import Address

    rng = random.Random(seed)
    if os.environ.get("DQ_JOURNAL_CHECKPOINT_EVERY"):
        _log.JOURNAL_CHECKPOINT_EVERY = int(os.environ["DQ_JOURNAL_CHECKPOINT_EVERY"])
    real_live_refs = Address.live_refs

    def live_refs(self, first, end):  # type: ignore[no-untyped-def]
        report(f"resolved {first} {end}")  # scan's resolve: a page it planned on is gone
        return real_live_refs(self, first, end)

    Address.live_refs = live_refs  # type: ignore[method-assign]
    c = DurableQueue(root).address(name).consumer(who, ack_flush_ms=20)
    pa.Table.from_pylist([_journal_child.crash_row(-1, 1)])  # warm up
    report("ready")
    report(f"start {c.position}")
    expect = c.position
    n = 0
    while True:
        stopping = os.path.exists(stop)
        t = c.receive(max_messages=rng.choice([1, 7, 60, 500, 5000]),
                      max_bytes=rng.choice([1 << 10, 64 << 10, 16 << 20]), timeout_ms=50)
        if not t.num_rows:
            if stopping:
                break
            continue
        seqs = t.column("_seq").to_pylist()
        if seqs != list(range(expect, expect + len(seqs))):
            report(f"ERROR received {seqs[:5]}... after {expect}")
            return 3
        expect += len(seqs)
        times = t.column("_timestamp").cast(pa.int64()).to_pylist()
        out = []
        for seq, w, k, pad, ts in zip(seqs, t.column("w").to_pylist(), t.column("k").to_pylist(),
                                      t.column("pad").to_pylist(), times, strict=True):
            if pad != crash_pad(w, k):
                report(f"ERROR message {seq} ({w}, {k}) is not whole")
                return 3
            out.append(f"got {seq} {w} {k} {ts}\n")
        os.write(1, "".join(out).encode())  # recorded before it is acknowledged
        n += len(seqs)
        if rng.random() < 0.4:
            c.ack(t)
            report(f"flushed {c.flushed}")
        else:
            c.ack(t, flush=False)
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0, 0.02))
    c.flush()
    report(f"flushed {c.flushed}")
    report(f"done {n}")
    return 0


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "compact":
        return main_compact(root, sys.argv[3], int(sys.argv[4]))
    if mode == "consume":
        return main_consume(root, sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
