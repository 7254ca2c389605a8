"""Retention (issue 41, target 1): an address with an idle consumer and ``retentionBytes`` is fed
in 100-row sends; after every cleanup ``stats()["bytes"]`` must be at most the bound plus two
pages, and the sends must cost within 5% of the same sends to an address without retention.

Each round feeds ``--total`` bytes (as ``stats()`` counts them) in sends of ``--rows`` rows (an
int64 ``id`` and a ``--row-bytes`` body) to a fresh address with one consumer that never reads,
twice, alternating which goes first: A without retention, B with ``retention_bytes`` =
``--retention``. Sends run cleanup themselves when the address is over its retention (B;
``cleanupIntervalMs`` = ``--interval``, on a background thread); each time one did (the
cleaner's clock moved), the run waits for that cleanup to end and reads ``stats()`` outside the
timed sends, and records the bytes. The send time is the sum of the ``send`` calls. Both
addresses are the local journal (the default on a local disk) with ``fsync`` = ``--fsync``
(``never`` by default: the Python path, not the disk's sync time, which would drown a 5%
difference on a shared machine).

Run::

    .venv/bin/python benchmarks/bench_retention.py [--total 256MiB] [--retention 50MiB]
        [--rows 100] [--row-bytes 1000] [--page-size 10MiB] [--interval 1000]
        [--rounds 3] [--fsync never] [--json out.json] [--root DIR]

The default feeds 256 MiB per run (about 2,600 sends, a minute or two per round on a laptop);
the issue's figure is ``--total 1GiB``. Data goes to a temporary folder that is deleted after
each run (A without retention holds all of ``--total`` on disk meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from pyspark_durable_queue import DurableQueue  # noqa: E402
from pyspark_durable_queue._options import _to_int  # noqa: E402


def run(root: str, *, retention: int | None, args: argparse.Namespace) -> dict[str, Any]:
    """One feed of ``args.total`` bytes; the send time and, with retention, the bytes after
    each cleanup."""
    folder = tempfile.mkdtemp(prefix="bench-retention-", dir=root)
    try:
        settings: dict[str, Any] = {"page_size_bytes": args.page_size, "fsync": args.fsync,
                                    "cleanup_interval_ms": args.interval}
        if retention is not None:
            settings["retention_bytes"] = retention
        a = DurableQueue(folder).address("feed", **settings)
        a.consumer("idle", start="earliest")  # never reads: nothing is consumed
        ids = np.arange(args.rows, dtype=np.int64)
        body = pa.array([b"x" * args.row_bytes] * args.rows)
        sent = sends = 0
        spent = 0.0
        after: list[int] = []
        cleaned = a._cleaner.last
        while sent < args.total:
            table = pa.table({"id": ids + sends * args.rows, "body": body})
            t0 = time.perf_counter()
            a.send(table)
            spent += time.perf_counter() - t0
            sends += 1
            sent += table.nbytes
            if a._cleaner.last != cleaned:  # this send started a cleanup: look (untimed)
                cleaned = a._cleaner.last
                assert a._cleaner.background is not None
                a._cleaner.background.join()
                after.append(a.stats()["bytes"])
        if a._cleaner.background is not None:  # a cleanup the last sends started
            a._cleaner.background.join()
        stats = a.stats()
        disk = sum(os.path.getsize(os.path.join(d, f))
                   for d, _, files in os.walk(os.path.join(folder, "feed", "pages"))
                   for f in files)
        return {"seconds": spent, "sends": sends, "cleanups": len(after),
                "max_bytes_after_cleanup": max(after) if after else None,
                "bytes": stats["bytes"], "disk_bytes": disk,
                "retention_removed_bytes": stats["retention_removed_bytes"]}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total", default="256MiB", help="bytes fed per run (the issue: 1GiB)")
    p.add_argument("--retention", default="50MiB")
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--row-bytes", type=int, default=1000)
    p.add_argument("--page-size", default="10MiB")
    p.add_argument("--interval", type=int, default=1000, help="cleanupIntervalMs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fsync", default="never", choices=("always", "periodic", "never"))
    p.add_argument("--json")
    p.add_argument("--root", default=None, help="folder for the data (default: a temp dir)")
    args = p.parse_args(argv)
    args.total, args.retention = _to_int(args.total), _to_int(args.retention)
    args.page_size = _to_int(args.page_size)
    root = tempfile.mkdtemp(prefix="bench-retention-", dir=args.root)
    bound = args.retention + 2 * args.page_size
    results: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    try:
        for r in range(args.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for which in order:
                out = run(root, retention=None if which == "A" else args.retention, args=args)
                results[which].append(out)
                print(f"round {r + 1} {which}: {out['sends']} sends in {out['seconds']:.2f} s, "
                      f"{out['cleanups']} cleanups, max bytes after a cleanup "
                      f"{out['max_bytes_after_cleanup']}, at the end {out['bytes']} "
                      f"(disk {out['disk_bytes']})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    a = statistics.median(x["seconds"] for x in results["A"])
    b = statistics.median(x["seconds"] for x in results["B"])
    worst = max((x["max_bytes_after_cleanup"] or 0) for x in results["B"])
    summary = {
        "total_bytes": args.total, "retention_bytes": args.retention,
        "page_size_bytes": args.page_size, "rows_per_send": args.rows,
        "send_seconds_median": {"A_no_retention": a, "B_retention": b}, "ratio_B_A": b / a,
        "max_bytes_after_cleanup": worst, "bound": bound, "bound_met": worst <= bound,
        "cleanups_per_run": [x["cleanups"] for x in results["B"]],
        "runs": results,
    }
    print(f"sends: A (no retention) {a:.2f} s, B (retention) {b:.2f} s, B/A {b / a:.3f} "
          f"(target <= 1.05); max stats bytes after a cleanup {worst} <= bound {bound} "
          f"(retention + 2 pages): {worst <= bound}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
