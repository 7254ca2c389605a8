"""A Hypothesis state machine: the store against a plain list model.

Rules: send, receive, ack (all / a received table / a ``_seq``), seek, consumer create/delete,
cleanup (dry run and real), compaction (dry run and real; also automatic, in the cleanups
after acks, once 4 pages are small), an orphan page from a writer that "crashed" before
committing, and reopen (fresh objects on the same files). The model is a list of sent
messages plus, per consumer, a watermark and a cursor. Cleanup removes whole pages, which the
model does not know, so after each cleanup the machine checks the store against what cleanup
must do: every page behind all watermarks is gone, nothing any consumer still needs is.

Runs on ``memory://`` and on a local folder (a temp dir made in ``__init__``).
"""

from __future__ import annotations

import time

import pyarrow as pa
from conftest import ScratchRoot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pyspark_durable_queue import ConsumerNotFoundError, DurableQueue

NAME = "q"
CONSUMERS = ("c1", "c2", "c3")
# journal=False: the model's cleanup is per page file (a page goes once every consumer passed
# it); a journal keeps the segment being written, and a consumed segment's file until it is
# before the newest checkpoint (test_journal.py covers that).
SETTINGS = dict(page_size_bytes=4096, cleanup_interval_ms=0, fsync=False, journal=False,
                compact_small_pages=4)


class StoreMachine(RuleBasedStateMachine):
    kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.scratch = ScratchRoot(self.kind, "dq-sm-")
        self.root = self.scratch.url
        self.model: list[tuple[int, str]] = []  # (v, s) by _seq
        self.positions: dict[str, int] = {}
        self.cursors: dict[str, int] = {}
        self.last_table: dict[str, pa.Table] = {}
        self.consumers: dict = {}
        self.orphans: set[str] = set()
        self.first = 0  # lowest retained _seq, as observed after cleanups

    @initialize(archive=st.booleans())
    def open_store(self, archive: bool) -> None:
        self.archive = archive
        self.addr = DurableQueue(self.root).address(NAME, archive_data_logs=archive, **SETTINGS)

    def teardown(self) -> None:
        self.scratch.remove()

    # -- helpers --------------------------------------------------------------------------------
    def _check_after_cleanup(self) -> None:
        """What a real cleanup must leave: no page wholly behind every watermark, and nothing
        at or after the lowest watermark removed."""
        state = DurableQueue(self.root).address(NAME).state
        first = state.first_seq
        assert first >= self.first, (first, self.first)
        if self.positions:
            low = min(self.positions.values())
            if len(state.pages):
                assert state.pages.ends[0] > low, (state.pages.ends[0], low)
            assert first <= max(low, self.first), (first, low)
        else:
            assert first == self.first
        self.first = first

    def _page_names(self) -> set[str]:
        return {n for n in self.addr.storage.list(self.addr.pages_folder) if n.endswith(".page")}

    # -- rules ----------------------------------------------------------------------------------
    @rule(n=st.integers(1, 12), size=st.sampled_from([0, 5, 60, 700]))
    def send(self, n: int, size: int) -> None:
        start = len(self.model)
        msgs = [(start + k, "s" * ((start + k) % (size + 1))) for k in range(n)]
        result = self.addr.send([{"v": v, "s": s} for v, s in msgs])
        assert (result.seq, result.count) == (start, n)
        self.model.extend(msgs)

    @rule(name=st.sampled_from(CONSUMERS),
          start=st.one_of(st.sampled_from(["earliest", "latest"]), st.integers(0, 40)))
    def open_consumer(self, name: str, start) -> None:
        c = self.addr.consumer(name, start=start)
        if name not in self.positions:
            if start == "earliest":
                expected = self.first
            elif start == "latest":
                expected = len(self.model)
            else:
                expected = start
            self.positions[name] = expected
        self.cursors[name] = self.positions[name]
        self.consumers[name] = c
        assert c.position == self.positions[name]
        self.last_table.pop(name, None)

    @precondition(lambda self: self.consumers)
    @rule(data=st.data(), max_messages=st.integers(1, 30),
          max_bytes=st.sampled_from([1, 300, 5000, 1 << 24]))
    def receive(self, data, max_messages: int, max_bytes: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.consumers)))
        c = self.consumers[name]
        t = c.receive(max_messages=max_messages, max_bytes=max_bytes)
        start = max(self.cursors[name], self.first)
        available = len(self.model) - start
        k = t.num_rows
        if available <= 0:
            assert k == 0
            # everything up to the log's end was examined: the cursor is at the end
            self.cursors[name] = max(self.cursors[name], len(self.model))
        else:
            assert 1 <= k <= min(max_messages, available), (k, max_messages, available)
            assert t.column("_seq").to_pylist() == list(range(start, start + k))
            got = list(zip(t.column("v").to_pylist(), t.column("s").to_pylist(), strict=True))
            assert got == self.model[start:start + k]
            self.cursors[name] = start + k
        assert c.cursor == self.cursors[name]
        self.last_table[name] = t

    @precondition(lambda self: self.consumers)
    @rule(data=st.data(), how=st.sampled_from(["all", "table", "seq"]))
    def ack(self, data, how: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.consumers)))
        c = self.consumers[name]
        if how == "all":
            new = self.cursors[name]
            c.ack()
        elif how == "table":
            t = self.last_table.get(name)
            if t is None:
                return
            meta = t.schema.metadata or {}
            # a table received before anything was ever sent carries no position: a no-op
            new = int(meta[b"dq.position"]) if b"dq.position" in meta else -1
            c.ack(t)
        else:
            if not self.model:
                return
            seq = data.draw(st.integers(0, len(self.model) - 1))
            new = seq + 1
            c.ack(seq)
        if new > self.positions[name]:
            self.positions[name] = new
            self.cursors[name] = max(self.cursors[name], new)
            self._check_after_cleanup()  # cleanup_interval_ms=0: every ack cleans up
        assert c.position == self.positions[name]

    @precondition(lambda self: self.consumers)
    @rule(data=st.data(),
          to=st.one_of(st.sampled_from(["earliest", "latest"]), st.integers(0, 60)))
    def seek(self, data, to) -> None:
        target = to
        name = data.draw(st.sampled_from(sorted(self.consumers)))
        self.consumers[name].seek(target)
        if target == "earliest":
            pos = self.first
        elif target == "latest":
            pos = len(self.model)
        else:
            pos = target
        self.positions[name] = self.cursors[name] = pos
        assert self.consumers[name].position == pos

    @precondition(lambda self: self.consumers)
    @rule(data=st.data())
    def delete_consumer(self, data) -> None:
        name = data.draw(st.sampled_from(sorted(self.consumers)))
        c = self.consumers.pop(name)
        c.delete()
        del self.positions[name], self.cursors[name]
        self.last_table.pop(name, None)
        try:
            c.ack(10 ** 6)
        except ConsumerNotFoundError:
            pass
        else:
            raise AssertionError("ack on a deleted consumer succeeded")

    @rule(dry_run=st.booleans())
    def cleanup(self, dry_run: bool) -> None:
        before = self.addr.state
        names_before = list(before.pages.names)
        report = self.addr.cleanup(dry_run=dry_run)
        # young orphans are never touched; files compaction replaced go once their messages
        # are no longer retained
        assert set(report.orphans) <= {n for n, *_ in before.retired}, report.orphans
        if dry_run:
            assert list(self.addr.state.pages.names) == names_before
            low = min(self.positions.values()) if self.positions else None
            expected = [n for n, e in zip(names_before, before.pages.ends, strict=True)
                        if low is not None and e <= low]
            assert report.pages == expected
        else:
            self._check_after_cleanup()
            assert not set(report.pages) & self._page_names()
            if self.archive and report.pages:
                archived = set(self.addr.storage.list(f"{self.addr.folder}/archive"))
                assert set(report.pages) <= archived

    @rule(dry_run=st.booleans())
    def compact(self, dry_run: bool) -> None:
        before = self.addr.state
        names, rows = list(before.pages.names), sum(before.pages.rows)
        report = self.addr.compact(dry_run=dry_run)
        after = self.addr.state
        if dry_run:
            assert list(after.pages.names) == names
            return
        assert report.abandoned == 0
        assert sum(after.pages.rows) == rows and after.first_seq == before.first_seq
        assert len(after.pages) == len(names) - report.pages_before + report.pages_after
        assert set(report.pages) <= set(after.pages.names)

    @rule(n=st.integers(1, 5))
    def crashed_writer(self, n: int) -> None:
        """A writer that wrote a page and died before committing it."""
        w = self.addr.page_writer()
        w.write(pa.table({"v": list(range(n)), "s": ["orphan"] * n}))
        self.orphans |= {p.name for p in w.close()}

    @precondition(lambda self: self.orphans)
    @rule()
    def collect_orphans(self) -> None:
        report = self.addr.cleanup(dry_run=False, now=time.time() + 7200)
        assert self.orphans <= set(report.orphans)
        assert not self.orphans & self._page_names()
        self.orphans = set()
        self._check_after_cleanup()

    @rule()
    def reopen(self) -> None:
        self.addr = DurableQueue(self.root).address(NAME)
        assert self.addr.settings.archive_data_logs == self.archive
        assert self.addr.state.next_seq == len(self.model)
        persisted = {n: c["position"] for n, c in self.addr.consumers().items()}
        assert persisted == self.positions
        # unacknowledged deliveries are forgotten: cursors restart at the watermark
        self.consumers = {n: self.addr.consumer(n) for n in self.positions}
        self.cursors = dict(self.positions)
        self.last_table = {}

    @rule()
    def audit(self) -> None:
        """Everything retained reads back intact, through a throwaway consumer."""
        c = self.addr.consumer("audit", start="earliest")
        try:
            t = c.receive(max_messages=10 ** 6, max_bytes=1 << 30)
        finally:
            c.delete()
        expected = self.model[self.first:]
        if not expected:
            assert t.num_rows == 0
            return
        assert t.column("_seq").to_pylist() == list(range(self.first, len(self.model)))
        got = list(zip(t.column("v").to_pylist(), t.column("s").to_pylist(), strict=True))
        assert got == expected

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def log_matches_model(self) -> None:
        if not hasattr(self, "addr"):
            return
        state = self.addr.state
        assert state.next_seq == len(self.model)
        assert state.first_seq == self.first
        idx = state.pages
        assert sum(idx.rows) == len(self.model) - self.first  # retained is one dense run
        for i in range(1, len(idx)):
            assert idx.seq[i] == idx.ends[i - 1]
        files = self._page_names()
        assert set(idx.names) | self.orphans <= files
        # besides those, only files compaction replaced (kept for compactGraceMs)
        assert files - set(idx.names) - self.orphans <= {n for n, *_ in state.retired}


MachineSettings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.filter_too_much])


class FileStoreMachine(StoreMachine):
    kind = "file"


TestStoreMachineMemory = StoreMachine.TestCase
TestStoreMachineMemory.settings = MachineSettings
TestStoreMachineFile = FileStoreMachine.TestCase
TestStoreMachineFile.settings = MachineSettings
