"""Dead letters: the rows a consumer gave up on, as rows of a dead-letter address.

A row nacked after ``max_delivery_attempts`` deliveries goes to the address's
``dead_letter_address`` (Artemis' names; SQS's ``maxReceiveCount`` and redrive policy). One
dead-letter address may serve addresses of different schemas (Artemis' usual ``DLQ``), so a
dead letter keeps its origin's row whole as Arrow IPC bytes beside columns that say where it
came from and why::

    origin_address    string   the address it was sent to
    origin_consumer   string   the consumer that gave up on it
    origin_seq        int64    its _seq there
    origin_timestamp  timestamp[us, UTC]   its _timestamp there
    delivery_count    int32    how many times it was delivered
    reason            string   why it was dead-lettered
    message           binary   the row's own columns: an Arrow IPC stream of one row

Selectors on a dead-letter address see the origin columns (``origin_address = 'orders'``);
:func:`messages` turns dead letters back into their origin's rows, which is what ``redrive``
sends.

The move is never lost and never stored twice (see ``Consumer._dead_letter``): the consumer
writes its intent in its window (the rows, and the move's number), appends the dead letters
under the transaction key :func:`move_key` (origin, consumer, move number), then settles the
rows. A crash between the two repeats the append, which the key makes a duplicate.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from .._format.schema import RESERVED_COLUMNS, SEQ, TIMESTAMP, TIMESTAMP_TYPE

__all__ = ["DEAD_LETTER_SCHEMA", "MESSAGE", "ORIGIN_ADDRESS", "is_dead_letters", "letters",
           "message_row", "messages", "move_key"]

ORIGIN_ADDRESS = "origin_address"
MESSAGE = "message"

#: The columns of a dead-letter address.
DEAD_LETTER_SCHEMA = pa.schema([
    pa.field(ORIGIN_ADDRESS, pa.string(), nullable=False),
    pa.field("origin_consumer", pa.string(), nullable=False),
    pa.field("origin_seq", pa.int64(), nullable=False),
    pa.field("origin_timestamp", TIMESTAMP_TYPE, nullable=False),
    pa.field("delivery_count", pa.int32(), nullable=False),
    pa.field("reason", pa.string(), nullable=False),
    pa.field(MESSAGE, pa.binary(), nullable=False),
])

#: The namespace of dead-letter moves among the commit log's transaction keys (``_log/txn.py``).
KEY_PREFIX = "dead-letter:"


def move_key(origin: str, consumer: str, move: int) -> tuple[str, int]:
    """The transaction key of consumer ``consumer`` of ``origin``'s ``move``-th dead-letter
    move, in the dead-letter address's log (versions of one key only rise: moves are numbered
    in order, and a move is finished before the next starts)."""
    return f"{KEY_PREFIX}{origin}/{consumer}", move


def letters(origin: str, consumer: str, rows: pa.Table, counts: dict[int, int],
            reason: str) -> pa.Table:
    """The dead letters of ``rows`` (read from ``origin``, with ``_seq`` and ``_timestamp``):
    ``counts`` maps each ``_seq`` to its delivery count."""
    own = rows.select([name for name in rows.column_names if name not in RESERVED_COLUMNS])
    own = own.replace_schema_metadata(None)
    payloads = []
    for i in range(own.num_rows):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, own.schema) as writer:
            writer.write_table(own.take([i]))  # a copy: a slice would carry its page
        payloads.append(sink.getvalue().to_pybytes())
    seqs = rows.column(SEQ).to_pylist()
    n = rows.num_rows
    return pa.table([
        pa.array([origin] * n, pa.string()),
        pa.array([consumer] * n, pa.string()),
        rows.column(SEQ).cast(pa.int64()),
        rows.column(TIMESTAMP).cast(TIMESTAMP_TYPE),
        pa.array([counts[s] for s in seqs], pa.int32()),
        pa.array([reason] * n, pa.string()),
        pa.array(payloads, pa.binary()),
    ], schema=DEAD_LETTER_SCHEMA)


def messages(dead: pa.Table) -> list[tuple[str, pa.Table]]:
    """The origin rows of dead letters, grouped by origin address in the order they come:
    ``[(origin, table of its rows), ...]``.

    Raises
    ------
    ValueError
        ``dead`` is not a table of dead letters (names what is missing or unreadable).
    """
    missing = [f.name for f in DEAD_LETTER_SCHEMA if f.name not in dead.column_names]
    if missing:
        raise ValueError(f"not dead letters: the columns {', '.join(missing)} are missing")
    groups: dict[str, list[pa.Table]] = {}
    origins = dead.column(ORIGIN_ADDRESS).to_pylist()
    seqs = dead.column(SEQ).to_pylist() if SEQ in dead.column_names else [None] * len(origins)
    for origin, payload, seq in zip(origins, dead.column(MESSAGE).to_pylist(), seqs,
                                    strict=True):
        try:
            table = pa.ipc.open_stream(payload).read_all()
        except (pa.ArrowInvalid, TypeError) as exc:
            where = "" if seq is None else f" (_seq {seq})"
            raise ValueError(f"the message of a dead letter{where} is not an Arrow IPC "
                             f"stream: {exc}") from exc
        groups.setdefault(origin, []).append(table)
    return [(origin, _concat(tables)) for origin, tables in groups.items()]


def is_dead_letters(schema: pa.Schema | None) -> bool:
    """Whether an address of ``schema`` holds dead letters."""
    return schema is not None and all(
        f.name in schema.names and schema.field(f.name).type == f.type
        for f in DEAD_LETTER_SCHEMA)


def message_row(payload: bytes) -> dict[str, Any]:
    """A dead letter's own row (its ``message`` column) as a dict; an unreadable one as
    ``{"unreadable": why}``, so that looking at a damaged dead letter never fails."""
    try:
        rows = pa.ipc.open_stream(payload).read_all().to_pylist()
    except (pa.ArrowInvalid, TypeError) as exc:
        return {"unreadable": str(exc)}
    return rows[0] if len(rows) == 1 else {"rows": rows}


def _concat(tables: list[pa.Table]) -> pa.Table:
    """Rows of one origin; their schemas differ when the origin's schema grew between them."""
    return pa.concat_tables(tables, promote_options="default")

