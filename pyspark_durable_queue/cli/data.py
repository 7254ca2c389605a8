"""The ``durablequeue`` commands that move messages in bulk, streaming with bounded memory:
``export`` (to a Parquet or JSON-lines file), ``import`` (from one) and ``transfer`` (from one
address to another, each message once, resumable after a crash).

``cli.COMMANDS`` dispatches to the ``cmd_*`` functions here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from .._format.schema import RESERVED_COLUMNS, SEQ, compile_selector, with_system_schema
from .._log.txn import app_txn
from .._ops import dead_letter
from ..errors import DurableQueueError
from ..queue import DurableQueue
from .output import EXIT_FAILED, EXIT_USAGE, emit, json_default, progress


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
            self.writer.writelines(json.dumps(row, default=json_default, ensure_ascii=False) + "\n"
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
    count, first, last, at = 0, -1, -1, start
    # no bar when the messages themselves go to the terminal
    with _Dump(args.file, fmt, with_system_schema(snapshot.schema)) as out, \
            progress(args, f"export {a.name}", max(0, end - start),
                     quiet=args.file == "-" and sys.stdout.isatty()) as bar:
        for batch, after in snapshot.messages(start, max(start, end)):
            bar.advance(after - at)
            at = after
            if batch is None or batch.num_rows == 0:
                continue
            out.write(batch)
            seqs = batch.column(SEQ)
            first = seqs[0].as_py() if first < 0 else first
            last = seqs[-1].as_py()
            count += batch.num_rows
    report = {"address": a.name, "file": args.file, "format": fmt, "messages": count,
              "first_seq": first if count else None, "last_seq": last if count else None}
    if args.file != "-":
        emit(args, report, f"exported {count} messages"
              + (f" (_seq {first}..{last})" if count else "") + f" to {args.file} ({fmt})")
    return 0


def _import_size(args: argparse.Namespace, fmt: str) -> tuple[int | None, str]:
    """How much an import reads, for its progress bar, and in what unit: messages of a
    Parquet file (its footer says), bytes of a JSON-lines file, messages (total unknown) of
    standard input."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(args.file).num_rows, "msg"
    return (None, "msg") if args.file == "-" else (os.path.getsize(args.file), "B")


def _import_batches(args: argparse.Namespace,
                    fmt: str) -> Iterator[tuple[pa.Table | list[Any], int]]:
    """The messages of an export file, ``--batch-size`` at a time, without the system
    columns (the address gives them anew), each with how far into the input it reaches (in
    the unit of `_import_size`)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with pq.ParquetFile(args.file) as f:
            columns = [n for n in f.schema_arrow.names if n not in RESERVED_COLUMNS]
            done = 0
            for batch in f.iter_batches(batch_size=args.batch_size, columns=columns):
                done += batch.num_rows
                yield pa.Table.from_batches([batch]), done
        return
    stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")

    def reached(rows: int) -> int:
        # the bytes read from the file (ahead of the decoded lines by one read, 8 KiB)
        return done + rows if stream is sys.stdin else stream.buffer.tell()

    try:
        rows: list[Any] = []
        done = 0
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
                yield rows, reached(len(rows))
                done, rows = done + len(rows), []
        if rows:
            yield rows, reached(len(rows))
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
    total, unit = _import_size(args, fmt)
    try:
        with progress(args, f"import {a.name}", total, unit) as bar:
            for batch, reached in _import_batches(args, fmt):
                result = a.send(batch)
                sent += result.count
                dropped += len(batch) if result.dropped else 0
                bar.reached(reached, total)
    except (DurableQueueError, _BadInput) as exc:
        print(f"error: {exc}; {sent} messages were imported before it", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError | TypeError) else EXIT_FAILED
    emit(args, {"address": a.name, "file": args.file, "format": fmt, "messages": sent,
                 "dropped": dropped},
          f"imported {sent} messages from {args.file} ({fmt}) into {a.name}"
          + (f"; {dropped} dropped (address full)" if dropped else ""))
    return 0


#: The transaction namespace of ``transfer`` in the destination's log (see ``_log.txn``).
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

    # the bar counts the source's messages examined (matching or not), from where the
    # transfer starts to the source's end when it started
    what = f"transfer {src.name}"
    try:
        if args.consumer is not None:
            with src.consumer(args.consumer, selector=selector) as c:
                if done > c.position:  # sent by a run that stopped before acknowledging
                    c.ack(done - 1)
                _send_through(c, args, what, src.snapshot().end, send)
        else:
            snapshot = src.snapshot()
            compiled = compile_selector(selector, snapshot.schema) if selector else None
            pending: list[pa.RecordBatch] = []
            at = max(snapshot.first_seq, done)
            with progress(args, what, max(0, snapshot.end - at)) as bar:
                for part, after in snapshot.messages(at, selector=compiled):
                    if part is not None and part.num_rows:
                        pending.append(part)
                    if sum(b.num_rows for b in pending) >= args.batch_size:
                        send(pa.Table.from_batches(pending), after)
                        pending = []
                    bar.advance(after - at)
                    at = after
                if pending:
                    send(pa.Table.from_batches(pending), after)
    except DurableQueueError as exc:
        print(f"error: {exc}; {report['messages']} messages were transferred before it",
              file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError | TypeError) else EXIT_FAILED
    emit(args, report, f"transferred {report['messages']} messages from {src.name} to "
          f"{dst.name}" + (f"; {report['dropped']} dropped (address full)"
                           if report["dropped"] else ""))
    return 0


def _send_through(consumer: Any, args: argparse.Namespace, what: str, end: int,
                  send: Callable[[pa.Table, int], None]) -> None:
    """``transfer`` and ``redrive`` through a consumer: its messages ``--batch-size`` at a
    time, each batch given to ``send`` with the cursor after it and acknowledged once sent; the
    progress bar counts the messages examined up to ``end`` (the source's end when it started;
    it grows if messages keep coming)."""
    begin = consumer.position
    total = max(0, end - begin)
    with progress(args, what, total) as bar:
        while True:
            batch = consumer.receive(max_messages=args.batch_size)
            if batch.num_rows:
                send(batch, consumer.cursor)
            consumer.ack(batch)
            bar.reached(consumer.cursor - begin, total)
            if not batch.num_rows:
                return


#: The transaction namespace of ``redrive`` in the addresses it sends to (see ``_log.txn``).
REDRIVE_APP = "durablequeue-redrive"


def cmd_redrive(q: DurableQueue, args: argparse.Namespace) -> int:
    """Send dead letters back where they came from (or ``--to`` one address), each once,
    resumable after a crash, as SQS's redrive does.

    The dead letters are those of a consumer of the dead-letter address (``--consumer``,
    default ``redrive``, created at the first retained dead letter; ``--selector`` on the
    dead-letter columns, e.g. ``origin_address = 'orders'``), acknowledged once sent. Every
    batch goes to each destination with the transaction ``(redrive id, _seq after the
    batch)``; a destination keeps the highest version per id, so the dead letters below it are
    not sent there again by a run that follows one that died before acknowledging.
    """
    dlq = q.address(args.address, create=False)
    if dlq.schema is not None and not dead_letter.is_dead_letters(dlq.schema):
        missing = [f.name for f in dead_letter.DEAD_LETTER_SCHEMA if f.name not in dlq.schema.names]
        print(f"error: {dlq.name} does not hold dead letters: "
              + (f"the columns {', '.join(missing)} are missing" if missing
                 else "its columns are not of the dead-letter types"), file=sys.stderr)
        return EXIT_USAGE
    app_id = f"{REDRIVE_APP} {dlq.name} consumer {args.consumer}"
    key = app_txn((app_id, 0))[0]
    destinations: dict[str, Any] = {}
    report: dict[str, Any] = {"address": dlq.name, "consumer": args.consumer,
                              "selector": args.selector, "messages": 0, "dropped": 0,
                              "destinations": {}}

    def destination(name: str) -> Any:
        if name not in destinations:
            destinations[name] = q.address(name, create=args.to is not None)
        return destinations[name]

    def send(batch: pa.Table, after: int) -> None:
        targets = ([args.to] * batch.num_rows if args.to is not None
                   else batch.column(dead_letter.ORIGIN_ADDRESS).to_pylist())
        seqs = batch.column(SEQ).to_pylist()
        for name in dict.fromkeys(targets):
            dst = destination(name)
            done = dst.state.txns.get(key, -1)  # sent there by an earlier run, below it
            rows = [i for i, (t, s) in enumerate(zip(targets, seqs, strict=True))
                    if t == name and s >= done]
            if not rows:
                continue
            parts = [table for _, table in dead_letter.messages(batch.take(rows))]
            table = pa.concat_tables(parts, promote_options="default")
            result = dst.send(table, txn=(app_id, after))
            report["messages"] += result.count
            report["dropped"] += table.num_rows if result.dropped else 0
            counts = report["destinations"]
            counts[name] = counts.get(name, 0) + result.count

    try:
        with dlq.consumer(args.consumer, selector=args.selector) as c:
            _send_through(c, args, f"redrive {dlq.name}", dlq.snapshot().end, send)
    except (DurableQueueError, ValueError) as exc:
        print(f"error: {exc}; {report['messages']} dead letters were sent back before it",
              file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError | TypeError) else EXIT_FAILED
    where = ", ".join(f"{n} to {name}" for name, n in report["destinations"].items())
    emit(args, report, f"redrove {report['messages']} dead letters from {dlq.name}"
          + (f" ({where})" if where else "")
          + (f"; {report['dropped']} dropped (address full)" if report["dropped"] else ""))
    return 0
