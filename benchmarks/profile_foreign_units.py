"""What a sending process pays per unit that *other* processes appended to a journal address.

Before a process appends, its view of the log must reach the journal's end; today it gets
there by replaying every unit written since its last look (``CommitLog.refresh``: read the
unit, check its CRC over entry and frames, parse the entry, apply it to the view). This
compares that, per foreign unit, with walking the unit heads alone (one 32-byte ``pread`` a
unit, hopping by the lengths in each head): the floor of a design in which a writer learns
the journal's end without applying what others wrote (docs/architecture.md, "The send path
across processes").

Run::

    .venv/bin/python benchmarks/profile_foreign_units.py [--units 2000] [--rounds 5]

Each round a child process appends ``--units`` single-row units (``fsync=never``: the bytes
are in the page cache either way, the sync is not what is measured); this process then walks
their heads, and then refreshes its view over them. Medians per unit are printed; the scratch
address is deleted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.unit import HEAD, ROLL_MAGIC, UNIT_HEAD, UNITS

CHILD = r"""
import sys
from pyspark_durable_queue import DurableQueue
a = DurableQueue(sys.argv[1]).address("p", fsync="never")
for i in range(int(sys.argv[2])):
    a.send([{"id": i, "kind": "a", "body": b"x" * 100}])
"""


def walk_heads(journal, segment: int, offset: int) -> int:
    """Units from ``offset`` of ``segment`` to the journal's end, by their heads alone."""
    n = 0
    while True:
        fd = os.open(journal.path(segment), os.O_RDONLY)
        try:
            while True:
                head = os.pread(fd, UNIT_HEAD.size, offset)
                if len(head) < UNIT_HEAD.size or not any(head):
                    return n
                magic, _crc, _version, _prev, entry_len, frames_len = UNIT_HEAD.unpack(head)
                if magic == ROLL_MAGIC:
                    break
                if magic not in UNITS:
                    return n
                offset += UNIT_HEAD.size + entry_len + frames_len
                n += 1
        finally:
            os.close(fd)
        segment, offset = segment + 1, HEAD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--units", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dq-foreign-")
    try:
        address = DurableQueue(root).address("p", fsync="never")
        address.send([{"id": 0, "kind": "a", "body": b"x" * 100}])
        log = address.log
        log.refresh()
        replay, heads = [], []
        for _ in range(args.rounds):
            subprocess.run([sys.executable, "-c", CHILD, root, str(args.units)], check=True)
            position = log.state.journal
            start = time.perf_counter()
            walked = walk_heads(log.journal, position.segment, position.offset)
            heads.append((time.perf_counter() - start) / walked)
            before = log.state.version
            start = time.perf_counter()
            log.refresh()
            replayed = log.state.version - before
            replay.append((time.perf_counter() - start) / replayed)
            assert walked == replayed == args.units, (walked, replayed, args.units)
        print(f"per foreign unit ({args.units} units x {args.rounds} rounds, medians): "
              f"refresh (read, CRC, parse, apply) {statistics.median(replay) * 1e6:.1f} us; "
              f"heads alone {statistics.median(heads) * 1e6:.1f} us; "
              f"ratio {statistics.median(replay) / statistics.median(heads):.0f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
