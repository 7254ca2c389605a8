"""Prometheus metrics of a store: a collector of every address and consumer under a root.

Two ways to export them:

* ``durablequeue ROOT metrics [--host 127.0.0.1] [--port 9108]`` serves ``/metrics`` (the CLI's
  ``metrics`` command, :func:`serve`);
* :func:`register_collector` adds a collector to a process that already serves ``/metrics``
  (a web service with ``prometheus_client``)::

      from pyspark_durable_queue.metrics import register_collector
      register_collector("/data/dq")  # into prometheus_client.REGISTRY

Metrics are collected on each scrape (no background thread): the collector reads
:meth:`Address.stats` of every address, which reads no messages (see ``_ops/metrics.py``).
Opened addresses are kept between scrapes and refreshed by each one. An address that cannot be
read (damaged, deleted while listed) does not break the scrape: it is exported as
``durablequeue_address_up{address} 0`` and logged once, until it can be read again.

Names follow Prometheus' conventions: the ``durablequeue_`` prefix, units as suffixes
(``_bytes``, ``_seconds``), ``_total`` for counters, labels ``address`` and ``consumer``. Rates
are Prometheus' to compute: ``rate(durablequeue_messages_sent_total[5m])`` is the send rate,
``rate(durablequeue_consumer_acknowledged_messages_total[5m])`` a consumer's (it counts the
``_seq`` its ack point passed, so messages its selector skipped count too). The table of
metrics is ``docs/operations.md`` ("Monitoring").
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .address import Address
from .queue import DurableQueue

__all__ = ["DurableQueueCollector", "register_collector", "serve"]

log = logging.getLogger(__name__)

_A = ["address"]
_C = ["address", "consumer"]

#: (name, kind, help, value of an address's stats or a consumer's row). Counters are named
#: with ``_total``. Figures of expiry and dead letters are read with ``.get(key, 0)`` (the
#: stats of a consumer row built before they existed have none).
_ADDRESS: list[tuple[str, str, str, Any]] = [
    ("durablequeue_address_messages", "gauge", "Messages retained by the address.",
     lambda s: s["messages"]),
    ("durablequeue_address_bytes", "gauge", "Bytes of the pages the address retains.",
     lambda s: s["bytes"]),
    ("durablequeue_address_pages", "gauge", "Live pages (page files and journal rows).",
     lambda s: s["pages"]),
    ("durablequeue_address_consumers", "gauge", "Durable consumers of the address.",
     lambda s: len(s["consumers"])),
    ("durablequeue_oldest_message_age_seconds", "gauge",
     "Age of the first retained message (0 without any).",
     lambda s: s["oldest_message_age_ms"] / 1000),
    ("durablequeue_messages_sent_total", "counter",
     "Messages stored since the address was created (its next _seq).",
     lambda s: s["next_seq"]),
    ("durablequeue_messages_dropped_total", "counter",
     "Messages the DROP policy dropped.", lambda s: s["dropped_messages"]),
    ("durablequeue_bytes_dropped_total", "counter",
     "Bytes the DROP policy dropped.", lambda s: s["dropped_bytes"]),
    ("durablequeue_retention_removed_messages_total", "counter",
     "Messages retention removed before every consumer had passed them.",
     lambda s: s["retention_removed_messages"]),
    ("durablequeue_retention_removed_bytes_total", "counter",
     "Bytes retention removed before every consumer had passed them.",
     lambda s: s["retention_removed_bytes"]),
    ("durablequeue_address_expired_messages", "gauge",
     "Retained messages past the address's expiry delay, never delivered (a lower bound by "
     "at most a page).", lambda s: s.get("expired_messages", 0)),
    ("durablequeue_expired_removed_messages_total", "counter",
     "Messages removed by cleanup because every message of their page had expired (settled, "
     "not lost).", lambda s: s.get("expired_removed_messages", 0)),
    ("durablequeue_expired_moved_messages_total", "counter",
     "Expired messages moved to the address's expiry address.",
     lambda s: s.get("expired_moved_messages", 0)),
    ("durablequeue_messages_lost_total", "counter",
     "Messages repair gave up (damaged pages or journal).", lambda s: s["lost_messages"]),
    ("durablequeue_scheduled_messages", "gauge",
     "Messages scheduled for later delivery and not appended yet (SQS's Delayed).",
     lambda s: s.get("scheduled_messages", 0)),
]
_CONSUMER: list[tuple[str, str, str, Any]] = [
    ("durablequeue_consumer_backlog_messages", "gauge",
     "Messages after the consumer's watermark (whatever its selector).",
     lambda c: c["backlog_messages"]),
    ("durablequeue_consumer_backlog_bytes", "gauge",
     "Bytes of the messages after the consumer's watermark.", lambda c: c["backlog_bytes"]),
    ("durablequeue_consumer_oldest_unsettled_age_seconds", "gauge",
     "Age of the message at the consumer's watermark, whatever its selector (0: none).",
     lambda c: c["oldest_unsettled_age_ms"] / 1000),
    ("durablequeue_consumer_in_flight_messages", "gauge",
     "Messages delivered and not settled, as the consumer's owner last reported them.",
     lambda c: c["in_flight"]),
    ("durablequeue_consumer_redelivery_pending_messages", "gauge",
     "Messages nacked and not settled since.", lambda c: c["redelivery_pending"]),
    ("durablequeue_consumer_redelivery_delayed_messages", "gauge",
     "Nacked messages whose redelivery delay has not passed.",
     lambda c: c["redelivery_delayed"]),
    ("durablequeue_consumer_max_delivery_count", "gauge",
     "Highest delivery count among the messages waiting for redelivery.",
     lambda c: c["max_delivery_count"]),
    ("durablequeue_consumer_acknowledged_messages_total", "counter",
     "The consumer's ack point: _seq positions it settled (with skipped ones).",
     lambda c: c["ack_point"]),
    ("durablequeue_consumer_dead_lettered_messages_total", "counter",
     "Messages moved to the dead-letter address.", lambda c: c.get("dead_lettered", 0)),
    ("durablequeue_consumer_dead_letters_dropped_messages_total", "counter",
     "Messages past their delivery attempts dropped for want of a dead-letter address.",
     lambda c: c.get("dead_letters_dropped", 0)),
]

#: Of shared consumers only (``shared=True``: its handles' leases, ``_ops/shared.py``).
_SHARED: list[tuple[str, str, str, Any]] = [
    ("durablequeue_consumer_leased_messages", "gauge",
     "Messages of a shared consumer leased to its handles (received, not settled).",
     lambda c: c["leased"]),
    ("durablequeue_consumer_handles", "gauge",
     "Handles of a shared consumer that hold leases or were seen lately.",
     lambda c: c["handles"]),
]


class _Families:
    """One table of metrics (``_ADDRESS``, ``_CONSUMER``, ``_SHARED``) with its labels: its
    families, empty (``describe``) or filled by one scrape (:meth:`add`)."""

    def __init__(self, table: list[tuple[str, str, str, Any]], labels: list[str]) -> None:
        self.table = table
        self.labels = labels
        self.families = self.empty()

    def empty(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        return [CounterMetricFamily(name, doc, labels=self.labels) if kind == "counter"
                else GaugeMetricFamily(name, doc, labels=self.labels)
                for name, kind, doc, _ in self.table]

    def add(self, labels: list[str], row: dict[str, Any]) -> None:
        """A sample of each metric, from ``row`` (an address's stats, a consumer's row)."""
        for family, (_, _, _, value) in zip(self.families, self.table, strict=True):
            family.add_metric(labels, value(row))


class DurableQueueCollector:
    """A ``prometheus_client`` collector of every address and consumer under a store root.

    Concurrency guarantee: scrapes of one collector are serialised (its ``_lock`` guards the
    opened addresses and the addresses whose failure was logged); any number of processes may
    scrape one store.

    Parameters
    ----------
    root : str
        The store root (a local path or an fsspec URL).
    storage_options : dict, optional
        fsspec options of the root.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.queue = DurableQueue(root, storage_options)
        self._lock = threading.Lock()
        #: addresses opened by earlier scrapes (one handle each, refreshed by every scrape)
        self._open: dict[str, Address] = {}
        #: addresses whose failure was logged (again only after they recover)
        self._failed: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        """The metric families, without samples: registering reads no store."""
        for table, labels in ((_ADDRESS, _A), (_CONSUMER, _C), (_SHARED, _C)):
            yield from _Families(table, labels).families
        yield GaugeMetricFamily("durablequeue_address_up", "", labels=_A)
        yield GaugeMetricFamily("durablequeue_scrape_duration_seconds", "")

    def collect(self) -> Iterator[Metric]:
        """Every address's metrics as they are now (called by ``prometheus_client`` on each
        scrape)."""
        with self._lock:
            started = time.monotonic()
            up = GaugeMetricFamily("durablequeue_address_up",
                                   "1 when the address's stats could be read, else 0.",
                                   labels=_A)
            addresses = _Families(_ADDRESS, _A)
            consumers = _Families(_CONSUMER, _C)
            shared = _Families(_SHARED, _C)
            names = self.queue.addresses()
            for gone in set(self._open) - set(names):
                del self._open[gone]
            for name in names:
                stats = self._stats(name)
                up.add_metric([name], 0 if stats is None else 1)
                if stats is None:
                    continue
                addresses.add([name], stats)
                for consumer, row in stats["consumers"].items():
                    consumers.add([name, consumer], row)
                    if row.get("shared"):
                        shared.add([name, consumer], row)
            yield up
            for group in (addresses, consumers, shared):
                yield from group.families
            took = GaugeMetricFamily("durablequeue_scrape_duration_seconds",
                                     "How long the collector took to read the store.")
            took.add_metric([], time.monotonic() - started)
            yield took

    def _stats(self, name: str) -> dict[str, Any] | None:
        """``stats()`` of address ``name``, ``None`` when it cannot be read (logged once)."""
        try:
            address = self._open.get(name)
            if address is None:
                address = self._open[name] = self.queue.address(name, create=False)
            stats = address.stats()
        except Exception as exc:
            # whatever one address raises (damaged metadata or log, deleted while listed, a
            # store error), the scrape goes on with the others: it is reported as down
            self._open.pop(name, None)
            if name not in self._failed:
                self._failed.add(name)
                log.warning("metrics: address %r of %s cannot be read, exported as "
                            "durablequeue_address_up 0 until it can: %s", name,
                            self.queue.storage.url, exc)
            return None
        if name in self._failed:
            self._failed.discard(name)
            log.info("metrics: address %r can be read again", name)
        return stats


def register_collector(root: str, registry: CollectorRegistry | None = None, *,
                       storage_options: dict[str, Any] | None = None) -> DurableQueueCollector:
    """Register a :class:`DurableQueueCollector` of the store at ``root`` in ``registry``
    (default: ``prometheus_client.REGISTRY``, what ``start_http_server`` and the usual
    ``/metrics`` handlers serve) and return it. ``registry.unregister(collector)`` removes it.

    Raises
    ------
    ValueError
        The registry holds metrics of these names already (a collector of another store: use
        a registry of its own per store, or one collector).
    """
    collector = DurableQueueCollector(root, storage_options)
    (REGISTRY if registry is None else registry).register(collector)
    return collector


def serve(root: str, host: str = "127.0.0.1", port: int = 9108, *,
          storage_options: dict[str, Any] | None = None,
          ready: Any = None) -> None:
    """Serve the store's metrics at ``http://host:port/metrics`` until interrupted (the
    CLI's ``metrics`` command). ``port=0`` takes a free port; ``ready(url)`` is called once
    the server listens."""
    registry = CollectorRegistry(auto_describe=False)
    register_collector(root, registry, storage_options=storage_options)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, status, kind = generate_latest(registry), 200, CONTENT_TYPE_LATEST
            elif path == "/":
                body, status, kind = b'<a href="/metrics">/metrics</a>\n', 200, "text/html"
            else:
                body, status, kind = b"not found: see /metrics\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics: " + format, *args)

    server_class: type[ThreadingHTTPServer] = ThreadingHTTPServer
    if ":" in host:  # an IPv6 address (``::1``, ``::``)
        class _IPv6Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6

        server_class = _IPv6Server
    server = server_class((host, port), Handler)
    server.daemon_threads = True
    try:
        bound_host, bound_port = server.server_address[:2]
        shown = f"[{bound_host!s}]" if ":" in str(bound_host) else str(bound_host)
        if ready is not None:
            ready(f"http://{shown}:{bound_port}/metrics")
        server.serve_forever()
    finally:
        server.server_close()
