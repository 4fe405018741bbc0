"""Tiny clusters and requests whose figures are easy to compute by hand.

``BYTES_PER_TOKEN`` is 512 (GQA, 1 layer, 1 head of 64 float32 dims, K and V); a 512-token
slice at ``SLICE_BW`` takes 0.1 s on the link; prefill computes 1 ms per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvplane.simulate.geometry import gqa_geometry
from kvplane.simulate.spec import (
    ClusterSpec,
    DecodeSpec,
    PrefillSpec,
    TierSpec,
    TransportSpec,
)
from kvplane.simulate.workload import Request

BYTES_PER_TOKEN = 512
SLICE_BW = 512 * 512 / 0.1  # bytes/s: one 512-token slice in 0.1 s
RTT = 0.01
OVERHEAD = 0.005


def tiny_spec(**changes: Any) -> ClusterSpec:
    """One prefill and one decode worker, no tiers, pipelined 512-token slices; ``changes``
    replace ClusterSpec fields."""
    spec = ClusterSpec(
        geometry=gqa_geometry(1, 1, 64, "float32", 1),
        prefill=PrefillSpec(token_s=1e-3, slice_tokens=512),
        decode=DecodeSpec(token_s=0.02),
        transport=TransportSpec(bandwidth_bytes_s=SLICE_BW, rtt_s=RTT, op_overhead_s=OVERHEAD),
        prefill_workers=1,
        decode_workers=1,
    )
    return dataclasses.replace(spec, **changes)


def device_tier(chunks: int, chunk_tokens: int = 512, **changes: Any) -> TierSpec:
    """A device tier of ``chunks`` chunks for the tiny geometry."""
    return TierSpec(
        name="device",
        capacity_bytes=chunks * chunk_tokens * BYTES_PER_TOKEN,
        bandwidth_bytes_s=changes.pop("bandwidth_bytes_s", 1e12),
        chunk_tokens=chunk_tokens,
        **changes,
    )


def request(rid: int, at: float, tokens: int, out: int = 11, ids: tuple[int, ...] = ()) -> Request:
    """A request of ``tokens`` prompt tokens; block ids ``ids`` or unique ones from rid."""
    blocks = -(-tokens // 512)
    return Request(rid, at, tokens, out, ids or tuple(rid * 1000 + b for b in range(blocks)))
