"""kvplane's counters as vLLM KV-connector stats: the table, per-step deltas, sums, a log line.

Owns :data:`STATS` (each stat vLLM sees: its key, the kvplane counter and labels it reads, its
help text), :class:`StatsTaker` (one side's counter growth since its last take), :func:`merge`
and :func:`summary`. Plain dicts in and out, no vLLM import: the vLLM-typed envelope and the
``vllm:kvplane_*`` Prometheus counters are in :mod:`.connector_stats`. Where each appears:
``docs/vllm.md`` ("Metrics").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kvplane.metrics import PREFIX, MetricsRegistry

Side = Literal["scheduler", "worker"]

StatsData = dict[str, float]
"""One interval's stats: key -> growth of its counter (absent: no growth)."""


@dataclass(frozen=True, slots=True)
class Stat:
    """One vLLM-facing stat: ``key`` (also ``vllm:kvplane_<key>`` in vLLM's ``/metrics``) is
    the growth of kvplane counter ``metric`` with ``labels``, counted by the connector's
    ``side``."""

    key: str
    side: Side
    metric: str
    doc: str
    labels: tuple[tuple[str, str], ...] = ()


def _tier(tier: str) -> tuple[tuple[str, str], ...]:
    return (("tier", tier),)


def _path(path: str) -> tuple[tuple[str, str], ...]:
    return (("path", path),)


_S: Side = "scheduler"
_W: Side = "worker"

STATS: tuple[Stat, ...] = (
    Stat("query_tokens", _S, "vllm_query_tokens", "Prompt tokens asked beyond vLLM's own hit"),
    Stat("hit_tokens", _S, "vllm_hit_tokens", "Tokens loaded into vLLM from kvplane"),
    Stat("hit_chunks_host", _S, "vllm_hit_chunks", "Chunks loaded from host", _tier("host")),
    Stat("hit_chunks_disk", _S, "vllm_hit_chunks", "Chunks loaded from disk", _tier("disk")),
    Stat("hit_chunks_remote", _S, "vllm_hit_chunks", "Chunks loaded from remote", _tier("remote")),
    Stat("stored_chunks", _S, "vllm_stored_chunks", "Chunks stored into host"),
    Stat("store_no_room_chunks", _S, "vllm_store_no_room", "Chunks not stored: no host room"),
    Stat("load_failed_chunks", _S, "vllm_load_failed_chunks", "Chunks that failed to load"),
    Stat("load_error_blocks", _W, "vllm_load_error_blocks", "Blocks reported failed to vLLM"),
    Stat("load_wait_seconds", _W, "vllm_load_wait_seconds", "Forward time spent on loads"),
    Stat("fenced_frees", _S, "vllm_fenced_frees", "Requests freed while their gather ran"),
    Stat("bytes_loaded", _W, "offload_bytes", "Bytes host -> vLLM", _path("host_to_device")),
    Stat("bytes_stored", _W, "offload_bytes", "Bytes vLLM -> host", _path("device_to_host")),
    Stat("bytes_to_disk", _W, "offload_bytes", "Bytes host -> disk", _path("host_to_disk")),
    Stat("bytes_to_remote", _W, "offload_bytes", "Bytes host -> remote", _path("host_to_remote")),
)
"""Every stat, in log order; keys are unique."""

_BY_SAMPLE = {(PREFIX + s.metric + "_total", s.labels): s.key for s in STATS}


class StatsTaker:
    """Reads the :data:`STATS` counters of one ``side``'s :class:`MetricsRegistry` (which that
    side's objects created); each :meth:`take` returns what grew since the previous one. Not
    thread-safe (called from the side's one vLLM thread)."""

    def __init__(self, metrics: MetricsRegistry, side: Side) -> None:
        mine = {(s.metric, tuple(k for k, _ in s.labels)) for s in STATS if s.side == side}
        self._families = [metrics.counter(name, name, labels) for name, labels in sorted(mine)]
        self._last: dict[str, float] = {}

    def take(self) -> StatsData:
        """The growth of the side's :data:`STATS` counters since the last take, only keys that
        grew (``{}`` when none did). Reads only those counters, so it is cheap every step."""
        now: dict[str, float] = {}
        for counter in self._families:
            for sample in next(iter(counter.collect())).samples:
                key = _BY_SAMPLE.get((sample.name, tuple(sorted(sample.labels.items()))))
                if key is not None:
                    now[key] = float(sample.value)
        grown = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last.update(now)
        return {k: d for k, d in grown.items() if d > 0}


def merge(a: Mapping[str, float], b: Mapping[str, float]) -> StatsData:
    """Key-wise sum of two intervals' (or two sides', or two ranks') stats."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v
    return out


def summary(data: Mapping[str, float]) -> dict[str, int | float]:
    """vLLM's log line for an interval: every stat in :data:`STATS` order (counts as ints,
    seconds rounded to ms) and the hit rate of the looked-up tokens (absent with none)."""
    out: dict[str, int | float] = {}
    for s in STATS:
        v = data.get(s.key, 0.0)
        out[s.key] = round(v, 3) if s.key.endswith("seconds") else int(v)
    asked = data.get("query_tokens", 0.0)
    if asked:
        out["hit_rate"] = round(data.get("hit_tokens", 0.0) / asked, 3)
    return out
