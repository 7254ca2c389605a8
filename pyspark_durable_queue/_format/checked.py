"""JSON files that carry their own checksum (on-disk format 5 and later).

Every JSON file an address of format 5 reads back (``address.json``, commit-log entries and
the checkpoint hint, consumer state, lease claims, the cleanup marker) ends with a
``"crc32c"`` member: the CRC32C of every byte before that member, in hex::

    {"format":5,"name":"orders",...,"crc32c":"1c291ca3"}

The file stays plain JSON (``cat``, ``jq`` and older tools read it) and no canonical form is
needed: the checksum covers the bytes as written, so any change to them, a flipped bit in a
number included, is found before the JSON is parsed. A quote inside a JSON string is escaped,
so the member's bytes (``"crc32c":"``) cannot occur inside a value: the last occurrence is the
checksum's.

Formats 1-4 wrote the same files without the member; :func:`loads` reads them when the caller
says the checksum is not ``required``.
"""

from __future__ import annotations

import json
from typing import Any

from crc32c import crc32c

__all__ = ["ChecksumError", "KEY", "check_binary", "dumps", "loads"]

#: The member that holds the checksum.
KEY = "crc32c"
_MEMBER = b'"crc32c":"'
#: the encoders (``json.dumps`` with arguments builds one per call)
_COMPACT = json.JSONEncoder(separators=(",", ":"))
_INDENTED = {1: json.JSONEncoder(indent=1)}


class ChecksumError(ValueError):
    """The bytes do not match their checksum, or a checksum that must be there is not
    (a ``ValueError``: callers report it as they report JSON that does not parse)."""


def dumps(obj: dict[str, Any], *, indent: int | None = None) -> bytes:
    """``obj`` as JSON bytes ending with its checksum member (``indent`` as ``json.dumps``)."""
    if KEY in obj:
        raise ValueError(f"{KEY!r} is the checksum's member, not a field")
    encoder = (_INDENTED.get(indent) or json.JSONEncoder(indent=indent)) if indent else _COMPACT
    body = encoder.encode(obj).encode()
    covered = body.rstrip()[:-1].rstrip()  # without the closing brace
    if covered != b"{":
        covered += b","
    if indent:
        covered += b"\n" + b" " * indent
    crc = b"%08x" % crc32c(covered)
    return covered + _MEMBER + crc + (b'"\n}\n' if indent else b'"}')


def loads(data: bytes, *, required: bool) -> dict[str, Any]:
    """The JSON object in ``data``, its checksum checked and removed.

    Raises :class:`ChecksumError` when the checksum does not match, or is missing while
    ``required``; ``ValueError``/``TypeError`` when the bytes are not a JSON object."""
    at = data.rfind(_MEMBER)
    if at < 0:
        if required:
            raise ChecksumError(f"has no {KEY} member: not written by this format, or damaged")
    else:
        end = at + len(_MEMBER)
        stated = data[end:end + 8]
        actual = b"%08x" % crc32c(data[:at])
        if stated != actual:
            raise ChecksumError(f"fails its checksum (stated {stated.decode('ascii', 'replace')}"
                                f", bytes give {actual.decode()})")
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise TypeError(f"a JSON {type(obj).__name__}, not an object")
    obj.pop(KEY, None)
    return obj


def check_binary(data: bytes, expected: int, announced: str, version: int, flags: int,
                 reads: int) -> None:
    """Check a binary file that ends with the CRC32C of every byte before it (a consumer's
    window, a shared consumer's state): its length against the ``expected`` one its header
    announces (``announced`` says what it holds), the checksum, then the header's ``version``
    and ``flags`` against the version this release ``reads``. ``ValueError`` naming what is
    wrong."""
    if len(data) != expected:
        raise ValueError(f"{len(data)} bytes where its header announces {expected} "
                         f"({announced})")
    stated = int.from_bytes(data[-4:], "little")
    actual = crc32c(memoryview(data)[:-4])
    if stated != actual:
        raise ValueError(f"fails its checksum (stated {stated:08x}, bytes give {actual:08x})")
    if version != reads or flags:
        raise ValueError(f"version {version} (flags {flags}): written by a newer release "
                         f"than this one, which reads version {reads}")
