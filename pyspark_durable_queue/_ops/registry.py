"""The durable consumers of an address: their state files, and the folders of their leases.

A consumer's state is one small JSON object in ``consumers/<name>.json``::

    {"name": "billing", "selector": "region = 'EU'" | null, "position": 1200,
     "created": 1732240000.1, "updated": 1732240060.4,
     "lost": [[first, end, reason], ...]}          # optional, see Consumer._change_selector

``position`` is the acknowledged watermark: every ``_seq`` below it is done. The state file is
created exclusively (two processes creating one consumer agree on one state) and replaced
atomically afterwards; one owner at a time moves it.

From on-disk format 3 (``watermark_files``) the position moves in ``consumers/<name>.wm``
instead (see ``_format.watermark``: one data sync per write on a local disk), which takes precedence
over the state file's ``position`` once it exists; :meth:`ConsumerRegistry.load` and
:meth:`ConsumerRegistry.all` return states with the current position either way.

Rows settled out of order and rows waiting for redelivery are kept in
``consumers/<name>.window`` (see ``_ops/window.py``), written only once a nack made any, with
its own checksum in every format (older releases do not read it: they see the ``.wm``, which
stays below every pending row).

From format 5 (``checksums``) the state file carries its checksum (``_format/checked.py``), and
one without it is damaged.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from .._format import checked
from .._format.layout import AddressLayout
from .._format.watermark import WatermarkFile
from .._storage import NotFound, Storage
from ..errors import ConsumerNotFoundError, DamagedMetadataError
from . import window as _window

__all__ = ["ConsumerRegistry"]


class ConsumerRegistry:
    """Reads and writes the consumer state files of one address.

    Concurrency guarantee: :meth:`create` is exclusive (of concurrent creators one wins, the
    others get ``False`` and read the winner's state); :meth:`save` replaces atomically (a
    reader sees the old or the new state); :meth:`save` of a consumer deleted meanwhile fails
    with :class:`ConsumerNotFoundError` instead of bringing it back.
    """

    def __init__(self, storage: Storage, layout: AddressLayout, address: str, *,
                 watermark_files: bool = False, checksums: bool = False) -> None:
        self.storage = storage
        self.layout = layout
        self.address = address
        #: positions move in ``<name>.wm`` files (on-disk format 3)
        self.watermark_files = watermark_files
        #: state files carry their checksum (on-disk format 5)
        self.checksums = checksums
        self._watermarks: dict[str, WatermarkFile] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # open watermark files and the lock stay in this process
        del state["_watermarks"], state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._watermarks = {}
        self._lock = threading.Lock()

    def _watermark(self, name: str) -> WatermarkFile:
        with self._lock:
            wm = self._watermarks.get(name)
            if wm is None:
                wm = self._watermarks[name] = WatermarkFile(
                    self.storage, self.layout.consumer_watermark(name))
            return wm

    def _with_watermark(self, name: str, state: dict[str, Any]) -> dict[str, Any]:
        if not self.watermark_files:
            return state
        mark = self._watermark(name).read()
        if mark is None:  # not written yet, or never whole (killed while creating it)
            return state
        return dict(state, position=mark.position, updated=mark.time_us / 1e6)

    def _encode(self, state: dict[str, Any]) -> bytes:
        return checked.dumps(state) if self.checksums else json.dumps(state).encode()

    def _deleted(self, name: str) -> ConsumerNotFoundError:
        return ConsumerNotFoundError(f"consumer {name!r} of address {self.address!r} was deleted")

    def load(self, name: str) -> dict[str, Any]:
        """The state of consumer ``name``.

        Raises
        ------
        ConsumerNotFoundError
            It does not exist.
        DamagedMetadataError
            Its file is not a consumer state.
        """
        path = self.layout.consumer_state(name)
        try:
            data = self.storage.read(path)
        except NotFound:
            raise ConsumerNotFoundError(
                f"consumer {name!r} of address {self.address!r} does not exist") from None
        return self._with_watermark(name, _parse(data, path, self.checksums))

    def all(self) -> dict[str, dict[str, Any]]:
        """Every consumer's state, by name (consumers deleted while listing are left out)."""
        out = {}
        for fname in sorted(self.storage.list(self.layout.consumers)):
            if not fname.endswith(".json") or fname.startswith((".", "_")):
                continue
            path = f"{self.layout.consumers}/{fname}"
            try:
                state = _parse(self.storage.read(path), path, self.checksums)
            except NotFound:
                continue
            name = str(state.get("name", fname[:-len(".json")]))
            out[name] = self._with_watermark(name, state)
        return out

    def create(self, name: str, state: dict[str, Any]) -> bool:
        """Create the state file; ``False`` when another process created it first."""
        self.storage.makedirs(self.layout.consumers)
        created = self.storage.create(self.layout.consumer_state(name),
                                      self._encode(state))
        if created:
            # a watermark or window left by a deletion that was killed half-way is not this
            # consumer's
            if self.watermark_files:
                self.storage.delete(self.layout.consumer_watermark(name))
            self.storage.delete(self.layout.consumer_window(name))
        return created

    def save(self, name: str, state: dict[str, Any]) -> None:
        """Replace the state of an existing consumer."""
        path = self.layout.consumer_state(name)
        if not self.storage.exists(path):
            raise self._deleted(name)
        self.storage.replace(path, self._encode(state))

    def acknowledge(self, name: str, state: dict[str, Any], *, state_changed: bool) -> None:
        """Write an acknowledgement: ``state`` carries the consumer's new position. Without
        ``watermark_files`` the state file is replaced; with them the position moves in the
        watermark file, after the state file is replaced when ``state_changed`` (fields other
        than the position and its time changed too)."""
        if not self.watermark_files:
            self.save(name, state)
            return
        if state_changed:
            self.save(name, state)
        # one data sync on a local disk (see _format.watermark)
        path = self.layout.consumer_state(name)
        if not self._watermark(name).write(int(state["position"]),
                                           lambda: self.storage.exists(path)):
            raise self._deleted(name)

    def load_window(self, name: str) -> dict[str, Any] | None:
        """The record of consumer ``name``'s window file (see ``_ops/window.py``), ``None``
        when it has none.

        Raises
        ------
        DamagedMetadataError
            The file is not a window (or fails its checksum).
        """
        path = self.layout.consumer_window(name)
        try:
            data = self.storage.read(path)
        except NotFound:
            return None
        try:
            return _window.decode(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise DamagedMetadataError(path, f"not a consumer window ({exc})", (
                f"consumer window {path} is damaged ({exc}); deleting it makes the consumer "
                "deliver again every row from its watermark on (rows nacked and rows "
                "acknowledged out of order among them)")) from exc

    def save_window(self, name: str, record: dict[str, Any] | None) -> None:
        """Replace consumer ``name``'s window file with ``record`` atomically, or remove it
        (``None``). Called under the consumer's lock, never the publish lock."""
        path = self.layout.consumer_window(name)
        if record is None:
            self.storage.delete(path)
            return
        if not self.storage.exists(self.layout.consumer_state(name)):
            raise self._deleted(name)
        self.storage.replace(path, _window.encode(record))

    def delete(self, name: str) -> None:
        """Remove the consumer and its lease records (cleanup no longer keeps pages for it)."""
        # the watermark first: a deletion killed half-way leaves a consumer at its first
        # position, never a watermark that a new consumer of the name would take for its own
        self.storage.delete(self.layout.consumer_watermark(name))
        self.storage.delete(self.layout.consumer_window(name))
        with self._lock:
            wm = self._watermarks.pop(name, None)
        if wm is not None:
            wm.close()
        self.storage.delete(self.layout.consumer_state(name))
        for folder in (self.layout.leases(name), self.layout.shared(name)):
            if self.storage.exists(folder):
                self.storage.delete_tree(folder)


def _parse(data: bytes, path: str, checksums: bool) -> dict[str, Any]:
    try:
        state = checked.loads(data, required=checksums)
        int(state["position"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DamagedMetadataError(path, f"not a consumer state ({exc})", (
            f"consumer state {path} is damaged ({exc}); delete the file to recreate the "
            "consumer, or restore it")) from exc
    return state
