"""Executor-side reading: the page slices of one task as Arrow record batches for Spark.

Runs in Spark's Python workers. Whole pages go through the process-wide page cache (bounded by
``pageMaxCacheSize``), with the next page of the task loaded in the background; a slice of a
large page that was split between tasks reads only the frames it needs (range reads). The
selector is applied frame by frame (frame statistics skip frames that cannot match), and the
output is re-cut into batches of about :data:`YIELD_ROWS` rows, which is what the Python-to-JVM
transport handles best (measured in ``benchmarks/bench_source.py``).

"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa

from .._format.page import read_page
from .._format.schema import as_schema, compile_selector, unexpired, user_fields
from .._log.index import PageRef
from .._storage import Storage
from ..errors import DataLossError
from .cache import page_cache
from .scan import Scan

__all__ = ["YIELD_ROWS", "ReadSpec", "read_slices", "rebatch"]

log = logging.getLogger(__name__)

#: Rows per record batch handed to Spark (the environment variable is for benchmarks).
YIELD_ROWS = int(os.environ.get("PYSPARK_DQ_YIELD_ROWS", "8192"))
#: ... and bytes at most: with large messages, 8,192 rows would mean copying 8 MB batches.
YIELD_BYTES = 2 << 20


@dataclass(frozen=True)
class ReadSpec:
    """What every task of a read needs besides its slices (small and picklable).

    Attributes
    ----------
    output : pyarrow.Schema
        The schema Spark expects (``to_arrow_schema`` of the read schema), exactly.
    selector : str or None
        Selector text (the ``selector`` option, AND-ed with pushed filters in batch reads).
    extra : tuple of pyarrow.Field
        Address columns the selector uses that ``output`` lacks.
    expire_before : int or None
        Messages whose ``_timestamp`` (epoch microseconds) is before it have expired and are
        not read (``expiry_delay_ms``, as of the read's plan).
    ttl_now : int or None
        Messages sent with ``ttl_ms`` whose deadline is before it (epoch microseconds) have
        expired and are not read (the read's plan time; ``None``: TTLs are not applied).
    """

    storage: Storage
    pages_folder: str
    output: pa.Schema
    selector: str | None = None
    fail_on_data_loss: bool = True
    page_max_cache_size: int = 5
    yield_rows: int = YIELD_ROWS
    extra: tuple[pa.Field, ...] = ()
    expire_before: int | None = None
    ttl_now: int | None = None

    @property
    def user_schema(self) -> pa.Schema:
        """Columns read from the pages: the output's, plus ``extra`` columns the selector needs
        that a user-given read schema left out (dropped again before Spark sees them)."""
        return pa.schema([*user_fields(self.output), *self.extra])


def rebatch(batches: Iterable[pa.RecordBatch], rows: int,
            max_bytes: int = YIELD_BYTES) -> Iterator[pa.RecordBatch]:
    """Re-cut batches to about ``rows`` rows and at most about ``max_bytes``, in order: large
    ones are sliced (no copy), runs of small ones (a selective selector leaves a few rows per
    frame) are concatenated. The byte cap keeps large messages from being concatenated into
    big copies: frames are already ~1 MiB, so they pass through as they are."""
    pending: list[pa.RecordBatch] = []
    count = size = 0
    for b in batches:
        n = b.num_rows
        if n == 0:
            continue
        target = max(1, min(rows, max_bytes // max(1, b.nbytes // n)))
        if n < target // 2:
            pending.append(b)
            count += n
            size += b.nbytes
            if count >= target or size >= max_bytes:
                yield pa.concat_batches(pending)
                pending, count, size = [], 0, 0
            continue
        if pending:
            yield pa.concat_batches(pending)
            pending, count, size = [], 0, 0
        if n <= target * 3 // 2:
            yield b
            continue
        parts = -(-n // target)
        step = -(-n // parts)
        for at in range(0, n, step):
            yield b.slice(at, step)
    if pending:
        yield pa.concat_batches(pending)


def read_slices(spec: ReadSpec, slices: list[PageRef], *,
                lost_ok: Callable[[PageRef], bool] | None = None,
                resolve: Callable[[int, int], Iterable[PageRef]] | None = None,
                ) -> Iterator[pa.RecordBatch]:
    """The messages of ``slices`` (one task), as record batches of ``spec.output``.

    Parameters
    ----------
    lost_ok : callable, optional
        Called when a page is missing; returns ``True`` to skip it (batch reads: the page was
        removed by cleanup after planning). Otherwise a missing page raises
        :class:`DataLossError`, or is skipped with a warning when ``failOnDataLoss=false``.
    resolve : callable, optional
        The live pages of a ``_seq`` range as the log is now: a page that compaction swapped
        out after planning is read from its successors (see ``Scan``).
    """
    # exactly the schema Spark checks (names, order, types, nullability, metadata)
    return rebatch((as_schema(b, spec.output, exact=True)
                    for b in _scan_slices(spec, slices, lost_ok, resolve)), spec.yield_rows)


def _scan_slices(spec: ReadSpec, slices: list[PageRef],
                 lost_ok: Callable[[PageRef], bool] | None,
                 resolve: Callable[[int, int], Iterable[PageRef]] | None,
                 ) -> Iterator[pa.RecordBatch]:
    cache = page_cache()
    cache.limit(spec.pages_folder, spec.page_max_cache_size)
    user = spec.user_schema
    selector = compile_selector(spec.selector, user) if spec.selector else None
    storage = spec.storage
    for k, s in enumerate(slices):
        # read-ahead of the next page; with a selector, scan may read only some frames of it
        if selector is None and k + 1 < len(slices) and slices[k + 1].whole \
                and slices[k + 1].span is None:  # journal ranges are read where they are
            nxt = slices[k + 1]
            nxt_path = f"{spec.pages_folder}/{nxt.name}"
            cache.prefetch(nxt_path, functools.partial(read_page, storage, nxt_path), nxt.bytes)
        try:
            # A slice of a page split between tasks reads only its frames (range reads).
            for batch, _ in Scan(storage, spec.pages_folder, [s], s.lo, s.hi, schema=user,
                                 selector=selector, cache=cache, range_reads=not s.whole,
                                 resolve=resolve, ttl_now=spec.ttl_now):
                if batch is not None and spec.expire_before is not None:
                    batch = unexpired(batch, spec.expire_before)
                if batch is not None and batch.num_rows:
                    yield batch
        except DataLossError:
            if lost_ok is not None and lost_ok(s):
                continue
            if spec.fail_on_data_loss:
                raise
            log.warning("page %s (_seq %d..%d) is missing; skipped because "
                        "failOnDataLoss=false", s.name, s.lo, s.hi - 1)
