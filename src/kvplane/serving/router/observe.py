"""The router's Prometheus metrics: requests (gathered ones too), their ends, pairings, re-pairs,
workers, flights, and the cluster's seed metrics.

:class:`RouterMetrics` owns their names and documentation, in the router's registry (the one
``RouterService`` serves on ``/metrics``, with its order socket's drops). It only counts: it
never decides anything. See docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable

from kvplane.errors import InvalidArgumentError
from kvplane.metrics import MetricsRegistry
from kvplane.pd.states import SessionState
from kvplane.serving.router.seed_metrics import ClusterSeedMetrics, Gather

_ENDS = frozenset(s.value for s in SessionState)
_CAUSES = ("lost", "refused")
"""Why a pair is paired again (``Pairing`` values of ``serving/router/pairings``)."""


class RouterMetrics:
    """The router's metrics in ``registry``. ``flights``: requests in flight now; ``workers``:
    (up, down) now; ``waiting``: pairs waiting out a re-pair backoff now; ``cluster``: the
    workers' counters now (None: no seed metrics, :class:`ClusterSeedMetrics`); all read at
    each scrape."""

    def __init__(
        self,
        registry: MetricsRegistry,
        *,
        flights: Callable[[], int],
        workers: Callable[[], tuple[int, int]],
        waiting: Callable[[], int] = lambda: 0,
        cluster: Gather | None = None,
    ) -> None:
        if cluster is not None:
            registry.register(ClusterSeedMetrics(cluster))
        self.requests = registry.counter("router_requests", "Requests the router sent orders for")
        self.gathered = registry.counter(
            "router_gathered_requests", "Requests sent to a gather set of several prefill ranks"
        )
        self._results = registry.counter(
            "router_results", "Requests ended, by state (failed: the router's failures)", ["state"]
        )
        self.pairings = registry.counter(
            "router_pairings", "Workers (re-)paired by refreshes that had no pairing error"
        )
        self.pairing_errors = registry.counter(
            "router_pairing_errors", "Refreshes in which a pairing failed"
        )
        self._retries = registry.counter(
            "router_repairs",
            "Pairings sent again after a backoff, by cause (lost: reported unpaired; refused)",
            ["cause"],
        )
        for cause in _CAUSES:
            self._retries.labels(cause)  # shown at 0 from the start
        registry.gauge(
            "router_pairs_backing_off", "Lost or refused pairs waiting out their re-pair backoff"
        ).set_function(waiting)
        registry.gauge("router_flights", "Requests in flight").set_function(flights)
        up = registry.gauge("router_workers", "Workers the router knows, by state", ["state"])
        up.labels("up").set_function(lambda: workers()[0])
        up.labels("down").set_function(lambda: workers()[1])

    def retried(self, cause: str) -> None:
        """Count one pairing sent again after its backoff, for ``cause`` (``lost`` or
        ``refused``; anything else is a bug: ``InvalidArgumentError``)."""
        if cause not in _CAUSES:
            raise InvalidArgumentError(f"re-pair cause must be one of {_CAUSES}, got {cause!r}")
        self._retries.labels(cause).inc()

    def ended(self, state: str) -> None:
        """Count one request ended in ``state`` (a session state; anything else: ``other``)."""
        self._results.labels(state if state in _ENDS else "other").inc()
