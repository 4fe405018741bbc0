"""The PD transport a connector worker makes, and the regions vLLM's KV memory is in it.

Owns :func:`make_pd_transport` (the configured transport, secret applied) and the
registration of a worker's pools (:func:`register_pools`): under vLLM's hybrid KV cache
manager every KV cache group's pool views one buffer slot by slot, so equal pools share one
region (:func:`pool_buffers`). Moves no byte; decides nothing. See ``docs/vllm.md`` ("PD").
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvplane.errors import UnsupportedError
from kvplane.ids import RegionId
from kvplane.integrations.vllm.groups import HMA_OFF
from kvplane.integrations.vllm.pd_config import PDSettings
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.transports.base import Transport
from kvplane.transports.registry import create_transport


def make_pd_transport(settings: PDSettings) -> Transport:
    """The configured PD transport (``tcp`` listens on ``settings.host``), secret applied."""
    options: dict[str, object] = {"agent": f"{settings.name}.{os.getpid()}"}
    if settings.transport == "tcp":
        options["host"] = settings.host
    if settings.secret is not None:
        options["secret"] = settings.secret
    return create_transport(settings.transport, **options)


def pool_buffers(pools: Sequence[VllmPool]) -> list[int]:
    """For each pool, the index of the first pool viewing the same bytes (its region is that
    one's: groups share vLLM's buffer slot by slot). :class:`UnsupportedError` in one line for
    pools that overlap without being the same bytes (a transport cannot register both)."""
    spans = [(p.tensor.data_ptr(), p.tensor.numel() * p.tensor.element_size()) for p in pools]
    out: list[int] = []
    for i, (lo, size) in enumerate(spans):
        same = next((j for j in range(i) if spans[j] == (lo, size)), i)
        for j in range(i):
            other, osize = spans[j]
            if same == i and lo < other + osize and other < lo + size:
                raise UnsupportedError(
                    f"KV cache groups {j} and {i} view overlapping but unequal memory: PD "
                    f"cannot register both; start vLLM with {HMA_OFF}"
                )
        out.append(same)
    return out


def register_pools(
    transport: Transport, pools: Sequence[VllmPool]
) -> tuple[tuple[RegionId, ...], dict[RegionId, int]]:
    """Register each pool's memory with ``transport`` once (:func:`pool_buffers`): every
    pool's region, and each region's length in bytes (the driver's local regions)."""
    regions: list[RegionId] = []
    local: dict[RegionId, int] = {}
    for p, first in zip(pools, pool_buffers(pools), strict=True):
        if first < len(regions):  # groups view one buffer slot by slot: one region
            regions.append(regions[first])
            continue
        regions.append(RegionId(transport.register(p.tensor).region_id))
        local[regions[-1]] = p.tensor.numel() * p.tensor.element_size()
    return tuple(regions), local
