"""kvplane's :mod:`.stats` in vLLM's KV-connector stats types (imports vLLM, like the connector).

Owns :class:`KVPlaneStats` (vLLM's ``KVConnectorStats``: what a side's
``get_kv_connector_stats`` returns, summed across sides and ranks, reduced to vLLM's
"KV Transfer metrics" log line) and :class:`KVPlanePromMetrics` (one ``vllm:kvplane_<key>``
counter per :data:`~.stats.STATS` entry in vLLM's own ``/metrics``, labelled per engine). The
numbers come from :class:`~.stats.StatsTaker`; nothing here reads kvplane state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvplane.errors import UnsupportedError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.metrics.utils import create_metric_per_engine
except ImportError as exc:  # pragma: no cover - exercised where vLLM is absent
    raise UnsupportedError(
        f"kvplane.integrations.vllm.connector_stats runs inside vLLM ({exc})"
    ) from exc

from kvplane.integrations.vllm.stats import STATS, merge, summary


class KVPlaneStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's :data:`~.stats.StatsData` in vLLM's stats envelope."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVPlaneStats:
        if not isinstance(other, KVPlaneStats):
            raise UnsupportedError(f"cannot merge kvplane stats with {type(other).__name__}")
        return KVPlaneStats(data=merge(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)

    def is_empty(self) -> bool:
        return not self.data


class KVPlanePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:kvplane_<key>`` counters (``_total`` on export) fed by each step's stats."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for s in STATS:
            counter = self._counter_cls(
                name=f"vllm:kvplane_{s.key}",
                documentation=f"kvplane: {s.doc}",
                labelnames=labelnames,
            )
            self._counters[s.key] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: Mapping[str, Any], engine_idx: int = 0) -> None:
        """Add one step's stats (keys this version does not know are ignored)."""
        for key, value in transfer_stats_data.items():
            counters = self._counters.get(key)
            if counters is not None and value > 0:
                counters[engine_idx].inc(value)
