"""Memory bounds: the page cache's bound holds with read-ahead in flight, and the read path
stays lean (no pandas, no fsspec for local stores: each costs every Spark worker 12-30 MB)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pyarrow as pa

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._format.page import DecodedPage
from pyspark_durable_queue._read.cache import PageCache


def fake_page(name: str, nbytes: int = 100) -> DecodedPage:
    return DecodedPage(name, [pa.record_batch({"x": [1]})], [{"rows": 1}], nbytes)


def test_read_ahead_stays_within_the_page_bound():
    cache = PageCache(max_pages=3, max_bytes=10_000)
    for name in "abc":
        cache.get(name, lambda name=name: fake_page(name))
    release = threading.Event()

    def slow(name: str) -> DecodedPage:
        release.wait(5)
        return fake_page(name)

    assert cache.prefetch("d", lambda: slow("d"), 100)
    # while "d" is in flight, cached + loading never exceeds max_pages
    assert cache.stats()["pages"] + len(cache._loading) <= 3
    release.set()
    assert cache.get("d", lambda: fake_page("d")).name == "d"
    stats = cache.stats()
    assert stats["pages"] <= 3 and stats["prefetched"] == 1
    assert stats["misses"] == 3  # a, b, c; d came from the read-ahead


def test_read_ahead_respects_the_byte_bound():
    cache = PageCache(max_pages=10, max_bytes=250)
    cache.get("a", lambda: fake_page("a", 100))
    cache.get("b", lambda: fake_page("b", 100))
    assert cache.prefetch("c", lambda: fake_page("c", 100), 100)
    cache.get("c", lambda: fake_page("c", 100))
    assert cache.stats()["bytes"] <= 250
    assert not cache.prefetch("huge", lambda: fake_page("huge", 1000), 1000)


def test_the_cache_keeps_no_count_for_folders_it_holds_no_page_of():
    # A process that reads many addresses one after the other (the corruption sweep reads
    # ~20,000 copies) must not make each insertion walk every folder it ever held a page of.
    cache = PageCache(max_pages=10, max_bytes=250)  # two pages of 100 bytes
    for n in range(50):
        cache.get(f"/root/a{n}/pages/p", lambda n=n: fake_page(f"p{n}"))
    assert cache.stats()["pages"] == 2
    assert len(cache._counts) == 2


def test_reading_a_local_store_imports_neither_pandas_nor_fsspec(tmp_path):
    DurableQueue(str(tmp_path)).address("a").send(
        pa.table({"i": pa.array(range(1000)), "s": ["x"] * 1000}))
    code = textwrap.dedent(f"""
        import sys
        from pyspark_durable_queue import DurableQueue
        c = DurableQueue({str(tmp_path)!r}).address("a").consumer("c")
        t = c.receive(max_messages=10_000)
        assert t.num_rows == 1000, t.num_rows
        c.ack(t)
        heavy = sorted(m for m in ("pandas", "fsspec", "pyarrow.compute") if m in sys.modules)
        print(",".join(heavy))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the read path imported {out.stdout.strip()}"


def test_parsed_statistics_are_bounded(tmp_path, monkeypatch):
    import pyspark_durable_queue._log.index as index_mod

    parsed = index_mod._PARSED
    monkeypatch.setattr(parsed, "max_items", 8)
    parsed.clear()
    # statistics per page file (journal=False: a journal's rows carry none)
    a = DurableQueue(str(tmp_path)).address("a", fsync=False, journal=False)
    for i in range(30):
        a.send({"i": i, "color": "red" if i == 29 else "blue"})
    fresh = DurableQueue(str(tmp_path)).address("a")
    idx = fresh.state.pages
    assert [idx.stats(i)["columns"]["i"]["min"] for i in range(30)] == list(range(30))
    assert len(parsed) <= 8
    c = fresh.consumer("reds", selector="color = 'red'")
    assert c.receive().column("i").to_pylist() == [29]
    assert len(parsed) <= 8
    assert parsed.evictions >= 22