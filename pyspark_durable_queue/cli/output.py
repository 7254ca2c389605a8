"""What every ``durablequeue`` command shares: its exit statuses and how it prints.

``cli.main`` maps errors to the exit statuses; the commands (:mod:`.commands`, :mod:`.data`)
print their results with `emit` (text, or JSON with ``--json``), `format_table` and `print_rows`,
and show how far a long one is with `progress` (a tqdm bar on standard error, only on a
terminal).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

EXIT_FAILED, EXIT_USAGE = 1, 2  # and 0 for success


def json_default(value: Any) -> Any:
    """JSON for what ``json`` cannot write: times in ISO 8601, bytes in hex, the rest as text."""
    if isinstance(value, _dt.datetime | _dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "as_tuple"):  # Decimal
        return str(value)
    return str(value)


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print a command's result: ``data`` as JSON with ``--json`` (one line with ``--compact``),
    else ``text``."""
    if args.json:
        print(json.dumps(data, default=json_default, indent=None if args.compact else 2))
    else:
        print(text)


def format_table(rows: list[list[Any]], header: list[str]) -> str:
    """``rows`` under ``header`` in left-aligned columns."""
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in cells)


def print_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Messages as JSON lines (with ``--json``, ASCII only); flushed, so that a caller that
    acknowledges after printing acknowledges only what reached standard output."""
    for row in rows:
        print(json.dumps(row, default=json_default, ensure_ascii=args.json))
    sys.stdout.flush()


class Progress:
    """How far a long command is: a tqdm bar on standard error, or nothing (``bar`` None).

    Two ways to move it: `advance` by an amount, or `reached` (done, total), the form of the
    engine's ``progress`` callbacks (``verify_pages``, ``Cleaner.cleanup``), which learn the
    total only as they go."""

    def __init__(self, bar: Any = None) -> None:
        self.bar = bar

    def advance(self, n: int) -> None:
        if self.bar is not None and n:
            self.bar.update(n)

    def reached(self, done: int, total: int | None) -> None:
        if self.bar is None:
            return
        if total is not None and done > total:  # more came in than there was at the start
            total = done
        if self.bar.total != total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)


@contextmanager
def progress(args: argparse.Namespace, what: str, total: int | None, unit: str = "msg", *,
             quiet: bool = False) -> Iterator[Progress]:
    """A progress bar for the block, drawn on standard error (standard output carries the
    command's data and result) only when standard error is a terminal and neither ``--json``
    nor ``quiet`` is set; else a `Progress` that does nothing. ``unit`` ``"B"`` counts bytes
    (KiB, MiB...); ``total`` None shows a count and a rate without a percentage.

    The bar appears after half a second (a quick command draws nothing) and is erased at the
    end, where the command prints its result. tqdm is imported here, only when a bar is drawn,
    so that importing the client does not import it.
    """
    if quiet or args.json or not sys.stderr.isatty():
        yield Progress()
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=what, unit=unit, unit_scale=True, file=sys.stderr,
               leave=False, delay=0.5, dynamic_ncols=True,
               unit_divisor=1024 if unit == "B" else 1000)
    try:
        yield Progress(bar)
    finally:
        bar.close()
