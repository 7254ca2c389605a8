"""``PageRef``: the one reference to published messages of a page, built by ``PageIndex.ref``.

Planning, reading and cleanup all work on it; a task's slice is a ``PageRef`` narrowed to a
``_seq`` range, and a reference may name only some frames of a file (what a journal will
publish). Real pages on disk, no mocks.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import pyspark_durable_queue
from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.page import read_footer
from pyspark_durable_queue._format.schema import compile_selector
from pyspark_durable_queue._log.index import PageIndex, PageRef
from pyspark_durable_queue._read.cache import PageCache
from pyspark_durable_queue._read.plan import plan_tasks
from pyspark_durable_queue._read.scan import Scan

NAME = "0123456789abcdef0123456789abcdef.page"


def test_the_index_builds_references_from_its_columns():
    idx = PageIndex()
    idx.add("a.page", 0, 10, 1000, 7, {"rows": 10, "columns": {}})
    idx.add("b.page", 10, 5, 500, 8, {"rows": 5, "columns": {}})
    ref = idx.ref(1)
    assert ref == PageRef("b.page", 10, 5, 500, 8)
    assert (ref.end, ref.lo, ref.hi, ref.frames, ref.whole) == (15, 10, 15, None, True)
    assert [r.name for r in idx.refs(0)] == ["a.page", "b.page"]
    assert [r.name for r in idx.refs(10, 15)] == ["b.page"]
    assert [r.name for r in idx.refs(3, 10)] == ["a.page"]


def test_only_the_index_constructs_references():
    """One place builds a ``PageRef`` from index columns; everything else narrows one."""
    package = Path(pyspark_durable_queue.__file__).parent
    builders = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                      if re.search(r"\bPageRef\(", p.read_text()))
    assert builders == ["_log/index.py"]


def test_a_slice_narrows_the_range_read_and_keeps_the_page():
    ref = PageRef(NAME, 100, 50, 5000, 9)
    part = ref.slice(120, 130)
    assert (part.name, part.seq, part.rows, part.bytes, part.lo, part.hi) == (
        NAME, 100, 50, 5000, 120, 130)
    assert not part.whole and part.nbytes == 1000
    assert ref.slice(0, 10**9) == ref  # clamped to the reference
    assert part.slice(125, 200) == ref.slice(125, 150)


@pytest.mark.parametrize("ref", [
    PageRef(NAME, 100, 50, 5000, 9),
    PageRef(NAME, 100, 50, 5000, 9).slice(110, 140),
    PageRef(NAME, 40, 30, 9000, 9, frames=(2, 5)),
    PageRef(NAME, 40, 30, 9000, 9, frames=(2, 5)).slice(45, 50),
], ids=["whole", "slice", "frames", "frames-slice"])
def test_round_trips_through_json_and_pickle(ref):
    doc = json.loads(json.dumps(ref.to_dict()))
    assert PageRef.from_dict(doc) == ref
    assert ("frames" in doc) == (ref.frames is not None)
    assert ("lo" in doc) == (not ref.whole)
    copy = pickle.loads(pickle.dumps(ref))
    assert copy == ref and copy.frames == ref.frames and (copy.lo, copy.hi) == (ref.lo, ref.hi)


def test_pickled_task_slices_are_small():
    ref = PageRef(NAME, 10**9, 16384, 1 << 20, 1_700_000_000_000_000, frames=(3, 9))
    task = [ref.slice(10**9 + k * 100, 10**9 + k * 100 + 100) for k in range(100)]
    assert len(pickle.dumps(ref.slice(10**9 + 5, 10**9 + 50))) < 150
    assert len(pickle.dumps(task)) < 100 * 150
    assert pickle.loads(pickle.dumps(task)) == task


def test_plan_tasks_hands_out_slices_of_index_references():
    idx = PageIndex()
    for k in range(4):
        idx.add(f"p{k}.page", k * 100, 100, 10 << 20, k, {"rows": 100, "columns": {}})
    tasks = plan_tasks(idx, 50, 350, slots=2)
    flat = [s for t in tasks for s in t]
    assert all(isinstance(s, PageRef) for s in flat)
    assert {dataclasses.replace(s, lo=-1, hi=-1) for s in flat} == {
        idx.ref(i) for i in range(4)}
    assert (flat[0].lo, flat[-1].hi) == (50, 350)


@pytest.fixture
def framed(tmp_path):
    """An address with one page of three frames (16,384 rows at most per frame): a page file
    (``journal=False``), whose footer lists its frames."""
    a = DurableQueue(str(tmp_path)).address("q", journal=False)
    n = 40_000
    a.send(pa.table({"id": pa.array(np.arange(n, dtype=np.int64)),
                     "even": pa.array(np.arange(n) % 2 == 0)}))
    ref = a.state.pages.ref(0)
    frames = read_footer(a.storage, a.layout.page(ref.name), ref.bytes)["frames"]
    assert len(frames) == 3
    return a, ref, [int(f["rows"]) for f in frames]


def _ids(a, ref, start, end, **kw):
    out = []
    for batch, _ in Scan(a.storage, a.layout.pages, [ref], start, end, schema=a.schema,
                         cache=PageCache(), **kw):
        if batch is not None:
            out += batch.column("id").to_pylist()
    return out


@pytest.mark.parametrize("how", ["whole-page", "range-reads", "selector"])
def test_a_frame_range_reads_only_those_frames(framed, how):
    a, page, rows = framed
    first = page.seq + rows[0]
    ref = PageRef(page.name, first, rows[1] + rows[2], page.bytes, page.ts, frames=(1, 3))
    kw = {"whole-page": {}, "range-reads": {"range_reads": True},
          "selector": {"selector": compile_selector("_seq >= 0", a.schema)}}[how]
    assert _ids(a, ref, ref.seq, ref.end, **kw) == list(range(first, page.end))
    # a slice inside the range; the selector filters rows after frames were chosen
    assert _ids(a, ref.slice(first + 5, first + 10), first + 5, first + 10,
                **kw) == list(range(first + 5, first + 10))
    middle = PageRef(page.name, first, rows[1], page.bytes, page.ts, frames=(1, 2))
    assert _ids(a, middle, middle.seq, middle.end, **kw) == list(range(first, first + rows[1]))
    # without a range the same page reads whole, as before
    assert _ids(a, page, page.seq, page.end, **kw) == list(range(page.seq, page.end))
