"""Progress bars of the long ``durablequeue`` commands: drawn on standard error only when it is
a terminal and ``--json`` is not given; standard output (data and results) is the same with or
without them.

The command line runs in a real subprocess whose standard error is a pseudo-terminal (``pty``)
or a pipe, against a real store under ``tmp_path``; the engine's ``progress`` callbacks are
checked against the page files on disk.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios

import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops.repair import verify_pages

#: Enough for an export to JSON lines to take well over the bar's half-second delay (about
#: 1.5 s here: ~150,000 messages/s).
MESSAGES = 200_000


def cli(*argv: str, terminal: bool) -> tuple[int, str, str]:
    """``python -m pyspark_durable_queue ARGV`` in a subprocess: ``(exit code, stdout,
    stderr)``; with ``terminal`` its standard error is a pseudo-terminal of 100 columns (a new
    one has 0, where tqdm draws nothing), else a pipe. Standard output is always a pipe."""
    cmd = [sys.executable, "-m", "pyspark_durable_queue", *argv]
    if not terminal:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave,
                          stdin=subprocess.DEVNULL) as proc:
        os.close(slave)
        err = b""
        try:
            while chunk := os.read(master, 65536):  # EIO once the child's side is closed
                err += chunk
        except OSError:
            pass
        finally:
            os.close(master)
        out = proc.stdout.read() if proc.stdout else b""
        code = proc.wait(timeout=120)
    return code, out.decode(), err.decode(errors="replace")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("progress") / "dq")
    a = DurableQueue(root).address("big")
    step = MESSAGES // 10
    for k in range(10):
        a.send(pa.table({"id": pa.array(range(k * step, (k + 1) * step), pa.int64()),
                         "body": pa.array(["x" * 100] * step)}))
    return root


def test_export_on_a_terminal_draws_a_bar_on_stderr_and_stdout_is_unchanged(store, tmp_path):
    on_tty = str(tmp_path / "tty.jsonl")
    code, out, err = cli(store, "export", "big", on_tty, terminal=True)
    assert code == 0, err
    # tqdm's bar: the description, a percentage, the count of the total and the rate
    assert "export big:" in err and "%|" in err and f"/{MESSAGES // 1000}k" in err, err[:500]
    assert "msg/s" in err
    assert "\r" in err  # redrawn in place
    piped = str(tmp_path / "pipe.jsonl")
    code, out_piped, err_piped = cli(store, "export", "big", piped, terminal=False)
    assert code == 0 and err_piped == ""  # no progress output without a terminal
    assert out == out_piped.replace(piped, on_tty)
    assert out.startswith(f"exported {MESSAGES} messages")
    with open(on_tty, "rb") as f1, open(piped, "rb") as f2:
        assert f1.read() == f2.read()


def test_json_on_a_terminal_draws_no_bar(store, tmp_path):
    code, out, err = cli(store, "export", "big", str(tmp_path / "x.jsonl"), "--json",
                         terminal=True)
    assert code == 0
    assert err == ""
    assert json.loads(out)["messages"] == MESSAGES


def test_import_on_a_terminal_counts_the_file_bytes(store, tmp_path):
    dump = str(tmp_path / "dump.jsonl")
    assert cli(store, "export", "big", dump, terminal=False)[0] == 0
    code, out, err = cli(store, "import", "copy", dump, terminal=True)
    assert code == 0, err
    assert out == f"imported {MESSAGES} messages from {dump} (jsonl) into copy\n"
    assert "import copy:" in err and "B/s" in err, err[:500]
    total = re.search(r"/([0-9.]+)M ", err)  # the total is the file's size, in MiB
    assert total and float(total[1]) == pytest.approx(os.path.getsize(dump) / 2**20, rel=0.01)


def test_verify_reports_bytes_of_the_page_files_as_it_reads_them(tmp_path):
    # page files (journal=False): the progress total is their size on disk
    a = DurableQueue(str(tmp_path / "dq")).address("orders", page_size_bytes=4096,
                                                   journal=False)
    for i in range(5):
        a.send([{"id": i * 100 + j, "body": "y" * 50} for j in range(100)])
    calls: list[tuple[int, int]] = []
    checked, problems = verify_pages(a.storage, a.layout, a.state,
                                     progress=lambda done, total: calls.append((done, total)))
    assert checked == len(a.state.pages) and not problems
    pages_folder = tmp_path / "dq" / "orders" / "pages"
    on_disk = sum(p.stat().st_size for p in pages_folder.iterdir() if p.suffix == ".page")
    assert calls[0] == (0, on_disk) and calls[-1] == (on_disk, on_disk)
    assert len(calls) == checked + 1
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_cleanup_reports_each_file_it_retires(tmp_path):
    # a page file per send (journal=False): cleanup retires the 4 of them, one by one
    a = DurableQueue(str(tmp_path / "dq")).address("orders", page_size_bytes=4096,
                                                   cleanup_interval_ms=3_600_000, journal=False)
    for i in range(4):
        a.send([{"id": i}])
    c = a.consumer("billing")
    assert a.cleanup(dry_run=False).pages == []  # and none after the ack for an hour
    c.ack(c.receive(max_messages=10))
    calls: list[tuple[int, int]] = []
    report = a.cleanup(dry_run=False, progress=lambda done, total: calls.append((done, total)))
    pages_folder = tmp_path / "dq" / "orders" / "pages"
    assert len(report.pages) == 4
    assert not [p for p in pages_folder.iterdir() if p.suffix == ".page"]
    assert calls == [(n, 4) for n in range(5)]
