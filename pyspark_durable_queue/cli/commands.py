"""The ``durablequeue`` commands that inspect and manage a store: list addresses, stats (also
``--watch``, a live view), consumers, metrics (Prometheus, served over HTTP), pages, browse,
count, receive, verify, repair, cleanup, compact, send, scheduled (list or cancel scheduled
sends), consumer create/delete/seek, settings, delete-address.

Each ``cmd_*`` takes the open store and the parsed command line and returns the exit status;
``cli.COMMANDS`` dispatches to them. The data movement commands (export, import, transfer) are
in :mod:`.data`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from dataclasses import asdict
from typing import Any

from .._format.schema import compile_selector
from .._ops import dead_letter
from .._ops.repair import PageProblem, journal_damage, verify_metadata, verify_pages
from .._ops.verify_shared import verify_shared_states
from .._options import parse_options
from ..errors import DamagedLogError
from ..queue import DurableQueue
from ..settings import HANDLE_KEYS
from .output import (
    EXIT_FAILED,
    EXIT_USAGE,
    emit,
    format_table,
    json_default,
    print_rows,
    progress,
)


def cmd_addresses(q: DurableQueue, args: argparse.Namespace) -> int:
    out = []
    for name in q.addresses():
        s = q.address(name, create=False).stats()
        out.append({k: s[k] for k in ("address", "messages", "bytes", "pages", "first_seq",
                                      "next_seq", "dropped_messages")}
                   | {"consumers": len(s["consumers"])})
    rows = [[o["address"], o["messages"], o["bytes"], o["pages"], o["consumers"],
             o["dropped_messages"]] for o in out]
    emit(args, out, format_table(rows, ["address", "messages", "bytes", "pages", "consumers",
                                   "dropped"]) if out else "no addresses")
    return 0


def cmd_stats(q: DurableQueue, args: argparse.Namespace) -> int:
    if args.watch is not None:
        return _watch(q, args)
    s = q.address(args.address, create=False).stats()
    lines = [f"{k}: {s[k]}" for k in ("address", "messages", "bytes", "pages", "first_seq",
                                      "next_seq", "commits", "dropped_messages",
                                      "dropped_bytes", "retention_removed_messages",
                                      "lost_messages")]
    lines.append(f"expired_messages: {s.get('expired_messages', 0)}")
    lines.append(f"expired_removed_messages: {s.get('expired_removed_messages', 0)}")
    lines.append(f"expired_moved_messages: {s.get('expired_moved_messages', 0)}")
    lines.append(f"scheduled_messages: {s.get('scheduled_messages', 0)}")
    lines.append(f"oldest message: {_age(s['oldest_message_age_ms'])} old")
    lines.append("schema: " + (s["schema"] or "(none yet)").replace("\n", ", "))
    lines.append("settings: " + ", ".join(f"{k}={v}" for k, v in s["settings"].items()))
    now_ms = int(time.time() * 1000)
    for name, c in s["consumers"].items():
        lines.append(f"consumer {name}: position {c['position']}, backlog "
                     f"{c['backlog_messages']} messages / {c['backlog_bytes']} bytes, oldest "
                     f"unsettled {_age(c['oldest_unsettled_age_ms'])} old, "
                     f"{c['in_flight']} in flight, {c['redelivery_pending']} waiting for "
                     f"redelivery, {c.get('dead_lettered', 0)} dead-lettered"
                     + (f", shared: {c['leased']} leased to {c['handles']} handle(s), first "
                        f"lease runs out {_lease_left(c['first_lease_expiry_ms'], now_ms)}"
                        if c.get("shared") else "")
                     + (f", selector {c['selector']!r}" if c["selector"] else ""))
    emit(args, s, "\n".join(lines))
    return 0


def _age(ms: int) -> str:
    """An age in milliseconds for people: ``850 ms``, ``12.5 s``, ``3.2 h``."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:.1f} {unit}"
    return f"{ms} ms"


def _watch(q: DurableQueue, args: argparse.Namespace) -> int:
    """``stats --watch [SECONDS]``: the address's counts and send rate, and per consumer its
    backlog, the age of its oldest unsettled message, what it has in flight and how fast it
    acknowledges (its ack point's change per second), every SECONDS (or ``--interval``) until
    interrupted (or ``--count`` views). Rates are the change of a counter between two views
    divided by the time between them (the first view has none). On a terminal each view
    replaces the last; else (or with ``--json``: one JSON line per view) the views follow one
    another."""
    interval = args.interval if args.watch is True else args.watch
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
                "oldest_message_age_ms": s["oldest_message_age_ms"],
                "dropped_messages": s["dropped_messages"],
                "retention_removed_messages": s["retention_removed_messages"],
                "expired_messages": s.get("expired_messages", 0),
                "expired_removed_messages": s.get("expired_removed_messages", 0),
                "expired_moved_messages": s.get("expired_moved_messages", 0),
                "consumers": {}}
            for name, c in s["consumers"].items():
                view["consumers"][name] = {
                    "position": c["position"], "ack_point": c["ack_point"],
                    "backlog_messages": c["backlog_messages"],
                    "backlog_bytes": c["backlog_bytes"],
                    "oldest_unsettled_age_ms": c["oldest_unsettled_age_ms"],
                    "in_flight": c["in_flight"],
                    "redelivery_pending": c["redelivery_pending"],
                    "dead_lettered": c.get("dead_lettered", 0),
                    "ack_rate": _rate(last, now, lambda t, n=name: t["consumers"].get(
                        n, {}).get("ack_point"), c["ack_point"])}
                if c.get("shared"):
                    view["consumers"][name].update(
                        shared=True, leased=c["leased"], handles=c["handles"],
                        first_lease_expiry_ms=c["first_lease_expiry_ms"])
            if args.json:
                print(json.dumps(view))  # one line per view, --compact or not
            else:
                rows = [[n, c["position"], c["backlog_messages"], c["backlog_bytes"],
                         _per_second(c["ack_rate"]), _age(c["oldest_unsettled_age_ms"]),
                         c["in_flight"], c["redelivery_pending"], c["dead_lettered"]]
                        for n, c in view["consumers"].items()]
                header = ["consumer", "position", "backlog", "backlog_bytes", "acks/s",
                          "oldest", "in_flight", "nacked", "dead"]
                if any(c.get("shared") for c in view["consumers"].values()):
                    wall_ms = int(time.time() * 1000)
                    for row, c in zip(rows, view["consumers"].values(), strict=True):
                        row += _shared_columns(c, wall_ms)
                    header += ["shared", "leased", "handles", "first_lease_expiry"]
                text = (f"{view['address']}: {view['messages']} messages, {view['bytes']} bytes,"
                        f" next _seq {view['next_seq']}, sending "
                        f"{_per_second(view['send_rate'])}, oldest "
                        f"{_age(view['oldest_message_age_ms'])}\n"
                        + (format_table(rows, header) if rows else "no consumers"))
                print(("\x1b[H\x1b[2J" if redraw else "") + text + ("" if redraw else "\n"))
            sys.stdout.flush()
            shown += 1
            if args.count and shown >= args.count:
                return 0
            last = (now, {"next_seq": s["next_seq"], "consumers": s["consumers"]})
            time.sleep(interval)
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
    """``consumers ADDR``: a row per consumer; with a shared consumer among them, the
    columns of shared consumers too (its leased rows, handles, and when its first lease runs
    out)."""
    s = q.address(args.address, create=False).stats()["consumers"]
    rows = [[n, c["position"], c["backlog_messages"], c["backlog_bytes"],
             c["redelivery_pending"], c["redelivery_delayed"], c["max_delivery_count"],
             c["in_flight"], _age(c["oldest_unsettled_age_ms"]).replace(" ", ""),
             c["dead_lettered"] + c["dead_letters_dropped"], c["selector"] or ""]
            for n, c in s.items()]
    header = ["consumer", "position", "backlog", "backlog_bytes", "nacked", "delayed",
              "max_deliveries", "in_flight", "oldest", "dead_lettered", "selector"]
    if any(c.get("shared") for c in s.values()):
        now_ms = int(time.time() * 1000)
        for row, c in zip(rows, s.values(), strict=True):
            row[-1:-1] = _shared_columns(c, now_ms)
        header[-1:-1] = ["shared", "leased", "handles", "first_lease_expiry"]
    emit(args, s, format_table(rows, header) if rows else "no consumers")
    return 0


def _shared_columns(c: dict[str, Any], now_ms: int) -> list[Any]:
    """A consumer's shared, leased, handles and first-lease-expiry columns (blank for an
    exclusive consumer; the expiry as the time left, ``-`` without leases)."""
    if not c.get("shared"):
        return ["", "", "", ""]
    return ["yes", c["leased"], c["handles"], _lease_left(c["first_lease_expiry_ms"], now_ms)]


def _lease_left(expiry_ms: int | None, now_ms: int) -> str:
    """When a lease runs out, for people: ``in 29.5s``, ``1.2s ago``, ``-`` without one."""
    if expiry_ms is None:
        return "-"
    left = expiry_ms - now_ms
    text = _age(abs(left)).replace(" ", "")
    return f"in {text}" if left >= 0 else f"{text} ago"


def cmd_metrics(q: DurableQueue, args: argparse.Namespace) -> int:
    """``metrics``: serve Prometheus metrics until interrupted (see
    :mod:`pyspark_durable_queue.metrics`); prints the URL once it listens."""
    from ..metrics import serve  # prometheus_client loads only for this command

    def ready(url: str) -> None:
        print(f"serving the metrics of {q.storage.url} at {url}", flush=True)

    try:
        serve(args.root, args.host, args.port, storage_options=dict(args.storage_option),
              ready=ready)
    except KeyboardInterrupt:
        return 0
    except OSError as exc:  # the port is taken, the host is not ours
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_pages(q: DurableQueue, args: argparse.Namespace) -> int:
    idx = q.address(args.address, create=False).state.pages
    out = [{"name": idx.names[i], "first_seq": idx.seq[i], "last_seq": idx.ends[i] - 1,
            "rows": idx.rows[i], "bytes": idx.bytes[i],
            "committed": _dt.datetime.fromtimestamp(idx.ts[i] / 1e6, _dt.timezone.utc)}
           for i in range(len(idx))]
    rows = [[o["name"], o["first_seq"], o["last_seq"], o["rows"], o["bytes"],
             json_default(o["committed"])[:19]] for o in out]
    emit(args, out, format_table(rows, ["page", "first_seq", "last_seq", "rows", "bytes",
                                   "committed"]) if rows else "no pages")
    return 0


def cmd_browse(q: DurableQueue, args: argparse.Namespace) -> int:
    a = q.address(args.address, create=False)
    snapshot = a.snapshot()
    if snapshot.schema is None:
        emit(args, [], "no messages")
        return 0
    selector = compile_selector(args.selector, snapshot.schema) if args.selector else None
    start = snapshot.first_seq if args.start is None else args.start
    shown = 0
    rows: list[dict[str, Any]] = []
    letters = dead_letter.is_dead_letters(snapshot.schema)
    for batch, _ in snapshot.messages(start, selector=selector):
        if batch is None:
            continue
        for row in batch.slice(0, args.limit - shown).to_pylist():
            if letters:  # the dead letter's own row, readable, beside why it is here
                row[dead_letter.MESSAGE] = dead_letter.message_row(row[dead_letter.MESSAGE])
            rows.append(row)
        shown = len(rows)
        if shown >= args.limit:
            break
    print_rows(args, rows)
    return 0


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
        count, at = 0, snapshot.first_seq
        with progress(args, f"count {a.name}", snapshot.end - at) as bar:
            for batch, after in snapshot.messages(at, selector=selector):
                count += 0 if batch is None else batch.num_rows
                bar.advance(after - at)  # messages examined, matching or not
                at = after
    emit(args, {"address": a.name, "messages": count, "selector": args.selector}, str(count))
    return 0


#: Messages per receive of ``durablequeue receive`` (and per acknowledgement with ``--ack``).
RECEIVE_BATCH = 10_000


def cmd_receive(q: DurableQueue, args: argparse.Namespace) -> int:
    """Print up to ``--limit`` messages of a consumer as JSON lines; ``--ack`` acknowledges
    each batch once it is printed (at-least-once: a crash between the two prints it again)."""
    a = q.address(args.address, create=False)
    with a.consumer(args.consumer, create=False) as c:
        left = args.limit
        while left > 0:
            batch = c.receive(max_messages=min(left, RECEIVE_BATCH))
            rows = batch.to_pylist()
            print_rows(args, rows)
            if args.ack:
                c.ack(batch)  # an empty batch too: it passes the unmatched messages examined
            if not rows:
                break
            left -= len(rows)
    return 0
def cmd_verify(q: DurableQueue, args: argparse.Namespace) -> int:
    """Read every live page and check every frame's checksum; report missing and orphans."""
    a = q.address(args.address, create=False)
    try:
        state = a.state
    except DamagedLogError as exc:
        report: dict[str, Any] = {"address": a.name, "ok": False, "log": str(exc)}
        emit(args, report, f"{a.name}: the commit log is damaged: {exc}\nPROBLEMS FOUND")
        return EXIT_FAILED
    with progress(args, f"verify {a.name}", sum(state.pages.bytes), "B") as bar:
        checked, problems = verify_pages(a.storage, a.layout, state, progress=bar.reached)
    metadata, damaged = verify_metadata(a.storage, a.layout, a.log,
                                        checksums=a.format.checksums)
    problems += damaged
    shared_files, damaged, notes = verify_shared_states(a.storage, a.layout)
    metadata += shared_files
    problems += damaged
    consumers = a.registry.all()
    journal = journal_damage(a.log, state, [int(c["position"]) for c in consumers.values()])
    if journal is not None:  # the readable part of the journal ends there
        problems.insert(0, PageProblem(journal.where, "damaged journal", journal.lost[0],
                                       journal.lost[1] - journal.lost[0], journal.reason))

    unlisted = a.cleanup(dry_run=True, now=float("inf")).orphans
    retired = {name for name, *_ in state.retired}
    orphans = [n for n in unlisted if n not in retired]
    replaced = [n for n in unlisted if n in retired]
    report = {"address": a.name, "pages_checked": checked, "metadata_files_checked": metadata,
              "metadata_checksums": a.format.checksums,
              "problems": [asdict(p) for p in problems], "unpublished_files": orphans,
              "replaced_files": replaced, "notes": notes, "ok": not problems}
    lines = [f"{a.name}: {checked} of {len(state.pages)} pages verified, {metadata} metadata "
             "files read" + ("" if a.format.checksums else
                             f" (format {int(a.format)}: metadata has no checksums, so only "
                             "files that do not parse are found)")]
    lines += [f"  {p.page}: {p.problem}" + (f" {p.detail}" if p.detail else "")
              for p in problems]
    lines += [f"  note: {note}" for note in notes]
    if orphans:
        lines.append(f"  {len(orphans)} unpublished page files (orphans or in-flight writes)")
    if replaced:
        lines.append(f"  {len(replaced)} files compaction replaced (cleanup deletes them "
                     "after compactGraceMs)")
    if problems:
        lines.append(f"PROBLEMS FOUND (`durablequeue {args.root} repair {a.name}` shows what "
                     "repair would do)")
    else:
        lines.append("OK")
    emit(args, report, "\n".join(lines))
    return 0 if not problems else EXIT_FAILED


def cmd_repair(q: DurableQueue, args: argparse.Namespace) -> int:
    """Set aside a damaged last log entry and damaged pages (dry run unless --apply)."""
    a = q.address(args.address, create=False)
    with progress(args, f"verify {a.name}", None, "B") as bar:
        report = a.repair(dry_run=not args.apply, grace_ms=args.grace_ms, progress=bar.reached)
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
    if report.journal_damage is not None:
        d = report.journal_damage
        lost = (f"_seq {d.lost[0]}..{d.lost[1] - 1} are lost" if d.lost[1] > d.lost[0] else
                "it held no messages" if d.known else
                "how many messages it held cannot be told")
        kept = "; the units after it are kept" if d.units_after else ""
        lines.append(f"  {would} {d.bytes} damaged bytes of the journal at {d.where} (where "
                     f"commit {d.version} should be: {d.reason}): {lost}{kept}")
    if report.journal_tail:
        lines.append(f"  {report.journal_tail} bytes of an unfinished commit after the "
                     f"journal's last one (a writer killed while writing it, or one writing "
                     f"now): never read; {'would be zeroed' if report.dry_run else 'zeroed'}")
    if report.clean:
        lines.append(f"  nothing to repair ({report.pages_checked} pages verified)")
    elif report.dry_run and not report.waiting:
        lines.append("(dry run: pass --apply to do it; files go to the address's damaged/ "
                     "folder, nothing is deleted)")
    emit(args, report.to_dict(), "\n".join(lines))
    return 0 if report.clean or not (report.dry_run or report.waiting) else EXIT_FAILED


def cmd_cleanup(q: DurableQueue, args: argparse.Namespace) -> int:
    a = q.address(args.address, create=False)
    with progress(args, f"cleanup {a.name}", None, "file") as bar:
        report = a.cleanup(dry_run=not args.apply, progress=bar.reached)
    verb = "would remove" if report.dry_run else ("archived" if report.archived else "removed")
    text = (f"{verb} {len(report.pages)} consumed pages ({report.bytes} bytes), "
            f"{len(report.orphans)} orphan pages and {len(report.log_files)} expired commit-log "
            "files" + ("\n(dry run: pass --apply to do it)" if report.dry_run else ""))
    emit(args, report.to_dict(), text)
    return 0


def cmd_expire(q: DurableQueue, args: argparse.Namespace) -> int:
    """``expire``: :meth:`Address.move_expired` now."""
    a = q.address(args.address, create=False)
    target = a.settings.expiry_address
    report = a.move_expired()
    if not target:
        text = (f"address {a.name} has no expiry_address: expired messages are never "
                "delivered and cleanup removes their pages; nothing to move")
    else:
        text = (f"moved {report.moved} expired messages to {target} in {report.moves} moves; "
                f"every message before _seq {report.cursor} was moved or passed")
    emit(args, {"address": a.name, "expiry_address": target, "moves": report.moves,
                "moved": report.moved, "cursor": report.cursor}, text)
    return 0


def cmd_compact(q: DurableQueue, args: argparse.Namespace) -> int:
    a = q.address(args.address, create=False)
    with progress(args, f"compact {a.name}", None, "B") as bar:
        report = a.compact(dry_run=not args.apply, max_bytes=args.max_bytes,
                           progress=bar.reached)
    verb = "would rewrite" if report.dry_run else "rewrote"
    into = "about " if report.dry_run else ""
    text = (f"{verb} {report.pages_before} small pages ({report.messages} messages, "
            f"{report.bytes_read} bytes) in {report.runs} runs into {into}"
            f"{report.pages_after} pages"
            + (f"; {report.abandoned} runs left as they were (changed by another process "
               "meanwhile)" if report.abandoned else "")
            + ("\n(dry run: pass --apply to do it)" if report.dry_run else ""))
    emit(args, report.to_dict(), text)
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
    result = q.address(args.address).send(rows, delay_ms=args.delay_ms,
                                          ttl_ms=getattr(args, "ttl_ms", None))
    if result.scheduled is not None:
        emit(args, {"first_seq": -1, "count": 0, "dropped": False,
                    "scheduled": result.scheduled, "rows": len(rows)},
             f"scheduled {len(rows)} messages as {result.scheduled}")
        return 0
    emit(args, {"first_seq": result.seq, "count": result.count, "dropped": result.dropped},
          f"sent {result.count} messages" + (f" from _seq {result.seq}" if result.count else "")
          + (" (dropped: address full)" if result.dropped else ""))
    return 0


def cmd_scheduled(q: DurableQueue, args: argparse.Namespace) -> int:
    """List an address's scheduled sends not yet appended (due time, rows, file), in the order
    they will be appended; ``--cancel ID`` removes one (exit status 1 naming it when it is gone:
    appended already, cancelled, or never there)."""
    a = q.address(args.address, create=False)
    if args.cancel is not None:
        if not a.cancel_scheduled(args.cancel):
            print(f"error: address {a.name} has no scheduled send {args.cancel!r}: it was "
                  "delivered or cancelled already, or the id is wrong (list them with "
                  f"`durablequeue ROOT scheduled {a.name}`)", file=sys.stderr)
            return EXIT_FAILED
        emit(args, {"address": a.name, "cancelled": args.cancel},
             f"cancelled scheduled send {args.cancel} of {a.name}")
        return 0
    out = a.scheduled()
    now_ms = time.time() * 1000
    rows = [[o["id"], json_default(o["due"])[:23],
             "due" if o["due_ms"] <= now_ms else "in " + _age(int(o["due_ms"] - now_ms)),
             o["rows"], o["file"]] for o in out]
    emit(args, out, format_table(rows, ["id", "due", "when", "rows", "file"]) if rows
         else f"no scheduled sends in {a.name}")
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
    emit(args, out, f"created consumer {c.name} of {a.name} at _seq {c.position}"
          + (f" with selector {c.selector_text!r}" if c.selector_text else ""))
    return 0


def cmd_consumer_delete(q: DurableQueue, args: argparse.Namespace) -> int:
    a = q.address(args.address, create=False)
    c = a.consumer(args.name, create=False)
    position = c.position
    c.delete()
    emit(args, {"address": a.name, "consumer": args.name, "deleted": True,
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
    emit(args, {"address": a.name, "consumer": c.name, "previous_position": before,
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
    emit(args, {"address": a.name, "settings": after,
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
    emit(args, {"address": s["address"], "deleted": True, "messages": s["messages"],
                 "bytes": s["bytes"], "consumers": sorted(s["consumers"])}, f"deleted {what}")
    return 0
