"""The option table: every setting and option, its names, converter, default, doc and scopes.

The single source of truth: the settings dataclasses (``settings``) take their fields and
defaults from it (a test ties them), ``docs/options.md`` is generated from it, and
:func:`parse_options` validates against it.

Every option has a canonical camelCase name (the Spark option), a snake_case key (the Python
keyword, and the key persisted in ``address.json``), optional aliases (Artemis/ActiveMQ
kebab-case names, Kafka's and Delta's names), and scopes: ``address`` (persisted address
settings), ``read`` (streaming and batch readers), ``write`` (the sink). Spark options are
case-insensitive.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._positions import position_value, time_value
from .errors import InvalidOptionError

__all__ = ["ADDRESS_FULL_POLICIES", "COMPRESSIONS", "OPTIONS", "Option", "by_key",
           "parse_options", "storage_value"]

ADDRESS_FULL_POLICIES = ("PAGE", "DROP", "FAIL", "BLOCK")
COMPRESSIONS = ("none", "lz4", "zstd")
MiB = 1024 * 1024


#: The shortest log retention allowed (``logRetentionMs``): far above the time after which a
#: process checks a view it has not refreshed (``_log.commit_log.VERIFY_EVERY_S``) plus clock skew
#: between hosts, so entries published after a view's last refresh cannot be gone yet.
MIN_LOG_RETENTION_MS = 300_000

def _to_int(value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        out = value
    else:
        text = str(value).strip().replace("_", "")
        out = int(_parse_size(text)) if text[-1:].isalpha() else int(text)
    if minimum is not None and out < minimum:
        raise ValueError(f"must be at least {minimum}")
    return out


def _to_float(value: Any, *, minimum: float) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    out = float(value)
    if not out >= minimum or out == float("inf"):
        raise ValueError(f"must be a finite number of at least {minimum}")
    return out


def _optional_ms(value: Any) -> int | None:
    return None if value is None else _to_int(value, minimum=0)


_SIZE_SUFFIX = {"k": 1024, "kb": 1024, "kib": 1024, "m": MiB, "mb": MiB, "mib": MiB,
                "g": 1024 * MiB, "gb": 1024 * MiB, "gib": 1024 * MiB}


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([A-Za-z]+)", text)
    if not m or m.group(2).lower() not in _SIZE_SUFFIX:
        raise ValueError(f"{text!r} is not a number (sizes may use KiB, MiB, GiB)")
    return int(m.group(1)) * _SIZE_SUFFIX[m.group(2).lower()]


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


FSYNC_MODES = ("always", "periodic", "never")


def _fsync_mode(value: Any) -> str:
    # true/false were the values before the modes existed: they keep their meaning
    if isinstance(value, bool):
        return "always" if value else "never"
    text = str(value).strip().lower()
    if text in FSYNC_MODES:
        return text
    try:
        return "always" if _to_bool(text) else "never"
    except ValueError:
        raise ValueError(f"expected one of {', '.join(FSYNC_MODES)} (or true/false)") from None


def _choice(choices: tuple[str, ...], *, upper: bool) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        text = str(value).strip()
        text = text.upper() if upper else text.lower()
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return convert


_DURATION_UNITS = {"us": 0.001, "ms": 1, "s": 1000, "sec": 1000, "m": 60_000, "min": 60_000,
                   "h": 3_600_000, "d": 86_400_000}


def _to_duration_ms(value: Any) -> int:
    """Milliseconds from a number (ms) or a duration as Spark writes them (``30s``, ``15m``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        out = value
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", str(value).lower())
        if not m or m.group(2) not in ("", *_DURATION_UNITS):
            raise ValueError("expected a duration: milliseconds, or a number with a unit "
                             "(us, ms, s, m, min, h, d), e.g. 30s or 15m")
        out = int(int(m.group(1)) * _DURATION_UNITS.get(m.group(2), 1))
    if out < 0:
        raise ValueError("must not be negative")
    return out


def _limit(value: Any) -> int:
    out = _to_int(value)
    if out < -1 or out == 0:
        raise ValueError("must be positive, or -1 for unlimited")
    return out


def _retention_ms(value: Any) -> int:
    # -1 (unbounded) or a positive duration; 0 would remove every message at once
    if not isinstance(value, bool) and str(value).strip() == "-1":
        return -1
    out = _to_duration_ms(value)
    if out == 0:
        raise ValueError("must be positive, or -1 for unbounded")
    return out


def _text(value: Any) -> str:
    return str(value)


def _nonempty_text(value: Any) -> str:
    text = str(value)
    if not text:
        raise ValueError("must not be empty")
    return text


def _optional_name(value: Any) -> str | None:
    # an address name (checked as one where the address is opened); empty: none
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def _version(value: Any) -> int:
    # Plain digits only: a size suffix (as _to_int accepts) makes no sense for a version.
    text = str(value).strip()
    if isinstance(value, bool) or not (text.isascii() and text.isdigit()):
        raise ValueError("expected an integer >= 0")
    return int(text)


def _json_object(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    try:
        parsed = json.loads(str(value))
    except ValueError as exc:
        raise ValueError(f"expected a JSON object: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("expected a JSON object")
    return parsed


def storage_value(value: Any) -> Any:
    """An fsspec option given as text (Spark's ``storage.<key>``, the CLI's ``-o``): a JSON
    literal is that value (``false``, ``3``, ``null``, ``{"a": 1}``), ``True``/``False`` in any
    case are booleans, anything else stays text. fsspec backends want real booleans: the string
    ``"false"`` is truthy, so ``anon=false`` as text would turn anonymous access on."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    if value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


STORAGE_PREFIX = "storage."


@dataclass(frozen=True)
class Option:
    """One option: names, converter, default, and where it applies."""

    name: str  # camelCase, the Spark option
    key: str  # snake_case, the Python keyword
    convert: Callable[[Any], Any]
    default: Any
    scopes: frozenset[str]
    doc: str
    aliases: tuple[str, ...] = ()


# scopes: "address" (persisted address setting), "read" (streaming/batch reader), "write" (sink)
_A, _R, _W = "address", "read", "write"
OPTIONS: tuple[Option, ...] = (
    Option("address", "address", _text, None, frozenset({_R, _W}),
           "address name (a write may route rows by an _address column instead; the option "
           "wins); a read takes a comma-separated list of names and wildcard patterns "
           "(orders.* one word, orders.# any number; rows get an _address column); a name "
           "holding a comma is quoted with backticks"),
    Option("consumer", "consumer", _text, None, frozenset({_R}), "durable consumer name"),
    Option("selector", "selector", _text, None, frozenset({_R}), "Jakarta Messaging selector"),
    Option("startingPosition", "starting_position", position_value, None, frozenset({_R}),
           "where a new consumer (or a batch read) starts: earliest, latest, a _seq or "
           '{"seq": N}', ("startingOffsets",)),
    Option("startingTimestamp", "starting_timestamp", time_value, None, frozenset({_R}),
           "start at the first message committed at or after this time (epoch ms or "
           "ISO-8601)"),
    Option("endingOffsets", "ending_offsets", position_value, None, frozenset({_R}),
           "batch reads: end before this _seq (latest, a _seq or {\"seq\": N})"),
    Option("endingTimestamp", "ending_timestamp", time_value, None, frozenset({_R}),
           "batch reads: end before the first message committed at or after this time"),
    Option("maxMessagesPerTrigger", "max_messages_per_trigger",
           lambda v: _to_int(v, minimum=1), None, frozenset({_R}),
           "most messages per micro-batch (default: the memory budget)",
           ("maxOffsetsPerTrigger",)),
    Option("maxBytesPerTrigger", "max_bytes_per_trigger",
           lambda v: _to_int(v, minimum=1), None, frozenset({_R}),
           "most bytes per micro-batch (default: the memory budget)"),
    Option("maxPagesPerTrigger", "max_pages_per_trigger",
           lambda v: _to_int(v, minimum=1), None, frozenset({_R}),
           "most pages per micro-batch", ("maxFilesPerTrigger",)),
    Option("minOffsetsPerTrigger", "min_offsets_per_trigger",
           lambda v: _to_int(v, minimum=1), None, frozenset({_R}),
           "wait for at least this many messages before a micro-batch (see maxTriggerDelay)"),
    Option("maxTriggerDelay", "max_trigger_delay", _to_duration_ms, 15 * 60_000,
           frozenset({_R}), "longest wait for minOffsetsPerTrigger (ms, or 30s, 15m, 1h)"),
    Option("minPartitions", "min_partitions", lambda v: _to_int(v, minimum=1), None,
           frozenset({_R}), "at least this many tasks per micro-batch (a hint)"),
    Option("failOnDataLoss", "fail_on_data_loss", _to_bool, True, frozenset({_R}),
           "fail when needed pages are gone"),
    Option("taskSlots", "task_slots", lambda v: _to_int(v, minimum=1), None, frozenset({_R}),
           "task slots of the cluster: tasks per micro-batch and the default batch size "
           "(default: the driver's CPU count)"),
    Option("consumerLeaseMs", "consumer_lease_ms", lambda v: _to_int(v, minimum=1000), 60000,
           frozenset({_R}), "how long a crashed query's claim on its consumer lasts"),
    Option("pageMaxCacheSize", "page_max_cache_size", lambda v: _to_int(v, minimum=1), 5,
           frozenset({_R, _A}), "pages of the address each process caches (a read's value is "
           "persisted)", ("page-max-cache-size",)),
    Option("pageSizeBytes", "page_size_bytes", lambda v: _to_int(v, minimum=1024), 10 * MiB,
           frozenset({_A, _W}), "page roll size", ("page-size-bytes",)),
    Option("maxSizeBytes", "max_size_bytes", _limit, -1, frozenset({_A, _W}),
           "address backlog limit in bytes", ("max-size-bytes",)),
    Option("maxSizeMessages", "max_size_messages", _limit, -1, frozenset({_A, _W}),
           "address backlog limit in messages", ("max-size-messages",)),
    Option("addressFullPolicy", "address_full_policy", _choice(ADDRESS_FULL_POLICIES, upper=True),
           "PAGE", frozenset({_A, _W}), "what to do when the address is full",
           ("address-full-policy",)),
    Option("blockTimeoutMs", "block_timeout_ms", lambda v: _to_int(v, minimum=0), 60000,
           frozenset({_A, _W}), "longest BLOCK wait", ("block-timeout-ms",
                                                        "maxProducerFlowControlWait")),
    Option("compression", "compression", _choice(COMPRESSIONS, upper=False), "none",
           frozenset({_A, _W}), "page compression"),
    Option("fsync", "fsync", _fsync_mode, "always", frozenset({_A, _W}),
           "durability of this writer's commits: always (synced before a send returns), "
           "periodic (synced every fsyncIntervalMs; a send returns when written), never (the "
           "OS decides); true/false mean always/never. A setting of the handle, not persisted",
           ("syncOnWrite", "journalDiskSyncStrategy")),
    Option("fsyncIntervalMs", "fsync_interval_ms", lambda v: _to_int(v, minimum=1), 1000,
           frozenset({_A, _W}), "how often fsync=periodic syncs (not persisted)",
           ("journalDiskSyncInterval",)),
    Option("journal", "journal", _to_bool, True, frozenset({_A, _W}),
           "when the address is created on a local disk: commits are appended to a journal "
           "(one fdatasync each, pages rolled at pageSizeBytes) instead of a file per commit "
           "(on-disk format 4); false keeps a file per commit (format 3); elsewhere, and for "
           "existing addresses, no effect"),
    Option("archiveDataLogs", "archive_data_logs", _to_bool, False, frozenset({_A, _W}),
           "move consumed pages instead of deleting them", ("archive-data-logs",)),
    Option("directoryArchive", "directory_archive", _text, "archive", frozenset({_A, _W}),
           "archive folder inside the address", ("directory-archive",)),
    Option("cleanupIntervalMs", "cleanup_interval_ms", lambda v: _to_int(v, minimum=0), 30000,
           frozenset({_A, _W, _R}), "least time between cleanups", ("cleanupInterval",
                                                                    "cleanup-interval")),
    Option("orphanGraceMs", "orphan_grace_ms", lambda v: _to_int(v, minimum=0), 3_600_000,
           frozenset({_A, _W}), "age before an unpublished page counts as an orphan"),
    Option("compactSmallPages", "compact_small_pages", lambda v: _to_int(v, minimum=0), 100,
           frozenset({_A, _W}),
           "cleanup also compacts the backlog once it holds this many small pieces (page "
           "files under half of pageSizeBytes; commits of rolled journal segments that average "
           "under half a frame); 0: only on demand (Address.compact, the CLI's compact)"),
    Option("compactGraceMs", "compact_grace_ms", lambda v: _to_int(v, minimum=0), 600_000,
           frozenset({_A, _W}),
           "how long files that compaction replaced stay for readers that planned on them "
           "before the swap (a reader that finds one gone reads its successors anyway)"),
    Option("logRetentionMs", "log_retention_ms",
           lambda v: _to_int(v, minimum=MIN_LOG_RETENTION_MS),
           3_600_000, frozenset({_A, _W}),
           "age before commit-log entries a checkpoint covers are deleted"),
    Option("retentionMs", "retention_ms", _retention_ms, -1, frozenset({_A, _W}),
           "cleanup removes whole pages (journal segments) whose newest message is older than "
           "this, read or not, oldest first (ms, or 7d, 12h; -1: unbounded); consumers that had "
           "not read them report the range as lost", ("retention.ms",)),
    Option("retentionBytes", "retention_bytes", _limit, -1, frozenset({_A, _W}),
           "cleanup removes the oldest whole pages (journal segments), read or not, while the "
           "address holds more than this without them: met to within one page (pageSizeBytes); "
           "-1: unbounded", ("retention.bytes",)),
    Option("expiryDelayMs", "expiry_delay_ms", _retention_ms, -1, frozenset({_A, _W}),
           "a message expires this long after it was sent (ms, or 30s, 7d; -1: never): it is "
           "never delivered after that and counts as settled for every consumer (Artemis' "
           "expiry-delay); evaluated when messages are read, so a change applies to messages "
           "already stored", ("expiry-delay",)),
    Option("redeliveryDelayMs", "redelivery_delay_ms", lambda v: _to_int(v, minimum=0), 0,
           frozenset({_A, _W}),
           "how long a nacked message waits before it is delivered again (Artemis' "
           "redelivery-delay; a delay_ms given to nack wins)", ("redelivery-delay",)),
    Option("redeliveryDelayMultiplier", "redelivery_delay_multiplier",
           lambda v: _to_float(v, minimum=1.0), 1.0, frozenset({_A, _W}),
           "each further nack of a message multiplies its redelivery delay by this",
           ("redelivery-delay-multiplier",)),
    Option("maxRedeliveryDelayMs", "max_redelivery_delay_ms", _optional_ms, None,
           frozenset({_A, _W}), "longest redelivery delay (default: 10 x redeliveryDelayMs)",
           ("max-redelivery-delay",)),
    Option("maxInFlight", "max_in_flight", lambda v: _to_int(v, minimum=1), 10_000,
           frozenset({_A, _W}),
           "most messages from a consumer's watermark to its cursor (delivered and not "
           "settled, or skipped by its selector among them): past it a receive returns only "
           "messages due for redelivery", ("max-in-flight",)),
    Option("maxDeliveryAttempts", "max_delivery_attempts", _limit, -1, frozenset({_A, _W}),
           "a message nacked after this many deliveries goes to deadLetterAddress (or is "
           "dropped without one) instead of being delivered again (Artemis' "
           "max-delivery-attempts, SQS's maxReceiveCount); -1: no limit",
           ("max-delivery-attempts",)),
    Option("deadLetterAddress", "dead_letter_address", _optional_name, None,
           frozenset({_A, _W}),
           "where messages go after maxDeliveryAttempts, with their origin (created on first "
           "use; one may serve many addresses)", ("dead-letter-address",)),
    Option("expiryAddress", "expiry_address", _optional_name, None, frozenset({_A, _W}),
           "where expired messages (expiryDelayMs, a send's ttl_ms) are moved, once per "
           "address, with their origin (the dead-letter columns, reason 'expired'), by "
           "cleanup or Address.move_expired (created on first use); unset: they are dropped",
           ("expiry-address",)),
    Option("mergeSchema", "merge_schema", _to_bool, False, frozenset({_W}),
           "allow adding nullable columns"),
    Option("ttlMs", "ttl_ms", lambda v: _to_int(v, minimum=1), None, frozenset({_W}),
           "time to live of the rows written (send(rows, ttl_ms=N)): each expires ttlMs "
           "after its commit (or at expiryDelayMs if that comes first), is never delivered "
           "after that and counts as settled; unset: no TTL", ("ttl-ms",)),
    Option("txnAppId", "txn_app_id", _nonempty_text, None, frozenset({_W}),
           "with txnVersion: idempotent batch write, the same transaction as send(txn=...)"),
    Option("txnVersion", "txn_version", _version, None, frozenset({_W}),
           "with txnAppId: a version (>= 0) already committed for the app id is skipped"),
    Option("path", "path", _text, None, frozenset({_R, _W}), "root of the store"),
    Option("storageOptions", "storage_options", lambda v: _json_object(v), None,
           frozenset({_R, _W}), "fsspec options as a JSON object (credentials, endpoint...)"),
)

_BY_LOWER: dict[str, Option] = {}
for _opt in OPTIONS:
    for _name in (_opt.name, _opt.key, *_opt.aliases):
        _BY_LOWER[_name.lower()] = _opt


def parse_options(options: Mapping[str, Any], scope: str,
                  ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """Validate options given by a user and return them by snake_case key.

    Only options present are returned (no defaults filled in). All problems are collected and
    raised together as one :class:`InvalidOptionError`.

    Parameters
    ----------
    options : mapping
        Option name (any case, camelCase, snake_case or Artemis alias) to value.
    scope : {"address", "read", "write"}
        Where the options are used; an option of another scope is unknown here.
    ignore : tuple of str
        Lower-case names to pass over silently (Spark's own options such as
        ``checkpointlocation``).
    """
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    problems: list[str] = []
    prefixed: dict[str, Any] = {}
    for raw_name, value in options.items():
        lower = str(raw_name).lower()
        if lower in ignore:
            continue
        if lower.startswith(STORAGE_PREFIX) and scope in (_R, _W) and len(lower) > 8:
            # fsspec options (credentials, endpoints): storage.key=..., storage.anon=true
            prefixed[str(raw_name)[len(STORAGE_PREFIX):]] = storage_value(value)
            continue
        opt = _BY_LOWER.get(lower)
        if opt is None or scope not in opt.scopes:
            accepted = sorted(o.name for o in OPTIONS if scope in o.scopes)
            problems.append(
                f"unknown option {raw_name!r}; accepted options are: {', '.join(accepted)}")
            continue
        if opt.key in given_as:
            # aliases of one option (startingPosition and startingOffsets): which one wins
            # would be an accident of dict order
            problems.append(f"options {given_as[opt.key]!r} and {raw_name!r} are the same "
                            f"option ({opt.name}); give only one")
            continue
        given_as[opt.key] = str(raw_name)
        try:
            out[opt.key] = opt.convert(value)
        except (ValueError, TypeError) as exc:
            also = f" ({opt.name})" if str(raw_name) != opt.name else ""
            problems.append(f"option {raw_name}={value!r}{also} is invalid: {exc}")
    if problems:
        raise InvalidOptionError("; ".join(problems))
    if prefixed:
        out["storage_options"] = {**out.get("storage_options", {}), **prefixed}
    return out


def by_key(key: str) -> Option:
    """The option whose snake_case key is ``key``."""
    return _BY_LOWER[key.lower()]


def reference() -> str:
    """``docs/options.md``: every option, generated from the table (a test keeps the file in
    step and says how to regenerate it)."""
    lines = ["# Options and settings", "",
             "Generated from the option table (`pyspark_durable_queue/_options.py`); see",
             "`tests/test_settings.py` to regenerate it. Spark options are",
             "case-insensitive; Python keywords are the snake_case keys. Scopes: *address*",
             "(persisted in `address.json`, given to `DurableQueue.address(...)` or a write),",
             "*read* (`spark.read` / `spark.readStream`), *write* (`df.write` / `writeStream`).",
             "", "| option | Python key | also | scopes | default | meaning |",
             "|---|---|---|---|---|---|"]
    for o in OPTIONS:
        also = ", ".join(f"`{a}`" for a in o.aliases)
        default = "" if o.default is None else f"`{o.default!r}`"
        scopes = ", ".join(s for s in (_A, _R, _W) if s in o.scopes)
        lines.append(f"| `{o.name}` | `{o.key}` | {also} | {scopes} | {default} | {o.doc} |")
    return "\n".join(lines) + "\n"
