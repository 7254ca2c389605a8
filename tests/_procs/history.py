"""Audit an address written by ``store_child.py`` (helper of the crash/concurrency tests).

The audit does not trust the store's folded state alone: it replays the whole commit log
(entries are never deleted), decodes every page file ever published, live ones from ``pages/``
and removed ones from the archive folder, and rebuilds the complete message history by
``_seq``. Then it checks the store's guarantees against what the child reported as returned.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pyarrow as pa

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.page import read_page

CHILD = str(Path(__file__).with_name("store_child.py"))


def parse_report(path: str | Path) -> dict:
    """What a child reported before it died: acknowledged sends and acks (complete lines)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        text = ""
    lines = text.split("\n")[:-1]  # the last piece has no newline yet: not reported
    sent: dict[tuple[int, int], tuple[int, int]] = {}
    acked = -1
    ready = done = False
    stalled = None
    errors = []
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "sent":
            run, k, m, seq = map(int, parts[1:5])
            sent[(run, k)] = (m, seq)
        elif parts[0] == "acked":
            acked = max(acked, int(parts[1]))
        elif parts[0] == "ready":
            ready = True
        elif parts[0] == "done":
            done = True
        elif parts[0] == "stalled":
            stalled = parts[1]
        else:
            errors.append(line)
    return {"sent": sent, "acked": acked, "ready": ready, "done": done, "stalled": stalled,
            "errors": errors}


def wait_ready(path: str | Path, proc, timeout: float = 20.0, what: str = "ready") -> bool:
    """Wait until the child reported ``what`` (``ready`` or ``stalled``); ``False`` if it
    exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if parse_report(path)[what]:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    raise AssertionError(f"child did not report {what!r} in {timeout}s")


def wait_sent(path: str | Path, proc, count: int, timeout: float = 60.0) -> None:
    """Wait until the child reported ``count`` acknowledged sends (or exited): on a loaded
    machine a child killed at a random moment after "ready" may not have sent anything yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if len(parse_report(path)["sent"]) >= count:
            return
        time.sleep(0.005)


def audit(root: str, address: str, *, sent: dict, min_position: int | None = None,
          cache: dict | None = None, archive: str = "archive") -> dict:
    """Check every guarantee; return a summary. ``cache`` keeps decoded pages across calls."""
    cache = {} if cache is None else cache
    a = DurableQueue(root).address(address)
    state = a.state

    # 1. the log: dense appends, removes of published pages, fold == state
    published: list[tuple[str, int, int]] = []
    removed: set[str] = set()
    nxt = 0
    last_ts = 0
    for v in range(1, state.version + 1):
        # entries seen by an earlier audit are remembered: cleanup may since have expired them
        e = cache.get(("entry", v)) or a.log.read_entry(v)
        cache[("entry", v)] = e
        assert int(e["ts"]) >= last_ts, f"entry {v}: commit time went backwards"
        last_ts = int(e["ts"])
        if e["op"] == "append":
            assert int(e["seq"]) == nxt, f"entry {v} starts at {e['seq']}, expected {nxt}"
            s = nxt
            for p in e["pages"]:
                published.append((p["name"], s, int(p["rows"])))
                s += int(p["rows"])
            nxt = s
        elif e["op"] == "remove":
            names = set(e["pages"])
            assert names <= {n for n, _, _ in published} - removed, f"entry {v}: bad remove"
            removed |= names
    assert nxt == state.next_seq
    live = [n for n, _, _ in published if n not in removed]
    assert live == list(state.pages.names)
    assert len({n for n, _, _ in published}) == len(published), "a page published twice"

    # 2. every page ever published is intact: live in pages/, removed ones archived (or still
    #    in pages/ when the process died between publishing the removal and moving the file)
    files = set(a.storage.list(a.pages_folder))
    archived = set(a.storage.list(f"{a.folder}/{archive}"))
    assert set(live) <= files, f"live pages missing: {set(live) - files}"
    by_seq: list[tuple | None] = [None] * nxt
    for name, seq, rows in published:
        recs = cache.get(name)
        if recs is None:
            folder = a.pages_folder if name in files else f"{a.folder}/{archive}"
            assert name in files or name in archived, f"page {name} lost"
            page = read_page(a.storage, f"{folder}/{name}")
            t = pa.Table.from_batches(page.batches)
            recs = list(zip(*(t.column(c).to_pylist() for c in ("run", "k", "idx", "m")),
                            strict=True))
            cache[name] = recs
        assert len(recs) == rows
        for j, rec in enumerate(recs):
            assert by_seq[seq + j] is None
            by_seq[seq + j] = rec
    assert all(r is not None for r in by_seq), "_seq not dense"

    # 3. every send is whole and present once: all of its messages, contiguous, or none
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for s, (run, k, idx, m) in enumerate(by_seq):  # type: ignore[misc]
        groups[(run, k)].append((s, idx, m))
    for key, items in groups.items():
        m = items[0][2]
        assert [i for _, i, _ in items] == list(range(m)), f"send {key} partial or repeated"
        seqs = [s for s, _, _ in items]
        assert seqs == list(range(seqs[0], seqs[0] + m)), f"send {key} not contiguous"

    # 4. every acknowledged send is there, where its send() said
    for key, (m, seq) in sent.items():
        assert key in groups, f"acknowledged send {key} lost"
        assert len(groups[key]) == m
        assert groups[key][0][0] == seq, f"send {key} at {groups[key][0][0]}, reported {seq}"

    # 5. the consumer's watermark is at or after the last acknowledged ack
    consumers = a.consumers()
    position = None
    if "worker" in consumers:
        position = int(consumers["worker"]["position"])
        assert position <= nxt
        if min_position is not None:
            assert position >= min_position, (position, min_position)
        # cleanup never removed a page the worker still needed
        assert state.first_seq <= position, (state.first_seq, position)
    elif min_position is not None and min_position >= 0:
        raise AssertionError("the worker consumer is gone")

    # 6. what is retained reads back end to end through a consumer
    c = a.consumer("audit", start="earliest")
    try:
        t = c.receive(max_messages=10 ** 7, max_bytes=1 << 40)
    finally:
        c.delete()
    got = t.column("_seq").to_pylist() if t.num_rows else []
    assert got == list(range(state.first_seq, nxt))
    if t.num_rows:
        tail = list(zip(*(t.column(c).to_pylist() for c in ("run", "k", "idx", "m")),
                        strict=True))
        assert tail == by_seq[state.first_seq:]
    return {"next_seq": nxt, "live": len(live), "removed": removed,
            "sends": len(groups), "position": position, "version": state.version,
            "files": files, "archived": archived}
