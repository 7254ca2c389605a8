"""Driver-side planning of reads: how far a micro-batch goes, and how it is cut into tasks.

Offsets are ``_seq`` watermarks: a micro-batch reads ``start <= _seq < end``. Both decisions work
on the commit log's page index (a few numbers per page), never on messages:

- :func:`admit` walks pages from ``start`` and stops where a read limit (messages, bytes, pages)
  would be exceeded; pages the selector provably cannot match cost nothing.
- :func:`plan_tasks` cuts ``[start, end)`` into tasks of the same number of bytes: small pages
  are coalesced into one task, pages are split into row ranges where a task boundary falls,
  pages the selector cannot match are left out. The task count follows the data size. A task
  is a list of :class:`PageRef` slices.

"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._log.index import PageIndex, PageRef
from ..settings import AddressSettings
from .scan import page_may_match

if TYPE_CHECKING:
    from .._selector import Selector

__all__ = ["Limits", "admit", "batch_budget", "parallelism", "plan_tasks", "share_limits"]

#: Tasks never get less than this much data unless the whole batch is smaller.
MIN_TASK_BYTES = 8 << 20
#: Tasks never get more than this much data: larger batches get more tasks.
MAX_TASK_BYTES = 128 << 20
#: Cache-fulls of data per task slot in a default micro-batch (see :func:`batch_budget`).
TASKS_PER_SLOT = 4
#: A task boundary is not placed where it would cut off less than this from a page.
_MIN_SPLIT_BYTES = 256 << 10


def parallelism() -> int:
    """Task slots assumed when sizing batches and tasks (the driver's cores; local mode)."""
    return max(1, os.cpu_count() or 1)


def batch_budget(settings: AddressSettings, slots: int | None = None) -> int:
    """Bytes one micro-batch admits when no ``max*PerTrigger`` option is given.

    The memory model: a task streams its pages through its worker's page cache, so it never
    holds more than ``pageMaxCacheSize`` pages of ``pageSizeBytes``, however much it reads; a
    micro-batch is ``TASKS_PER_SLOT`` such cache-fulls per task slot. This is the default read
    limit (``ReadMaxBytes``), so ``Trigger.AvailableNow`` over a large backlog runs as several
    bounded batches (why four: ``docs/decisions.md``).
    """
    slots = parallelism() if slots is None else slots
    return (max(1, settings.page_max_cache_size) * settings.page_size_bytes * slots
            * TASKS_PER_SLOT)


@dataclass(frozen=True)
class Limits:
    """Read limits of one micro-batch (``None``: unlimited); ``min_rows`` from ``ReadMinRows``."""

    rows: int | None = None
    bytes: int | None = None
    pages: int | None = None
    min_rows: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.rows is None and self.bytes is None and self.pages is None

    def tighten(self, other: Limits) -> Limits:
        def low(a: int | None, b: int | None) -> int | None:
            return b if a is None else a if b is None else min(a, b)

        return Limits(low(self.rows, other.rows), low(self.bytes, other.bytes),
                      low(self.pages, other.pages), self.min_rows or other.min_rows)


def _matcher(index: PageIndex, selector: Selector | None) -> Callable[[int], bool]:
    """Whether page ``i`` may hold a message the selector takes (``True`` without one)."""
    if selector is None:
        return lambda i: True

    def may(i: int) -> bool:
        stats: dict[str, Any] = index.stats(i) or {}
        return page_may_match(selector, stats, index.ref(i))

    return may


def admit(index: PageIndex, start: int, target: int, limits: Limits,
          selector: Selector | None = None) -> int:
    """The end offset of a micro-batch starting at ``start``: as far as ``limits`` allow, never
    past ``target`` (the log's next ``_seq``, or the AvailableNow target).

    At least one message is admitted when one is available, however large it is, so a limit
    smaller than a message cannot stall the query. Returns ``start`` when there is nothing to
    read (or less than ``min_rows``).
    """
    if target <= start:
        return start
    if limits.unlimited and limits.min_rows is None:
        return target
    may = _matcher(index, selector)
    end = start
    rows = 0
    nbytes = 0.0
    pages = 0
    i = index.find(start)
    while i < len(index) and index.seq[i] < target:
        lo, hi = max(start, index.seq[i]), min(index.ends[i], target)
        if not may(i):
            end = hi  # skipped without reading: free
            i += 1
            continue
        if limits.pages is not None and pages >= limits.pages:
            break
        per_row = max(1e-9, index.bytes[i] / max(1, index.rows[i]))
        take = hi - lo
        if limits.rows is not None:
            take = min(take, limits.rows - rows)
        if limits.bytes is not None:
            take = min(take, int((limits.bytes - nbytes) // per_row))
        if take <= 0 and rows == 0:
            take = 1  # one message always goes
        if take <= 0:
            break
        end = lo + take
        rows += take
        nbytes += take * per_row
        pages += 1
        if end < hi:
            break
        i += 1
    else:
        end = target  # nothing retained up to target (removed or never written): skip over
    if limits.min_rows is not None and rows < limits.min_rows:
        return start
    return end


def share_limits(limits: Limits, backlog: dict[str, int]) -> dict[str, Limits]:
    """The limits of one micro-batch over several addresses, shared among them in proportion to
    their backlogs (``backlog``: messages available in each), as Kafka's source shares
    ``maxOffsetsPerTrigger`` among partitions.

    Each address with a backlog gets at least one message (or byte, or page) of every limit, so
    the batch as a whole may exceed a limit by at most one unit per address; an address without
    a backlog gets nothing. With several addresses, ``min_rows`` applies to the whole batch and
    is the caller's to check: the shares carry none. One address keeps ``limits``.
    """
    if len(backlog) == 1:
        return dict.fromkeys(backlog, limits)
    total = sum(n for n in backlog.values() if n > 0)

    def part(value: int | None, n: int) -> int | None:
        if value is None:
            return None
        return max(1, int(value * n / total)) if n > 0 else 0

    shares = {}
    for name, n in backlog.items():
        shares[name] = Limits(part(limits.rows, n), part(limits.bytes, n),
                              part(limits.pages, n))
    return shares


def plan_tasks(index: PageIndex, start: int, end: int, *, selector: Selector | None = None,
               slots: int | None = None, min_tasks: int | None = None,
               runs: Sequence[tuple[int, int]] | None = None) -> list[list[PageRef]]:
    """Cut ``[start, end)`` into tasks of equal size (lists of page slices, in ``_seq`` order);
    ``runs`` (sorted, disjoint ``[lo, hi)`` ranges in it): only those rows.

    As many tasks as task slots, unless that makes tasks smaller than :data:`MIN_TASK_BYTES`
    (fewer tasks) or larger than :data:`MAX_TASK_BYTES` (more tasks), and at least
    ``min_tasks`` (``minPartitions``) while there are messages to split. Task boundaries fall
    anywhere inside a page, by rows, so the tasks are balanced whatever the page sizes: small
    pages are coalesced, a large page is split. Pages the selector cannot match are left out.
    """
    may = _matcher(index, selector)
    wanted: list[PageRef] = []
    for lo, hi in [(start, end)] if runs is None else runs:
        i = index.find(lo)
        while i < len(index) and index.seq[i] < hi:
            if may(i):
                wanted.append(index.ref(i).slice(lo, hi))
            i += 1
    if not wanted:
        return []
    total = sum(s.nbytes for s in wanted)
    slots = parallelism() if slots is None else slots
    count = max(1, math.ceil(total / MAX_TASK_BYTES),
                min(slots, math.ceil(total / MIN_TASK_BYTES)))
    forced = min_tasks is not None and min_tasks > count
    if min_tasks is not None and forced:
        count = min(min_tasks, sum(s.hi - s.lo for s in wanted))
    share = total / count
    tasks: list[list[PageRef]] = [[]]
    size = 0.0
    for s in wanted:
        per_row = max(1e-9, s.bytes / max(1, s.rows))
        lo = s.lo
        while lo < s.hi:
            take = s.hi - lo
            if len(tasks) < count:
                take = min(take, int((share - size) / per_row))
                if 0 < take < s.hi - lo and take * per_row < _MIN_SPLIT_BYTES and tasks[-1] \
                        and not forced:
                    take = 0  # a sliver is not worth a split: the next task starts here
                if forced and take <= 0 and not tasks[-1]:
                    take = 1  # a task of large messages: at least one each
            if take > 0:
                tasks[-1].append(s.slice(lo, lo + take))
                size += take * per_row
                lo += take
            if lo < s.hi:
                tasks.append([])
                size = 0.0
    return [t for t in tasks if t]
