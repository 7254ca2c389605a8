"""Journal units on disk (format 4): the heads of segments and units, and the rule that tells a
unit torn by a crash from a damaged one.

Who uses it: :mod:`.._log.journal` (which describes segments and units) reads and writes units
with these heads, and asks :func:`judge_tail` what the bytes are where the next unit should be
but is not: the journal's end (nothing written there, or a unit torn by a crash, which no one
was told was committed), or damage, which readers report and writers must not write over.

The rule (docs/architecture.md, "Damage versus a torn tail", says why it holds):

* A power cut keeps any subset of the 4 KiB pages (aligned on file offsets) of a unit that was
  not synced; a process killed in the middle of a ``pwrite`` leaves a prefix of it that ends on
  such a page boundary (the kernel copies a page at a time and stops only between pages). The
  space a unit is written into is zeros before (allocated ahead, or zeroed by the writer that
  found a torn unit there). So a torn unit has a *piece* (the part of one 4 KiB page inside
  it) that is all zeros, or ends in more zeros than a whole unit ends with (a write cut
  short), or its stated end lies past the end of the file.
* Damage (a bad disk, a flipped bit) leaves every piece written. So: a unit whose checksum
  fails is torn only if such zeros lie where it fails (the entry, if it does not parse; each
  frame whose own checksum fails; everything from a frame head that does not read). Anything
  else is damage: a head with bytes that is not the next unit's (a wrong magic, version or
  ``prev``) and not a prefix of it, a checksum that fails with every piece written, a head
  whose lengths were damaged (the bytes after it are a whole unit of other lengths with the
  right checksum), a synced unit (``DQJU``) followed by a unit that proves it was synced: the
  next unit, unless its entry has ``synced_to`` below the torn unit's version (its writer
  appended while the sync of the one before it was still running, outside the publish lock,
  and knew units synced only up to that version); then the first unit after a run of such
  units whose entry has no ``synced_to`` or one that reaches the torn unit, or a roll mark.

Proof from outside the segment (a later segment, a consumer's position past the unit, a
checkpoint covering it) makes damage of what this rule calls torn: the journal and the commit
log look at those (``Journal._judged``, ``CommitLog._prove_end``). What it cannot tell (a flip
in a unit that also holds a page of zeros where it fails...) is listed in the architecture
document.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass

from crc32c import crc32c

from .frame import FRAME_HEAD, FRAME_MAGIC

__all__ = ["HEAD", "MAX_UNIT", "PIECE", "ROLL_MAGIC", "SEGMENT_HEAD", "SEGMENT_MAGIC",
           "SYNCED_TO", "UNITS", "UNIT_FIELDS", "UNIT_HEAD", "UNIT_MAGIC", "UNSYNCED_MAGIC",
           "Damage", "judge_tail", "zero_pieces"]

SEGMENT_MAGIC = b"DQJRNL01"
UNIT_MAGIC = b"DQJU"
#: a unit written without a sync (``fsync=never|periodic``)
UNSYNCED_MAGIC = b"DQJu"
UNITS = (UNIT_MAGIC, UNSYNCED_MAGIC)
ROLL_MAGIC = b"DQJN"
SEGMENT_HEAD = struct.Struct("<8s16sI4x")  # magic, random id, crc of magic + id
UNIT_HEAD = struct.Struct("<4sIQIIQ")  # magic, crc, version, prev, entry length, frames length
UNIT_FIELDS = struct.Struct("<QIIQ")  # what the crc covers of the head
HEAD = SEGMENT_HEAD.size
#: A unit longer than this is not a unit (a corrupt length): no reader allocates more.
MAX_UNIT = 1 << 34
#: What a power cut keeps or loses of an unsynced write, at least: one page of the page cache
#: (aligned on file offsets; devices that tear inside a page are the residual case, see the
#: architecture document).
PIECE = 4096

#: The bytes a damaged head's lengths are looked for in (the entry of a unit is a few KB).
_ENTRY_WINDOW = 1 << 20
_DECODER = json.JSONDecoder()

#: ``read(start, end)``: the bytes of the segment in ``[start, end)``, fewer at its end.
Read = Callable[[int, int], bytes]


@dataclass(frozen=True)
class Damage:
    """Bytes after a journal's last valid unit that no crash explains: from ``offset`` (where
    the next unit would start) to ``end`` (the damaged unit's stated end, or as far as what is
    damaged can be told), and why."""

    offset: int
    end: int
    reason: str


def zero_pieces(data: bytes, at: int) -> list[tuple[int, int]]:
    """The pieces of ``data`` (read from file offset ``at``), split at 4 KiB file offsets, that
    are all zeros, as file ranges."""
    out = []
    lo = at
    end = at + len(data)
    while lo < end:
        hi = min(end, (lo // PIECE + 1) * PIECE)
        if data.count(0, lo - at, hi - at) == hi - lo:
            out.append((lo, hi))
        lo = hi
    return out


def _overlaps(ranges: list[tuple[int, int]], others: list[tuple[int, int]]) -> bool:
    return any(lo < o_hi and o_lo < hi for lo, hi in ranges for o_lo, o_hi in others)


def judge_tail(read: Read, at: int, version: int, prev: int, size: int) -> Damage | None:
    """What is at ``at``, where the unit of ``version`` chained to ``prev`` would start and is
    not (``size``: the segment file's size): ``None`` when it is the journal's end (zeros, a
    unit torn by a crash, or a unit being written right now, which only the caller's lock can
    tell from damage), else the :class:`Damage`. See the module docstring."""
    head = read(at, at + UNIT_HEAD.size)
    head += bytes(UNIT_HEAD.size - len(head))  # past the file's end: never written
    if not any(head):
        return None
    magic, crc, head_version, head_prev, entry_len, frames_len = UNIT_HEAD.unpack(head)
    if magic not in UNITS or (head_version, head_prev) != (version, prev):
        # A head split by a page boundary, one part not written. (The bytes after a unit's
        # head are its entry, never zeros: a part of the head that is zeros only because its
        # fields' high bytes are does not count.)
        near = head + read(at + UNIT_HEAD.size, at + UNIT_HEAD.size + 8)
        if zero_pieces(near, at):
            return None
        if magic == ROLL_MAGIC and (head_version, head_prev) == (version, prev):
            return Damage(at, at + UNIT_HEAD.size, "is a roll mark that fails its checksum")
        if _cut_head(near, version, prev):
            return None
        if magic not in UNITS and magic != ROLL_MAGIC:
            what = f"has bytes that are not a unit head (magic {magic!r})"
        elif head_version != version:
            what = f"is a unit head of version {head_version}, not {version}"
        else:
            what = (f"is a unit head whose prev ({head_prev:#010x}) is not the crc of the "
                    f"unit before it ({prev:#010x})")
        return Damage(at, at + UNIT_HEAD.size, what + " where the next unit should be")
    stated = at + UNIT_HEAD.size + entry_len + frames_len
    end = min(stated, size, at + UNIT_HEAD.size + MAX_UNIT)
    data = head + read(at + UNIT_HEAD.size, end)
    end = at + len(data)
    fields = UNIT_FIELDS.pack(version, prev, entry_len, frames_len)
    if end == stated and crc32c(data[UNIT_HEAD.size:], crc32c(fields)) == crc:
        return None  # whole now: a read that raced its write (the caller reads it again)
    zeros = zero_pieces(data, at)
    if end < stated:  # past the file's end: its size was not persisted
        zeros.append((end, stated))
    # A write cut short: zeros from where it stopped. A whole unit ends in at most 4 zeros (the
    # Arrow stream's end mark, after 4 bytes 0xFF), one without frames in none (its entry).
    run = len(data) - len(data.rstrip(b"\0"))
    if run > (4 if frames_len else 0):
        zeros.append((end - run, end))
    torn = bool(zeros) and _overlaps(zeros, _failing(data, at, entry_len, frames_len))
    if torn:
        whole = _whole_lengths(read, at, size)
        if whole is not None and whole != (entry_len, frames_len):
            body = read(at + UNIT_HEAD.size, at + UNIT_HEAD.size + sum(whole))
            if crc32c(body, crc32c(UNIT_FIELDS.pack(version, prev, *whole))) == crc:
                return Damage(at, at + UNIT_HEAD.size + sum(whole), (
                    f"is a unit whose head states lengths {entry_len}+{frames_len}, but the "
                    f"bytes after it are a whole unit of {whole[0]}+{whole[1]} (its head was "
                    "damaged)"))
        if magic == UNIT_MAGIC and stated <= size and \
                _proven_synced(read, stated, version + 1, crc, size):
            return Damage(at, stated, (
                "is a synced unit that fails its checksum although the unit after it is intact "
                "and proves it was synced (damaged after it was written)"))
        return None
    if zeros:
        return Damage(at, stated, (
            f"is a unit that fails its checksum; its 4 KiB blocks of zeros "
            f"({_ranges_text(zeros)}) are not where it fails, so it is damaged, not torn by a "
            "crash"))
    return Damage(at, stated, "is a unit that fails its checksum with every 4 KiB block "
                              "written (damaged after it was written, not torn by a crash)")


#: The key of an entry whose writer did not know the unit before it to be synced yet (its sync
#: runs after the publish lock is let go, see ``_log.journal``): the newest unit version it
#: knew synced. The unit's presence proves that version and those before it synced, no more.
SYNCED_TO = "synced_to"


def _proven_synced(read: Read, at: int, version: int, prev: int, size: int) -> bool:
    """Whether what follows a torn-looking synced unit (from ``at``, where the unit of
    ``version`` chained to ``prev`` starts) proves that unit was synced, so whole once: a roll
    mark (written only once what is before it was synced), or a unit whose entry has no
    ``synced_to`` (its writer knew the unit before it synced) or one that reaches the torn
    unit, after a run of units whose ``synced_to`` does not (each whole, chained: they were
    written while syncs were running, and a later sync covers every byte before it). A unit
    that is not whole, or the end, proves nothing."""
    torn = version - 1
    while at + UNIT_HEAD.size <= size:
        head = read(at, at + UNIT_HEAD.size)
        if len(head) < UNIT_HEAD.size:
            return False
        magic, crc, head_version, head_prev, entry_len, frames_len = UNIT_HEAD.unpack(head)
        if (head_version, head_prev) != (version, prev):
            return False
        if magic == ROLL_MAGIC:
            return True
        end = at + UNIT_HEAD.size + entry_len + frames_len
        if magic not in UNITS or end > size or end - at > MAX_UNIT:
            return False
        body = read(at + UNIT_HEAD.size, end)
        if crc32c(body, crc32c(UNIT_FIELDS.pack(version, prev, entry_len, frames_len))) != crc:
            return False
        try:
            entry = json.loads(body[:entry_len])
        except ValueError:
            return False
        if not isinstance(entry, dict):
            return False
        synced_to = entry.get(SYNCED_TO)
        if synced_to is None or (type(synced_to) is int and synced_to >= torn):
            return True
        at, version, prev = end, version + 1, crc
    return False


def _cut_head(near: bytes, version: int, prev: int) -> bool:
    """Whether ``near`` (a head and the 8 bytes after it) is a head whose write was cut short:
    zeros from inside it into where its entry would start, before them a prefix of the head
    of ``version`` chained to ``prev`` (its magic, then its fields as far as they go)."""
    cut = len(near.rstrip(b"\0"))
    if cut >= UNIT_HEAD.size:
        return False
    if not any(m.startswith(near[:min(cut, 4)]) for m in (*UNITS, ROLL_MAGIC)):
        return False
    expected = UNIT_FIELDS.pack(version, prev, 0, 0)[:12]  # version and prev, at head[8:20]
    return near[8:min(cut, 20)] == expected[:max(0, min(cut, 20) - 8)]


def _failing(data: bytes, at: int, entry_len: int, frames_len: int) -> list[tuple[int, int]]:
    """Where the unit in ``data`` (read from ``at``, maybe short) fails: its entry if it does
    not parse, each frame whose checksum fails, everything from a frame head that does not
    read; the head and entry when all of those pass (then the unit's own checksum failed)."""
    body = UNIT_HEAD.size
    stop = body + entry_len + frames_len
    out = []
    try:
        json.loads(data[body:body + entry_len])
    except ValueError:  # (the head too: its lengths place the entry)
        out.append((at, at + body + entry_len))
    view = memoryview(data)
    q = body + entry_len
    while q < stop:
        if q + FRAME_HEAD.size > len(data):
            out.append((at + q, at + stop))
            break
        magic, length, rows, crc = FRAME_HEAD.unpack_from(data, q)
        after = q + FRAME_HEAD.size + length
        if magic != FRAME_MAGIC or after > stop:
            out.append((at + q, at + stop))
            break
        payload = view[q + FRAME_HEAD.size:after]
        if after > len(data) or \
                crc32c(payload, crc32c(struct.pack("<QI", length, rows))) != crc:
            out.append((at + q, at + after))
        q = after
    return out or [(at, at + body + entry_len)]


def _whole_lengths(read: Read, at: int, size: int) -> tuple[int, int] | None:
    """The lengths of the unit at ``at`` as its bytes tell them (the entry's JSON, then frames
    head to head), ``None`` when they do not."""
    start = at + UNIT_HEAD.size
    window = read(start, min(size, start + _ENTRY_WINDOW))
    try:
        _, entry_len = _DECODER.raw_decode(window.decode("latin-1"))
    except ValueError:
        return None
    q = start + entry_len
    while q + FRAME_HEAD.size <= size:
        frame_head = read(q, q + FRAME_HEAD.size)
        if len(frame_head) < FRAME_HEAD.size:
            break
        magic, length, _rows, _crc = FRAME_HEAD.unpack(frame_head)
        if magic != FRAME_MAGIC or q + FRAME_HEAD.size + length > size:
            break
        q += FRAME_HEAD.size + length
    return entry_len, q - start - entry_len


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"{lo}-{hi}" for lo, hi in ranges[:3])
    return shown + (f" and {len(ranges) - 3} more" if len(ranges) > 3 else "")
