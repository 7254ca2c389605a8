"""The durable consumers of an address: their state files, and the folders of their leases.

A consumer's state is one small JSON object in ``consumers/<name>.json``::

    {"name": "billing", "selector": "region = 'EU'" | null, "position": 1200,
     "created": 1732240000.1, "updated": 1732240060.4,
     "lost": [[first, end, reason], ...]}          # optional, see Consumer._change_selector

``position`` is the acknowledged watermark: every ``_seq`` below it is done. The state file is
created exclusively (two processes creating one consumer agree on one state) and replaced
atomically afterwards; one owner at a time moves it.
"""

from __future__ import annotations

import json
from typing import Any

from ._layout import AddressLayout
from ._storage import NotFound, Storage
from .errors import ConsumerNotFoundError, DamagedMetadataError

__all__ = ["ConsumerRegistry"]


class ConsumerRegistry:
    """Reads and writes the consumer state files of one address.

    Concurrency guarantee: :meth:`create` is exclusive (of concurrent creators one wins, the
    others get ``False`` and read the winner's state); :meth:`save` replaces atomically (a
    reader sees the old or the new state); :meth:`save` of a consumer deleted meanwhile fails
    with :class:`ConsumerNotFoundError` instead of bringing it back.
    """

    def __init__(self, storage: Storage, layout: AddressLayout, address: str) -> None:
        self.storage = storage
        self.layout = layout
        self.address = address

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
        return _parse(data, path)

    def all(self) -> dict[str, dict[str, Any]]:
        """Every consumer's state, by name (consumers deleted while listing are left out)."""
        out = {}
        for fname in sorted(self.storage.list(self.layout.consumers)):
            if not fname.endswith(".json") or fname.startswith((".", "_")):
                continue
            path = f"{self.layout.consumers}/{fname}"
            try:
                state = _parse(self.storage.read(path), path)
            except NotFound:
                continue
            out[str(state.get("name", fname[:-len(".json")]))] = state
        return out

    def create(self, name: str, state: dict[str, Any]) -> bool:
        """Create the state file; ``False`` when another process created it first."""
        self.storage.makedirs(self.layout.consumers)
        return self.storage.create(self.layout.consumer_state(name), json.dumps(state).encode())

    def save(self, name: str, state: dict[str, Any]) -> None:
        """Replace the state of an existing consumer."""
        path = self.layout.consumer_state(name)
        if not self.storage.exists(path):
            raise ConsumerNotFoundError(
                f"consumer {name!r} of address {self.address!r} was deleted")
        self.storage.replace(path, json.dumps(state).encode())

    def delete(self, name: str) -> None:
        """Remove the consumer and its lease records (cleanup no longer keeps pages for it)."""
        self.storage.delete(self.layout.consumer_state(name))
        leases = self.layout.leases(name)
        if self.storage.exists(leases):
            self.storage.delete_tree(leases)

    def lease_folder(self, name: str) -> str:
        return self.layout.leases(name)


def _parse(data: bytes, path: str) -> dict[str, Any]:
    try:
        state = json.loads(data)
        if not isinstance(state, dict):
            raise TypeError(f"a JSON {type(state).__name__}, not an object")
        int(state["position"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DamagedMetadataError(path, f"not a consumer state ({exc})", (
            f"consumer state {path} is damaged ({exc}); delete the file to recreate the "
            "consumer, or restore it")) from exc
    return state
