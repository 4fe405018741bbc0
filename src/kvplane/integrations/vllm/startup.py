"""The connector's start-up checks and messages that need no vLLM.

Owns :func:`failure_policy_warning` (the one warning about ``kv_load_failure_policy="fail"``
with a tier that can fail to read), :func:`serve_metrics` (the private ``/metrics`` ports, a
busy one a one-line ``ConfigError`` naming ``metrics_port``), :func:`kv_events_addresses` (the
KV event sockets' ports) and :func:`sizing_note` (the slots derived from byte sizes, for the
log). The connector calls them once per role; they decide nothing else. Why ``recompute``:
``docs/vllm.md`` ("Failure policy").
"""

from __future__ import annotations

import errno

from kvplane.errors import ConfigError
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.sizing import GIB, slot_cost
from kvplane.metrics import MetricsRegistry, MetricsServer

SCHEDULER_PORT_OFFSET = 1
"""The scheduler side serves on ``metrics_port + 1``, the worker side (rank 0) on
``metrics_port``; rank ``r > 0`` on ``metrics_port + 1 + r`` (:func:`metrics_port_of`)."""


def failure_policy_warning(config: ConnectorConfig, policy: str) -> str | None:
    """The start-up warning for ``kv_load_failure_policy`` ``policy`` with ``config``'s tiers,
    or None. Only a disk or remote tier can fail a load (a host slot is memory); with
    ``"fail"`` vLLM then fails the request, and its offline ``LLM`` API returns the
    request's output without raising."""
    tiers = config.lower_tiers
    if policy != "fail" or not tiers:
        return None
    what = " and ".join(f"the {t} tier" for t in tiers)
    return (
        f"kvplane: kv_load_failure_policy='fail' with {what} configured: a chunk that fails "
        "to load (an outage, a corrupt or missing chunk) fails its request, and the offline "
        "LLM API then returns an output without raising; set kv_load_failure_policy="
        "'recompute' to recompute those tokens instead"
    )


def metrics_port_of(config: ConnectorConfig, *, scheduler: bool, rank: int = 0) -> int:
    """The private metrics port of one side: the scheduler's ``metrics_port + 1``, worker rank
    0's ``metrics_port`` (so TP 1 keeps its two ports), worker rank ``r > 0``'s
    ``metrics_port + 1 + r`` (each rank worker is its own process and needs its own port).
    ``ConfigError`` when that is past 65535."""
    base = config.metrics_port
    port = base + SCHEDULER_PORT_OFFSET if scheduler else base + (rank + 1 if rank else 0)
    if port > 65535:
        raise ConfigError(f"metrics_port={base}: worker rank {rank} would serve on port {port}")
    return port


def kv_events_addresses(config: ConnectorConfig, dp_rank: int = 0) -> tuple[str, str]:
    """The zmq addresses of an engine's KV event sockets (its scheduler side publishes, one per
    engine whatever its TP size): PUB on ``kv_events_port + 2 * dp_rank`` (each data-parallel
    engine is its own process and needs its own ports), the replay ROUTER on the next port.
    ``ConfigError`` when that is past 65535."""
    ev = config.kv_events
    port = ev.port + 2 * dp_rank
    if port + 1 > 65535:
        raise ConfigError(
            f"kv_events_port={ev.port}: data-parallel rank {dp_rank} would publish on port {port}"
        )
    return f"tcp://{ev.host}:{port}", f"tcp://{ev.host}:{port + 1}"


def serve_metrics(
    metrics: MetricsRegistry, config: ConnectorConfig, *, scheduler: bool, rank: int = 0
) -> MetricsServer | None:
    """Serve ``metrics`` on the side's private port (:func:`metrics_port_of`; none when
    ``metrics_port`` is 0). A port in use is a ``ConfigError`` naming the key, not a bare
    ``OSError``."""
    if not config.metrics_port:
        return None
    port = metrics_port_of(config, scheduler=scheduler, rank=rank)
    try:
        return metrics.serve(port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        if scheduler:
            side = "scheduler side (metrics_port + 1)"
        elif rank:
            side = f"worker side of rank {rank} (metrics_port + {rank + 1})"
        else:
            side = "worker side (metrics_port)"
        raise ConfigError(
            f"metrics_port={config.metrics_port}: port {port} for the {side} is already in use "
            "on 127.0.0.1; choose another metrics_port, or 0 for no private metrics port"
        ) from None


def sizing_note(config: ConnectorConfig, chunk_bytes: int, ranks: int = 1) -> str | None:
    """One log line with the slots each byte-sized tier got (per rank with ``ranks`` > 1; a
    host chunk of ``chunk_bytes``, a lower tier's its span of them), or None when none is."""
    parts, spans = [], config.spans
    for tier in ("host", "disk", "remote"):
        if config.sizes.of(tier):
            budget = config.sizes.per_rank(tier, ranks)
            slots = config.tier_slots(tier)
            used = slots * slot_cost(tier, chunk_bytes * spans.get(tier, 1)) / GIB
            parts.append(f"{tier} {slots} slots ({used:.3f} of {budget / GIB:.3f} GiB)")
    if not parts:
        return None
    each = f" per rank of {ranks}" if ranks > 1 else ""
    return f"kvplane: chunks of {chunk_bytes} bytes{each}; " + ", ".join(parts)
