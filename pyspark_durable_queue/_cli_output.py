"""What every ``durablequeue`` command shares: its exit statuses and how it prints.

``cli.main`` maps errors to the exit statuses; the commands (``_cli_commands``, ``_cli_data``)
print their results with `emit` (text, or JSON with ``--json``), `format_table` and `print_rows`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
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
