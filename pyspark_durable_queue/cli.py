"""``durablequeue``: the operator's command-line tool (no Spark needed).

Examples::

    durablequeue /data/dq addresses
    durablequeue /data/dq stats orders --json
    durablequeue /data/dq stats orders --watch      # live: backlog and rates per consumer
    durablequeue /data/dq consumers orders
    durablequeue /data/dq pages orders
    durablequeue /data/dq browse orders --from 1000 --limit 20 --selector "region = 'EU'"
    durablequeue /data/dq verify orders
    durablequeue /data/dq repair orders             # dry run: prints what would be set aside
    durablequeue /data/dq repair orders --apply
    durablequeue /data/dq cleanup orders            # dry run: prints what would go
    durablequeue /data/dq cleanup orders --apply
    durablequeue /data/dq send orders < messages.jsonl
    durablequeue /data/dq consumer create orders billing --selector "region = 'EU'" --start latest
    durablequeue /data/dq consumer seek orders billing 2026-11-23T10:00:00Z
    durablequeue /data/dq consumer delete orders billing
    durablequeue /data/dq count orders --selector "region = 'EU'"
    durablequeue /data/dq receive orders --consumer billing --ack --limit 1000 > batch.jsonl
    durablequeue /data/dq export orders orders.parquet --from 1000 --to 2000
    durablequeue /data/dq import orders-copy orders.parquet
    durablequeue /data/dq transfer orders.dlq orders --consumer retry
    durablequeue /data/dq settings orders --set max_size_bytes=1GiB --set addressFullPolicy=BLOCK
    durablequeue /data/dq delete-address orders --yes
    durablequeue s3://bucket/dq -o anon=false -o 'client_kwargs={"region_name": "eu"}' stats orders

The global options (``--json``, ``--compact``, ``-o``) go before or after the command.

Exit status: 0 when the command succeeded; 1 when it failed (the address does not exist, storage
errors, damaged data) or ``verify``/``repair`` found work to do; 2 when the command line or its
input is wrong (usage errors, a malformed ``-o``, an invalid address name, selector or setting,
``send``/``import`` input that is not JSON or does not fit the address, ``transfer`` to an
address whose schema does not fit).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import pyarrow as pa

from ._options import parse_options, storage_value
from ._positions import Position, position_value
from ._repair import DEFAULT_GRACE_MS, verify_pages
from ._schema import RESERVED_COLUMNS, compile_selector, with_system_schema
from ._txn import app_txn
from .errors import DamagedLogError, DurableQueueError
from .queue import DurableQueue
from .settings import HANDLE_KEYS

__all__ = ["main"]

EXIT_FAILED, EXIT_USAGE = 1, 2  # and 0 for success


def storage_option(item: str) -> tuple[str, Any]:
    """Parse one ``-o KEY=VALUE`` into an fsspec option (values as ``storage.<key>`` in Spark:
    JSON literals and true/false become values, the rest stays text; quote a value to keep it
    text, ``-o 'key="123"'``)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{item!r} is not KEY=VALUE")
    return key.strip(), storage_value(value)


_POSITION_HELP = ("earliest, latest, a _seq (an integer >= 0) or an ISO-8601 time "
                  "(2026-11-23T10:00:00Z; without a zone it is UTC)")


def position(text: str) -> Position | _dt.datetime:
    """Parse a position given on the command line: ``earliest``, ``latest``, a ``_seq``, or an
    ISO-8601 time, which becomes a ``datetime`` (the first message committed at or after it)."""
    try:
        return position_value(text)
    except ValueError:
        pass
    try:
        if text.strip().lstrip("-").isdigit():  # a negative _seq, not epoch milliseconds
            raise ValueError(text)
        when = _dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00")
                                          .replace("z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a position: use {_POSITION_HELP}"
                                         ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=_dt.timezone.utc)


def positive(text: str) -> int:
    """An integer >= 1 given on the command line."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def nonnegative(text: str) -> int:
    """An integer >= 0 given on the command line (a ``_seq``)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a _seq (an integer >= 0)")
    return int(text)


def setting(item: str) -> tuple[str, str]:
    """Parse one ``--set KEY=VALUE`` (checked against the option table by the command)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{item!r} is not KEY=VALUE")
    return key.strip(), value.strip()


def _default(value: Any) -> Any:
    if isinstance(value, _dt.datetime | _dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "as_tuple"):  # Decimal
        return str(value)
    return str(value)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        print(json.dumps(data, default=_default, indent=None if args.compact else 2))
    else:
        print(text)


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


def cmd_addresses(q: DurableQueue, args: argparse.Namespace) -> int:
    out = []
    for name in q.addresses():
        s = q.address(name, create=False).stats()
        out.append({k: s[k] for k in ("address", "messages", "bytes", "pages", "first_seq",
                                      "next_seq", "dropped_messages")}
                   | {"consumers": len(s["consumers"])})
    rows = [[o["address"], o["messages"], o["bytes"], o["pages"], o["consumers"],
             o["dropped_messages"]] for o in out]
    _emit(args, out, _table(rows, ["address", "messages", "bytes", "pages", "consumers",
                                   "dropped"]) if out else "no addresses")
    return 0


def cmd_stats(q: DurableQueue, args: argparse.Namespace) -> int:
    if args.watch:
        return _watch(q, args)
    s = q.address(args.address, create=False).stats()
    lines = [f"{k}: {s[k]}" for k in ("address", "messages", "bytes", "pages", "first_seq",
                                      "next_seq", "commits", "dropped_messages",
                                      "dropped_bytes")]
    lines.append("schema: " + (s["schema"] or "(none yet)").replace("\n", ", "))
    lines.append("settings: " + ", ".join(f"{k}={v}" for k, v in s["settings"].items()))
    for name, c in s["consumers"].items():
        lines.append(f"consumer {name}: position {c['position']}, backlog "
                     f"{c['backlog_messages']} messages / {c['backlog_bytes']} bytes"
                     + (f", selector {c['selector']!r}" if c["selector"] else ""))
    _emit(args, s, "\n".join(lines))
    return 0


def _watch(q: DurableQueue, args: argparse.Namespace) -> int:
    """``stats --watch``: the address's counts, and per consumer its backlog and how fast it
    acknowledges, every ``--interval`` seconds until interrupted (or ``--count`` views). On a
    terminal each view replaces the last; else (or with ``--json``: one JSON line per view)
    the views follow one another."""
    a = q.address(args.address, create=False)
    redraw = sys.stdout.isatty() and not args.json
    last: tuple[float, dict[str, Any]] | None = None
    shown = 0
    try:
        while True:
            now, s = time.monotonic(), a.stats()
            view: dict[str, Any] = {
                "address": s["address"], "messages": s["messages"], "bytes": s["bytes"],
                "next_seq": s["next_seq"],
                "send_rate": _rate(last, now, lambda t: t["next_seq"], s["next_seq"]),
                "consumers": {}}
            for name, c in s["consumers"].items():
                view["consumers"][name] = {
                    "position": c["position"], "backlog_messages": c["backlog_messages"],
                    "backlog_bytes": c["backlog_bytes"],
                    "ack_rate": _rate(last, now, lambda t, n=name: t["consumers"].get(
                        n, {}).get("position"), c["position"])}
            if args.json:
                print(json.dumps(view))  # one line per view, --compact or not
            else:
                rows = [[n, c["position"], c["backlog_messages"], c["backlog_bytes"],
                         _per_second(c["ack_rate"])] for n, c in view["consumers"].items()]
                text = (f"{view['address']}: {view['messages']} messages, {view['bytes']} bytes,"
                        f" next _seq {view['next_seq']}, sending "
                        f"{_per_second(view['send_rate'])}\n"
                        + (_table(rows, ["consumer", "position", "backlog", "backlog_bytes",
                                         "acks/s"]) if rows else "no consumers"))
                print(("\x1b[H\x1b[2J" if redraw else "") + text + ("" if redraw else "\n"))
            sys.stdout.flush()
            shown += 1
            if args.count and shown >= args.count:
                return 0
            last = (now, {"next_seq": s["next_seq"], "consumers": s["consumers"]})
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _rate(last: tuple[float, dict[str, Any]] | None, now: float, value: Any,
          current: int) -> float | None:
    """Change per second of a counter since the last view (``None`` in the first view, or
    for a consumer that was not there)."""
    if last is None:
        return None
    before = value(last[1])
    if before is None or now <= last[0]:
        return None
    return round((current - before) / (now - last[0]), 1)


def _per_second(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:g}/s"


def cmd_consumers(q: DurableQueue, args: argparse.Namespace) -> int:
    s = q.address(args.address, create=False).stats()["consumers"]
    rows = [[n, c["position"], c["backlog_messages"], c["backlog_bytes"], c["selector"] or ""]
            for n, c in s.items()]
    _emit(args, s, _table(rows, ["consumer", "position", "backlog", "backlog_bytes",
                                 "selector"]) if rows else "no consumers")
    return 0


def cmd_pages(q: DurableQueue, args: argparse.Namespace) -> int:
    idx = q.address(args.address, create=False).state.pages
    out = [{"name": idx.names[i], "first_seq": idx.seq[i], "last_seq": idx.ends[i] - 1,
            "rows": idx.rows[i], "bytes": idx.bytes[i],
            "committed": _dt.datetime.fromtimestamp(idx.ts[i] / 1e6, _dt.timezone.utc)}
           for i in range(len(idx))]
    rows = [[o["name"], o["first_seq"], o["last_seq"], o["rows"], o["bytes"],
             _default(o["committed"])[:19]] for o in out]
    _emit(args, out, _table(rows, ["page", "first_seq", "last_seq", "rows", "bytes",
                                   "committed"]) if rows else "no pages")
    return 0


def cmd_browse(q: DurableQueue, args: argparse.Namespace) -> int:
    a = q.address(args.address, create=False)
    snapshot = a.snapshot()
    if snapshot.schema is None:
        _emit(args, [], "no messages")
        return 0
    selector = compile_selector(args.selector, snapshot.schema) if args.selector else None
    start = snapshot.first_seq if args.start is None else args.start
    shown = 0
    rows: list[dict[str, Any]] = []
    for batch, _ in snapshot.messages(start, selector=selector):
        if batch is None:
            continue
        for row in batch.slice(0, args.limit - shown).to_pylist():
            rows.append(row)
        shown = len(rows)
        if shown >= args.limit:
            break
    _print_rows(args, rows)
    return 0


def _print_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Messages as JSON lines (with ``--json``, ASCII only); flushed, so that a caller that
    acknowledges after printing acknowledges only what reached standard output."""
    for row in rows:
        print(json.dumps(row, default=_default, ensure_ascii=args.json))
    sys.stdout.flush()


def cmd_count(q: DurableQueue, args: argparse.Namespace) -> int:
    """Messages retained (optionally: matching a selector), read page by page: pages whose
    statistics prove the selector cannot match are not read, and at most the page cache's
    pages are in memory."""
    a = q.address(args.address, create=False)
    snapshot = a.snapshot()
    selector = compile_selector(args.selector, snapshot.schema) if args.selector else None
    if selector is None:
        count = sum(ref.rows for ref in snapshot.refs(snapshot.first_seq))
    else:
        count = sum(batch.num_rows for batch, _ in snapshot.messages(snapshot.first_seq,
                                                                     selector=selector)
                    if batch is not None)
    _emit(args, {"address": a.name, "messages": count, "selector": args.selector}, str(count))
    return 0


def cmd_receive(q: DurableQueue, args: argparse.Namespace) -> int:
    """Print up to ``--limit`` messages of a consumer as JSON lines; ``--ack`` acknowledges
    each batch once it is printed (at-least-once: a crash between the two prints it again)."""
    a = q.address(args.address, create=False)
    with a.consumer(args.consumer, create=False) as c:
        left = args.limit
        while left > 0:
            batch = c.receive(max_messages=min(left, RECEIVE_BATCH))
            rows = batch.to_pylist()
            _print_rows(args, rows)
            if args.ack:
                c.ack(batch)  # an empty batch too: it passes the unmatched messages examined
            if not rows:
                break
            left -= len(rows)
    return 0


class _Dump:
    """An export file being written, batch by batch: Parquet (row groups of about
    ``DUMP_ROW_GROUP_BYTES``) or JSON lines. Written under a temporary name and renamed when
    complete, so a failed export leaves no file that looks whole; ``-`` is standard output
    (JSON lines only)."""

    def __init__(self, path: str, fmt: str, schema: pa.Schema) -> None:
        self.path, self.fmt, self.schema = path, fmt, schema
        self.tmp = None if path == "-" else f"{path}.partial-{os.getpid()}"
        self.pending: list[pa.RecordBatch] = []
        self.pending_bytes = 0
        self.writer: Any = None
        if fmt == "parquet":
            import pyarrow.parquet as pq

            self.writer = pq.ParquetWriter(self.tmp, schema)
        else:
            self.writer = sys.stdout if self.tmp is None else open(self.tmp, "w",
                                                                   encoding="utf-8")

    def write(self, batch: pa.RecordBatch) -> None:
        if self.fmt == "jsonl":
            self.writer.writelines(json.dumps(row, default=_default, ensure_ascii=False) + "\n"
                                   for row in batch.to_pylist())
            return
        self.pending.append(batch)
        self.pending_bytes += batch.nbytes
        if self.pending_bytes >= DUMP_ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.writer.write_table(pa.Table.from_batches(self.pending, schema=self.schema))
        self.pending, self.pending_bytes = [], 0

    def __enter__(self) -> _Dump:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self.fmt == "parquet":
            if exc_type is None:
                self._flush()
            self.writer.close()
        elif self.tmp is None:
            self.writer.flush()
        else:
            self.writer.close()
        if self.tmp is None:
            return
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            os.remove(self.tmp)


#: An export to Parquet writes a row group when this much is waiting (memory stays bounded).
DUMP_ROW_GROUP_BYTES = 64 << 20
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def _dump_format(args: argparse.Namespace) -> str:
    if args.format:
        return str(args.format)
    if args.file == "-" or args.file.lower().endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if args.file.lower().endswith((".parquet", ".pq")):
        return "parquet"
    if args.command == "export" or not os.path.isfile(args.file):
        return "parquet"
    with open(args.file, "rb") as f:
        return "parquet" if f.read(4) == b"PAR1" else "jsonl"


def cmd_export(q: DurableQueue, args: argparse.Namespace) -> int:
    """Write the messages ``--from <= _seq < --to`` (default: all retained) with ``_seq`` and
    ``_timestamp`` to a file, page by page: at most the page cache and one row group are in
    memory. Consumers are not moved."""
    fmt = _dump_format(args)
    if fmt == "parquet" and args.file == "-":
        print("error: parquet cannot go to standard output; name a file or use --format jsonl",
              file=sys.stderr)
        return EXIT_USAGE
    folder = os.path.dirname(os.path.abspath(args.file))
    if args.file != "-" and not os.path.isdir(folder):
        print(f"error: cannot write {args.file}: the folder {folder} does not exist",
              file=sys.stderr)
        return EXIT_FAILED
    a = q.address(args.address, create=False)
    snapshot = a.snapshot()
    if snapshot.schema is None:
        print(f"error: address {a.name} has never had a message (it has no schema yet): "
              "nothing to export", file=sys.stderr)
        return EXIT_FAILED
    start = max(snapshot.first_seq, 0 if args.start is None else args.start)
    end = snapshot.end if args.end is None else min(args.end, snapshot.end)
    count, first, last = 0, -1, -1
    with _Dump(args.file, fmt, with_system_schema(snapshot.schema)) as out:
        for batch, _ in snapshot.messages(start, max(start, end)):
            if batch is None or batch.num_rows == 0:
                continue
            out.write(batch)
            seqs = batch.column("_seq")
            first = seqs[0].as_py() if first < 0 else first
            last = seqs[-1].as_py()
            count += batch.num_rows
    report = {"address": a.name, "file": args.file, "format": fmt, "messages": count,
              "first_seq": first if count else None, "last_seq": last if count else None}
    if args.file != "-":
        _emit(args, report, f"exported {count} messages"
              + (f" (_seq {first}..{last})" if count else "") + f" to {args.file} ({fmt})")
    return 0


def _import_batches(args: argparse.Namespace, fmt: str) -> Iterator[pa.Table | list[Any]]:
    """The messages of an export file, ``--batch-size`` at a time, without the system
    columns (the address gives them anew)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with pq.ParquetFile(args.file) as f:
            columns = [n for n in f.schema_arrow.names if n not in RESERVED_COLUMNS]
            for batch in f.iter_batches(batch_size=args.batch_size, columns=columns):
                yield pa.Table.from_batches([batch])
        return
    stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
    try:
        rows: list[Any] = []
        for n, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise _BadInput(f"line {n} of {args.file} is not JSON: {exc}") from None
            if isinstance(row, dict):
                for name in RESERVED_COLUMNS:
                    row.pop(name, None)
            rows.append(row)
            if len(rows) >= args.batch_size:
                yield rows
                rows = []
        if rows:
            yield rows
    finally:
        if stream is not sys.stdin:
            stream.close()


class _BadInput(ValueError):
    """Input that is not what the command reads (exit status 2)."""


def cmd_import(q: DurableQueue, args: argparse.Namespace) -> int:
    """Send the messages of an export file (Parquet or JSON lines) to an address, created when
    missing, ``--batch-size`` messages per commit: memory stays bounded, and an import that
    fails part way has committed the batches before the failure (the report says how many)."""
    if args.file != "-" and not os.path.isfile(args.file):
        print(f"error: cannot read {args.file}: no such file", file=sys.stderr)
        return EXIT_FAILED
    fmt = _dump_format(args)
    a = q.address(args.address)
    sent = dropped = 0
    try:
        for batch in _import_batches(args, fmt):
            result = a.send(batch)
            sent += result.count
            dropped += len(batch) if result.dropped else 0
    except (DurableQueueError, _BadInput) as exc:
        print(f"error: {exc}; {sent} messages were imported before it", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError | TypeError) else EXIT_FAILED
    _emit(args, {"address": a.name, "file": args.file, "format": fmt, "messages": sent,
                 "dropped": dropped},
          f"imported {sent} messages from {args.file} ({fmt}) into {a.name}"
          + (f"; {dropped} dropped (address full)" if dropped else ""))
    return 0


#: The transaction namespace of ``transfer`` in the destination's log (see ``_txn``).
TRANSFER_APP = "durablequeue-transfer"


def cmd_transfer(q: DurableQueue, args: argparse.Namespace) -> int:
    """Send the messages of one address to another, each once, resumable after a crash.

    Every batch is sent with the transaction ``(transfer id, _seq after the batch)``; the
    destination's log keeps the highest version per id, so a run starts after what the runs
    before it sent, and a batch sent by a run that died before acknowledging it is not sent
    again. With ``--consumer`` the messages are the consumer's (its selector; its watermark
    moves past what was sent), else the source's retained messages (``--selector``), from where
    the last transfer with the same selector stopped.
    """
    if args.source == args.destination:
        print("error: the source and the destination are the same address", file=sys.stderr)
        return EXIT_USAGE
    src = q.address(args.source, create=False)
    selector = args.selector
    if args.consumer is not None:
        stored = src.consumers().get(args.consumer)
        if stored is not None and selector is not None and selector != stored.get("selector"):
            print(f"error: consumer {args.consumer!r} of {src.name} has the selector "
                  f"{stored.get('selector')!r}; a transfer through it takes its messages: leave "
                  "out --selector (or use a new consumer)", file=sys.stderr)
            return EXIT_USAGE
        if stored is not None:
            selector = stored.get("selector")
    app_id = f"{TRANSFER_APP} {src.name}" + (f" consumer {args.consumer}" if args.consumer
                                              else f" selector {selector or ''}")
    key = app_txn((app_id, 0))[0]
    dst = q.address(args.destination)
    done = dst.state.txns.get(key, -1)  # the _seq of the source after what was sent
    report = {"source": src.name, "destination": dst.name, "consumer": args.consumer,
              "selector": selector, "messages": 0, "dropped": 0}

    def send(batch: pa.Table, after: int) -> None:
        table = batch.drop_columns([n for n in batch.column_names if n in RESERVED_COLUMNS])
        result = dst.send(table.replace_schema_metadata(None), txn=(app_id, after))
        report["messages"] += result.count
        report["dropped"] += table.num_rows if result.dropped else 0

    try:
        if args.consumer is not None:
            with src.consumer(args.consumer, selector=selector) as c:
                if done > c.position:  # sent by a run that stopped before acknowledging
                    c.ack(done - 1)
                while True:
                    batch = c.receive(max_messages=args.batch_size)
                    if batch.num_rows:
                        send(batch, c.cursor)
                    c.ack(batch)
                    if not batch.num_rows:
                        break
        else:
            snapshot = src.snapshot()
            compiled = compile_selector(selector, snapshot.schema) if selector else None
            pending: list[pa.RecordBatch] = []
            for part, after in snapshot.messages(max(snapshot.first_seq, done),
                                                 selector=compiled):
                if part is not None and part.num_rows:
                    pending.append(part)
                if sum(b.num_rows for b in pending) >= args.batch_size:
                    send(pa.Table.from_batches(pending), after)
                    pending = []
            if pending:
                send(pa.Table.from_batches(pending), after)
    except DurableQueueError as exc:
        print(f"error: {exc}; {report['messages']} messages were transferred before it",
              file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError | TypeError) else EXIT_FAILED
    _emit(args, report, f"transferred {report['messages']} messages from {src.name} to "
          f"{dst.name}" + (f"; {report['dropped']} dropped (address full)"
                           if report["dropped"] else ""))
    return 0


#: Messages per receive of ``durablequeue receive`` (and per acknowledgement with ``--ack``).
RECEIVE_BATCH = 10_000


def cmd_verify(q: DurableQueue, args: argparse.Namespace) -> int:
    """Read every live page and check every frame's checksum; report missing and orphans."""
    a = q.address(args.address, create=False)
    try:
        state = a.state
    except DamagedLogError as exc:
        report: dict[str, Any] = {"address": a.name, "ok": False, "log": str(exc)}
        _emit(args, report, f"{a.name}: the commit log is damaged: {exc}\nPROBLEMS FOUND")
        return EXIT_FAILED
    checked, problems = verify_pages(a.storage, a.layout, state)
    orphans = a.cleanup(dry_run=True, now=float("inf")).orphans
    report = {"address": a.name, "pages_checked": checked,
              "problems": [asdict(p) for p in problems], "unpublished_files": orphans,
              "ok": not problems}
    lines = [f"{a.name}: {checked} of {len(state.pages)} pages verified"]
    lines += [f"  {p.page}: {p.problem}" + (f" {p.detail}" if p.detail else "")
              for p in problems]
    if orphans:
        lines.append(f"  {len(orphans)} unpublished page files (orphans or in-flight writes)")
    if problems:
        lines.append(f"PROBLEMS FOUND (`durablequeue {args.root} repair {a.name}` shows what "
                     "repair would do)")
    else:
        lines.append("OK")
    _emit(args, report, "\n".join(lines))
    return 0 if not problems else EXIT_FAILED


def cmd_repair(q: DurableQueue, args: argparse.Namespace) -> int:
    """Set aside a damaged last log entry and damaged pages (dry run unless --apply)."""
    a = q.address(args.address, create=False)
    report = a.repair(dry_run=not args.apply, grace_ms=args.grace_ms)
    would = "would set aside" if report.dry_run else "set aside"
    lines = [f"{a.name}:"]
    if report.waiting:
        lines.append(f"  the last commit-log entry {report.waiting} does not parse but is "
                     f"younger than {args.grace_ms} ms: a writer may still be writing it; "
                     "run repair again later")
    if report.log_entry:
        lines.append(f"  {would} the damaged last commit-log entry {report.log_entry} "
                     "(left by a writer killed while writing it; never acknowledged)")
        if report.dry_run:
            lines.append("  the pages are checked once the log opens (after --apply)")
    for p in report.pages:
        lines.append(f"  {would} page {p.page} ({p.problem}{' ' + p.detail if p.detail else ''}"
                     f"): _seq {p.first_seq}..{p.first_seq + p.messages - 1} are lost")
    if report.clean:
        lines.append(f"  nothing to repair ({report.pages_checked} pages verified)")
    elif report.dry_run and not report.waiting:
        lines.append("(dry run: pass --apply to do it; files go to the address's damaged/ "
                     "folder, nothing is deleted)")
    _emit(args, report.to_dict(), "\n".join(lines))
    return 0 if report.clean or not (report.dry_run or report.waiting) else EXIT_FAILED


def cmd_cleanup(q: DurableQueue, args: argparse.Namespace) -> int:
    a = q.address(args.address, create=False)
    report = a.cleanup(dry_run=not args.apply)
    verb = "would remove" if report.dry_run else ("archived" if report.archived else "removed")
    text = (f"{verb} {len(report.pages)} consumed pages ({report.bytes} bytes), "
            f"{len(report.orphans)} orphan pages and {len(report.log_files)} expired commit-log "
            "files" + ("\n(dry run: pass --apply to do it)" if report.dry_run else ""))
    _emit(args, report.to_dict(), text)
    return 0


def cmd_send(q: DurableQueue, args: argparse.Namespace) -> int:
    """Send JSON lines from standard input (one message per line) in one commit."""
    rows = []
    for n, line in enumerate(sys.stdin, 1):
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            print(f"error: line {n} is not JSON: {exc}; nothing was sent", file=sys.stderr)
            return EXIT_USAGE
    result = q.address(args.address).send(rows)
    _emit(args, {"first_seq": result.seq, "count": result.count, "dropped": result.dropped},
          f"sent {result.count} messages" + (f" from _seq {result.seq}" if result.count else "")
          + (" (dropped: address full)" if result.dropped else ""))
    return 0


def cmd_consumer_create(q: DurableQueue, args: argparse.Namespace) -> int:
    """Create a durable consumer; an existing one is an error (``consumer seek`` moves it)."""
    a = q.address(args.address, create=False)
    known = a.consumers()
    if args.name in known:
        print(f"error: consumer {args.name!r} of {a.name} already exists (at _seq "
              f"{known[args.name]['position']}); move it with `consumer seek`, or delete it "
              "first", file=sys.stderr)
        return EXIT_FAILED
    c = a.consumer(args.name, selector=args.selector, start=args.start)
    out = {"address": a.name, "consumer": c.name, "position": c.position,
           "selector": c.selector_text}
    _emit(args, out, f"created consumer {c.name} of {a.name} at _seq {c.position}"
          + (f" with selector {c.selector_text!r}" if c.selector_text else ""))
    return 0


def cmd_consumer_delete(q: DurableQueue, args: argparse.Namespace) -> int:
    a = q.address(args.address, create=False)
    c = a.consumer(args.name, create=False)
    position = c.position
    c.delete()
    _emit(args, {"address": a.name, "consumer": args.name, "deleted": True,
                 "position": position},
          f"deleted consumer {args.name} of {a.name} (it was at _seq {position})")
    return 0


def cmd_consumer_seek(q: DurableQueue, args: argparse.Namespace) -> int:
    """Move a consumer's watermark (also back): what it acknowledged before is delivered again,
    what it skips is acknowledged."""
    a = q.address(args.address, create=False)
    c = a.consumer(args.name, create=False)
    before = c.position
    c.seek(args.position)
    _emit(args, {"address": a.name, "consumer": c.name, "previous_position": before,
                 "position": c.position},
          f"consumer {c.name} of {a.name} moved from _seq {before} to _seq {c.position}")
    return 0


def cmd_settings(q: DurableQueue, args: argparse.Namespace) -> int:
    """Show an address's persisted settings; ``--set`` changes some (validated by the option
    table, as ``DurableQueue.address(name, **settings)`` does)."""
    changes = dict(args.set or [])
    if changes:
        parsed = parse_options(changes, "address")
        handle = [k for k in parsed if k in HANDLE_KEYS]
        if handle:
            one = len(handle) == 1
            print(f"error: {', '.join(handle)} {'is a setting' if one else 'are settings'} of "
                  "each writer, not of the address (never persisted): pass "
                  f"{'it' if one else 'them'} when opening the address to write",
                  file=sys.stderr)
            return EXIT_USAGE
    before = q.address(args.address, create=False).settings.to_json()
    a = q.address(args.address, create=False, **changes) if changes else \
        q.address(args.address, create=False)
    after = a.settings.to_json()
    changed = {k: [before[k], v] for k, v in after.items() if before[k] != v}
    lines = [f"{k} = {v}" for k, v in after.items()]
    lines += [f"changed {k}: {old} -> {new}" for k, (old, new) in changed.items()]
    if changes and not changed:
        lines.append("nothing changed (the address already had these values)")
    _emit(args, {"address": a.name, "settings": after,
                 "changed": {k: {"from": old, "to": new} for k, (old, new) in changed.items()}},
          "\n".join(lines))
    return 0


def cmd_delete_address(q: DurableQueue, args: argparse.Namespace) -> int:
    """Remove an address with its messages and consumers; refuses without ``--yes``."""
    s = q.address(args.address, create=False).stats()
    what = (f"address {s['address']} with its {s['messages']} messages ({s['bytes']} bytes) and "
            f"{len(s['consumers'])} consumers")
    if not args.yes:
        print(f"error: this would delete {what}; pass --yes to do it", file=sys.stderr)
        return EXIT_USAGE
    q.delete_address(s["address"])
    _emit(args, {"address": s["address"], "deleted": True, "messages": s["messages"],
                 "bytes": s["bytes"], "consumers": sorted(s["consumers"])}, f"deleted {what}")
    return 0


# -o after the command collects here; parse_args appends it to the list given before the command.
_OPTIONS_AFTER_COMMAND = "storage_option_after_command"


def _add_global_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """Add the options every command takes, before or after its name, to ``parser``.

    argparse parses a command's arguments into a fresh namespace and copies all of it over the
    main one, so the copies after the command have no defaults (``SUPPRESS``): leaving them out
    there keeps what was given before the command. ``-o`` after the command goes to a list of its
    own, or it would replace the ``-o`` values given before it instead of adding to them.
    """
    unset = argparse.SUPPRESS
    group = parser.add_argument_group("global options", "before or after the command")
    group.add_argument("--json", action="store_true", default=unset if after_command else False,
                       help="machine-readable output")
    group.add_argument("--compact", action="store_true",
                       default=unset if after_command else False, help="one-line JSON")
    group.add_argument("-o", "--storage-option", action="append", metavar="KEY=VALUE",
                       dest=_OPTIONS_AFTER_COMMAND if after_command else "storage_option",
                       default=unset if after_command else [], type=storage_option,
                       help="fsspec storage option (repeatable); VALUE is read as JSON when it "
                            "parses (false, 3, null, {...}), else as a string")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser; read a command line with `parse_args`, which also joins the
    ``-o`` options given after the command to those given before it."""
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog="durablequeue", description=doc.split("\n")[0],
                                epilog=doc[doc.find("Exit status:"):].replace("``", ""))
    p.add_argument("root", help="store root: a local path or an fsspec URL")
    _add_global_options(p, after_command=False)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, helptext: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=helptext)
        _add_global_options(sp, after_command=True)
        return sp

    command("addresses", "list addresses")
    for name, helptext in (("stats", "counts, backlog, settings"), ("consumers", "consumers"),
                           ("pages", "live page files"), ("verify", "check every checksum")):
        sp = command(name, helptext)
        sp.add_argument("address")
        if name == "stats":
            sp.add_argument("--watch", action="store_true",
                            help="a live view: backlog and acknowledgement rate per consumer, "
                                 "refreshed every --interval seconds until interrupted")
            sp.add_argument("--interval", type=float, default=1.0,
                            help="seconds between views (default: %(default)s)")
            sp.add_argument("--count", type=positive, default=None,
                            help="stop after this many views")
    sp = command("browse", "print messages without consuming them")
    sp.add_argument("address")
    sp.add_argument("--from", dest="start", type=int, default=None, help="first _seq")
    sp.add_argument("--limit", type=int, default=20)
    sp.add_argument("--selector", default=None)
    sp = command("cleanup", "remove consumed and orphan pages (dry run by default)")
    sp.add_argument("address")
    sp.add_argument("--apply", action="store_true", help="really remove")
    sp = command("repair", "set aside a damaged last log entry and damaged pages "
                           "(dry run by default)")
    sp.add_argument("address")
    sp.add_argument("--apply", action="store_true", help="really do it")
    sp.add_argument("--grace-ms", type=int, default=DEFAULT_GRACE_MS,
                    help="age before a damaged last log entry counts as abandoned "
                         "(default: %(default)s)")
    sp = command("send", "send JSON lines from standard input")
    sp.add_argument("address")

    consumer = sub.add_parser("consumer", help="create, delete or move a durable consumer")
    verbs = consumer.add_subparsers(dest="consumer_command", required=True)

    def verb(name: str, helptext: str) -> argparse.ArgumentParser:
        vp = verbs.add_parser(name, help=helptext)
        _add_global_options(vp, after_command=True)
        vp.add_argument("address")
        vp.add_argument("name", help="consumer name")
        return vp

    vp = verb("create", "create a consumer (an existing one is an error)")
    vp.add_argument("--selector", default=None, help="only messages it matches are delivered")
    vp.add_argument("--start", type=position, default=None, metavar="POSITION",
                    help=f"where it starts: {_POSITION_HELP} (default: earliest)")
    verb("delete", "delete a consumer (cleanup no longer keeps pages for it)")
    vp = verb("seek", "move a consumer's watermark, also back")
    vp.add_argument("position", type=position, metavar="POSITION", help=_POSITION_HELP)

    sp = command("count", "count retained messages (matching a selector)")
    sp.add_argument("address")
    sp.add_argument("--selector", default=None)
    sp = command("receive", "print a consumer's next messages as JSON lines")
    sp.add_argument("address")
    sp.add_argument("--consumer", required=True, help="an existing consumer (see consumer "
                                                      "create)")
    sp.add_argument("--ack", action="store_true",
                    help="acknowledge what was printed (else the consumer stays where it is)")
    sp.add_argument("--limit", type=positive, default=100,
                    help="most messages to print (default: %(default)s)")

    sp = command("export", "write messages to a Parquet or JSON-lines file")
    sp.add_argument("address")
    sp.add_argument("file", help="where to write; - is standard output (JSON lines)")
    sp.add_argument("--format", choices=("parquet", "jsonl"), default=None,
                    help="default: jsonl for a .jsonl/.ndjson/.json file or -, else parquet")
    sp.add_argument("--from", dest="start", type=nonnegative, default=None, metavar="SEQ",
                    help="first _seq (default: the first retained)")
    sp.add_argument("--to", dest="end", type=nonnegative, default=None, metavar="SEQ",
                    help="stop before this _seq (exclusive; default: the end of the log)")
    sp = command("import", "send the messages of an export file (created when missing)")
    sp.add_argument("address")
    sp.add_argument("file", help="a Parquet or JSON-lines file; - is standard input (JSON "
                                 "lines)")
    sp.add_argument("--format", choices=("parquet", "jsonl"), default=None,
                    help="default: by the file's suffix, else by its content")
    sp.add_argument("--batch-size", type=positive, default=10_000,
                    help="messages per commit (default: %(default)s)")

    sp = command("transfer", "send messages of one address to another, each once")
    sp.add_argument("source")
    sp.add_argument("destination", help="created when missing")
    sp.add_argument("--selector", default=None,
                    help="only the messages it matches (for a new --consumer: its selector)")
    sp.add_argument("--consumer", default=None,
                    help="take the messages of this consumer of the source (created when "
                         "missing) and acknowledge them; without it, the source's retained "
                         "messages from where the last transfer (same selector) stopped")
    sp.add_argument("--batch-size", type=positive, default=10_000,
                    help="messages per commit (default: %(default)s)")

    sp = command("settings", "show an address's settings; --set changes them")
    sp.add_argument("address")
    sp.add_argument("--set", type=setting, action="append", metavar="KEY=VALUE",
                    help="change a setting (repeatable): a Python key, Spark option or alias, "
                         "e.g. max_size_bytes=1GiB or addressFullPolicy=BLOCK")
    sp = command("delete-address", "delete an address with its messages and consumers")
    sp.add_argument("address")
    sp.add_argument("--yes", action="store_true", help="really delete (refused without it)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line ``argv`` (``sys.argv[1:]`` when None); usage errors exit with 2.

    ``storage_option`` holds every ``-o`` in command-line order, those before the command first,
    so a key given twice takes its last value."""
    args = build_parser().parse_args(argv)
    after = vars(args).pop(_OPTIONS_AFTER_COMMAND, [])
    args.storage_option = [*args.storage_option, *after]
    return args


COMMANDS = {"addresses": cmd_addresses, "stats": cmd_stats, "consumers": cmd_consumers,
            "pages": cmd_pages, "browse": cmd_browse, "verify": cmd_verify,
            "cleanup": cmd_cleanup, "repair": cmd_repair, "send": cmd_send,
            "consumer create": cmd_consumer_create, "consumer delete": cmd_consumer_delete,
            "consumer seek": cmd_consumer_seek, "settings": cmd_settings,
            "delete-address": cmd_delete_address, "count": cmd_count,
            "receive": cmd_receive, "export": cmd_export, "import": cmd_import,
            "transfer": cmd_transfer}


def open_queue(args: argparse.Namespace) -> DurableQueue:
    """The store named on the command line, with its ``-o`` options."""
    return DurableQueue(args.root, dict(args.storage_option))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv``; returns the exit status (usage errors exit with 2 from
    argparse)."""
    args = parse_args(argv)
    try:
        command = " ".join(filter(None, (args.command, getattr(args, "consumer_command", None))))
        return COMMANDS[command](open_queue(args), args)
    except DurableQueueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        # The store's ValueError/TypeError kinds say a value the user gave is wrong (address
        # name, selector, messages that do not fit); the rest say the command failed.
        return EXIT_USAGE if isinstance(exc, ValueError | TypeError) else EXIT_FAILED
    except BrokenPipeError:
        # the reader of standard output went away (`| head`): stop quietly, as cat does; what
        # was not printed was not acknowledged
        sys.stdout = open(os.devnull, "w")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
