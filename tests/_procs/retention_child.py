"""Child processes of ``tests/test_retention.py``.

``read ROOT ADDRESS END OUT``: consumer ``reader`` receives (never acknowledging, so retention
overtakes it) until its cursor reaches ``END``, and writes to ``OUT`` as JSON the ``_seq`` it got,
the ranges its warnings said were lost, and how many rows did not hold their own ``_seq``.

``clean ROOT ADDRESS``: sends 100 rows (``i`` = the ``_seq`` each gets: the only sender) and runs
a cleanup, forever, printing a line each time cleanup removed pages; the parent SIGKILLs it.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import pyarrow as pa

from pyspark_durable_queue import DurableQueue

ROWS = 100
READ = 1000  # rows per receive: several pages per read, so that pages go in the middle


class Lost(logging.Handler):
    """The ranges the consumer's warnings name (``_seq a..b are lost``), and how many reads
    started over because a page went under them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.ranges: list[list[int]] = []
        self.again = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.again += "reading again" in record.msg
        if "are lost" in record.msg and isinstance(record.args, tuple):
            first, last = record.args[2], record.args[3]
            self.ranges.append([int(first), int(last) + 1])


def read(root: str, name: str, end: int, out: str) -> None:
    lost = Lost()
    logger = logging.getLogger("pyspark_durable_queue.consumer")
    logger.addHandler(lost)
    logger.setLevel(logging.INFO)
    c = DurableQueue(root).address(name).consumer("reader")
    seqs: list[int] = []
    bad = 0
    deadline = time.monotonic() + 50
    while c.cursor < end:
        if time.monotonic() > deadline:
            raise SystemExit(f"stuck at {c.cursor} of {end}")
        t = c.receive(max_messages=READ, timeout_ms=200)
        if not t.num_rows:  # (before the first send the table has no column i)
            continue
        got = t.column("_seq").to_pylist()
        bad += sum(i != s for i, s in zip(t.column("i").to_pylist(), got, strict=True))
        seqs += got
        time.sleep(0.003)
    with open(out, "w") as f:
        json.dump({"seqs": seqs, "lost": lost.ranges, "bad": bad, "again": lost.again}, f)


def clean(root: str, name: str) -> None:
    a = DurableQueue(root).address(name)
    while True:
        at = a.state.next_seq
        a.send(pa.table({"i": pa.array(range(at, at + ROWS), pa.int64())}))
        report = a.cleanup(dry_run=False)
        if report.pages:
            print(len(report.pages), report.retention_messages, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "read":
        read(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        clean(sys.argv[2], sys.argv[3])
