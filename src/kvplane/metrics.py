"""Metrics: a registry over prometheus-client, injected where used, and the seed's ratios.

:class:`MetricsRegistry` owns its own collector registry (never the global one) and prefixes
``kvplane_``; the derived ratios are defined here once. See docs/serving.md.
"""

from __future__ import annotations

import math
import socketserver
import threading
from collections.abc import Sequence
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
)

from kvplane.errors import InvalidArgumentError

PREFIX = "kvplane_"

M = TypeVar("M", Counter, Gauge, Histogram)

COUNT_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Histogram buckets for per-op counts (blocks per transfer op, chunks per job)."""
SECONDS_BUCKETS: tuple[float, ...] = (
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0,
)  # fmt: skip


class MetricsRegistry:
    """A per-component-tree metrics registry; every metric name gets the ``kvplane_`` prefix."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}

    def _get(self, kind: type[M], name: str, doc: str, labels: Sequence[str], **kw: Any) -> M:
        if not name or not name.replace("_", "").isalnum():
            raise InvalidArgumentError(f"metric name must be [a-z0-9_]+, got {name!r}")
        full = name if name.startswith(PREFIX) else PREFIX + name
        existing = self._metrics.get(full)
        if existing is not None:
            if not isinstance(existing, kind) or tuple(existing._labelnames) != tuple(labels):
                raise InvalidArgumentError(
                    f"metric {full!r} already registered as {type(existing).__name__}"
                    f"{tuple(existing._labelnames)}, asked for {kind.__name__}{tuple(labels)}"
                )
            return existing
        metric = kind(full, doc, labelnames=tuple(labels), registry=self.registry, **kw)
        self._metrics[full] = metric
        return metric

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """Get or create a counter (``_total`` is appended by prometheus-client on export)."""
        return self._get(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._get(Gauge, name, doc, labels)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = SECONDS_BUCKETS,
    ) -> Histogram:
        return self._get(Histogram, name, doc, labels, buckets=tuple(buckets))

    def value(self, name: str, labels: dict[str, str] | None = None, suffix: str = "") -> float:
        """Current sample value (e.g. ``suffix="_total"`` for counters); 0.0 if never set."""
        full = (name if name.startswith(PREFIX) else PREFIX + name) + suffix
        got = self.registry.get_sample_value(full, labels or {})
        return 0.0 if got is None else float(got)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return bytes(generate_latest(self.registry))

    def serve(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Expose ``/metrics`` over HTTP on ``addr:port`` (loopback unless told otherwise) on
        a daemon thread; ``OSError`` if the port is taken. See :class:`MetricsServer`."""
        server = make_server(
            addr, port, make_wsgi_app(self.registry), MetricsServer, handler_class=_Quiet
        )
        threading.Thread(target=server.serve_forever, name="kvplane-metrics", daemon=True).start()
        return server


HTTP_TIMEOUT_S = 5.0
"""A ``/metrics`` client silent this long (mid-request or idle) is dropped."""
HTTP_MAX_CLIENTS = 16
"""Connections a ``/metrics`` server serves at once; more are closed unanswered."""


class _Quiet(WSGIRequestHandler):
    timeout = HTTP_TIMEOUT_S  # socket timeout per connection: no client holds a thread forever

    def log_message(self, format: str, *args: Any) -> None:
        """No access log (a scraper every few seconds is not news)."""


class MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    """The ``/metrics`` HTTP server: a thread per connection, at most
    :data:`HTTP_MAX_CLIENTS` of them, each dropped after :data:`HTTP_TIMEOUT_S` of silence,
    so idle or half-sent connections cannot pile up threads."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(HTTP_MAX_CLIENTS)
        super().__init__(*args, **kwargs)

    def stop(self) -> None:
        """Stop serving and close the listening socket (its thread ends); idempotent."""
        self.shutdown()
        self.server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # over the cap: closed unanswered
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _ratio(num: float, den: float, what: str) -> float:
    if num < 0 or den < 0:
        raise InvalidArgumentError(f"{what}: negative input ({num}, {den})")
    return num / den if den > 0 else 0.0


def transfer_amplification(bytes_moved: float, logical_bytes: float) -> float:
    """Bytes moved / logical bytes needed (1.0 is ideal). Nothing needed: 0.0 when nothing
    moved either, ``inf`` when bytes moved anyway (every byte was waste, never "better than
    ideal")."""
    if logical_bytes == 0 and bytes_moved > 0:
        return math.inf
    return _ratio(bytes_moved, logical_bytes, "transfer_amplification")


def overlap_ratio(hidden_transfer_s: float, total_transfer_s: float) -> float:
    """Transfer time hidden under prefill compute / total transfer time, in [0, 1]."""
    if hidden_transfer_s > total_transfer_s:
        raise InvalidArgumentError(
            f"overlap_ratio: hidden time {hidden_transfer_s} exceeds total {total_transfer_s}"
        )
    return _ratio(hidden_transfer_s, total_transfer_s, "overlap_ratio")


def fallback_ratio(plans_on_fallback: int, plans: int) -> float:
    """Plans resolved to a non-first backend candidate / plans."""
    return _ratio(plans_on_fallback, plans, "fallback_ratio")
