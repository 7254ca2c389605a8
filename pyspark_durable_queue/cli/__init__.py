"""``durablequeue``: the operator's command-line tool (no Spark needed).

This package: argument parsing, global options, dispatch and exit statuses here; the commands
that inspect and manage in :mod:`.commands`, the streaming data movement in :mod:`.data`, what
every command shares (exit statuses, printing, progress bars) in :mod:`.output`. The console
script is ``pyspark_durable_queue.cli:main``; ``python -m pyspark_durable_queue`` and
``python -m pyspark_durable_queue.cli`` run it too.

Examples::

    durablequeue /data/dq addresses
    durablequeue /data/dq stats orders --json
    durablequeue /data/dq stats orders --watch 5    # live, every 5 s: rates, backlog, oldest age
    durablequeue /data/dq consumers orders
    durablequeue /data/dq metrics --port 9108   # Prometheus: http://127.0.0.1:9108/metrics
    durablequeue /data/dq pages orders
    durablequeue /data/dq browse orders --from 1000 --limit 20 --selector "region = 'EU'"
    durablequeue /data/dq verify orders
    durablequeue /data/dq repair orders             # dry run: prints what would be set aside
    durablequeue /data/dq repair orders --apply
    durablequeue /data/dq cleanup orders            # dry run: prints what would go
    durablequeue /data/dq cleanup orders --apply
    durablequeue /data/dq compact orders --apply     # few full pages from many small ones
    durablequeue /data/dq send orders < messages.jsonl
    durablequeue /data/dq send orders --delay-ms 60000 < messages.jsonl   # appended in a minute
    durablequeue /data/dq scheduled orders          # scheduled sends: due time, rows, file
    durablequeue /data/dq scheduled orders --cancel 00000001795815676454-...-2
    durablequeue /data/dq consumer create orders billing --selector "region = 'EU'" --start latest
    durablequeue /data/dq consumer seek orders billing 2026-11-23T10:00:00Z
    durablequeue /data/dq consumer delete orders billing
    durablequeue /data/dq count orders --selector "region = 'EU'"
    durablequeue /data/dq receive orders --consumer billing --ack --limit 1000 > batch.jsonl
    durablequeue /data/dq export orders orders.parquet --from 1000 --to 2000
    durablequeue /data/dq import orders-copy orders.parquet
    durablequeue /data/dq transfer orders.dlq orders --consumer retry
    durablequeue /data/dq redrive DLQ --selector "origin_address = 'orders'"
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
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._ops.repair import DEFAULT_GRACE_MS
from .._options import storage_value
from .._positions import ReadPosition, position_value
from ..errors import DurableQueueError
from ..queue import DurableQueue
from .commands import (
    cmd_addresses,
    cmd_browse,
    cmd_cleanup,
    cmd_compact,
    cmd_consumer_create,
    cmd_consumer_delete,
    cmd_consumer_seek,
    cmd_consumers,
    cmd_count,
    cmd_delete_address,
    cmd_expire,
    cmd_metrics,
    cmd_pages,
    cmd_receive,
    cmd_repair,
    cmd_scheduled,
    cmd_send,
    cmd_settings,
    cmd_stats,
    cmd_verify,
)
from .data import cmd_export, cmd_import, cmd_redrive, cmd_transfer
from .output import EXIT_FAILED, EXIT_USAGE

__all__ = ["main"]


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


def position(text: str) -> ReadPosition | _dt.datetime:
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


def seconds(text: str) -> float:
    """A number of seconds > 0 given on the command line."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def port(text: str) -> int:
    """A TCP port given on the command line (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return value


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


def nonnegative_ms(text: str) -> int:
    """A number of milliseconds >= 0 given on the command line."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds >= 0")
    return int(text)


def setting(item: str) -> tuple[str, str]:
    """Parse one ``--set KEY=VALUE`` (checked against the option table by the command)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{item!r} is not KEY=VALUE")
    return key.strip(), value.strip()


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


#: Adds a command (name, help text) with the global options and returns its parser.
AddCommand = Callable[[str, str], argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser; read a command line with `parse_args`, which also joins the
    ``-o`` options given after the command to those given before it.

    The commands are added one group at a time, in the order ``--help`` lists them."""
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

    _add_inspection_commands(command)
    _add_maintenance_commands(command)
    sp = command("send", "send JSON lines from standard input")
    sp.add_argument("address")
    sp.add_argument("--delay-ms", type=nonnegative_ms, default=None, metavar="MS",
                    help="scheduled delivery: append them this many milliseconds from now")
    sp.add_argument("--ttl-ms", type=positive, default=None, metavar="MS",
                    help="time to live: they expire this many milliseconds after they are "
                         "appended (never delivered after)")
    sp = command("scheduled", "list scheduled sends not yet appended; --cancel removes one")
    sp.add_argument("address")
    sp.add_argument("--cancel", default=None, metavar="ID",
                    help="remove this scheduled send (its id as listed); exit status 1 when "
                         "it is gone")
    _add_consumer_command(sub)
    _add_reading_commands(command)
    _add_data_movement_commands(command)
    _add_address_commands(command)
    _add_metrics_command(command)
    return p


def _add_inspection_commands(command: AddCommand) -> None:
    """``addresses``, ``stats``, ``consumers``, ``pages``, ``verify``, ``browse``: look, change
    nothing."""
    command("addresses", "list addresses")
    sp = command("stats", "counts, backlog, settings")
    sp.add_argument("address")
    sp.add_argument("--watch", nargs="?", type=seconds, const=True, default=None,
                    metavar="SECONDS",
                    help="a live view: send rate, and per consumer backlog, oldest unsettled "
                         "message, in flight and acknowledgement rate, refreshed every SECONDS "
                         "(default: --interval) until interrupted")
    sp.add_argument("--interval", type=seconds, default=1.0,
                    help="seconds between views of --watch (default: %(default)s)")
    sp.add_argument("--count", type=positive, default=None,
                    help="stop after this many views")
    for name, helptext in (("consumers", "consumers"), ("pages", "live page files"),
                           ("verify", "check every checksum")):
        command(name, helptext).add_argument("address")
    sp = command("browse", "print messages without consuming them")
    sp.add_argument("address")
    sp.add_argument("--from", dest="start", type=int, default=None, help="first _seq")
    sp.add_argument("--limit", type=int, default=20)
    sp.add_argument("--selector", default=None)


def _add_maintenance_commands(command: AddCommand) -> None:
    """``cleanup``, ``compact``, ``repair``: each a dry run unless ``--apply``."""
    sp = command("cleanup", "remove consumed and orphan pages (dry run by default)")
    sp.add_argument("address")
    sp.add_argument("--apply", action="store_true", help="really remove")
    sp = command("compact", "rewrite runs of small pages as full pages (dry run by default)")
    sp.add_argument("address")
    sp.add_argument("--apply", action="store_true", help="really rewrite")
    sp.add_argument("--max-bytes", type=positive, default=None,
                    help="stop after about this many bytes of small pages")
    command("expire", "move the messages that expired to the address's expiry_address now "
                      "(cleanup also does it before it removes pages)").add_argument("address")
    sp = command("repair", "set aside a damaged last log entry and damaged pages "
                           "(dry run by default)")
    sp.add_argument("address")
    sp.add_argument("--apply", action="store_true", help="really do it")
    sp.add_argument("--grace-ms", type=int, default=DEFAULT_GRACE_MS,
                    help="age before a damaged last log entry counts as abandoned "
                         "(default: %(default)s)")


def _add_consumer_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``consumer create|delete|seek ADDRESS NAME``: the global options go with the verb."""
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


def _add_reading_commands(command: AddCommand) -> None:
    """``count`` and ``receive``: messages as a consumer (or a selector) sees them."""
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


def _add_data_movement_commands(command: AddCommand) -> None:
    """``export``, ``import``, ``transfer``, ``redrive``: messages streamed to a file, from a
    file, to another address, or dead letters back where they came from (:mod:`.data`)."""
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
    sp = command("redrive", "send dead letters back to the addresses they came from, "
                            "each once")
    sp.add_argument("address", help="a dead-letter address")
    sp.add_argument("--to", default=None, metavar="ADDRESS",
                    help="send them all to this address instead (created when missing)")
    sp.add_argument("--selector", default=None,
                    help="only the dead letters it matches, on their columns (origin_address, "
                         "origin_consumer, origin_seq, delivery_count, reason)")
    sp.add_argument("--consumer", default="redrive",
                    help="the consumer of the dead-letter address that takes them (default: "
                         "%(default)s); its acknowledgements make a redrive resumable")
    sp.add_argument("--batch-size", type=positive, default=10_000,
                    help="dead letters per commit (default: %(default)s)")


def _add_metrics_command(command: AddCommand) -> None:
    """``metrics``: Prometheus metrics of every address, served over HTTP."""
    sp = command("metrics", "serve Prometheus metrics of every address and consumer at "
                            "/metrics until interrupted")
    sp.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default: %(default)s; 0.0.0.0 for every "
                         "interface)")
    sp.add_argument("--port", type=port, default=9108,
                    help="port to listen on (default: %(default)s; 0: a free one, printed)")


def _add_address_commands(command: AddCommand) -> None:
    """``settings`` and ``delete-address``: an address's settings and its end."""
    sp = command("settings", "show an address's settings; --set changes them")
    sp.add_argument("address")
    sp.add_argument("--set", type=setting, action="append", metavar="KEY=VALUE",
                    help="change a setting (repeatable): a Python key, Spark option or alias, "
                         "e.g. max_size_bytes=1GiB or addressFullPolicy=BLOCK")
    sp = command("delete-address", "delete an address with its messages and consumers")
    sp.add_argument("address")
    sp.add_argument("--yes", action="store_true", help="really delete (refused without it)")


def _watch_before_address(argv: list[str]) -> list[str]:
    """``stats --watch ADDR`` as it was written before ``--watch`` took SECONDS: a ``--watch``
    followed by a word that is not a number of seconds goes after that word."""
    argv = list(argv)
    for i in range(len(argv) - 1):
        if argv[i] == "--watch" and not argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                argv[i], argv[i + 1] = argv[i + 1], argv[i]
    return argv


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line ``argv`` (``sys.argv[1:]`` when None); usage errors exit with 2.

    ``storage_option`` holds every ``-o`` in command-line order, those before the command first,
    so a key given twice takes its last value."""
    args = build_parser().parse_args(_watch_before_address(
        sys.argv[1:] if argv is None else list(argv)))
    after = vars(args).pop(_OPTIONS_AFTER_COMMAND, [])
    args.storage_option = [*args.storage_option, *after]
    return args


COMMANDS = {"addresses": cmd_addresses, "stats": cmd_stats, "consumers": cmd_consumers,
            "pages": cmd_pages, "browse": cmd_browse, "verify": cmd_verify,
            "cleanup": cmd_cleanup, "expire": cmd_expire, "compact": cmd_compact,
            "repair": cmd_repair, "send": cmd_send,
            "scheduled": cmd_scheduled,
            "consumer create": cmd_consumer_create, "consumer delete": cmd_consumer_delete,
            "consumer seek": cmd_consumer_seek, "settings": cmd_settings,
            "delete-address": cmd_delete_address, "count": cmd_count,
            "receive": cmd_receive, "export": cmd_export, "import": cmd_import,
            "transfer": cmd_transfer, "redrive": cmd_redrive,
            "metrics": cmd_metrics}


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
