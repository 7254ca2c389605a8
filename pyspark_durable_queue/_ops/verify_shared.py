"""Verifying the states of an address's shared consumers (``durablequeue verify``), in
``consumers/_shared/<name>/``; what they are and how they are written: ``_ops/shared.py``.

The rule: verify reads each state as its readers do, and calls damage what a reader refuses
or what no crash leaves; what a crash leaves, and readers pass over, is a note.

- **Generations** (``<generation>.log``, a local disk). The newest one is the state: a whole,
  checksummed state first, then change records. Damage: its first state is not whole or its
  checksum fails (the consumer cannot be opened), or a checksummed change record that does not
  apply to the state before it (both stop the consumer's handles, whatever caused them: bit
  rot, or a writer killed while it created the file where the filesystem has no hard links and
  files are visible while being written). A note: bytes after the last whole record (a torn tail: a
  writer killed while appending, or a power cut that kept some unsynced appends and not
  others, whole records possibly after the tear); readers stop before them and the next change
  starts a new generation. An older generation is left only by a crash between starting the
  next one and deleting it (the next rotation deletes it) and is never read: damage when its
  first state fails (it was created whole and synced before anything was appended), a note
  for a torn tail (a rotation does not sync the older file first: the appends of other
  processes may still have been in the page cache, and the new generation holds their effect
  whole).
- **Epochs** (numbered files, object stores and ``memory://``): each is written once, whole,
  by a conditional PUT, so any epoch that does not decode is damage.
"""

from __future__ import annotations

import json

from .._format import shared as shared_file
from .._format.layout import SHARED, AddressLayout, is_numbered, numbered
from .._storage import NotFound, Storage
from .repair import PageProblem
from .shared import SharedState

__all__ = ["verify_shared_states"]

_DAMAGE = (ValueError, KeyError, TypeError, IndexError)


def verify_shared_states(storage: Storage, layout: AddressLayout,
                         ) -> tuple[int, list[PageProblem], list[str]]:
    """Check every file of every shared consumer's state of the address (see the module
    docstring); returns ``(files checked, problems, notes)``."""
    folder = f"{layout.consumers}/{SHARED}"
    files, problems, notes = 0, [], []
    for name in sorted(storage.list(folder)):
        checked, found, noted = _verify_one(storage, f"{folder}/{name}", name)
        files += checked
        problems += found
        notes += noted
    return files, problems, notes


def _verify_one(storage: Storage, folder: str, name: str,
                ) -> tuple[int, list[PageProblem], list[str]]:
    names = storage.list(folder)
    generations = sorted(int(n[:-4]) for n in names
                         if n.endswith(".log") and is_numbered(n[:-4]))
    epochs = sorted(int(n) for n in names if is_numbered(n))
    files, problems, notes = 0, [], []
    for generation in generations:
        path = f"{folder}/{numbered(generation)}.log"
        try:
            data = storage.read(path)
        except NotFound:  # rotated away while listing
            continue
        files += 1
        newest = generation == generations[-1]
        problem, note = _verify_generation(path, data, name, newest)
        if problem is not None:
            problems.append(problem)
        if note is not None:
            notes.append(note)
    for epoch in epochs:
        path = f"{folder}/{numbered(epoch)}"
        try:
            data = storage.read(path)
        except NotFound:  # pruned while listing
            continue
        files += 1
        try:
            SharedState.decode(data)
        except _DAMAGE as exc:
            problems.append(PageProblem(path, "corrupt", -1, 0, (
                f"an epoch of shared consumer {name}'s state does not decode ({exc}); epochs "
                "are written once, whole: this is damage"
                + ("" if epoch != epochs[-1] else
                   "; it is the newest, which the consumer's handles cannot read: deleting it "
                   "makes the consumer go on from the epoch before it (rows leased or "
                   "acknowledged since are delivered again)"))))
    return files, problems, notes


def _verify_generation(path: str, data: bytes, name: str,
                       newest: bool) -> tuple[PageProblem | None, str | None]:
    """A generation's problem (damage) and note (a torn tail), as the module docstring says."""
    older = "" if newest else (
        "an older generation, left by a crash between starting the next one and deleting this "
        "one (never read; the next rotation deletes it): ")
    if newest:
        what = (f"shared consumer {name} cannot be opened; deleting the file makes it go on "
                "from its watermark (rows leased or acknowledged since are delivered again)")
    else:
        what = "deleting the file loses nothing (the newest generation is the state)"
    # a generation is created whole and synced (by a link, or with O_EXCL where the
    # filesystem has no hard links: then a writer killed while creating the newest leaves it
    # short, and readers refuse it as they refuse bit rot)
    why = "" if newest else ": no crash leaves that (it was created whole and synced)"
    found, after = shared_file.records(data)
    if not found or not found[0][0]:
        try:
            length = shared_file.state_length(data)
            SharedState.decode(data[:length])
            reason = "its first record is not a whole state"
        except _DAMAGE as exc:
            reason = str(exc)
        return PageProblem(path, "corrupt", -1, 0, (
            f"{older}its first state is not whole and checksummed ({reason}){why}; "
            f"{what}")), None
    at = 0
    state: SharedState | None = None
    for number, (whole, record) in enumerate(found):
        try:
            state = SharedState.decode(record) if whole else (
                state.apply(json.loads(record)) if state is not None else None)
        except _DAMAGE as exc:
            return PageProblem(path, "corrupt", -1, 0, (
                f"{older}record {number} at byte {at} has a sound checksum but does not apply "
                f"to the state before it ({type(exc).__name__}: {exc}); {what}")), None
        at += len(record) if whole else len(record) + 12
    if after < len(data):
        return None, (f"{path}: {older}a torn tail of {len(data) - after} bytes after the last "
                      f"whole record (byte {after}): a change its writer did not finish or "
                      "sync before a crash; readers stop before it and the next change starts "
                      "a new generation")
    return None, None
