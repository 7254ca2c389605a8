"""``address.json`` and the on-disk format it records.

An address keeps the format it was created in, so that the release that wrote it, and every
later one, reads it; ``address.json`` records the number and opening refuses a number it does
not know rather than misreading it. What each format added is a named feature of
:class:`Format`, so that code asks ``fmt.watermark_files`` rather than compares numbers:

====== ===================================================================================
format what it added
====== ===================================================================================
1      the first release: a commit-log entry and a page file per commit
2      ``txns``: a commit-log entry may carry several transactions (a group of idempotent
       sends)
3      ``watermark_files``: a consumer's position moves in ``consumers/<name>.wm``,
       rewritten in place (formats 1-2 replace the consumer's state file on every ack)
4      ``journal``: commits and their messages are units of a local journal (``journal.py``)
5      ``checksums``: every JSON file the address reads back carries a CRC32C
       (``_format/checked.py``), checkpoints a trailer; ``journal_field``: ``journal`` is a
       field of its own (``"journal": true``), as format 5 comes with and without the journal
====== ===================================================================================
"""

from __future__ import annotations

import json
import time
from typing import Any

from .._format import checked
from .._format.layout import AddressLayout
from .._storage import Storage
from ..errors import DamagedMetadataError, UnsupportedFormatError

__all__ = ["CURRENT", "JOURNAL_ONLY", "KNOWN", "Format", "create_meta", "read_meta", "write_meta"]

#: The format new addresses are created in.
CURRENT = 5
#: The formats this release reads and writes.
KNOWN = (1, 2, 3, 4, 5)
#: The format that always has the journal (earlier releases created journal addresses in it;
#: format 5 records ``journal`` as a field).
JOURNAL_ONLY = 4


class Format(int):
    """An address's on-disk format: its number (an ``int``, as ``address.json`` records it)
    and the features it has, by name."""

    journal: bool

    def __new__(cls, number: int, journal: bool = False) -> Format:
        fmt = super().__new__(cls, number)
        fmt.journal = journal or number == JOURNAL_ONLY
        return fmt

    def __repr__(self) -> str:
        return f"Format({int(self)}, journal={self.journal})"

    @property
    def txns(self) -> bool:
        """A commit-log entry may carry several transactions (``txns``)."""
        return self >= 2

    @property
    def watermark_files(self) -> bool:
        """A consumer's position is kept in a watermark file (``consumers/<name>.wm``)."""
        return self >= 3

    @property
    def checksums(self) -> bool:
        """Every metadata file carries a checksum, and one without it is damaged."""
        return self >= 5

    @property
    def journal_field(self) -> bool:
        """``address.json`` records ``journal`` as a field of its own (the format comes with
        and without the journal; format 4 is the journal's alone)."""
        return self >= 5

    def to_meta(self) -> dict[str, Any]:
        """The fields of ``address.json`` that record the format."""
        return {"format": int(self), "journal": self.journal} if self.journal_field else {
            "format": int(self)}

    @classmethod
    def of(cls, meta: dict[str, Any], path: str, name: str) -> Format:
        """The format ``address.json`` (read from ``path``) records, checked."""
        number = meta.get("format", 1)
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise DamagedMetadataError(path, f"has format {number!r}, not a format number",
                                       f"{path} has format {number!r}, not a format number")
        if number not in KNOWN:
            raise UnsupportedFormatError(
                f"address {name!r} ({path}) is in on-disk format {number}, written by a newer "
                f"release of pyspark-durable-queue; this release reads formats {list(KNOWN)}. "
                "Upgrade pyspark-durable-queue to open it (nothing was changed)")
        journal = meta.get("journal", False)
        if cls(number).journal_field and not isinstance(journal, bool):
            raise DamagedMetadataError(path, f"has journal {journal!r}, not true or false")
        return cls(number, bool(journal))


def read_meta(storage: Storage, layout: AddressLayout) -> dict[str, Any]:
    """``address.json``, its checksum checked when it has one (format 5 and later always do:
    one without it is damaged). ``NotFound`` when the address does not exist."""
    path = layout.meta
    data = storage.read(path)
    try:
        meta = checked.loads(data, required=False)
        if meta.get("format") in KNOWN and Format(meta["format"]).checksums and \
                checked.KEY.encode() not in data:
            raise checked.ChecksumError(f"has no {checked.KEY} member although its format has")
    except checked.ChecksumError as exc:
        raise DamagedMetadataError(path, str(exc), f"{path} is damaged: {exc}; the address's "
                                   "settings and format cannot be trusted (restore the file "
                                   "from a backup, or rewrite it: see docs/operations.md)"
                                   ) from exc
    except (ValueError, TypeError) as exc:
        raise DamagedMetadataError(path, f"not valid JSON ({exc})",
                                   f"{path} is not valid JSON: {exc}") from exc
    return meta


def _encode(meta: dict[str, Any]) -> bytes:
    fmt = meta.get("format", 1)
    if isinstance(fmt, int) and Format(fmt).checksums:
        return checked.dumps(meta, indent=1)
    return json.dumps(meta, indent=1).encode()


def create_meta(storage: Storage, layout: AddressLayout, name: str, fmt: Format,
                settings: dict[str, Any]) -> dict[str, Any]:
    """Create ``address.json`` for a new address; the one that exists wins when another
    process created it first. Returns what the file holds."""
    meta = {**fmt.to_meta(), "name": name, "created": time.time(), "settings": settings}
    if not storage.create(layout.meta, _encode(meta)):
        return read_meta(storage, layout)
    return meta


def write_meta(storage: Storage, layout: AddressLayout, meta: dict[str, Any]) -> None:
    """Replace ``address.json`` (a settings change), checksummed as its format says."""
    storage.replace(layout.meta, _encode(meta))
