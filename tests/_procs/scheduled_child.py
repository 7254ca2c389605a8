"""A process that releases an address's due scheduled sends in a loop, for
tests/test_scheduled_crash.py (run as a script; SIGKILLed by the test).

Usage: scheduled_child.py ROOT ADDRESS

stdout lines (each flushed): ``S`` once it is ready, ``A <schedule id> <duplicate 0|1>`` after
each release's append returned (before its file is deleted), ``E`` when no scheduled send is left.
With ``DQ_RELEASE_PAUSE_MS`` it pauses that long after each append, before the delete: the
crash window, widened so that the test's kills land in it.
"""

from __future__ import annotations

import os
import sys
import time

from pyspark_durable_queue import DurableQueue


def main(root: str, name: str) -> None:
    address = DurableQueue(root).address(name)
    pause = int(os.environ.get("DQ_RELEASE_PAUSE_MS", "0")) / 1000

    def send(table, key, merge):
        result = address._send(table, key, merge)
        print("A", key[0].split(":", 1)[1], int(result.duplicate), flush=True)
        time.sleep(pause)
        return result

    print("S", flush=True)
    while True:
        address._scheduler().release(send, force=True)
        if not address.scheduled():
            print("E", flush=True)
            time.sleep(60)  # wait for the kill
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
