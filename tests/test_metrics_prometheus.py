"""Prometheus metrics (issue 41): the collector a process registers, and the ``/metrics``
endpoint of ``durablequeue ROOT metrics`` scraped over HTTP on loopback from a real subprocess.

Values are checked against ``stats()`` after sends, acknowledgements and nacks, and the
exposition is parsed with ``prometheus_client``'s own parser."""

from __future__ import annotations

import logging
import re
import sys
import urllib.error
import urllib.request

import pytest
from conftest import _serving
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue.metrics import DurableQueueCollector, register_collector


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _scrape(registry: CollectorRegistry):
    return _samples(generate_latest(registry).decode())


def _store(root):
    q = DurableQueue(str(root))
    orders = q.address("orders", fsync="never")
    orders.send([{"n": i} for i in range(10)])
    billing = orders.consumer("billing")
    batch = billing.receive(6)
    billing.nack(batch.slice(1, 1), delay_ms=60_000)
    billing.ack(batch)  # settles 0 and 2..5; _seq 1 waits for redelivery
    billing.close()
    orders.consumer("audit")
    q.address("events", fsync="never").send([{"e": "x"}] * 3)
    return q


def test_the_collector_exports_what_stats_says(tmp_path):
    q = _store(tmp_path)
    registry = CollectorRegistry()
    collector = register_collector(str(tmp_path), registry)
    assert isinstance(collector, DurableQueueCollector)
    got = _scrape(registry)
    for name in ("orders", "events"):
        s = q.address(name).stats()
        a = (("address", name),)
        assert got[("durablequeue_address_up", a)] == 1
        assert got[("durablequeue_address_messages", a)] == s["messages"]
        assert got[("durablequeue_address_bytes", a)] == s["bytes"]
        assert got[("durablequeue_messages_sent_total", a)] == s["next_seq"]
        assert got[("durablequeue_messages_dropped_total", a)] == s["dropped_messages"]
        assert got[("durablequeue_retention_removed_messages_total", a)] == 0
        assert got[("durablequeue_address_expired_messages", a)] == s["expired_messages"] == 0
        assert got[("durablequeue_address_consumers", a)] == len(s["consumers"])
        for consumer, row in s["consumers"].items():
            c = (("address", name), ("consumer", consumer))
            assert got[("durablequeue_consumer_backlog_messages", c)] == row["backlog_messages"]
            assert got[("durablequeue_consumer_backlog_bytes", c)] == row["backlog_bytes"]
            assert got[("durablequeue_consumer_acknowledged_messages_total", c)] == \
                row["ack_point"]
            assert got[("durablequeue_consumer_redelivery_pending_messages", c)] == \
                row["redelivery_pending"]
            assert got[("durablequeue_consumer_in_flight_messages", c)] == row["in_flight"]
            assert got[("durablequeue_consumer_dead_lettered_messages_total", c)] == 0
            age = got[("durablequeue_consumer_oldest_unsettled_age_seconds", c)]
            assert abs(age - row["oldest_unsettled_age_ms"] / 1000) < 5
    # and the figures themselves (independent of stats): what the test did
    billing = (("address", "orders"), ("consumer", "billing"))
    assert got[("durablequeue_consumer_acknowledged_messages_total", billing)] == 6
    assert got[("durablequeue_consumer_redelivery_pending_messages", billing)] == 1
    assert got[("durablequeue_consumer_redelivery_delayed_messages", billing)] == 1
    assert got[("durablequeue_consumer_backlog_messages", billing)] == 9  # from _seq 1
    assert got[("durablequeue_messages_sent_total", (("address", "events"),))] == 3


def test_each_scrape_reads_the_store_as_it_is_then(tmp_path):
    q = _store(tmp_path)
    registry = CollectorRegistry()
    register_collector(str(tmp_path), registry)
    a = (("address", "orders"),)
    audit = (("address", "orders"), ("consumer", "audit"))
    first = _scrape(registry)
    q.address("orders").send([{"n": i} for i in range(5)])
    c = q.address("orders").consumer("audit")
    c.ack(c.receive(4))
    c.close()
    q.address("late", fsync="never").send([{"x": 1}])
    second = _scrape(registry)
    assert second[("durablequeue_messages_sent_total", a)] == \
        first[("durablequeue_messages_sent_total", a)] + 5
    assert second[("durablequeue_consumer_acknowledged_messages_total", audit)] == \
        first[("durablequeue_consumer_acknowledged_messages_total", audit)] + 4
    assert second[("durablequeue_address_up", (("address", "late"),))] == 1
    q.delete_address("late")
    assert ("durablequeue_address_up", (("address", "late"),)) not in _scrape(registry)


def test_names_follow_prometheus_conventions(tmp_path):
    _store(tmp_path)
    registry = CollectorRegistry()
    register_collector(str(tmp_path), registry)
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    assert len(families) >= 20
    for family in families:
        assert re.fullmatch(r"durablequeue_[a-z0-9_]+", family.name), family.name
        assert family.documentation, family.name
        labels = {k for s in family.samples for k in s.labels}
        assert labels <= {"address", "consumer"}, family.name
        if family.type == "counter":
            assert all(s.name == family.name + "_total" for s in family.samples
                       if not s.name.endswith("_created")), family.name
        else:
            assert not family.name.endswith("_total"), family.name
        assert not re.search(r"_(ms|milliseconds|secs|kb|mb)(_|$)", family.name), family.name


def test_registering_reads_nothing_and_an_empty_store_exports_only_the_scrape_time(tmp_path):
    registry = CollectorRegistry(auto_describe=True)
    register_collector(str(tmp_path / "not-yet"), registry)  # describe(): no store read
    assert not (tmp_path / "not-yet").exists()
    got = _scrape(registry)
    assert [name for name, _ in got] == ["durablequeue_scrape_duration_seconds"]
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        register_collector(str(tmp_path), registry)


def test_a_damaged_address_is_down_and_does_not_break_the_scrape(tmp_path, caplog):
    _store(tmp_path)
    meta = tmp_path / "orders" / "address.json"
    good = meta.read_bytes()
    meta.write_bytes(b"{not json")
    registry = CollectorRegistry()
    register_collector(str(tmp_path), registry)
    with caplog.at_level(logging.WARNING, logger="pyspark_durable_queue.metrics"):
        first = _scrape(registry)
        second = _scrape(registry)
    orders = (("address", "orders"),)
    assert first[("durablequeue_address_up", orders)] == 0
    assert second[("durablequeue_address_up", orders)] == 0
    assert ("durablequeue_address_messages", orders) not in second
    # the other address is exported as before
    assert second[("durablequeue_address_up", (("address", "events"),))] == 1
    assert second[("durablequeue_address_messages", (("address", "events"),))] == 3
    warnings = [r for r in caplog.records if "'orders'" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not every scrape
    meta.write_bytes(good)  # repaired: up again
    third = _scrape(registry)
    assert third[("durablequeue_address_up", orders)] == 1
    assert third[("durablequeue_address_messages", orders)] == 10


def test_the_endpoint_serves_metrics_over_http(tmp_path):
    q = _store(tmp_path)
    args = [sys.executable, "-m", "pyspark_durable_queue.cli", str(tmp_path), "metrics",
            "--host", "127.0.0.1", "--port", "0"]
    with _serving(args, r"http://127\.0\.0\.1:(\d+)/metrics", "durablequeue metrics") as port:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            got = _samples(response.read().decode())
        s = q.address("orders").stats()
        a = (("address", "orders"),)
        assert got[("durablequeue_address_up", a)] == 1
        assert got[("durablequeue_messages_sent_total", a)] == s["next_seq"] == 10
        billing = (("address", "orders"), ("consumer", "billing"))
        assert got[("durablequeue_consumer_backlog_messages", billing)] == \
            s["consumers"]["billing"]["backlog_messages"]
        # a send between scrapes is in the next one: collected on scrape
        q.address("orders").send([{"n": 99}])
        with urllib.request.urlopen(url, timeout=30) as response:
            assert _samples(response.read().decode())[
                ("durablequeue_messages_sent_total", a)] == 11
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=30)
        assert missing.value.code == 404


def test_the_endpoint_serves_ipv6_loopback(tmp_path):
    import socket

    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    _store(tmp_path)
    args = [sys.executable, "-m", "pyspark_durable_queue.cli", str(tmp_path), "metrics",
            "--host", "::1", "--port", "0"]
    with _serving(args, r"http://\[::1\]:(\d+)/metrics", "durablequeue metrics",
                  host="::1") as port:
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=30) as response:
            got = _samples(response.read().decode())
        assert got[("durablequeue_address_up", (("address", "orders"),))] == 1


def test_every_metric_the_operations_guide_names_is_exported(tmp_path):
    """docs/operations.md's Monitoring section (its table and alert rules) names only metrics
    a scrape has."""
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    section = doc[doc.index("## Monitoring"):doc.index("## Routine maintenance")]
    named = set(re.findall(r"\bdurablequeue_[a-z_]*[a-z]", section))
    _store(tmp_path)
    registry = CollectorRegistry()
    register_collector(str(tmp_path), registry)
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    exported = {f.name for f in families} | {s.name for f in families for s in f.samples}
    assert len(named) >= 15
    assert named <= exported, named - exported


def test_dead_letters_are_counted_per_consumer_and_their_address_is_an_address(tmp_path):
    q = DurableQueue(str(tmp_path))
    jobs = q.address("jobs", fsync="never", max_delivery_attempts=2, dead_letter_address="DLQ")
    jobs.send([{"id": i} for i in range(5)])
    c = jobs.consumer("w")
    for _ in range(2):  # _seq 0 fails twice: dead-lettered
        got = c.receive(1)
        assert got.column("id").to_pylist() == [0]
        c.nack(got, delay_ms=0)
    c.ack(c.receive(10))
    c.close()
    registry = CollectorRegistry()
    register_collector(str(tmp_path), registry)
    got = _scrape(registry)
    w = (("address", "jobs"), ("consumer", "w"))
    assert got[("durablequeue_consumer_dead_lettered_messages_total", w)] == 1
    assert got[("durablequeue_consumer_dead_letters_dropped_messages_total", w)] == 0
    assert got[("durablequeue_address_messages", (("address", "DLQ"),))] == 1  # its depth
    assert q.address("jobs").stats()["consumers"]["w"]["dead_lettered"] == 1


def test_shared_consumers_export_their_leased_rows_and_handles(tmp_path):
    q = DurableQueue(str(tmp_path))
    jobs = q.address("jobs", fsync="never")
    jobs.send([{"id": i} for i in range(10)])
    one = jobs.consumer("pool", shared=True, prefetch=1)
    two = jobs.consumer("pool", shared=True, prefetch=1)
    assert one.receive(3).num_rows == 3  # held: leased to one
    two.ack(two.receive(2))  # settled: leased to nobody
    jobs.consumer("audit").close()  # an exclusive consumer: no shared families
    registry = CollectorRegistry()
    register_collector(str(tmp_path), registry)
    got = _scrape(registry)
    pool = (("address", "jobs"), ("consumer", "pool"))
    audit = (("address", "jobs"), ("consumer", "audit"))
    assert got[("durablequeue_consumer_leased_messages", pool)] == 3
    assert got[("durablequeue_consumer_handles", pool)] == 2
    assert got[("durablequeue_consumer_in_flight_messages", pool)] == 3
    assert ("durablequeue_consumer_leased_messages", audit) not in got
    assert ("durablequeue_consumer_handles", audit) not in got
    one.close()  # gives its three rows back: none leased, one handle forgotten
    got = _scrape(registry)
    assert got[("durablequeue_consumer_leased_messages", pool)] == 0
    assert got[("durablequeue_consumer_handles", pool)] == 1
    two.close()
