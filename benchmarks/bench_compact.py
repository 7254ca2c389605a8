"""Compaction (issue 28): page files left, drain rate after compacting, compaction's own speed
and memory, each against baselines measured in the same run.

``Address.compact()`` rewrites runs of small pages (a file per commit with ``journal=False``)
and journal rows (a frame per commit) of the backlog as full pages of ~1 MiB frames. This
measures issue 28's three targets, for addresses with a file per commit (``journal=False``)
and with the local journal (the default on local disks):

1. ``fresh``: ``--fresh`` single sends, each from a fresh ``DurableQueue(root).address()``,
   then ``compact()`` and ``cleanup(dry_run=False, now=time.time() + 3600)`` (which deletes the
   replaced files, past ``compactGraceMs``): the files in the pages folder before and after,
   against the bound ``ceil(stored bytes / pageSizeBytes) + 4`` (stored bytes as ``stats()``
   reports them; a journal segment's file is allocated ``pageSizeBytes`` ahead).
2. ``drain``: a backlog of ``--messages`` ~100-byte rows sent in commits of ``--commit-rows``
   (and of one row: ``--single-messages``) is drained (``receive(max_messages=10_000)`` +
   ``ack`` until empty, a fresh consumer from ``earliest``) (b) before and (c) after
   compaction, against (a) the same messages sent as one batch; target (c)/(a) >= 0.5. A
   consumer that never acknowledges keeps the drained pages needed (compaction leaves pages
   every consumer acknowledged to cleanup). (a) and (c) are the best of ``--repeat`` drains,
   (b) one drain (it is long).
3. ``stream``: compaction of ``N`` and ``10 N`` small pages (``--stream-pages``, commits of 10
   rows), each in a fresh subprocess that reports its peak RSS (``VmHWM`` of
   ``/proc/self/status``, read inside the child), next to a subprocess that only opens the
   address (the page index's own share) and one that reads the same backlog once through
   ``address.snapshot().messages(first_seq)`` (the baseline: read time / compact time >= 0.5);
   and a bare sequential read of the page files' bytes (``cat``-like).

Backlogs are built with ``fsync=never`` (what is measured is their shape, not the sends) and
every address has ``compactSmallPages=0`` (cleanup compacts nothing by itself) and, for
targets 2 and 3, ``cleanupIntervalMs`` of an hour (no cleanup inside a measured drain). Each
drain starts with this process's page cache emptied, so it decodes every page. Run::

    .venv/bin/python benchmarks/bench_compact.py [--quick | --full] [--json out.json]
        [--fresh 600] [--messages 100000] [--commit-rows 10] [--single-messages N]
        [--stream-pages N,N] [--repeat 3] [--only fresh,drain,stream] [--root DIR]

``--quick`` (the default; ``run_all.py``'s size, ~1-2 minutes) runs 50,000 messages in
commits of 10, 2,000 single-row commits and N = 500 / 2,000 commits of 10 (file per commit /
journal); ``--full`` the issue's 100,000 messages (in single-row commits too) and N = 2,000 /
20,000 (at N = 20,000 journal commits the backlog is past the caches' bound of a few pages).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import pyarrow as pa  # noqa: E402

from pyspark_durable_queue import DurableQueue  # noqa: E402
from pyspark_durable_queue._read.cache import page_cache  # noqa: E402
from pyspark_durable_queue.errors import DurableQueueError  # noqa: E402

BODY = "x" * 90  # with the int64 id, a ~100-byte row
KINDS = (("file per commit", {"journal": False}), ("journal", {"journal": True}))
#: every address of the run: cleanup never compacts by itself
BASE = {"compact_small_pages": 0}
#: the backlogs measured: built without syncs, no cleanup in the middle of a measured drain
BUILD = {**BASE, "fsync": "never", "cleanup_interval_ms": 3_600_000}
QUICK: dict[str, Any] = {"fresh": 600, "messages": 50_000, "single": 2_000, "repeat": 3,
         "stream": ((500, 10), (2_000, 10))}
FULL: dict[str, Any] = {"fresh": 600, "messages": 100_000, "single": 100_000, "repeat": 5,
        "stream": ((2_000, 10), (20_000, 10))}


def rows(first: int, n: int) -> list[dict[str, Any]]:
    return [{"id": i, "body": BODY} for i in range(first, first + n)]


def table(first: int, n: int) -> pa.Table:
    return pa.table({"id": pa.array(range(first, first + n), pa.int64()),
                     "body": pa.array([BODY] * n)})


def files(address: Any) -> tuple[int, int]:
    """Files in the pages folder and their bytes."""
    entries = [e for e in os.scandir(address.pages_folder) if e.is_file()]
    return len(entries), sum(e.stat().st_size for e in entries)


def send_commits(address: Any, messages: int, step: int) -> None:
    for first in range(0, messages, step):
        address.send(rows(first, min(step, messages - first)))


def drain(address: Any, name: str) -> tuple[int, float]:
    """A fresh consumer from ``earliest`` until empty; this process's page cache emptied
    first (every drain decodes its pages, as with a backlog larger than the cache)."""
    page_cache().clear()
    consumer = address.consumer(name, start="earliest")
    started = time.perf_counter()
    count = 0
    while True:
        batch = consumer.receive(max_messages=10_000)
        if batch.num_rows == 0:
            break
        count += batch.num_rows
        consumer.ack(batch)
    return count, time.perf_counter() - started


def best_drain(address: Any, tag: str, repeat: int, expect: int) -> float:
    times = []
    for k in range(repeat):
        got, seconds = drain(address, f"{tag}-{k}")
        assert got == expect, (address.name, tag, got, expect)
        times.append(seconds)
    return min(times)


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


# -- 1. page files after compacting single sends from fresh handles ---------------------------
def bench_fresh(root: str, n: int) -> list[dict[str, Any]]:
    out = []
    for kind, settings in KINDS:
        name = f"fresh-{settings['journal']}"
        started = time.perf_counter()
        for i in range(n):
            DurableQueue(root).address(name, **settings, **BASE).send(rows(i, 1))
        send_s = time.perf_counter() - started
        address = DurableQueue(root).address(name, **settings, **BASE)
        before, on_disk = files(address)
        stored = int(address.stats()["bytes"])
        started = time.perf_counter()
        report = address.compact()
        compact_s = time.perf_counter() - started
        address.cleanup(dry_run=False, now=time.time() + 3600)
        after, after_bytes = files(address)
        bound = math.ceil(stored / address.settings.page_size_bytes) + 4
        got, _ = drain(address, "check")
        assert got == n, (kind, got)
        r = {"kind": kind, "sends": n, "send_rate": n / send_s, "files_before": before,
             "stored_bytes": stored, "disk_bytes_before": on_disk, "files_after": after,
             "disk_bytes_after": after_bytes,
             "bound": bound, "met": after <= bound, "compact_s": compact_s,
             "report": {k: v for k, v in report.to_dict().items() if k != "pages"}}
        print(f"  {kind:<16} {n} single sends from fresh handles ({r['send_rate']:,.0f}/s): "
              f"{before} files ({on_disk:,} bytes on disk, {stored:,} stored) -> compact() "
              f"({compact_s * 1e3:.0f} ms, "
              f"{report.pages_before} rows -> {report.pages_after} pages) + cleanup -> "
              f"{after} files ({after_bytes:,} bytes); bound {bound}: {verdict(r['met'])}",
              flush=True)
        out.append(r)
    return out


# -- 2. drain rate before and after compaction against one batch ------------------------------
def bench_drain(root: str, cases: list[tuple[int, int]], repeat: int) -> list[dict[str, Any]]:
    out = []
    for messages, step in cases:
        for kind, settings in KINDS:
            tag = f"{messages}-{step}-{settings['journal']}"
            batch = DurableQueue(root).address(f"batch-{tag}", **settings, **BUILD)
            batch.consumer("hold", start="earliest")  # cleanup after a drain removes nothing
            batch.send(table(0, messages))
            small = DurableQueue(root).address(f"small-{tag}", **settings, **BUILD)
            small.consumer("hold", start="earliest")  # keeps every page needed
            started = time.perf_counter()
            send_commits(small, messages, step)
            send_s = time.perf_counter() - started
            files_before, _ = files(small)
            a = best_drain(batch, "a", repeat, messages)
            try:
                b = best_drain(small, "b", 1, messages)
                failed = ""
            except DurableQueueError as exc:  # e.g. EMFILE: a received table maps every page
                b, failed = math.inf, f"{type(exc).__name__}: {exc}"
            started = time.perf_counter()
            try:
                report = small.compact()
            except DurableQueueError as exc:
                print(f"  {kind:<16} {messages:,} messages in commits of {step}: compact() "
                      f"FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                out.append({"kind": kind, "messages": messages, "commit_rows": step,
                            "compact_failed": f"{type(exc).__name__}: {exc}"})
                continue
            compact_s = time.perf_counter() - started
            c = best_drain(small, "c", repeat, messages)
            r = {"kind": kind, "messages": messages, "commit_rows": step, "send_s": send_s,
                 "files_before": files_before, "rows_compacted": report.pages_before,
                 "pages_after": report.pages_after, "compact_s": compact_s,
                 "a_rate": messages / a, "b_rate": messages / b, "c_rate": messages / c,
                 "b_ratio": a / b, "c_ratio": a / c, "met": a / c >= 0.5, "b_failed": failed}
            print(f"  {kind:<16} {messages:,} messages in commits of {step} ({files_before:,} "
                  f"files; compact {report.pages_before:,} rows -> {report.pages_after} pages in "
                  f"{compact_s:.2f} s): drain (a) one batch {r['a_rate']:,.0f} msg/s, "
                  f"(b) before {r['b_rate']:,.0f} msg/s, (c) after {r['c_rate']:,.0f} msg/s; "
                  f"(b)/(a) {r['b_ratio']:.4f}x, (c)/(a) {r['c_ratio']:.2f}x (target >= 0.5: "
                  f"{verdict(r['met'])})", flush=True)
            if failed:
                print(f"  {'':<16} (b) FAILED: {failed[:300]}", flush=True)
            out.append(r)
    return out


# -- 3. compaction's speed and memory, in subprocesses ----------------------------------------
def child(mode: str, root: str, name: str) -> None:
    """One measurement in this (fresh) process; prints one JSON line with its peak RSS."""
    result: dict[str, Any] = {"mode": mode}
    if mode == "cat":
        folder = os.path.join(root, name, "pages")
        started = time.perf_counter()
        total = 0
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            with open(entry.path, "rb", buffering=0) as f:
                while chunk := f.read(1 << 20):
                    total += len(chunk)
        result.update(seconds=time.perf_counter() - started, bytes=total)
    else:
        fsync = {"fsync": "never"} if mode == "compact-nosync" else {}
        address = DurableQueue(root).address(name, create=False, **BASE, **fsync)
        started = time.perf_counter()
        if mode == "open":
            snap = address.snapshot()
            result["messages"] = snap.end - snap.first_seq
        elif mode == "read":
            snap = address.snapshot()
            result["messages"] = sum(b.num_rows for b, _ in snap.messages(snap.first_seq)
                                     if b is not None)
        elif mode in ("compact", "compact-nosync"):
            report = address.compact()
            result["report"] = {k: v for k, v in report.to_dict().items() if k != "pages"}
        elif mode == "profile":
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(address.compact)
            stats = pstats.Stats(prof, stream=sys.stderr)
            stats.sort_stats("cumulative").print_stats(40)
            stats.sort_stats("tottime").print_stats(25)
        else:
            raise SystemExit(f"unknown child mode {mode!r}")
        result["seconds"] = time.perf_counter() - started
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                result["peak_rss"] = int(line.split()[1]) * 1024
    print(json.dumps(result))


def measure(mode: str, root: str, name: str, pristine: str | None = None) -> dict[str, Any]:
    """``mode`` in a fresh subprocess; ``pristine``: first make ``root`` a copy of it (the
    measurements that compact get the backlog as it was built). Dirty pages are written out
    first (``os.sync``), outside the timing."""
    if pristine is not None:
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(pristine, root, symlinks=True)
    os.sync()  # no writeback of the copy (or of the build) while the child is timed
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode,
                           "--root", root, "--address", name],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{mode} on {root}: status {proc.returncode}\n{proc.stderr}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def best(mode: str, root: str, pristine: str | None, repeat: int) -> dict[str, Any]:
    """The fastest of ``repeat`` measurements."""
    runs = [measure(mode, root, "backlog", pristine) for _ in range(repeat)]
    return min(runs, key=lambda run: float(run["seconds"]))


def bench_stream(root: str, sizes: list[tuple[int, int]], repeat: int) -> list[dict[str, Any]]:
    out = []
    for (kind, settings), (pages, step) in zip(KINDS, sizes, strict=True):
        per_kind = []
        for n in (pages, 10 * pages):
            built = os.path.join(root, f"stream-{settings['journal']}-{n}")
            work = built + "-work"
            address = DurableQueue(built).address("backlog", **settings, **BUILD)
            started = time.perf_counter()
            send_commits(address, n * step, step)
            build_s = time.perf_counter() - started
            count, nbytes = files(address)
            stored = int(address.stats()["bytes"])
            page = address.settings.page_size_bytes
            cat = best("cat", built, None, repeat)
            opened = best("open", built, None, repeat)
            read = best("read", built, None, repeat)
            comp = best("compact", work, built, repeat)
            nosync = best("compact-nosync", work, built, repeat)
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(built, ignore_errors=True)
            assert read["messages"] == n * step, read
            assert comp["report"]["messages"] == n * step, comp
            assert nosync["report"]["messages"] == n * step, nosync
            r = {"kind": kind, "commits": n, "commit_rows": step, "messages": n * step,
                 "files": count, "disk_bytes": nbytes, "stored_bytes": stored,
                 "build_s": build_s, "cat_s": cat["seconds"], "read_s": read["seconds"],
                 "compact_s": comp["seconds"], "compact_nosync_s": nosync["seconds"],
                 "rss_open": opened["peak_rss"], "rss_read": read["peak_rss"],
                 "rss_compact": comp["peak_rss"], "rss_compact_nosync": nosync["peak_rss"],
                 "speed_ratio": read["seconds"] / comp["seconds"],
                 "speed_ratio_nosync": read["seconds"] / nosync["seconds"],
                 "cat_ratio": cat["seconds"] / comp["seconds"], "report": comp["report"],
                 "below_cache_bound": stored < 3 * page}
            r["met_speed"] = r["speed_ratio"] >= 0.5
            print(f"  {kind:<16} {n:,} commits of {step} ({count:,} files, "
                  f"{stored / 1e6:.1f} MB; {report_rows(comp)}): compact "
                  f"{r['compact_s']:.2f} s ({r['messages'] / r['compact_s']:,.0f} msg/s; "
                  f"{r['compact_nosync_s']:.2f} s with fsync=never), read once "
                  f"{r['read_s']:.2f} s, cat {r['cat_s'] * 1e3:.0f} ms", flush=True)
            print(f"  {'':<16} read/compact {r['speed_ratio']:.2f}x (target >= 0.5: "
                  f"{verdict(r['met_speed'])}; fsync=never {r['speed_ratio_nosync']:.2f}x), "
                  f"cat/compact {r['cat_ratio']:.3f}x; peak RSS: open {mb(r['rss_open'])}, "
                  f"read {mb(r['rss_read'])}, compact {mb(r['rss_compact'])} "
                  f"(fsync=never {mb(r['rss_compact_nosync'])})", flush=True)
            per_kind.append(r)
        small, large = per_kind
        growth = large["rss_compact"] / small["rss_compact"]
        own = ((large["rss_compact"] - large["rss_open"])
               / max(1, small["rss_compact"] - small["rss_open"]))
        large["rss_growth"] = growth
        large["rss_own_growth"] = own
        large["met_memory"] = growth <= 1.15
        note = (" (N is under 3 pages of pageSizeBytes: compaction's page cache, 2 pages, "
                "is not full at N; indicative only, see --full)"
                if small["below_cache_bound"] else "")
        print(f"  {kind:<16} 10x the backlog: compaction's peak RSS {growth:.2f}x (target "
              f"flat, <= 1.15x: {verdict(large['met_memory'])}); above only opening the "
              f"address {own:.2f}x; opening alone {large['rss_open'] / small['rss_open']:.2f}x"
              f"{note}", flush=True)
        out.extend(per_kind)
    return out


def report_rows(result: dict[str, Any]) -> str:
    rep = result["report"]
    return f"{rep['pages_before']:,} rows -> {rep['pages_after']} pages"


def mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes (the default)")
    size.add_argument("--full", action="store_true", help="issue 28's sizes")
    ap.add_argument("--fresh", type=int, default=None)
    ap.add_argument("--messages", type=int, default=None)
    ap.add_argument("--commit-rows", type=int, default=10)
    ap.add_argument("--single-messages", type=int, default=None,
                    help="also a backlog of this many single-row commits (0: none)")
    ap.add_argument("--stream-pages", default=None,
                    help="N for the file-per-commit and the journal address, e.g. 500,2000")
    ap.add_argument("--repeat", type=int, default=None,
                    help="drains (a) and (c): the best of this many (quick 3, full 5)")
    ap.add_argument("--stream-repeat", type=int, default=1,
                    help="target 3: the best of this many subprocesses per figure")
    ap.add_argument("--only", default="fresh,drain,stream")
    ap.add_argument("--root", default=None)
    ap.add_argument("--json", default=None, help="also write every figure here as JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.root, args.address)
        return
    sizes = FULL if args.full else QUICK
    fresh = args.fresh if args.fresh is not None else sizes["fresh"]
    messages = args.messages if args.messages is not None else sizes["messages"]
    single = args.single_messages if args.single_messages is not None else sizes["single"]
    stream = list(sizes["stream"]) if args.stream_pages is None else \
        [(int(n), 10) for n in args.stream_pages.split(",")]
    only = {s.strip() for s in args.only.split(",")}
    root = args.root or tempfile.mkdtemp(prefix="dq-compact-", dir="/tmp")
    results: dict[str, Any] = {}
    try:
        if "fresh" in only:
            print("1. page files after compact() + cleanup (bound: ceil(stored bytes / "
                  "pageSizeBytes) + 4)", flush=True)
            results["fresh"] = bench_fresh(root, fresh)
        if "drain" in only:
            print("2. drain rate, receive(10_000) + ack from earliest: (b) small commits and "
                  "(c) the same compacted, against (a) one batch", flush=True)
            cases = [(messages, args.commit_rows)] + ([(single, 1)] if single else [])
            repeat = args.repeat if args.repeat is not None else int(sizes["repeat"])
            results["drain"] = bench_drain(root, cases, repeat)
        if "stream" in only:
            print("3. compaction's speed and peak RSS (each figure a fresh subprocess), "
                  "against reading the same backlog once", flush=True)
            results["stream"] = bench_stream(root, stream, args.stream_repeat)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
