"""Single-message benchmark: durable sends of one ~100-byte message at a time.

Every figure is printed as a ratio against baselines measured in the same run, because these
machines are noisy. Each timed scenario runs for ``--seconds`` (or over a fixed number of
messages) and reports messages per second; everything is durable (fsync on), on a local folder.
Run::

    .venv/bin/python benchmarks/bench_messages.py [--quick] [--seconds 3]
        [--threads 16] [--procs 4x4] [--producer-messages 500000] [--backlog 5000]
        [--scenarios bare,sqlite,send,...] [--root DIR] [--journal | --no-journal]
        [--batch-procs 8] [--batch-rows 100] [--busy 2]

Issue 43's targets, one command each (every ratio within the one run)::

    # target 1: 4 processes x 4 threads of single sends against one thread and sqlite3
    bench_messages.py --scenarios bare,sqlite,send,procs --procs 4x4 --seconds 3
    # target 2: 8 processes of send(100 rows) against one, idle and beside 2 busy processes
    bench_messages.py --scenarios batchprocs --batch-procs 8 --batch-rows 100 --busy 2
    # target 4: 8 writer processes of single sends, max / min p99 across them
    bench_messages.py --scenarios procs --procs 8x1 --seconds 3

Addresses on a local disk get the journal by default (on-disk format 4: a commit is one unit
appended to a journal segment with one ``fdatasync``); ``--no-journal`` creates every address
of the run with ``journal=False`` (a page file and a log entry per commit, format 3), for
comparison. ``--journal`` says the default explicitly.

Scenarios (``--scenarios`` takes a comma list of these names):

``bare``
    ``os.write`` of 100 bytes + ``os.fdatasync`` appending to one file: 1 thread, and N threads
    each looping on one shared fd, for every writer count the other scenarios use.
``sqlite``
    stdlib sqlite3, WAL, ``synchronous=FULL``, one INSERT + COMMIT per message, one connection
    per thread on one file; and take + ack (SELECT + DELETE + COMMIT) over a backlog.
``persistqueue``
    persist-queue's ``SQLiteQueue.put`` per message, only when it is importable.
``send``
    ``address.send([row])`` from 1 thread.
``threads-shared`` / ``threads-own``
    ``--threads`` threads sending single rows on one shared ``Address``, or each on its own
    handle (``DurableQueue(root).address(name)`` per thread) of the same address.
``procs``
    P processes x T threads (spawned); each process opens one handle that its threads share.
    Prints each process's p50 / p99 and the max / min p99 across processes (issue 43, target
    4: within 2x, flagged met / NOT met).
``batchprocs``
    One process, then ``--batch-procs`` processes (default 8), each one thread of
    ``send(list of --batch-rows rows)`` (default 100); then both again beside ``--busy``
    (default 2) processes spinning a pure-Python loop. Prints N processes / one process for
    each load (issue 43, target 2: >= 2x, flagged met / NOT met). The rate is messages/s.
    The writers' CPU use (``getrusage``: user + sys) is in the notes, as cores (CPU seconds per
    wall second: 2 cores can give no more than 2.0 to all processes together) and as CPU
    microseconds a message; ``procs`` prints it too.
``producer``
    ``address.producer(linger_ms=5)`` when it exists: one thread sends ``--producer-messages``
    rows, then ``flush()``; counted until flush returns. Checks that every future resolved and
    that the ``_seq`` values are dense and in send order.
``receive``
    ``receive(max_messages=1)`` + ``ack`` per message over a backlog of ``--backlog``; and
    ``receive(1)`` + ``ack(flush=False)`` per message over ``--deferred-backlog`` (the final
    ``flush()`` counted).
``interleaved``
    One thread of each of the bare loop, sqlite3, persist-queue (when installed) and
    ``send([row])``, taking turns in rounds of 0.2 s for ``--seconds`` x 3 each: all four see
    the same load, so their ratios hold on a busy machine, where runs one after another
    measure the load as much as the code (issue 27's target 1). The ratios are in the notes.
``pagefiles``
    ``--pagefile-messages`` single sends (default 20,000) from 8 threads to an address with
    ``pageSizeBytes`` = 1 MiB: how many page files (pages and journal segments) they leave,
    against ``ceil(stored bytes / pageSizeBytes)``, the bytes as ``stats()`` reports them.
``latency``
    A sender process sends one message every 10 ms (``--latency-messages`` of them, the send
    time in the row); this process receives them with ``receive(1, timeout_ms=1000)``. The
    latency is from before the ``send`` call to the return of ``receive``.

For the multi-writer scenarios the p50 / p99 latency is the time of one call (one send, one
INSERT + COMMIT, one write + fdatasync) over every writer's calls. ``--quick`` is a smoke run of
about a minute. A scenario that fails (today several threads sending on one address may) is
reported as such; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import queue
import resource
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pyspark_durable_queue import DurableQueue

PAYLOAD = b"m" * 100  # the bare loop's and sqlite's message
BODY = "x" * 90  # with the int64 id, a ~100-byte row
ADDRESS = "bench"
#: settings every address of the run is created with (``--journal`` / ``--no-journal``)
ADDRESS_SETTINGS: dict[str, Any] = {}
SEND_ONE = "project send([row])"  # the row the other sending scenarios are compared with
PRODUCER_LINGER_MS = 5
SETUP_TIMEOUT_S = 120.0  # opening handles / starting processes on a loaded 2-core machine
HANG_GRACE_S = 60.0  # a call still running this long after the deadline counts as hung
PRODUCER_LIMIT_S = 120.0  # stop feeding a producer that is far slower than batching should be
SQLITE_BUSY_TIMEOUT_S = 30.0

Op = Callable[[int], Any]  # one message; returns a _seq to check, or None


def make_row(i: int) -> dict[str, Any]:
    return {"id": i, "body": BODY}


# -- measurement ------------------------------------------------------------------------------
@dataclass
class Run:
    """What the writer threads of one process did: messages, the window they ran in
    (``time.monotonic``, comparable between processes on Linux), every call's latency, the
    values the calls returned and the errors they raised."""

    count: int = 0
    start: float = 0.0
    end: float = 0.0
    latencies: list[float] = field(default_factory=list)
    values: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: CPU seconds (user + sys) the process used while its threads ran (the processes
    #: scenarios measure it with ``getrusage``; 0.0: not measured)
    cpu: float = 0.0

    @classmethod
    def merge(cls, runs: list[Run]) -> Run:
        ran = [r for r in runs if r.end > 0]
        return cls(
            cpu=sum(r.cpu for r in runs),
            count=sum(r.count for r in runs),
            start=min((r.start for r in ran), default=0.0),
            end=max((r.end for r in ran), default=0.0),
            latencies=[x for r in runs for x in r.latencies],
            values=[x for r in runs for x in r.values],
            errors=[x for r in runs for x in r.errors],
        )


def run_threads(factory: Callable[[int], contextlib.AbstractContextManager[Op]], threads: int,
                seconds: float, before_start: Callable[[], None] | None = None) -> Run:
    """Run ``threads`` threads, each calling its own op in a loop for ``seconds``.

    ``factory(k)`` is entered in thread ``k`` before the clock starts (open a connection or a
    handle there) and left after its loop. All threads start together; ``before_start`` runs
    in the calling thread once every thread is set up (the processes scenario waits for its
    go signal there).
    """
    barrier = threading.Barrier(threads + 1)
    runs = [Run() for _ in range(threads)]

    def body(k: int) -> None:
        run, passed = runs[k], False
        try:
            with factory(k) as op:
                barrier.wait(SETUP_TIMEOUT_S)
                passed = True
                run.start = time.monotonic()
                deadline = run.start + seconds
                i = 0
                while time.monotonic() < deadline:
                    t = time.perf_counter()
                    value = op(i)
                    run.latencies.append(time.perf_counter() - t)
                    run.count += 1
                    i += 1
                    if value is not None:
                        run.values.append(value)
        except threading.BrokenBarrierError:
            run.errors.append("setup failed in another thread")
        except Exception as exc:
            run.errors.append(f"{type(exc).__name__}: {exc}")
            if not passed:
                barrier.abort()
        finally:
            run.end = time.monotonic() if passed else 0.0

    workers = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    try:
        if before_start is not None:
            before_start()
        barrier.wait(SETUP_TIMEOUT_S)
    except threading.BrokenBarrierError:
        pass  # a thread's setup failed; its error is in its run
    except Exception:
        barrier.abort()
        raise
    limit = time.monotonic() + seconds + HANG_GRACE_S
    for w in workers:
        w.join(max(0.0, limit - time.monotonic()))
    merged = Run.merge(runs)
    hung = sum(w.is_alive() for w in workers)
    if hung:
        merged.errors.append(f"{hung} thread(s) still inside a call {HANG_GRACE_S:.0f} s "
                             "after the deadline (hung?)")
    return merged


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[round(p * (len(ordered) - 1))] if ordered else float("nan")


def check_dense(seqs: list[int], *, ordered: bool = False) -> str:
    """'' when ``seqs`` are distinct and without gaps (and ascending, if ``ordered``)."""
    if not seqs:
        return "no _seq returned"
    problems = []
    if len(set(seqs)) != len(seqs):
        problems.append(f"{len(seqs) - len(set(seqs))} duplicate _seq")
    if max(seqs) - min(seqs) + 1 != len(set(seqs)):
        problems.append(f"{max(seqs) - min(seqs) + 1 - len(set(seqs))} gaps in _seq")
    if ordered and any(b <= a for a, b in itertools.pairwise(seqs)):
        problems.append("_seq not in send order")
    return ", ".join(problems)


@dataclass
class Result:
    """One table row. ``family`` and ``kind`` ('send' or 'take') pick the baselines."""

    name: str
    family: str
    kind: str
    writers: int
    run: Run | None = None
    note: str = ""
    detail: str = ""  # printed under the table

    @property
    def rate(self) -> float | None:
        if self.run is None or self.run.count == 0 or self.run.end <= self.run.start:
            return None
        return self.run.count / (self.run.end - self.run.start)

    def notes(self) -> str:
        parts = [self.note] if self.note else []
        if self.run is not None and self.run.errors:
            first = self.run.errors[0]
            parts.append(f"ERROR x{len(self.run.errors)}: {first[:100]}")
        return "; ".join(parts)


def single(op: Op) -> contextlib.AbstractContextManager[Op]:
    return contextlib.nullcontext(op)


@dataclass
class Config:
    root: str
    seconds: float
    threads: int
    procs: int
    proc_threads: int
    producer_messages: int
    backlog: int
    deferred_backlog: int = 50_000
    latency_messages: int = 300
    pagefile_messages: int = 20_000
    batch_procs: int = 8
    batch_rows: int = 100
    busy: int = 2
    json: str | None = None  # also write the results here

    def folder(self, name: str) -> str:
        path = os.path.join(self.root, name)
        os.makedirs(path, exist_ok=True)
        return path

    def writer_counts(self) -> list[int]:
        """The thread counts baselines are measured at: every count a scenario uses."""
        return sorted({1, self.threads, self.procs * self.proc_threads})


# -- baselines --------------------------------------------------------------------------------
def scenario_bare(cfg: Config) -> list[Result]:
    """write(100 bytes) + fdatasync appending to one file; N threads share the fd."""
    results = []
    for writers in cfg.writer_counts():
        path = os.path.join(cfg.folder("bare"), f"journal-{writers}.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

        def write_sync(_: int, fd: int = fd) -> None:
            os.write(fd, PAYLOAD)
            os.fdatasync(fd)

        try:
            run = run_threads(lambda _k, op=write_sync: single(op), writers, cfg.seconds)
        finally:
            os.close(fd)
        results.append(Result("bare write+fdatasync", "bare", "send", writers, run))
    return results


@contextlib.contextmanager
def sqlite_connection(path: str) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(path, isolation_level=None, timeout=SQLITE_BUSY_TIMEOUT_S,
                           check_same_thread=False)
    try:
        conn.execute("PRAGMA synchronous=FULL")
        yield conn
    finally:
        conn.close()


@contextlib.contextmanager
def sqlite_inserter(path: str) -> Iterator[Op]:
    with sqlite_connection(path) as conn:
        def insert(_: int) -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO q (body) VALUES (?)", (PAYLOAD,))
            conn.execute("COMMIT")
        yield insert


def sqlite_take_ack(path: str, backlog: int) -> Run:
    """Take + ack one message per transaction (SELECT the oldest, DELETE it, COMMIT) until
    the backlog is empty: what a durable queue on SQLite does per received message."""
    with sqlite_connection(path) as conn:
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO q (body) VALUES (?)", ((PAYLOAD,) for _ in range(backlog)))
        conn.execute("COMMIT")
        run = Run(start=time.monotonic())
        while True:
            t = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute("SELECT id, body FROM q ORDER BY id LIMIT 1").fetchone()
            if row is None:
                conn.execute("COMMIT")
                break
            conn.execute("DELETE FROM q WHERE id = ?", (row[0],))
            conn.execute("COMMIT")
            run.latencies.append(time.perf_counter() - t)
            run.count += 1
        run.end = time.monotonic()
    if run.count != backlog:
        run.errors.append(f"took {run.count} of {backlog}")
    return run


def sqlite_db(folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    with sqlite_connection(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE q (id INTEGER PRIMARY KEY AUTOINCREMENT, body BLOB)")
    return path


def scenario_sqlite(cfg: Config) -> list[Result]:
    """sqlite3 WAL + synchronous=FULL: INSERT + COMMIT per message; take + ack per message."""
    results = []
    folder = cfg.folder("sqlite")
    for writers in cfg.writer_counts():
        path = sqlite_db(folder, f"send-{writers}.db")
        run = run_threads(lambda _k, path=path: sqlite_inserter(path), writers, cfg.seconds)
        results.append(Result("sqlite3 WAL FULL insert", "sqlite", "send", writers, run))
    run = sqlite_take_ack(sqlite_db(folder, "take.db"), cfg.backlog)
    results.append(Result("sqlite3 WAL FULL take+ack", "sqlite", "take", 1, run,
                          note=f"backlog {cfg.backlog:,}"))
    return results


def scenario_persistqueue(cfg: Config) -> list[Result]:
    """persist-queue's SQLiteQueue.put per message (auto_commit), when installed."""
    try:
        import persistqueue  # type: ignore[import-not-found]
    except ImportError:
        return [Result("persist-queue SQLiteQueue put", "peer", "send", 1,
                       note="skipped: persist-queue is not installed")]
    results = []
    for writers in (1, cfg.threads):
        pq = persistqueue.SQLiteQueue(os.path.join(cfg.folder("persistqueue"), str(writers)),
                                      auto_commit=True, multithreading=True)

        def put(_: int, pq: Any = pq) -> None:
            pq.put(PAYLOAD)

        run = run_threads(lambda _k, op=put: single(op), writers, cfg.seconds)
        results.append(Result("persist-queue SQLiteQueue put", "peer", "send", writers, run))
    return results


# -- this project -----------------------------------------------------------------------------
def open_address(root: str) -> Any:
    """The bench address, created with one warm-up send (schema, folders, first imports)."""
    address = DurableQueue(root).address(ADDRESS, **ADDRESS_SETTINGS)
    address.send([make_row(-1)])
    return address


def seq_note(run: Run) -> str:
    problem = check_dense(run.values)
    if not problem:
        return "_seq dense"
    return problem + (" (some sends failed)" if run.errors else "")


def scenario_pagefiles(cfg: Config) -> list[Result]:
    """Single sends from 8 threads with pageSizeBytes = 1 MiB: page files left behind."""
    root = cfg.folder("pagefiles")
    page_size = 1 << 20
    address = DurableQueue(root).address(ADDRESS, page_size_bytes=page_size, **ADDRESS_SETTINGS)
    per_thread = cfg.pagefile_messages // 8
    started = time.perf_counter()

    def body(k: int) -> None:
        for i in range(per_thread):
            address.send([make_row(k * per_thread + i)])

    threads = [threading.Thread(target=body, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    stored = int(address.stats()["bytes"])
    files = [n for n in os.listdir(os.path.join(root, ADDRESS, "pages"))
             if n.endswith((".page", ".dqj"))]
    bound = -(-stored // page_size)
    run = Run(count=per_thread * 8, start=0.0, end=elapsed)
    return [Result("project send, 8 threads, 1 MiB pages", "project", "send", 8, run,
                   note=f"{len(files)} page files for {stored:,} bytes; target <= "
                        f"ceil(bytes / pageSizeBytes) + 5 = {bound + 5}")]


def scenario_send(cfg: Config) -> list[Result]:
    """address.send([row]) in a loop, one thread."""
    address = open_address(cfg.folder("send"))
    run = run_threads(lambda _k: single(lambda i: address.send([make_row(i)]).seq), 1,
                      cfg.seconds)
    return [Result(SEND_ONE, "project", "send", 1, run, note=seq_note(run))]


INTERLEAVE_ROUND_S = 0.2


def scenario_interleaved(cfg: Config) -> list[Result]:
    """One thread each of the baselines and send([row]), in turns (see the module docstring)."""
    folder = cfg.folder("interleaved")
    fd = os.open(os.path.join(folder, "bare.bin"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                 0o644)

    def write_sync(_: int) -> None:
        os.write(fd, PAYLOAD)
        os.fdatasync(fd)

    with contextlib.ExitStack() as stack:
        stack.callback(os.close, fd)
        insert = stack.enter_context(sqlite_inserter(sqlite_db(folder, "insert.db")))
        ops: dict[str, tuple[str, Callable[[int], Any]]] = {
            "bare": ("bare write+fdatasync", write_sync),
            "sqlite": ("sqlite3 WAL FULL insert", insert)}
        try:
            import persistqueue
        except ImportError:
            pass
        else:
            pq = persistqueue.SQLiteQueue(os.path.join(folder, "pq"), auto_commit=True)
            ops["peer"] = ("persist-queue SQLiteQueue put", lambda _i: pq.put(PAYLOAD))
        address = open_address(cfg.folder("interleaved-send"))
        ops["project"] = (SEND_ONE, lambda i: address.send([make_row(i)]).seq)
        runs = {family: Run() for family in ops}
        for _round in range(max(1, round(cfg.seconds * 3 / INTERLEAVE_ROUND_S))):
            for family, (_name, op) in ops.items():
                run = runs[family]
                started = time.monotonic()
                deadline = started + INTERLEAVE_ROUND_S
                while time.monotonic() < deadline:
                    t = time.perf_counter()
                    value = op(run.count)
                    run.latencies.append(time.perf_counter() - t)
                    run.count += 1
                    if value is not None:
                        run.values.append(value)
                run.end += time.monotonic() - started  # the time in its turns only
    results = [Result(f"turns: {name}", "interleaved", "send", 1, runs[family])
               for family, (name, _op) in ops.items()]
    mine = results[-1]
    for r, (name, _op) in zip(results[:-1], ops.values(), strict=False):
        if r.rate and mine.rate:
            mine.note += f"{'; ' if mine.note else ''}{mine.rate / r.rate:.3f}x {name}"
    mine.note += f"; {seq_note(mine.run)}" if mine.run is not None else ""
    return results


def scenario_threads_shared(cfg: Config) -> list[Result]:
    """T threads sending single rows on one shared Address object."""
    address = open_address(cfg.folder("threads-shared"))
    run = run_threads(lambda _k: single(lambda i: address.send([make_row(i)]).seq),
                      cfg.threads, cfg.seconds)
    return [Result("project send, shared Address", "project", "send", cfg.threads, run,
                   note=seq_note(run))]


@contextlib.contextmanager
def own_handle(root: str) -> Iterator[Op]:
    address = DurableQueue(root).address(ADDRESS, **ADDRESS_SETTINGS)
    yield lambda i: address.send([make_row(i)]).seq


def scenario_threads_own(cfg: Config) -> list[Result]:
    """T threads, each with its own handle of the same address."""
    root = cfg.folder("threads-own")
    open_address(root)
    run = run_threads(lambda _k: own_handle(root), cfg.threads, cfg.seconds)
    return [Result("project send, handle per thread", "project", "send", cfg.threads, run,
                   note=seq_note(run))]


def proc_writer(k: int, root: str, threads: int, seconds: float, messages: Any,
                go: Any, rows: int = 1) -> None:
    """One process of the processes scenarios: open a handle, report ready, wait for go, run
    ``threads`` sending threads on it (each call ``send`` of ``rows`` rows) and send back the
    run as a dict: ``count`` in messages, one latency a call, one ``_seq`` (the first) a call."""
    try:
        address = DurableQueue(root).address(ADDRESS, **ADDRESS_SETTINGS)
        # the process's first send imports what sends need (pyarrow's pandas shim imports
        # pandas: seconds on a loaded machine), which is not what this scenario measures;
        # every process sends it before the go, so the run's _seq stay dense
        address.send([make_row(-1)])
        batch = [make_row(i) for i in range(rows)]  # built before the clock
        started: list[float] = []

        def ready() -> None:
            messages.put(("ready", k, None))
            if not go.wait(SETUP_TIMEOUT_S):
                raise TimeoutError("no go signal from the parent")
            started.append(cpu_seconds())

        if rows == 1:
            run = run_threads(lambda _k: single(lambda i: address.send([make_row(i)]).seq),
                              threads, seconds, before_start=ready)
        else:
            run = run_threads(lambda _k: single(lambda _i: address.send(batch).seq),
                              threads, seconds, before_start=ready)
            run.count *= rows
        if started:
            run.cpu = cpu_seconds() - started[0]
        messages.put(("done", k, asdict(run)))
    except BaseException as exc:
        messages.put(("error", k, f"{type(exc).__name__}: {exc}"))


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_note(run: Run) -> str:
    """The writers' CPU use while they ran: cores (CPU seconds per wall second of the run)
    and CPU microseconds a message; '' when not measured."""
    if run.cpu <= 0 or run.count == 0 or run.end <= run.start:
        return ""
    return (f"CPU {run.cpu / (run.end - run.start):.2f} cores, "
            f"{run.cpu / run.count * 1e6:.1f} us/msg")


def spin(stop: Any) -> None:
    """A busy CPU-bound process beside the writers (issue 43, target 2): a pure-Python loop
    until ``stop`` is set."""
    while not stop.is_set():
        n = 0
        for i in range(200_000):
            n += i


def collect(messages: Any, pending: set[int], kind: str, timeout: float,
            out: dict[int, Any], errors: list[str]) -> None:
    """Take messages of ``kind`` (or errors) from the processes in ``pending`` until each has
    answered or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while pending:
        try:
            got, k, payload = messages.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            errors.append(f"process(es) {sorted(pending)} did not report '{kind}' "
                          f"within {timeout:.0f} s")
            return
        if got == "error":
            errors.append(f"process {k}: {payload}")
            pending.discard(k)
        elif got == kind:
            out[k] = payload
            pending.discard(k)


def run_procs(root: str, procs: int, threads: int, seconds: float, rows: int = 1,
              busy: int = 0) -> tuple[Run, list[Run]]:
    """``procs`` spawned writer processes x ``threads`` threads sending ``rows`` rows a call
    to the address in ``root`` (created here), with ``busy`` spinning processes beside them
    from before the writers start until they are done: the merged run and each process's."""
    open_address(root)
    ctx = multiprocessing.get_context("spawn")
    messages, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    spinners = [ctx.Process(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
    workers = [ctx.Process(target=proc_writer, daemon=True,
                           args=(k, root, threads, seconds, messages, go, rows))
               for k in range(procs)]
    for w in spinners + workers:
        w.start()
    errors: list[str] = []
    ready: dict[int, Any] = {}
    done: dict[int, Any] = {}
    try:
        collect(messages, set(range(procs)), "ready", SETUP_TIMEOUT_S, ready, errors)
        go.set()
        collect(messages, set(ready), "done", seconds + SETUP_TIMEOUT_S + HANG_GRACE_S,
                done, errors)
    finally:
        go.set()
        stop.set()
        for w in workers + spinners:
            w.join(10)
            if w.is_alive():
                w.terminate()
                w.join()
    runs = [Run(**done[k]) for k in sorted(done)]
    run = Run.merge(runs)
    run.errors.extend(errors)
    return run, runs


#: issue 43, target 4: each writer process's p99 send latency within this factor of the others'
P99_SPREAD_TARGET = 2.0
#: issue 43, target 2: N batch-sending processes against one, same run
BATCH_PROCS_TARGET = 2.0


def p99_spread(runs: list[Run]) -> tuple[str, str]:
    """(each process's p50/p99, the max / min p99 across processes against target 4)."""
    per_process = ", ".join(
        f"{percentile(r.latencies, 0.5) * 1e3:.1f}/{percentile(r.latencies, 0.99) * 1e3:.1f}"
        for r in runs)
    p99s = [percentile(r.latencies, 0.99) for r in runs if r.latencies]
    if len(p99s) < 2 or min(p99s) <= 0:
        return per_process or "-", ""
    spread = max(p99s) / min(p99s)
    met = "met" if spread <= P99_SPREAD_TARGET else "NOT met"
    return per_process, (f"p99 max/min across processes {spread:.2f}x (target <= "
                         f"{P99_SPREAD_TARGET:g}x: {met})")


def batch_note(run: Run, rows: int) -> str:
    """'' when the batches' first ``_seq`` values are ``rows`` apart with nothing between them
    (every message of every batch landed once, no gaps)."""
    seqs = sorted(run.values)
    if not seqs:
        return "no _seq returned"
    bad = sum(b - a != rows for a, b in itertools.pairwise(seqs))
    if bad:
        return f"{bad} batches not {rows} _seq apart" + (" (some sends failed)"
                                                           if run.errors else "")
    return f"_seq dense in batches of {rows}"


def scenario_procs(cfg: Config) -> list[Result]:
    """P spawned processes x T threads; each process opens one handle its threads share."""
    run, runs = run_procs(cfg.folder("procs"), cfg.procs, cfg.proc_threads, cfg.seconds)
    per_process, spread = p99_spread(runs)
    writers = cfg.procs * cfg.proc_threads
    note = "; ".join(x for x in (seq_note(run), cpu_note(run), spread) if x)
    return [Result(f"project send, {cfg.procs} procs x {cfg.proc_threads} thr", "project",
                   "send", writers, run, note=note,
                   detail=f"per process p50/p99 ms: {per_process}")]


def scenario_batchprocs(cfg: Config) -> list[Result]:
    """One process, then ``--batch-procs`` processes, each sending ``--batch-rows`` rows a call
    from one thread; then both again beside ``--busy`` spinning processes (target 2)."""
    results: list[Result] = []
    loads = [0, cfg.busy] if cfg.busy else [0]
    for busy in loads:
        one: float | None = None
        for procs in (1, cfg.batch_procs):
            root = cfg.folder(f"batchprocs-{procs}-{busy}")
            try:
                run, runs = run_procs(root, procs, 1, cfg.seconds, cfg.batch_rows, busy)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            beside = f", {busy} busy" if busy else ""
            result = Result(f"project send({cfg.batch_rows}), {procs} procs{beside}",
                            "project", "batch", procs, run)
            notes = [batch_note(run, cfg.batch_rows), cpu_note(run)]
            if procs == 1:
                one = result.rate
            elif one and result.rate:
                met = "met" if result.rate / one >= BATCH_PROCS_TARGET else "NOT met"
                notes.append(f"{result.rate / one:.2f}x 1 proc{beside} (target >= "
                             f"{BATCH_PROCS_TARGET:g}x: {met})")
            per_process, spread = p99_spread(runs)
            notes.append(spread)
            result.note = "; ".join(x for x in notes if x)
            result.detail = f"per process p50/p99 ms: {per_process}"
            results.append(result)
    return results


def scenario_producer(cfg: Config) -> list[Result]:
    """producer(linger_ms=5): N x p.send(row), then flush(); rate until flush returns."""
    address = open_address(cfg.folder("producer"))
    name = f"project producer, {cfg.producer_messages:,} + flush"
    if not hasattr(address, "producer"):
        return [Result(name, "project", "send", 1,
                       note="not available: Address has no producer() in this build")]
    n = cfg.producer_messages
    rows = [make_row(i) for i in range(n)]  # the input, built before the clock
    futures = []
    with address.producer(linger_ms=PRODUCER_LINGER_MS) as producer:
        run = Run(start=time.monotonic())
        limit = run.start + PRODUCER_LIMIT_S
        for i in range(0, n, 1000):
            futures.extend(producer.send(row) for row in rows[i:i + 1000])
            if time.monotonic() > limit:
                run.errors.append(f"stopped after {len(futures):,} messages: "
                                  f"{PRODUCER_LIMIT_S:.0f} s passed")
                break
        producer.flush()
        run.end = time.monotonic()
        unresolved = sum(not f.done() for f in futures)
        failed = [f.exception() for f in futures if f.done() and f.exception() is not None]
        seqs = [f.result() for f in futures if f.done() and f.exception() is None]
        run.count = len(seqs)
    if unresolved:
        run.errors.append(f"{unresolved} future(s) not resolved after flush()")
    if failed:
        run.errors.append(f"{len(failed)} future(s) failed, first: {failed[0]!r}")
    problem = check_dense(seqs, ordered=True)
    return [Result(name, "project", "send", 1, run,
                   note=problem or "all futures resolved, _seq dense and in order")]


def scenario_receive(cfg: Config) -> list[Result]:
    """receive(max_messages=1) + ack per message over a backlog, one consumer."""
    address = DurableQueue(cfg.folder("receive")).address(ADDRESS, **ADDRESS_SETTINGS)
    address.send([make_row(i) for i in range(cfg.backlog)])
    consumer = address.consumer("c1", start="earliest")
    run, seqs = Run(start=time.monotonic()), []
    while True:
        t = time.perf_counter()
        batch = consumer.receive(max_messages=1)
        if batch.num_rows == 0:
            break
        consumer.ack(batch)
        run.latencies.append(time.perf_counter() - t)
        run.count += 1
        seqs.append(batch.column("_seq")[0].as_py())
    run.end = time.monotonic()
    problem = check_dense(seqs, ordered=True)
    if len(seqs) != cfg.backlog:
        problem = f"received {len(seqs)} of {cfg.backlog}" + (f", {problem}" if problem else "")
    results = [Result("project receive(1)+ack", "project", "take", 1, run,
                      note=problem or f"backlog {cfg.backlog:,}, _seq dense and in order")]
    # deferred acknowledgements: the watermark is written by the flush at the end
    address = DurableQueue(cfg.folder("receive-deferred")).address(ADDRESS, **ADDRESS_SETTINGS)
    address.send([make_row(i) for i in range(cfg.deferred_backlog)])
    consumer = address.consumer("c1", start="earliest", ack_flush_ms=1000)
    run, count, last = Run(start=time.monotonic()), 0, -1
    ordered = True
    while True:
        batch = consumer.receive(1)
        if batch.num_rows == 0:
            break
        consumer.ack(batch, flush=False)
        seq = batch.column("_seq")[0].as_py()
        ordered = ordered and seq == last + 1
        last = seq
        count += 1
    consumer.flush()
    run.end = time.monotonic()
    run.count = count
    problem = "" if ordered and count == cfg.deferred_backlog else (
        f"received {count} of {cfg.deferred_backlog}, in order: {ordered}")
    results.append(Result("project receive(1)+ack(flush=False)", "project", "take", 1, run,
                          note=problem or f"backlog {cfg.deferred_backlog:,}, in order, "
                          "flushed at the end"))
    return results


def latency_sender(root: str, count: int, interval: float) -> None:
    address = DurableQueue(root).address(ADDRESS, **ADDRESS_SETTINGS)
    next_at = time.monotonic()
    for i in range(count):
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
        address.send([{"id": i, "sent": time.time()}])


def scenario_latency(cfg: Config) -> list[Result]:
    """A message every 10 ms from another process; send -> receive latency of a blocking
    receiver (receive(1, timeout_ms=1000) + a deferred ack)."""
    root = cfg.folder("latency")
    address = DurableQueue(root).address(ADDRESS, **ADDRESS_SETTINGS)
    consumer = address.consumer("c1", start="latest")
    proc = multiprocessing.get_context("spawn").Process(
        target=latency_sender, args=(root, cfg.latency_messages, 0.010))
    proc.start()
    run = Run(start=time.monotonic())
    idle_limit = time.monotonic() + SETUP_TIMEOUT_S
    while run.count < cfg.latency_messages and time.monotonic() < idle_limit:
        batch = consumer.receive(1, timeout_ms=1000)
        if batch.num_rows == 0:
            continue
        run.latencies.append(time.time() - batch.column("sent")[0].as_py())
        consumer.ack(batch, flush=False)
        run.count += 1
        idle_limit = time.monotonic() + 30
    run.end = time.monotonic()
    consumer.close()
    proc.join(60)
    if run.count != cfg.latency_messages:
        run.errors.append(f"received {run.count} of {cfg.latency_messages}")
    return [Result("project send -> blocking receive", "project", "latency", 1, run,
                   note="a message every 10 ms from another process; target p50 <= 5 ms, "
                   "p99 <= 20 ms")]


SCENARIOS: dict[str, Callable[[Config], list[Result]]] = {
    "bare": scenario_bare,
    "sqlite": scenario_sqlite,
    "persistqueue": scenario_persistqueue,
    "send": scenario_send,
    "threads-shared": scenario_threads_shared,
    "threads-own": scenario_threads_own,
    "procs": scenario_procs,
    "batchprocs": scenario_batchprocs,
    "producer": scenario_producer,
    "receive": scenario_receive,
    "latency": scenario_latency,
    "pagefiles": scenario_pagefiles,
    "interleaved": scenario_interleaved,
}


# -- report -----------------------------------------------------------------------------------
def ratio(rate: float | None, base: float | None) -> str:
    return f"{rate / base:.3f}x" if rate and base else "-"


def print_table(results: list[Result]) -> None:
    rates = {(r.family, r.kind, r.writers): r.rate for r in results
             if r.family in ("bare", "sqlite")}
    one_thread = next((r.rate for r in results if r.name == SEND_ONE), None)
    header = (f"{'scenario':<40} {'writers':>7} {'msg/s':>9} {'vs bare':>8} {'vs sqlite':>9} "
              f"{'vs 1 thr':>8} {'p50 ms':>7} {'p99 ms':>7} {'mean ms':>7}  notes")
    print(header)
    print("-" * len(header))
    for r in results:
        rate = r.rate
        lat = r.run.latencies if r.run is not None else []
        p50 = f"{percentile(lat, 0.5) * 1e3:.2f}" if lat else "-"
        p99 = f"{percentile(lat, 0.99) * 1e3:.2f}" if lat else "-"
        mean = f"{sum(lat) / len(lat) * 1e3:.2f}" if lat else "-"
        mine = r.family == "project" and r.kind == "send" and r.name != SEND_ONE
        print(f"{r.name:<40} {r.writers:>7} {f'{rate:,.0f}' if rate else '-':>9} "
              f"{ratio(rate, rates.get(('bare', 'send', r.writers))):>8} "
              f"{ratio(rate, rates.get(('sqlite', r.kind, r.writers))):>9} "
              f"{ratio(rate, one_thread) if mine else '':>8} {p50:>7} {p99:>7} {mean:>7}  "
              f"{r.notes()}")
    for r in results:
        if r.detail:
            print(f"  {r.name}: {r.detail}")
    print("vs bare: against write+fdatasync on one file at the same writer count (an ack or a\n"
          "  take is one durable write too). vs sqlite: against sqlite3 at the same writer count\n"
          "  (insert for sends, take+ack for receive). vs 1 thr: against this project's own\n"
          "  1-thread send([row]). Latency: one call (send, insert+commit, write+fdatasync);\n"
          "  a mean far above p99 means a few calls waited long (sqlite's busy handler sleeps).")


def write_json(path: str, results: list[Result]) -> None:
    """The table as data (for benchmarks/run_all.py's report and plots)."""
    rows = []
    for r in results:
        lat = r.run.latencies if r.run is not None else []
        rows.append({"name": r.name, "family": r.family, "kind": r.kind, "writers": r.writers,
                     "rate": r.rate, "notes": r.notes(),
                     "latency_ms": {p: percentile(lat, q) * 1e3 for p, q in
                                    (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))}
                     if lat else None})
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def parse_args(argv: list[str] | None = None) -> tuple[Config, list[str], bool]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="folder for the data (default: a fresh temp "
                    "folder in /tmp, removed afterwards)")
    ap.add_argument("--seconds", type=float, default=None, help="per scenario (default 3)")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--procs", default="4x4", help="processes x threads per process")
    ap.add_argument("--producer-messages", type=int, default=None, help="default 500,000")
    ap.add_argument("--backlog", type=int, default=None,
                    help="messages for the take/receive scenarios (default 5,000)")
    ap.add_argument("--deferred-backlog", type=int, default=None,
                    help="messages for receive(1) + deferred ack (default 50,000)")
    ap.add_argument("--latency-messages", type=int, default=None,
                    help="messages of the latency scenario, one per 10 ms (default 300)")
    ap.add_argument("--pagefile-messages", type=int, default=None,
                    help="single sends of the pagefiles scenario (default 20,000)")
    ap.add_argument("--batch-procs", type=int, default=8,
                    help="writer processes of the batchprocs scenario (compared with one)")
    ap.add_argument("--batch-rows", type=int, default=100,
                    help="rows a send in the batchprocs scenario")
    ap.add_argument("--busy", type=int, default=2, help="busy (spinning) processes beside "
                    "the writers in batchprocs' second half; 0 skips it")
    ap.add_argument("--journal", action=argparse.BooleanOptionalAction, default=None,
                    help="create the run's addresses with journal=True (format 4, the default "
                    "on local disks) or, with --no-journal, journal=False (format 3)")
    ap.add_argument("--quick", action="store_true", help="short smoke run (~1 minute)")
    ap.add_argument("--json", default=None, help="also write every result (rates, latency "
                    "percentiles) to this file")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma list of: {', '.join(SCENARIOS)}")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    try:
        procs, proc_threads = (int(x) for x in args.procs.lower().split("x"))
    except ValueError:
        ap.error(f"--procs {args.procs!r}: expected PROCSxTHREADS, such as 4x4")
    if args.batch_procs < 2 or args.batch_rows < 1 or args.busy < 0:
        ap.error(f"--batch-procs {args.batch_procs} / --batch-rows {args.batch_rows} / --busy "
                 f"{args.busy}: expected at least 2 processes, 1 row and 0 busy processes")
    quick = args.quick
    if args.journal is not None:
        ADDRESS_SETTINGS["journal"] = args.journal
    created = args.root is None
    root = args.root or tempfile.mkdtemp(prefix="dq-msg-bench-", dir="/tmp")
    cfg = Config(
        root=root,
        seconds=args.seconds if args.seconds is not None else (1.0 if quick else 3.0),
        threads=args.threads,
        procs=procs,
        proc_threads=proc_threads,
        producer_messages=args.producer_messages or (50_000 if quick else 500_000),
        backlog=args.backlog or (1_000 if quick else 5_000),
        deferred_backlog=args.deferred_backlog or (10_000 if quick else 50_000),
        latency_messages=args.latency_messages or (100 if quick else 300),
        pagefile_messages=args.pagefile_messages or (4_000 if quick else 20_000),
        json=args.json,
        batch_procs=args.batch_procs,
        batch_rows=args.batch_rows,
        busy=args.busy,
    )
    return cfg, names, created


def main() -> None:
    cfg, names, created = parse_args()
    os.makedirs(cfg.root, exist_ok=True)
    print(f"single-message benchmark: {cfg.seconds:g} s per scenario, threads {cfg.threads}, "
          f"procs {cfg.procs}x{cfg.proc_threads}, fsync on, root {cfg.root}, "
          f"{os.cpu_count()} cores, Python {sys.version.split()[0]}")
    results: list[Result] = []
    try:
        for name in names:
            t = time.monotonic()
            try:
                got = SCENARIOS[name](cfg)
            except Exception as exc:
                got = [Result(name, "error", "send", 0,
                              note=f"scenario failed: {type(exc).__name__}: {exc}")]
            for r in got:
                rate = f"{r.rate:,.0f} msg/s" if r.rate else "no rate"
                print(f"  {r.name} [{r.writers}]: {rate} {r.notes()}", flush=True)
            print(f"  ({name}: {time.monotonic() - t:.1f} s)", flush=True)
            results.extend(got)
    finally:
        if created:
            shutil.rmtree(cfg.root, ignore_errors=True)
    print()
    print_table(results)
    if cfg.json:
        write_json(cfg.json, results)


if __name__ == "__main__":
    main()
