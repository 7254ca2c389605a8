"""A Hypothesis state machine: several handles of ONE shared consumer (issue 40) against a
plain Python model of what the code promises.

Rules: send; open a handle (up to three, each with its own ``prefetch``); receive(n) on a
handle; ack (the rows it names, one ``_seq``, or everything the handle holds; flushing or
deferred), nack (delay 0, 2 s, or the address's backoff), renew (the rows named, or
everything, prefetched rows too; the handle's lease or another), a refused call (a row the
handle does not hold); flush; time passing (from 1 ms to past a whole lease); close a handle;
abandon a handle (it stops without ``close()``: its leases must run out); reopen the whole
``DurableQueue`` (handles closed, as many opened again); a drain that settles everything.

The clock is the module's own ``now_ms`` (what every lease, due time and claim reads), set by
the test: runs are deterministic, so the model predicts each receive exactly and the draws may
depend on the model. Nothing else is replaced: real files (or ``memory://``), real state.

The model (:class:`Model`) is written from the promises of issue 40 and docs/architecture.md
("Shared consumers (client)"), with what the code says it does where those leave a choice:

- a claim writes the handle's deferred acks, then takes up to ``max(n - handed, prefetch)``
  rows: rows due again first (nacked and due, or whose lease ran out), lowest ``_seq`` first,
  each delivered again with ``_delivery_count`` + 1 (or moved to the dead-letter address,
  exactly once, when it was delivered ``max_delivery_attempts`` times), then new rows, while
  at most ``max_in_flight`` rows are leased or pending; the lease starts at the claim;
- a handle hands out its prefetched rows in order, and gives back (uncounted) those whose
  lease has less than the margin left;
- ``ack``/``nack``/``renew`` act on the rows whose lease is still the handle's (ran out and
  not claimed by another: still its own) and raise ``LeaseExpiredError`` for the others;
  naming a row the handle never held is refused and changes nothing;
- ``close()`` writes deferred acks and gives back every row the handle holds (handed out:
  delivered again with a higher count; prefetched: with the same count).

Checked after every step against independent values: the state on disk, read by a new reader
of the store (cursor, leases with holder, count and expiry, pending rows, counters); a fresh
``DurableQueue``'s ``stats()`` (leased, delivered, redelivered, acknowledged, dead-lettered);
the dead-letter address's rows (each once, with its delivery count). On every receive: every
row returned is leased to that handle with that count and was never acknowledged; no row is
held, under a running lease, by two handles. At a drain every row is acknowledged or
dead-lettered (none lost).

Runs on a local folder (the appended log) and on ``memory://`` (the chain of epochs).
``DQ_HYPOTHESIS_EXAMPLES=500`` runs longer (default: 8 examples per variant, a few seconds).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import pytest
from conftest import ScratchRoot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pyspark_durable_queue import DurableQueue, LeaseExpiredError, shared_consumer
from pyspark_durable_queue.errors import InvalidOptionError

NAME = "jobs"
DLQ = "DLQ"
POOL = "pool"
MAX_IN_FLIGHT = 8
ATTEMPTS = 3
#: the lease of every handle, on the test's clock; long, so that a deferred ack's timer (half
#: a lease, on the real clock) never fires during a run: deferred acks are written when the
#: model says
LEASE_MS = 600_000
#: a prefetched row with less than this left is not handed out (``shared_consumer``)
MARGIN_MS = min(200, LEASE_MS // 4)
#: the address's redelivery delay: 1 s, doubled per delivery, at most 4 s
BASE_MS, MULTIPLIER, MAX_MS = 1000, 2.0, 4000
SETTINGS = dict(redelivery_delay_ms=BASE_MS, redelivery_delay_multiplier=MULTIPLIER,
                max_redelivery_delay_ms=MAX_MS, max_in_flight=MAX_IN_FLIGHT,
                max_delivery_attempts=ATTEMPTS, cleanup_interval_ms=0, fsync="never",
                page_size_bytes=4096)
MAX_HANDLES = 3
EXAMPLES = int(os.environ.get("DQ_HYPOTHESIS_EXAMPLES", 0))
PICK = st.integers(0, 63)
STEPS = [1, 150, 2_000, LEASE_MS - 100, LEASE_MS + 1]


def model_delay(count: int) -> int:
    """The address's delay after a row's ``count``-th delivery, written out."""
    return int(min(BASE_MS * MULTIPLIER ** (count - 1), MAX_MS))


@dataclass
class Handle:
    """A handle as the model knows it."""

    holder: str
    prefetch: int
    #: claimed, not handed out: (_seq, delivery count, lease expiry)
    ahead: list[tuple[int, int, int]] = field(default_factory=list)
    #: handed out, not settled by this handle: {_seq: delivery count}
    out: dict[int, int] = field(default_factory=dict)
    #: handed out, found by renew() to be another handle's
    lost: set[int] = field(default_factory=set)
    #: prefetched rows whose lease ran low before they were handed out
    lapsed: set[int] = field(default_factory=set)
    #: acknowledged with flush=False, not written yet
    deferred: set[int] = field(default_factory=set)


@dataclass
class Model:
    sent: int = 0
    cursor: int = 0
    leases: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    pending: dict[int, tuple[int, int]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    #: rows whose acknowledgement was written
    acked: set[int] = field(default_factory=set)
    #: rows moved to the dead-letter address: their delivery count
    dead: dict[int, int] = field(default_factory=dict)

    def count(self, name: str, n: int) -> None:
        if n:
            self.counters[name] = self.counters.get(name, 0) + n

    # -- a handle's calls, at ``now`` -------------------------------------------------------
    def hand_out(self, h: Handle, n: int, now: int) -> list[tuple[int, int]]:
        while h.ahead and h.ahead[0][2] - now < MARGIN_MS:
            h.lapsed.add(h.ahead.pop(0)[0])
        part, h.ahead = h.ahead[:n], h.ahead[n:]
        for seq, count, _ in part:
            h.out[seq] = count
            h.lost.discard(seq)
        return [(s, c) for s, c, _ in part]

    def receive(self, h: Handle, n: int, now: int) -> list[tuple[int, int]]:
        got = self.hand_out(h, n, now)
        if len(got) >= n:
            return got
        self.claim(h, max(n - len(got), h.prefetch), now)
        return got + self.hand_out(h, n - len(got), now)

    def claim(self, h: Handle, limit: int, now: int) -> None:
        self.write_acks(h)  # deferred acks go with the claim (late ones only logged)
        for seq in sorted(h.lapsed):  # still its own: given back, not counted as delivered
            held = self.leases.get(seq)
            if held is not None and held[0] == h.holder:
                del self.leases[seq]
                self.pending[seq] = (held[1] - 1, now)
        h.lapsed = set()
        due = [(s, c) for s, (c, d) in self.pending.items() if d <= now]
        due += [(s, c) for s, (_, c, e) in self.leases.items() if e <= now]
        due = sorted(due)[:limit]
        dead = {s: c for s, c in due if c >= ATTEMPTS}
        again = [(s, c + 1) for s, c in due if c < ATTEMPTS]
        self.dead_letter(dead)
        expires = now + LEASE_MS
        for seq, count in again:
            self.pending.pop(seq, None)
            self.leases[seq] = (h.holder, count, expires)
        self.count("redelivered", sum(1 for _, c in again if c > 1))
        room = min(limit - len(again), MAX_IN_FLIGHT - len(self.leases) - len(self.pending))
        new = list(range(self.cursor, min(self.sent, self.cursor + max(room, 0))))
        for seq in new:
            self.leases[seq] = (h.holder, 1, expires)
        self.count("delivered", len(new))
        self.cursor = max(self.cursor, new[-1] + 1) if new else self.cursor
        h.ahead += [(s, c, expires) for s, c in again] + [(s, 1, expires) for s in new]

    def dead_letter(self, rows: dict[int, int]) -> None:
        if rows:
            for seq in rows:
                self.leases.pop(seq, None)
                self.pending.pop(seq, None)
            self.dead.update(rows)
            self.count("dead_lettered", len(rows))
            self.count("moves", 1)

    @staticmethod
    def settled_by(h: Handle, seqs: list[int]) -> None:
        """Rows the handle acknowledged or gave back leave it: also a copy claimed again
        (its first delivery's lease ran out and this handle took the row back)."""
        for seq in seqs:
            h.out.pop(seq, None)
            h.lost.discard(seq)
        h.ahead = [r for r in h.ahead if r[0] not in seqs]

    def mine(self, h: Handle, seq: int) -> bool:
        held = self.leases.get(seq)
        return held is not None and held[0] == h.holder

    def write_acks(self, h: Handle) -> list[int]:
        """The deferred acks written; the rows whose lease was another's."""
        if not h.deferred:
            return []
        lost, done = [], 0
        for seq in sorted(h.deferred):
            if self.mine(h, seq):
                del self.leases[seq]
                self.acked.add(seq)
                done += 1
            else:
                lost.append(seq)
        self.count("acked", done)
        h.deferred = set()
        return lost

    def nack(self, h: Handle, seqs: list[int], delay_ms: int | None, now: int) -> list[int]:
        lost, dead = [], {}
        for seq in seqs:
            if not self.mine(h, seq):
                lost.append(seq)
                continue
            count = self.leases[seq][1]
            if count >= ATTEMPTS:
                dead[seq] = count
                continue
            del self.leases[seq]
            self.pending[seq] = (count, now + (model_delay(count) if delay_ms is None
                                               else delay_ms))
        self.count("nacked", len(seqs) - len(dead) - len(lost))
        self.dead_letter(dead)
        self.settled_by(h, seqs)
        return lost

    def renew(self, h: Handle, seqs: list[int], everything: bool, until: int) -> list[int]:
        lost = [s for s in seqs if not self.mine(h, s)]
        ahead = [s for s, _, _ in h.ahead] if everything else []
        for seq in (*seqs, *ahead):
            if self.mine(h, seq):
                self.leases[seq] = (h.holder, self.leases[seq][1], until)
        for seq in lost:
            if h.out.pop(seq, None) is not None:
                h.lost.add(seq)
        if everything:
            h.ahead = [(s, c, until) for s, c, _ in h.ahead if self.mine(h, s)]
        return lost

    def close(self, h: Handle, now: int) -> None:
        self.write_acks(h)
        undelivered = {s for s, _, _ in h.ahead} | h.lapsed
        for seq in sorted(s for s, (x, _, _) in self.leases.items() if x == h.holder):
            _, count, _ = self.leases.pop(seq)
            self.pending[seq] = (count - 1 if seq in undelivered else count, now)


class SharedMachine(RuleBasedStateMachine):
    kind = "file"

    def __init__(self) -> None:
        super().__init__()
        self.scratch = ScratchRoot(self.kind, "dq-ssm-")
        self.root = self.scratch.url
        self.model = Model()
        #: live handles: (the code's, the model's)
        self.handles: list[tuple[shared_consumer.SharedConsumer, Handle]] = []
        self.abandoned: list[shared_consumer.SharedConsumer] = []
        self.clock = int(time.time() * 1000)
        self._real_now = shared_consumer.now_ms
        shared_consumer.now_ms = lambda: self.clock  # type: ignore[assignment]
        self.dead_seen = 0

    @initialize(n=st.integers(0, 12), prefetch=st.sampled_from([1, 3]))
    def open_queue(self, n: int, prefetch: int) -> None:
        self.address = self._address()
        self._open_handle(prefetch)
        if n:
            self.send(n)

    def _address(self):
        return DurableQueue(self.root).address(NAME, dead_letter_address=DLQ, **SETTINGS)

    def teardown(self) -> None:
        try:
            for code, _ in self.handles:
                code.close()
            for code in self.abandoned:  # stopped: their file closed, nothing written at exit
                close_file = getattr(code._chain, "_close_file", None)
                if close_file is not None:
                    close_file()
                code._closed = True
        finally:
            shared_consumer.now_ms = self._real_now  # type: ignore[assignment]
            self.scratch.remove()

    # -- helpers ----------------------------------------------------------------------------
    def _open_handle(self, prefetch: int) -> None:
        code = self.address.consumer(POOL, shared=True, lease_ms=LEASE_MS, prefetch=prefetch,
                                     ack_flush_ms=LEASE_MS)
        self.handles.append((code, Handle(code.holder, prefetch)))

    def _pick(self, which: int) -> tuple[shared_consumer.SharedConsumer, Handle]:
        return self.handles[which % len(self.handles)]

    @staticmethod
    def _rows(h: Handle, picks: list[int]) -> list[int]:
        held = sorted({*h.out, *h.lost})
        return sorted({held[p % len(held)] for p in picks}) if held else []

    def _receive(self, code, h: Handle, n: int) -> list[tuple[int, int]]:
        table = code.receive(n)
        got = list(zip(table.column("_seq").to_pylist(),
                       table.column("_delivery_count").to_pylist(), strict=True))
        expected = self.model.receive(h, n, self.clock)
        assert got == expected, f"receive({n}) returned {got}, the model {expected}"
        for seq, count in got:
            assert seq not in self.model.acked, f"_seq {seq} delivered after its ack"
            held = self.model.leases.get(seq)
            assert held is not None and held[:2] == (h.holder, count), (
                f"_seq {seq} handed out without a lease of its handle: {held}")
        return got

    def _expect(self, lost: list[int], call) -> None:
        """Run ``call``: it raises LeaseExpiredError exactly when the model lost rows."""
        if lost:
            with pytest.raises(LeaseExpiredError):
                call()
        else:
            call()

    # -- rules ------------------------------------------------------------------------------
    @rule(n=st.integers(1, 6))
    def send(self, n: int) -> None:
        self.address.send([{"id": self.model.sent + i} for i in range(n)])
        self.model.sent += n

    @precondition(lambda self: len(self.handles) < MAX_HANDLES)
    @rule(prefetch=st.sampled_from([1, 3, 5]))
    def open_handle(self, prefetch: int) -> None:
        self._open_handle(prefetch)

    @precondition(lambda self: self.handles)
    @rule(which=PICK, n=st.integers(1, 5))
    def receive(self, which: int, n: int) -> None:
        self._receive(*self._pick(which), n)

    @precondition(lambda self: self.handles)
    @rule(which=PICK, picks=st.lists(PICK, min_size=1, max_size=3),
          how=st.sampled_from(["rows", "one", "all"]), flush=st.booleans())
    def ack(self, which: int, picks: list[int], how: str, flush: bool) -> None:
        code, h = self._pick(which)
        rows = sorted(h.out) if how == "all" else self._rows(h, picks)
        if how == "one":
            rows = rows[:1]
        if not rows and how != "all":
            return
        arg = None if how == "all" else rows[0] if how == "one" else rows
        self.model.settled_by(h, rows)
        h.deferred |= set(rows)
        if not flush:
            code.ack(arg, flush=False)
            return
        lost = self.model.write_acks(h)
        self._expect(sorted(set(lost) & set(rows)),
                     lambda: code.ack(arg, flush=True))

    @precondition(lambda self: self.handles)
    @rule(which=PICK, n=st.integers(1, 2), picks=st.lists(PICK, min_size=1, max_size=3))
    def slow_worker(self, which: int, n: int, picks: list[int]) -> None:
        """A worker slower than its lease: the leases run out, its handle receives again
        (taking its own rows back, among others) and then acknowledges rows it had before."""
        code, h = self._pick(which)
        late = self._rows(h, picks)
        self.clock += LEASE_MS + 1
        self._receive(code, h, n)
        late = [s for s in late if s in h.out or s in h.lost]
        if late:
            h.deferred |= set(late)
            self.model.settled_by(h, late)
            lost = self.model.write_acks(h)
            self._expect(sorted(set(lost) & set(late)), lambda: code.ack(late))

    @precondition(lambda self: self.handles)
    @rule(which=PICK)
    def flush(self, which: int) -> None:
        code, h = self._pick(which)
        code.flush()
        self.model.write_acks(h)

    @precondition(lambda self: self.handles)
    @rule(which=PICK, picks=st.lists(PICK, min_size=1, max_size=3),
          delay_ms=st.sampled_from([0, 0, 2_000, None]))
    def nack(self, which: int, picks: list[int], delay_ms: int | None) -> None:
        code, h = self._pick(which)
        rows = self._rows(h, picks)
        if not rows:
            return
        lost = self.model.nack(h, rows, delay_ms, self.clock)
        self._expect(lost, lambda: code.nack(rows, delay_ms=delay_ms))

    @precondition(lambda self: self.handles)
    @rule(which=PICK, picks=st.lists(PICK, max_size=3),
          lease_ms=st.sampled_from([None, 1_000, 2 * LEASE_MS]))
    def renew(self, which: int, picks: list[int], lease_ms: int | None) -> None:
        code, h = self._pick(which)
        rows = self._rows(h, picks) if picks else sorted(h.out)
        until = self.clock + (LEASE_MS if lease_ms is None else lease_ms)
        lost = self.model.renew(h, rows, not picks, until)
        self._expect(lost, lambda: code.renew(rows if picks else None, lease_ms=lease_ms))

    @precondition(lambda self: self.handles and self.model.sent)
    @rule(which=PICK, pick=st.integers(0, 1000), what=st.sampled_from(["ack", "nack", "renew"]))
    def refused(self, which: int, pick: int, what: str) -> None:
        """A row the handle does not hold: refused, nothing changes."""
        code, h = self._pick(which)
        seq = pick % self.model.sent
        if seq in h.out or seq in h.lost:
            return
        before = code.state()
        with pytest.raises(InvalidOptionError, match="does not hold it"):
            getattr(code, what)([seq])
        assert code.state() == before

    @rule(ms=st.sampled_from(STEPS))
    def time_passes(self, ms: int) -> None:
        self.clock += ms

    @precondition(lambda self: self.handles)
    @rule(which=PICK)
    def close_handle(self, which: int) -> None:
        code, h = self._pick(which)
        code.close()
        self.model.close(h, self.clock)
        self.handles.remove((code, h))

    @precondition(lambda self: self.handles)
    @rule(which=PICK)
    def abandon_handle(self, which: int) -> None:
        """The handle stops without close() (a hung worker): its rows wait for their lease."""
        code, h = self._pick(which)
        if h.deferred:  # its deferred acks would be written at exit
            code.flush()
            self.model.write_acks(h)
        code._finalizer.detach()
        shared_consumer._OPEN.discard(code)
        self.abandoned.append(code)
        self.handles.remove((code, h))

    @rule()
    def reopen_queue(self) -> None:
        prefetches = [h.prefetch for _, h in self.handles] or [1]
        for code, h in self.handles:
            code.close()
            self.model.close(h, self.clock)
        self.handles = []
        self.address = self._address()
        for prefetch in prefetches:
            self._open_handle(prefetch)

    @rule()
    def drain(self) -> None:
        """Every handle flushes; then, past every lease and due time, one handle receives and
        acknowledges until nothing is left: every row acknowledged or dead-lettered."""
        if not self.handles:
            self._open_handle(3)
        for code, h in self.handles:
            code.flush()
            self.model.write_acks(h)
        code, h = self.handles[0]
        for _ in range(200):
            m = self.model
            if len(m.acked) + len(m.dead) == m.sent:
                break
            self.clock += 2 * LEASE_MS + 1
            got = self._receive(code, h, MAX_IN_FLIGHT)
            if got:
                code.ack([s for s, _ in got])
                h.deferred |= {s for s, _ in got}
                for seq, _ in got:
                    h.out.pop(seq)
                assert not self.model.write_acks(h)
        m = self.model
        assert m.acked | set(m.dead) == set(range(m.sent)), "rows lost"
        assert not m.acked & set(m.dead)
        assert code.state().ack_point == m.sent

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def one_holder_per_row(self) -> None:
        holders: dict[int, str] = {}
        for _, h in self.handles:
            for seq in h.out:
                held = self.model.leases.get(seq)
                if held is not None and held[0] == h.holder and held[2] > self.clock:
                    assert seq not in holders, f"_seq {seq} held by two handles"
                    holders[seq] = h.holder

    @invariant()
    def the_store_says_what_the_model_says(self) -> None:
        if not hasattr(self, "address"):
            return
        m = self.model
        reader = self.address.shared_chain(POOL, 0)  # a new reader of the files
        state = reader.current()
        assert state.cursor == m.cursor
        assert state.leases == m.leases, f"leases {state.leases}, the model {m.leases}"
        assert state.pending == m.pending, f"pending {state.pending}, the model {m.pending}"
        assert state.moving is None
        counters = {k: v for k, v in state.counters.items() if v}
        assert counters == m.counters, f"counters {counters}, the model {m.counters}"
        close_file = getattr(reader, "_close_file", None)
        if close_file is not None:
            close_file()
        stats = DurableQueue(self.root).address(NAME).stats()["consumers"][POOL]
        assert stats["shared"]
        got = {k: stats[k] for k in ("leased", "delivered", "redelivered", "acknowledged",
                                     "dead_lettered", "redelivery_pending")}
        assert got == {"leased": len(m.leases), "delivered": m.counters.get("delivered", 0),
                       "redelivered": m.counters.get("redelivered", 0),
                       "acknowledged": len(m.acked), "dead_lettered": len(m.dead),
                       "redelivery_pending": len(m.pending)}
        low = min([m.cursor, *m.leases, *m.pending])
        assert stats["ack_point"] == low
        if len(m.dead) != self.dead_seen:  # dead letters: each stored once, with its count
            letters: dict[int, int] = {}
            for batch, _ in DurableQueue(self.root).address(DLQ).snapshot().messages(0):
                if batch is not None:
                    for row in batch.to_pylist():
                        assert row["origin_seq"] not in letters, (
                            f"_seq {row['origin_seq']} dead-lettered twice")
                        assert (row["origin_address"], row["origin_consumer"]) == (NAME, POOL)
                        letters[row["origin_seq"]] = row["delivery_count"]
            assert letters == m.dead, f"dead letters {letters}, the model {m.dead}"
            self.dead_seen = len(m.dead)


def _settings() -> settings:
    return settings(max_examples=EXAMPLES or 8, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.filter_too_much])


class MemorySharedMachine(SharedMachine):
    kind = "memory"


TestSharedMachineFile = SharedMachine.TestCase
TestSharedMachineFile.settings = _settings()
TestSharedMachineMemory = MemorySharedMachine.TestCase
TestSharedMachineMemory.settings = _settings()


# -- what the machine found, as plain tests ---------------------------------------------------
@pytest.fixture
def clock(monkeypatch):
    """The module's clock, set by the test (ms)."""
    now = [int(time.time() * 1000)]
    monkeypatch.setattr(shared_consumer, "now_ms", lambda: now[0])
    return now


@pytest.mark.parametrize("settle", ["ack", "nack"])
def test_a_row_settled_late_by_the_handle_that_claimed_it_again_is_not_handed_out_again(
        root, clock, settle):
    # a slow worker: rows 0 and 1 run out, the same handle's next claim takes them back
    # (0 handed out at once, 1 prefetched) and the worker then settles its first delivery of 1
    a = DurableQueue(root).address(NAME)
    a.send([{"id": i} for i in range(4)])
    one = a.consumer(POOL, shared=True, lease_ms=1000, prefetch=3)
    assert one.receive(2).column("_seq").to_pylist() == [0, 1]
    clock[0] += 1001
    again = one.receive(1)
    assert again.column("_seq").to_pylist() == [0]
    assert again.column("_delivery_count").to_pylist() == [2]
    if settle == "ack":
        one.ack(1)  # its lease is this handle's still: accepted, and the row settled
        assert 1 not in one.state().leases
    else:
        one.nack(1, delay_ms=60_000)
        assert one.state().pending[1][0] == 2
    rest = one.receive(5)
    assert 1 not in rest.column("_seq").to_pylist()  # was: handed out again with count 2
    if settle == "nack":  # still given back, leased to no handle (was: in one's hands)
        assert 1 in one.state().pending and 1 not in one.state().leases
    one.close()


def test_a_closed_handle_writes_nothing_at_flush_even_when_its_consumer_is_gone(root):
    # the ack flusher keeps a handle with deferred acks until exit and flushes it then, also
    # after close() wrote them: that flush must not read the store (the consumer may be gone)
    a = DurableQueue(root).address(NAME)
    a.send([{"id": 0}])
    one = a.consumer(POOL, shared=True, prefetch=1)
    one.ack(one.receive(1), flush=False)
    one.close()
    a.consumer(POOL, shared=True).delete()
    one.flush()  # was: ConsumerNotFoundError


def test_the_ack_flusher_survives_a_shared_handle_whose_consumer_is_gone(root, caplog):
    from pyspark_durable_queue import consumer as consumer_module
    from pyspark_durable_queue.errors import ConsumerNotFoundError

    a = DurableQueue(root).address(NAME)
    a.send([{"id": 0}])
    one = a.consumer(POOL, shared=True, prefetch=1, ack_flush_ms=60_000)
    one.ack(one.receive(1), flush=False)
    a.consumer(POOL, shared=True).delete()
    # what the flusher's thread calls: was ConsumerNotFoundError out of its warning (reading
    # the shared consumer's position), which ended the thread
    consumer_module._flush_quietly(one)
    assert "could not write deferred acknowledgements" in caplog.text
    with pytest.raises(ConsumerNotFoundError):
        one.close()
