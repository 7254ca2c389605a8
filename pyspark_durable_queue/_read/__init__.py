"""Reading an address: the page cache, scanning with a selector, planning, executor tasks, and the
read surface for the Spark readers.

- :mod:`.cache`: the page cache, the memory coordinator of a process (``PageCache``);
- :mod:`.scan`: navigating pages with a selector; ``Snapshot``, an immutable view of the log;
- :mod:`.plan`: micro-batch admission and task planning (a task is a list of ``PageRef`` slices);
- :mod:`.tasks`: executor-side reading of planned slices.

Above the commit log (``_log``) and the on-disk formats; below the writes and maintenance
(``_ops``) and the client. The rest of this module is the engine's read surface for the Spark
readers: plan a read on the driver, run its tasks on executors.

The readers (``spark/_reader.py``, ``spark/_source.py``, ``spark/_batch.py``) take everything
they need for reading from here, the system columns and selector compilation from
:mod:`.._format.schema`, and the address itself from the public ``Address`` / ``Consumer``; they
never build storage, layouts or commit logs themselves. What this module offers:

- driver, planning: :func:`admit` and :class:`Limits` (how far a micro-batch goes),
  :func:`batch_budget` (the default read limit), :func:`plan_tasks` (the slices of each task,
  :class:`PageRef` of :mod:`.._log.index`), from :mod:`.plan`;
- driver, describing: :data:`EARLIEST` (the default start of a batch read, and of an address a
  pattern finds later), :class:`ReadPosition` (where a read starts),
  :func:`seq_ranges_text` (ranges in data-loss messages);
- executors: :func:`read_task`, the messages of one task of an address, located by its root
  URL, storage options and name (what a pickled reader carries); the caller hands it an
  :data:`OpenAddress`, which opens the address should a page be missing.

Needs no pyspark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import pyarrow as pa

from .._format.layout import AddressLayout
from .._log.index import PageRef
from .._log.state import LogState, seq_ranges_text
from .._positions import EARLIEST, ReadPosition
from .._storage import Storage, open_storage
from .plan import Limits, admit, batch_budget, parallelism, plan_tasks, share_limits
from .tasks import ReadSpec, read_slices

__all__ = [
    "EARLIEST",
    "Limits",
    "LiveAddress",
    "OpenAddress",
    "PageRef",
    "ReadPosition",
    "admit",
    "batch_budget",
    "parallelism",
    "plan_tasks",
    "read_task",
    "seq_ranges_text",
    "share_limits",
]



class LiveAddress(Protocol):
    """What a read task asks of its address when a page is missing: the pages as the log is
    now (``Address`` implements it)."""

    @property
    def state(self) -> LogState: ...

    def live_refs(self, first: int, end: int) -> list[PageRef]: ...


#: Opens the address named by the second argument under a storage, never creating it: given by
#: the caller of :func:`read_task`, which knows how an address is opened
#: (``functools.partial(Address.open, create=False)``).
OpenAddress = Callable[[Storage, str], LiveAddress]


def read_task(root: str, storage_options: dict[str, Any] | None, address: str,
              slices: Sequence[PageRef], output: pa.Schema, *, selector: str | None,
              fail_on_data_loss: bool, page_max_cache_size: int,
              open_address: OpenAddress, extra: tuple[pa.Field, ...] = (),
              skip_removed: bool = False,
              expire_before: int | None = None,
              ttl_now: int | None = None) -> Iterator[pa.RecordBatch]:
    """Executor: the messages of one task (``slices`` from :func:`plan_tasks`) of ``address``
    under ``root``, as record batches of exactly ``output``.

    Opens no address file: the slices say which pages to read.

    Parameters
    ----------
    selector : str or None
        Selector text, applied frame by frame.
    page_max_cache_size : int
        The address's ``pageMaxCacheSize`` (planned on the driver), bounding its pages in this
        process's cache.
    open_address : OpenAddress
        Opens the address, called only when a page is missing (rare): a page compaction
        swapped out after planning, or one cleanup removed.
    extra : tuple of pyarrow.Field
        Address columns the selector uses that ``output`` lacks (read, then dropped).
    skip_removed : bool
        Skip a missing page that the commit log no longer lists (batch reads: cleanup removed
        it after planning). Otherwise a missing page is data loss (see ``fail_on_data_loss``).
    expire_before : int or None
        Messages sent before it (epoch microseconds) have expired and are not read.
    ttl_now : int or None
        The plan's time (epoch microseconds): messages sent with ``ttl_ms`` that expired by
        then are not read.
    """
    storage = open_storage(root, storage_options)
    layout = AddressLayout(storage.join(address))
    spec = ReadSpec(storage, layout.pages, output, selector, fail_on_data_loss,
                    page_max_cache_size, extra=extra, expire_before=expire_before, ttl_now=ttl_now)
    opened: list[LiveAddress] = []

    def opener() -> LiveAddress:
        # opened only when a page is missing (rare): the address's own log, journal included
        if not opened:
            opened.append(open_address(storage, address))
        return opened[0]

    def resolve(first: int, end: int) -> list[PageRef]:
        # a page compaction swapped out after planning: its messages are in its successors
        return opener().live_refs(first, end)

    def removed(s: PageRef) -> bool:
        return s.name not in set(opener().state.pages.names)

    return read_slices(spec, list(slices), lost_ok=removed if skip_removed else None,
                       resolve=resolve)
