"""Settings: the typed views of the option table (``_options``), one dataclass per scope.

* :class:`AddressSettings`: persisted in ``address.json``; the Python keywords of
  ``DurableQueue.address(...)`` and the sink's address options.
* :class:`ReadSettings`: a Spark read (``spark.read`` / ``spark.readStream``).
* :class:`WriteSettings`: a Spark write, besides the address settings it carries.

Fields and defaults come from the table (``default_of``); a test checks that every option of a
scope is a field of its dataclass, with the table's default, and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._options import ADDRESS_FULL_POLICIES, COMPRESSIONS, by_key, parse_options
from ._positions import ReadPosition
from .errors import InvalidNameError, InvalidOptionError

__all__ = [
    "ADDRESS_FULL_POLICIES",
    "COMPRESSIONS",
    "AddressSettings",
    "ReadSettings",
    "WriteSettings",
    "parse_options",
    "validate_name",
]

#: Options Spark adds by itself (lower-cased by Spark); not ours to validate.
SPARK_OWN_OPTIONS = ("checkpointlocation",)


def default_of(key: str) -> Any:
    """The table's default of option ``key``."""
    return by_key(key).default


def absolute_path(path: str) -> str:
    # Resolved where the query is planned (the driver), so executors read the same place.
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


#: Settings of one handle (one writer), never persisted: durability is each writer's choice
#: (as Kafka's ``acks``), so one process opening an address with ``fsync="never"`` cannot lower
#: the durability of every other writer.
HANDLE_KEYS = ("fsync", "fsync_interval_ms")


@dataclass(frozen=True)
class AddressSettings:
    """Settings of an address: persisted in ``address.json``, except :data:`HANDLE_KEYS`."""

    page_size_bytes: int = default_of("page_size_bytes")
    max_size_bytes: int = default_of("max_size_bytes")
    max_size_messages: int = default_of("max_size_messages")
    address_full_policy: str = default_of("address_full_policy")
    block_timeout_ms: int = default_of("block_timeout_ms")
    compression: str = default_of("compression")
    fsync: str = default_of("fsync")
    fsync_interval_ms: int = default_of("fsync_interval_ms")
    journal: bool = default_of("journal")
    archive_data_logs: bool = default_of("archive_data_logs")
    directory_archive: str = default_of("directory_archive")
    cleanup_interval_ms: int = default_of("cleanup_interval_ms")
    orphan_grace_ms: int = default_of("orphan_grace_ms")
    log_retention_ms: int = default_of("log_retention_ms")
    retention_ms: int = default_of("retention_ms")
    retention_bytes: int = default_of("retention_bytes")
    compact_small_pages: int = default_of("compact_small_pages")
    compact_grace_ms: int = default_of("compact_grace_ms")
    page_max_cache_size: int = default_of("page_max_cache_size")
    expiry_delay_ms: int = default_of("expiry_delay_ms")
    redelivery_delay_ms: int = default_of("redelivery_delay_ms")
    redelivery_delay_multiplier: float = default_of("redelivery_delay_multiplier")
    max_redelivery_delay_ms: int | None = default_of("max_redelivery_delay_ms")
    max_in_flight: int = default_of("max_in_flight")
    max_delivery_attempts: int = default_of("max_delivery_attempts")
    dead_letter_address: str | None = default_of("dead_letter_address")
    expiry_address: str | None = default_of("expiry_address")
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.dead_letter_address is not None:
            validate_name(self.dead_letter_address, "dead_letter_address")
        if self.expiry_address is not None:
            validate_name(self.expiry_address, "expiry_address")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")

    @classmethod
    def persisted_keys(cls) -> tuple[str, ...]:
        return tuple(k for k in cls.keys() if k not in HANDLE_KEYS)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AddressSettings:
        # A persisted fsync (releases before the modes) is not this handle's choice: ignored.
        known = {k: data[k] for k in cls.persisted_keys() if k in data}
        return cls(**parse_options(known, "address"))

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.persisted_keys()}

    def replace(self, **changes: Any) -> AddressSettings:
        return dataclasses.replace(self, **changes)

    @property
    def limited(self) -> bool:
        return self.max_size_bytes > 0 or self.max_size_messages > 0

    def expire_before(self, now: float | None = None) -> int | None:
        """The ``_timestamp`` (epoch microseconds) before which messages have expired at
        ``now`` (epoch seconds, default the clock), ``None`` without ``expiry_delay_ms``."""
        if self.expiry_delay_ms <= 0:
            return None
        return int((time.time() if now is None else now) * 1e6) - self.expiry_delay_ms * 1000

    @property
    def retained(self) -> bool:
        """Whether retention bounds the address (``retention_ms`` or ``retention_bytes``)."""
        return self.retention_ms > 0 or self.retention_bytes > 0


@dataclass(frozen=True)
class ReadSettings:
    """The validated options of a Spark read (small and picklable: it travels to executors).

    Fields are the read options by key; ``None`` means not given.
    """

    path: str
    address: str
    consumer: str | None = None
    selector: str | None = None
    starting_position: ReadPosition | None = None
    starting_timestamp: ReadPosition | None = None
    ending_offsets: ReadPosition | None = None
    ending_timestamp: ReadPosition | None = None
    max_messages_per_trigger: int | None = None
    max_bytes_per_trigger: int | None = None
    max_pages_per_trigger: int | None = None
    min_offsets_per_trigger: int | None = None
    max_trigger_delay: int = default_of("max_trigger_delay")
    min_partitions: int | None = None
    fail_on_data_loss: bool = default_of("fail_on_data_loss")
    #: task slots to plan for; None: the driver's CPU count (right for local mode)
    task_slots: int | None = None
    consumer_lease_ms: int = default_of("consumer_lease_ms")
    page_max_cache_size: int | None = None
    cleanup_interval_ms: int | None = None
    storage_options: dict[str, Any] | None = None

    @functools.cached_property
    def selection(self) -> AddressSelection:
        """The addresses the option ``address`` names (a list, patterns, quoted names)."""
        return AddressSelection.parse(self.address)

    @property
    def start(self) -> ReadPosition | None:
        """Where a new consumer or a batch read starts (``None``: earliest)."""
        return self.starting_position or self.starting_timestamp

    @property
    def end(self) -> ReadPosition | None:
        """Where a batch read ends, exclusive (``None``: the log's end when planned)."""
        return self.ending_offsets or self.ending_timestamp

    @classmethod
    def parse(cls, options: Mapping[str, Any], *, streaming: bool | None) -> ReadSettings:
        """Validate a read's options; ``streaming=None`` when the kind of read is not known
        yet (``DataSource.schema()`` serves both), which skips the checks specific to one."""
        o = parse_options(dict(options), "read", ignore=SPARK_OWN_OPTIONS)
        missing = [name for name, key in (("path (the load() argument)", "path"),
                                          ("address", "address")) if not o.get(key)]
        if streaming and not o.get("consumer"):
            missing.append("consumer")
        if missing:
            raise InvalidOptionError(
                f"missing option{'s' if len(missing) > 1 else ''} {', '.join(missing)}: a "
                f"{'streaming' if streaming else 'batch'} read of durablequeue needs "
                ".option('address', ...)" + (".option('consumer', ...)" if streaming else "") +
                ".load(root)")
        problems = []
        if "starting_position" in o and "starting_timestamp" in o:
            problems.append("startingOffsets (startingPosition) and startingTimestamp both say "
                            "where to start; give one")
        if "ending_offsets" in o and "ending_timestamp" in o:
            problems.append("endingOffsets and endingTimestamp both say where to end; give one")
        if streaming is True:
            problems += [f"option {by_key(key).name} applies to batch reads (spark.read) only; "
                         "a streaming query runs until it is stopped (use "
                         "Trigger.AvailableNow to stop at the end of the backlog)"
                         for key in ("ending_offsets", "ending_timestamp") if key in o]
        elif streaming is False and o.get("consumer") and (
                "starting_position" in o or "starting_timestamp" in o):
            problems.append("a batch read starts at the watermark of the consumer it names, or "
                            "at startingOffsets / startingTimestamp, not both")
        if "max_trigger_delay" in o and "min_offsets_per_trigger" not in o:
            problems.append("maxTriggerDelay applies only with minOffsetsPerTrigger")
        if problems:
            raise InvalidOptionError("; ".join(problems))
        o["path"] = absolute_path(str(o["path"]))
        o["selector"] = o.get("selector") or None
        settings = cls(**o)
        if settings.selection.several:
            seqs = [by_key(k).name for k in ("starting_position", "ending_offsets")
                    if getattr(settings, k) is not None and getattr(settings, k).kind == "seq"]
            if seqs:
                raise InvalidOptionError(
                    f"option address={settings.address!r} names several addresses, where a "
                    f"_seq in {' and '.join(seqs)} means nothing (each address numbers its "
                    "own messages): use earliest, latest or a time (startingTimestamp / "
                    "endingTimestamp), or read the address alone")
        return settings


@dataclass(frozen=True)
class WriteSettings:
    """The validated options of a Spark write: where, how, and the address settings given
    (persisted when the address is opened)."""

    path: str
    address: str
    merge_schema: bool = default_of("merge_schema")
    txn_app_id: str | None = None
    txn_version: int | None = None
    ttl_ms: int | None = None
    storage_options: dict[str, Any] | None = None
    address_settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Mapping[str, Any], *, streaming: bool, overwrite: bool,
              routed: bool = False) -> WriteSettings:
        """Validate a write's options; ``routed``: the DataFrame has an ``_address`` column,
        which names each row's address, so the option ``address`` is optional (it wins when
        given, as Kafka's ``topic`` option does; ``address`` is then ``""``)."""
        o = parse_options(dict(options), "write", ignore=SPARK_OWN_OPTIONS)
        problems = []
        if overwrite:
            problems.append(
                "mode 'overwrite' (or outputMode 'complete') is not supported: an address is an "
                "append-only queue whose messages consumers may not have read yet; write with "
                "mode('append') (outputMode 'append' or 'update'), or delete the address first "
                "(DurableQueue(root).delete_address(name) or the durablequeue CLI)")
        if not o.get("path"):
            problems.append("the store root is missing: pass it to save(path) / start(path) or "
                            "as option 'path'")
        address = o.get("address")
        if not address and not routed:
            problems.append("option 'address' (the address name) is required, or an _address "
                            "column naming each row's address")
        elif address:
            selection = AddressSelection.parse(address)
            if selection.single is None:
                problems.append(
                    f"option address={address!r} names several addresses or a pattern; a "
                    "write goes to one address (quote a name holding a comma with backticks: "
                    "`a,b`)")
            else:
                address = selection.single
        app_id, version = o.get("txn_app_id"), o.get("txn_version")
        if (app_id is None) != (version is None):
            given, lacking = ("txnAppId", "txnVersion") if version is None else \
                ("txnVersion", "txnAppId")
            problems.append(f"options txnAppId and txnVersion go together (the app id and the "
                            f"version of an idempotent write): {given} was given without "
                            f"{lacking}")
        elif app_id is not None and streaming:
            problems.append("options txnAppId and txnVersion are for batch writes (df.write, "
                            "e.g. inside foreachBatch with txnVersion=batch id); a streaming "
                            "write is exactly-once per micro-batch without them")
        if problems:
            raise InvalidOptionError("; ".join(problems))
        keys = AddressSettings.keys()
        return cls(path=absolute_path(str(o["path"])), address=str(address or ""),
                   merge_schema=o.get("merge_schema", default_of("merge_schema")),
                   txn_app_id=app_id, txn_version=version, ttl_ms=o.get("ttl_ms"),
                   storage_options=o.get("storage_options"),
                   address_settings={k: v for k, v in o.items() if k in keys})



_NAME_MAX_BYTES = 200
_FORBIDDEN = set('/\\:*?"<>|')


def validate_name(name: Any, what: str = "address", *, new: bool = False) -> str:
    """Check that ``name`` is safe as a single path component on every filesystem.

    Accepted: 1..200 UTF-8 bytes of letters, digits and ``. - _ @ + = ~`` (Unicode letters
    included), not starting with ``.`` or ``_`` (reserved for the store's own files), without
    ``..``. A comma is accepted in the name of an existing address only (``new=False``): it
    separates names in the Spark option ``address``, so an address created now may not have one
    (an old one is named in that option quoted with backticks). Anything else raises
    :class:`InvalidNameError` saying why.
    """
    if not isinstance(name, str):
        raise InvalidNameError(f"{what} name must be a string, got {type(name).__name__}")
    problem = None
    if not name:
        problem = "it is empty"
    elif len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX_BYTES:
        problem = f"it is longer than {_NAME_MAX_BYTES} bytes"
    elif ".." in name:
        problem = "it contains '..'"
    elif name[0] in "._":
        problem = "it starts with '.' or '_' (reserved for the store's own files)"
    elif new and "," in name:
        problem = ("it contains ',', which separates address names in the Spark option "
                   "'address' (new address names may not contain it; an existing one still "
                   "opens)")
    else:
        for ch in name:
            if ch in _FORBIDDEN or ch.isspace() or unicodedata.category(ch)[0] in "CZ":
                problem = f"it contains the character {ch!r}"
                break
            if not (ch.isalnum() or ch in ".-_@+=~,"):
                problem = f"it contains the character {ch!r}"
                break
    if problem:
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise InvalidNameError(
            f"invalid {what} name {shown!r}: {problem}; use letters, digits and . - _ @ + = ~")
    return name


#: Artemis wildcard words: ``*`` is exactly one word, ``#`` any number of words (zero too).
ONE_WORD, ANY_WORDS = "*", "#"


@dataclass(frozen=True)
class AddressSelection:
    """What the Spark option ``address`` names: addresses and Artemis wildcard patterns.

    The text is a comma-separated list: ``"orders"``, ``"orders,returns"``, ``"orders.*"``
    (one more word after ``orders.``), ``"orders.#"`` (``orders`` and any name below it;
    ``.`` separates words). A name holding a comma (allowed before names were lists) is
    quoted with backticks, as Spark quotes identifiers: ``"`a,b`"``; a quoted name is never a
    pattern. Spaces around items are ignored (names have none).

    Attributes
    ----------
    names : tuple of str
        The literal names, in the order given, without duplicates.
    patterns : tuple of str
        The wildcard patterns, in the order given.
    """

    names: tuple[str, ...]
    patterns: tuple[str, ...] = ()

    @property
    def several(self) -> bool:
        """Whether the read may cover more than one address (several items, or a pattern): its
        rows then carry an ``_address`` column and its offsets one entry per address."""
        return len(self.names) + len(self.patterns) > 1 or bool(self.patterns)

    @property
    def single(self) -> str | None:
        """The one address named, ``None`` when :attr:`several`."""
        return None if self.several else self.names[0]

    def matches(self, name: str) -> bool:
        """Whether ``name`` is one of the names or matches one of the patterns."""
        return name in self.names or any(_match(p.split("."), name.split("."))
                                          for p in self.patterns)

    def resolve(self, existing: Any) -> list[str]:
        """The addresses read: the literal names (in the order given), then the names among
        ``existing`` (the store's addresses) that match a pattern, sorted."""
        found = sorted({n for n in existing if n not in self.names and any(
            _match(p.split("."), n.split(".")) for p in self.patterns)})
        return [*self.names, *found]

    @classmethod
    def parse(cls, text: str, option: str = "address") -> AddressSelection:
        """Split the option's text into names and patterns; a malformed item raises
        :class:`InvalidOptionError` naming it."""
        items: list[tuple[str, bool]] = []  # (item, quoted)
        i, n = 0, len(text)
        while True:
            while i < n and text[i].isspace():
                i += 1
            if i < n and text[i] == "`":
                close = text.find("`", i + 1)
                if close < 0:
                    raise InvalidOptionError(
                        f"option {option}={text!r}: the backtick at position {i} is not "
                        "closed; quote a name holding a comma as `a,b`")
                items.append((text[i + 1:close], True))
                i = close + 1
                while i < n and text[i].isspace():
                    i += 1
                if i < n and text[i] != ",":
                    raise InvalidOptionError(
                        f"option {option}={text!r}: {text[i]!r} after the quoted name "
                        f"`{items[-1][0]}`; separate names with ','")
            else:
                comma = text.find(",", i)
                end = n if comma < 0 else comma
                items.append((text[i:end].strip(), False))
                i = end
            if i >= n:
                break
            i += 1  # the comma
        names: list[str] = []
        patterns: list[str] = []
        for item, quoted in items:
            if not item:
                raise InvalidOptionError(
                    f"option {option}={text!r} has an empty name; give names separated by "
                    "',' (e.g. 'orders,returns')")
            words = item.split(".")
            if not quoted and (ONE_WORD in item or ANY_WORDS in item):
                bad = [w for w in words if (ONE_WORD in w or ANY_WORDS in w)
                       and w not in (ONE_WORD, ANY_WORDS)]
                if bad:
                    raise InvalidOptionError(
                        f"option {option}: pattern {item!r} uses a wildcard inside the word "
                        f"{bad[0]!r}; '*' (one word) and '#' (any number of words) stand for "
                        "whole words between '.' (e.g. 'orders.*', 'orders.#')")
                for w in words:
                    if w not in (ONE_WORD, ANY_WORDS):
                        _check_item(w, item, option)
                if item not in patterns:
                    patterns.append(item)
                continue
            _check_item(item, item, option)
            if item not in names:
                names.append(item)
        return cls(tuple(names), tuple(patterns))


def _check_item(word: str, item: str, option: str) -> None:
    try:
        validate_name(word)
    except InvalidNameError as exc:
        raise InvalidOptionError(f"option {option}: {item!r} is not an address name or "
                                 f"pattern: {exc}") from exc


def _match(pattern: list[str], words: list[str]) -> bool:
    """Artemis wildcard matching of word lists (``*`` one word, ``#`` zero or more)."""
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == ANY_WORDS:
        return any(_match(rest, words[k:]) for k in range(len(words) + 1))
    if not words:
        return False
    return (head == ONE_WORD or head == words[0]) and _match(rest, words[1:])
