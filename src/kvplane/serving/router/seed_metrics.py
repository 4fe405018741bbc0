"""The seed's six metrics on the router's ``/metrics``: the cluster's, summed over its workers.

:class:`ClusterSeedMetrics` is a collector in the router's registry. At each scrape it asks the
workers that are up for their stats (one bounded round, the router's ``gather_stats``) and
exposes the families of :data:`~kvplane.metrics.SEED_METRICS` under the workers' own names: the
five histograms summed bucket by bucket, the fallback ratio as all plans on a fallback / all
plans. A worker that gives no stats is left out of that scrape. It decides nothing and keeps
nothing between scrapes. See docs/serving.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from kvplane.metrics import (
    FALLBACK_RATIO,
    PREFIX,
    SEED_HISTOGRAMS,
    HistogramTotals,
    fallback_ratio,
)

Gather = Callable[[], Iterable[Mapping[str, int]]]
"""Each worker's ``WorkerStats.counters``, now."""


class ClusterSeedMetrics:
    """The collector; ``gather`` gives the workers' counters (see the module docstring)."""

    def __init__(self, gather: Gather) -> None:
        self._gather = gather

    def describe(self) -> list[Metric]:
        """Nothing up front, so registering it asks no worker anything."""
        return []

    def collect(self) -> Iterator[Metric]:
        counters = list(self._gather())
        for name in SEED_HISTOGRAMS:
            yield histogram_family(HistogramTotals.of(name, counters))
        plans = sum(int(c.get("attention_plans", 0)) for c in counters)
        fallbacks = sum(int(c.get("attention_fallbacks", 0)) for c in counters)
        name, doc = FALLBACK_RATIO
        yield GaugeMetricFamily(
            PREFIX + name, f"{doc} (the router's workers)", value=fallback_ratio(fallbacks, plans)
        )


def histogram_family(h: HistogramTotals) -> HistogramMetricFamily:
    """``h`` as a Prometheus histogram family (one ``+Inf`` bucket of 0 when it is empty)."""
    buckets = [(_le(bound), float(n)) for bound, n in h.buckets] or [("+Inf", 0.0)]
    return HistogramMetricFamily(
        h.name, f"{h.name} summed over the router's workers", buckets=buckets, sum_value=h.sum
    )


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))
