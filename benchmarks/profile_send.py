"""One thread of single sends, for a profiler: the rate and the CPU time per send.

Run::

    .venv/bin/python benchmarks/profile_send.py [--fsync always|never] [--seconds 4]
    py-spy record -r 1000 -f raw -o send.txt -- .venv/bin/python benchmarks/profile_send.py

``--fsync never`` leaves the Python path alone (and the ``pwrite``); py-spy samples only
threads that run (no ``--idle``), so a profile of ``--fsync always`` shows the CPU around
the sync, and its stacks under ``_fdatasync`` are the sync's own. The CPU per send is user +
system time of this process (``time.process_time``), which moves much less with the load of a
shared machine than the rate does. The scratch address is deleted.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from pyspark_durable_queue import DurableQueue


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fsync", default="always", choices=["always", "periodic", "never"])
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dq-profile-")
    try:
        address = DurableQueue(root).address("p", fsync=args.fsync)
        row = {"id": 1, "kind": "a", "body": b"x" * 100}
        warm = time.perf_counter() + 0.5
        while time.perf_counter() < warm:
            address.send([row])
        n, start, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() < start + args.seconds:
            address.send([row])
            n += 1
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"fsync={args.fsync}: {n / wall:,.0f} sends/s, {cpu / n * 1e6:.1f} us CPU and "
              f"{wall / n * 1e6:.1f} us wall per send")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
