"""The process-wide page cache: decoded pages shared by every consumer in a process.

This is the memory coordinator's store (Artemis ``page-max-cache-size``, ActiveMQ's linked
PendingCache/HeadQueueCache with a fixed amount of RAM): one LRU per process, bounded by a number
of pages *and* a number of bytes, shared by all consumers and readers of all addresses in the
process, so that two consumers reading close together fetch a page from storage once.

Bound: at most ``max_pages`` decoded pages and ``max_bytes`` bytes are held by the cache. Pages
larger than the byte bound are returned but never cached. Counters (hits, misses, evictions,
bytes read) are exposed by :meth:`PageCache.stats`.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ._page import DecodedPage

__all__ = ["PageCache", "page_cache"]


class PageCache:
    """A thread-safe LRU of decoded pages.

    Parameters
    ----------
    max_pages : int
        Most pages held (``pageMaxCacheSize``).
    max_bytes : int
        Most bytes held, counted as the pages' file sizes.
    """

    def __init__(self, max_pages: int = 5, max_bytes: int = 256 << 20) -> None:
        self.max_pages = max_pages
        self.max_bytes = max_bytes
        self._pages: OrderedDict[str, DecodedPage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.bytes_read = 0

    def resize(self, max_pages: int | None = None, max_bytes: int | None = None) -> None:
        with self._lock:
            if max_pages is not None:
                self.max_pages = max_pages
            if max_bytes is not None:
                self.max_bytes = max_bytes
            self._evict()

    def get(self, key: str, load: Callable[[], DecodedPage]) -> DecodedPage:
        """The page under ``key``, loading (outside the lock) on a miss."""
        with self._lock:
            page = self._pages.get(key)
            if page is not None:
                self._pages.move_to_end(key)
                self.hits += 1
                return page
            self.misses += 1
        page = load()
        with self._lock:
            self.bytes_read += page.nbytes
            if key not in self._pages and page.nbytes <= self.max_bytes:
                self._pages[key] = page
                self._bytes += page.nbytes
                self._evict()
        return page

    def peek(self, key: str) -> bool:
        with self._lock:
            return key in self._pages

    def discard(self, key: str) -> None:
        with self._lock:
            page = self._pages.pop(key, None)
            if page is not None:
                self._bytes -= page.nbytes

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._bytes = 0

    def _evict(self) -> None:
        while self._pages and (len(self._pages) > self.max_pages or self._bytes > self.max_bytes):
            _, page = self._pages.popitem(last=False)
            self._bytes -= page.nbytes
            self.evictions += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"pages": len(self._pages), "bytes": self._bytes,
                    "max_pages": self.max_pages, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "bytes_read": self.bytes_read}


_CACHE: PageCache | None = None
_CACHE_PID = -1
_CACHE_LOCK = threading.Lock()


def page_cache() -> PageCache:
    """This process's page cache (a fresh one after ``fork``)."""
    global _CACHE, _CACHE_PID
    with _CACHE_LOCK:
        if _CACHE is None or _CACHE_PID != os.getpid():
            _CACHE = PageCache()
            _CACHE_PID = os.getpid()
        return _CACHE
