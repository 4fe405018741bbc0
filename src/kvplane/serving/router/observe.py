"""The router's Prometheus metrics: requests, their ends, pairings, workers and flights.

:class:`RouterMetrics` owns their names and documentation, in the router's registry (the one
``RouterService`` serves on ``/metrics``, with its order socket's drops). It only counts: it
never decides anything. See docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable

from kvplane.metrics import MetricsRegistry
from kvplane.pd.states import SessionState

_ENDS = frozenset(s.value for s in SessionState)


class RouterMetrics:
    """The router's metrics in ``registry``. ``flights``: requests in flight now; ``workers``:
    (up, down) now; both are read at each scrape."""

    def __init__(
        self,
        registry: MetricsRegistry,
        *,
        flights: Callable[[], int],
        workers: Callable[[], tuple[int, int]],
    ) -> None:
        self.requests = registry.counter("router_requests", "Requests the router sent orders for")
        self._results = registry.counter(
            "router_results", "Requests ended, by state (failed: the router's failures)", ["state"]
        )
        self.pairings = registry.counter(
            "router_pairings", "Workers (re-)paired by refreshes that had no pairing error"
        )
        self.pairing_errors = registry.counter(
            "router_pairing_errors", "Refreshes in which a pairing failed"
        )
        registry.gauge("router_flights", "Requests in flight").set_function(flights)
        up = registry.gauge("router_workers", "Workers the router knows, by state", ["state"])
        up.labels("up").set_function(lambda: workers()[0])
        up.labels("down").set_function(lambda: workers()[1])

    def ended(self, state: str) -> None:
        """Count one request ended in ``state`` (a session state; anything else: ``other``)."""
        self._results.labels(state if state in _ENDS else "other").inc()
