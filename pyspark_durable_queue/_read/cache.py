"""The process-wide page cache: decoded pages shared by every consumer in a process.

This is the memory coordinator's store (Artemis ``page-max-cache-size``, ActiveMQ's linked
PendingCache/HeadQueueCache with a fixed amount of RAM): one LRU per process shared by all
consumers and readers, so that two consumers reading close together fetch a page from storage
once.

Bound: per address, at most ``page_max_cache_size`` decoded pages (the address setting, which a
Spark read may override for its query; each reader states it with :meth:`PageCache.limit`), and
at most ``max_bytes`` bytes in all, pages being read ahead included (room is made before a
read-ahead starts). Pages larger than the byte bound are returned but never cached. Counters
(hits, misses, evictions, read-ahead loads, bytes read) are exposed by :meth:`PageCache.stats`
and listed with every other bound by ``_bounded.memory_bounds``.

Eager loading (the seeds' eager loader, AMQ-688's batch loading): :meth:`PageCache.prefetch`
loads the next page in a background thread while the caller decodes the current one; it takes
the place of the least recently used pages of that address, never more than half of its share
at a time.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._bounded import BoundedLRU, register
from .._format.page import DecodedPage

__all__ = ["FOOTERS", "PageCache", "page_cache"]

FOOTERS = 1024


class PageCache:
    """A thread-safe LRU of decoded pages, bounded per address (see the module docstring).

    Keys are page paths; a page belongs to the address whose pages folder holds it.

    Parameters
    ----------
    max_pages : int
        Most pages held per address until a reader states the address's bound
        (:meth:`limit`); the default of ``pageMaxCacheSize``.
    max_bytes : int
        Most bytes held in all, counted as the pages' file sizes.
    """

    name = "page cache"

    def __init__(self, max_pages: int = 5, max_bytes: int = 256 << 20) -> None:
        self.max_pages = max_pages
        self.max_bytes = max_bytes
        self._limits: dict[str, int] = {}  # pages folder -> most pages held for that address
        self._pages: OrderedDict[str, DecodedPage] = OrderedDict()
        self._counts: dict[str, int] = {}  # pages folder -> pages held
        self._bytes = 0
        self._lock = threading.Lock()
        self._loading: dict[str, Future[DecodedPage]] = {}
        self._footers: BoundedLRU[str, dict[str, Any]] = BoundedLRU("page footers", FOOTERS)
        self._pool: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.bytes_read = 0
        self.prefetched = 0
        self.prefetch_hits = 0
        register(self)

    def limit(self, folder: str, max_pages: int) -> None:
        """Hold at most ``max_pages`` pages of the address whose pages live in ``folder``
        (its ``pageMaxCacheSize``); readers call it before reading an address."""
        with self._lock:
            self._limits[folder] = max(1, int(max_pages))
            self._evict(folder)

    def _bound(self, folder: str) -> int:
        return self._limits.get(folder, self.max_pages)

    def get(self, key: str, load: Callable[[], DecodedPage]) -> DecodedPage:
        """The page under ``key``, loading (outside the lock) on a miss."""
        with self._lock:
            page = self._pages.get(key)
            if page is not None:
                self._pages.move_to_end(key)
                self.hits += 1
                return page
            pending = self._loading.get(key)
            if pending is None:
                self.misses += 1
            else:
                self.prefetch_hits += 1
        if pending is not None:
            try:
                return pending.result()
            except Exception:  # a failed read-ahead is retried here, where errors surface
                pass
        page = load()
        self._put(key, page)
        return page

    def prefetch(self, key: str, load: Callable[[], DecodedPage], nbytes: int) -> bool:
        """Start loading ``key`` in the background if it fits in free room.

        Returns whether a load was started. Errors of the background load are not raised
        here; :meth:`get` loads again and raises them where the page is needed.
        """
        folder = _folder(key)
        with self._lock:
            if key in self._pages or key in self._loading:
                return False
            bound = self._bound(folder)
            loading = sum(1 for k in self._loading if _folder(k) == folder)
            # Read-ahead takes the place of the least recently used pages of the address (as
            # the seeds' PendingCache grows, the HeadQueueCache shrinks), but at most half its
            # share is ever in flight, so the page a reader is on is never pushed out for it.
            if loading >= max(1, bound // 2) or nbytes > self.max_bytes:
                return False
            # Make room now, so that cached pages plus pages being read ahead stay within the
            # bounds while the read is in flight.
            while (self._counts.get(folder, 0) + loading + 1 > bound
                   or self._bytes + nbytes > self.max_bytes):
                if not self._evict_one(folder if self._counts.get(folder, 0) else None):
                    break
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="dq-readahead")
            future = self._pool.submit(self._background, key, load)
            self._loading[key] = future
            self.prefetched += 1
            return True

    def _background(self, key: str, load: Callable[[], DecodedPage]) -> DecodedPage:
        try:
            page = load()
            self._put(key, page)
            return page
        finally:
            with self._lock:
                self._loading.pop(key, None)

    def _put(self, key: str, page: DecodedPage) -> None:
        with self._lock:
            self.bytes_read += page.nbytes
            if key not in self._pages and page.nbytes <= self.max_bytes:
                folder = _folder(key)
                self._pages[key] = page
                self._counts[folder] = self._counts.get(folder, 0) + 1
                self._bytes += page.nbytes
                self._evict(folder)

    def footer(self, key: str, load: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A page's footer (frame index and per-frame statistics), kept in a small LRU of
        ``FOOTERS`` entries: what selective reads consult before fetching frames."""
        return self._footers.get_or_load(key, load)

    def note_read(self, nbytes: int) -> None:
        """Count bytes read around the cache (partial page reads)."""
        with self._lock:
            self.bytes_read += nbytes

    def peek(self, key: str) -> bool:
        with self._lock:
            return key in self._pages

    def discard(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._counts.clear()
            self._footers.clear()
            self._bytes = 0

    def _drop(self, key: str) -> DecodedPage | None:
        page = self._pages.pop(key, None)
        if page is not None:
            folder = _folder(key)
            self._counts[folder] -= 1
            if not self._counts[folder]:
                # (``_evict`` walks the folders that hold pages: not every one ever read)
                del self._counts[folder]
            self._bytes -= page.nbytes
        return page

    def _evict_one(self, folder: str | None) -> bool:
        """Evict the least recently used page (of ``folder``, when given)."""
        for key in self._pages:
            if folder is None or _folder(key) == folder:
                self._drop(key)
                self.evictions += 1
                return True
        return False

    def _evict(self, folder: str) -> None:
        """Evict what exceeds ``folder``'s bound (only its count or bound just changed) and
        the byte bound: not a walk over every folder the cache holds pages of."""
        count = self._counts.get(folder, 0)
        while count > self._bound(folder) and self._evict_one(folder):
            count -= 1
        while self._pages and self._bytes > self.max_bytes:
            self._evict_one(None)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"name": self.name, "pages": len(self._pages), "bytes": self._bytes,
                    "max_pages": self.max_pages, "max_bytes": self.max_bytes,
                    "limits": dict(self._limits),
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                    "bytes_read": self.bytes_read, "prefetched": self.prefetched,
                    "prefetch_hits": self.prefetch_hits}


def _folder(key: str) -> str:
    return key.rpartition("/")[0]


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
