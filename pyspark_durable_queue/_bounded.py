"""Bounded maps: every in-memory cache of the store, with its bound stated and its counters.

Memory must not grow with the backlog, so nothing in the store keeps an unbounded map. Small
caches (parsed page statistics, page footers, selector verdicts) are :class:`BoundedLRU`; the
page cache (``_read.cache``) bounds itself by pages and bytes. Each registers here, and
:func:`memory_bounds` lists them all with their bound and hits/misses (for tests and
benchmarks; ``docs/architecture.md`` lists every bound).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

__all__ = ["BoundedLRU", "memory_bounds", "register"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_REGISTRY: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def register(cache: Any) -> None:
    """List ``cache`` (an object with ``name`` and ``stats()``) in :func:`memory_bounds`."""
    with _LOCK:
        _REGISTRY[id(cache)] = cache


def memory_bounds() -> list[dict[str, Any]]:
    """Every live bounded cache of this process: ``name``, bound and counters."""
    with _LOCK:
        caches = list(_REGISTRY.values())
    return sorted((c.stats() for c in caches), key=lambda s: str(s["name"]))


class BoundedLRU(Generic[K, V]):
    """A thread-safe map holding at most ``max_items`` entries, least recently used out first.

    Parameters
    ----------
    name : str
        What it holds (shown by :func:`memory_bounds`).
    max_items : int
        The bound.
    listed : bool
        Listed by :func:`memory_bounds` (caches owned by many small objects, such as a
        selector's compiled forms, are not: their bound is per owner).
    """

    def __init__(self, name: str, max_items: int, *, listed: bool = True) -> None:
        self.name = name
        self.max_items = max_items
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        if listed:
            register(self)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
                self.evictions += 1

    def get_or_load(self, key: K, load: Callable[[], V]) -> V:
        """The value under ``key``, computed by ``load`` (outside the lock) on a miss."""
        value = self.get(key)
        if value is None:
            value = load()
            self.put(key, value)
        return value

    def pop(self, key: K) -> V | None:
        with self._lock:
            return self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "items": len(self._items), "max_items": self.max_items,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}
