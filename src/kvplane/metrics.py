"""Metrics: a registry over prometheus-client, injected where used, and the seed's six metrics.

:class:`MetricsRegistry` owns its own collector registry (never the global one) and prefixes
``kvplane_``; the derived ratios, the names of the six families every role exposes
(:data:`SEED_METRICS`) and the integer form in which a histogram travels between processes
(:func:`histogram_counters`, :class:`HistogramTotals`) are defined here once. See
docs/serving.md.
"""

from __future__ import annotations

import math
import socketserver
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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

FALLBACK_RATIO = (
    "attention_fallback_ratio",
    "Attention plans resolved past the first candidate that runs on this platform / plans",
)
"""Name and help of the fallback-ratio gauge (the attention selector sets it)."""
SEED_HISTOGRAMS: tuple[str, ...] = (
    "kvplane_pd_transfer_amplification",
    "kvplane_pd_blocks_per_op",
    "kvplane_pd_overlap_ratio",
    "kvplane_pd_exposed_tail_seconds",
    "kvplane_pd_release_latency_seconds",
)
"""The five seed metrics that are distributions (declared by the PD pipeline's
``RuntimeMetrics``): transfer amplification per slice, blocks per transfer op, overlap ratio,
exposed tail and release latency after a failure."""
SEED_METRICS: tuple[str, ...] = (*SEED_HISTOGRAMS, PREFIX + FALLBACK_RATIO[0])
"""The seed's six metric families, under these names on the ``/metrics`` of every role."""
SUM_SCALE = 10**9
"""A histogram's sum travels as an integer of ``sum * SUM_SCALE`` (nano-units)."""


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

    def register(self, collector: Any) -> None:
        """Add a custom collector (``collect()`` yielding metric families) to this registry;
        its names are the caller's to prefix."""
        self.registry.register(collector)

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


def histogram_counters(registry: MetricsRegistry, names: Iterable[str]) -> dict[str, int]:
    """The histograms ``names`` of ``registry`` as integer counters (how they travel in a
    worker's stats): ``NAME_bucket:LE`` (cumulative), ``NAME_count`` and ``NAME_sum_nano``
    (sum x :data:`SUM_SCALE`, rounded). A name not registered gives nothing."""
    wanted = set(names)
    out: dict[str, int] = {}
    for family in registry.registry.collect():
        if family.name not in wanted or family.type != "histogram":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                out[f"{sample.name}:{sample.labels['le']}"] = int(sample.value)
            elif sample.name.endswith("_count"):
                out[sample.name] = int(sample.value)
            elif sample.name.endswith("_sum"):
                out[f"{sample.name}_nano"] = round(sample.value * SUM_SCALE)
    return out


@dataclass(frozen=True, slots=True)
class HistogramTotals:
    """One histogram summed over processes: ``buckets`` of ``(upper bound, cumulative
    count)`` in increasing order (the last bound ``inf``), ``count`` and ``sum``."""

    name: str
    buckets: tuple[tuple[float, int], ...]
    count: int
    sum: float

    @classmethod
    def of(cls, name: str, counters: Iterable[Mapping[str, int]]) -> HistogramTotals:
        """The sum of the histogram ``name`` over ``counters`` (each one process's
        :func:`histogram_counters`); empty (no buckets, count 0) where none has it."""
        by_bound: dict[float, int] = {}
        count = total = 0
        head = f"{name}_bucket:"
        for c in counters:
            for key, value in c.items():
                if key.startswith(head):
                    bound = float(key[len(head) :])
                    by_bound[bound] = by_bound.get(bound, 0) + int(value)
            count += int(c.get(f"{name}_count", 0))
            total += int(c.get(f"{name}_sum_nano", 0))
        return cls(name, tuple(sorted(by_bound.items())), count, total / SUM_SCALE)

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (0 <= q <= 1) by linear interpolation inside its bucket, as
        Prometheus' ``histogram_quantile`` does (the top finite bound for the ``inf`` bucket);
        0.0 with no observations."""
        if not 0.0 <= q <= 1.0:
            raise InvalidArgumentError(f"quantile must be in [0, 1], got {q}")
        if not self.count or not self.buckets:
            return 0.0
        rank = q * self.count
        lower, below = 0.0, 0
        for bound, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = (bound if not math.isinf(bound) else lower), cumulative
        return lower
