"""The simulator against a measured ``kvplane demo`` run: its workload simulated and compared.

:func:`check_demo` reads the run's saved trace (:mod:`~kvplane.simulate.demo_trace`),
calibrates a one-prefill, one-decode cluster from that run's own spans
(:mod:`~kvplane.simulate.demo_costs`), replays its requests at their measured arrivals with
their measured steps, slice ops, decodes and (in a trace that has them) order handling
(:func:`replay`) and sets the predicted TTFT median (to the serial decode worker's start of
the request) and overlap beside the measured ones. A demo chunk is 32 tokens, the
simulator's block 512: one demo token is :data:`SCALE` simulated tokens (costs and bytes
divided to match). Runs no demo, imports no serving module. See docs/simulate.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.errors import ConfigError
from kvplane.simulate.demo_costs import CHUNK_TOKENS, DemoCosts, demo_costs
from kvplane.simulate.demo_trace import measured, read_demo_trace
from kvplane.simulate.engine import Simulation
from kvplane.simulate.geometry import KVGeometry
from kvplane.simulate.result import SimResult
from kvplane.simulate.spec import (
    TRACE_BLOCK_TOKENS,
    ClusterSpec,
    DecodeSpec,
    PrefillSpec,
    TierSpec,
    TransportSpec,
)
from kvplane.simulate.summary import simulate
from kvplane.simulate.validate import Comparison
from kvplane.simulate.workload import Replayed, Request

SCALE = TRACE_BLOCK_TOKENS // CHUNK_TOKENS
"""Simulated tokens per demo token: a demo chunk is one simulated block."""
DISK_SLOTS = 64
"""The demo's disk tier, in chunks."""
SimRun = tuple[SimResult, Simulation]


def demo_cluster(costs: DemoCosts, bytes_per_token: int, host_slots: int) -> ClusterSpec:
    """The demo's cluster in simulated tokens: one interleaving prefill worker computing
    pipelined 32-token steps, one serial decode worker, a ``host_slots``-chunk host tier and a
    :data:`DISK_SLOTS`-chunk disk tier (each chunk op ``costs.chunk_op_s``), a link whose op
    takes ``costs.slice_op_s`` whatever its (small) size and lands ``costs.lag_s`` later."""
    per_token = max(1, round(bytes_per_token / SCALE))
    chunk_bytes = TRACE_BLOCK_TOKENS * per_token

    def tier(name: str, slots: int) -> TierSpec:
        return TierSpec(name, slots * chunk_bytes, 1e15, costs.chunk_op_s)

    return ClusterSpec(
        geometry=KVGeometry(
            per_token, per_token, f"the demo's {bytes_per_token} B/token / {SCALE}"
        ),
        prefill=PrefillSpec(
            token_s=costs.prefill_token_s / SCALE,
            step_s=costs.step_s,
            slice_tokens=TRACE_BLOCK_TOKENS,
            setup_s=costs.setup_s,
            interleave=True,
        ),
        decode=DecodeSpec(token_s=costs.decode_token_s, serial=True, accept_s=costs.accept_s),
        transport=TransportSpec(
            bandwidth_bytes_s=1e15, rtt_s=costs.lag_s, op_overhead_s=costs.slice_op_s
        ),
        prefill_workers=1,
        decode_workers=1,
        tiers=(tier("host", host_slots), tier("disk", DISK_SLOTS)),
    )


@dataclass(frozen=True, slots=True)
class DemoPrompt:
    """One demo request: its id and prompt."""

    request_id: str
    tokens: tuple[int, ...]


def _block_ids(prompts: Sequence[DemoPrompt]) -> list[tuple[int, ...]]:
    """One id per 32-token chunk of each prompt, equal for equal prefixes; a last, partial
    chunk's id matches nothing."""
    ids: dict[tuple[int, ...], int] = {}
    out = []
    for i, p in enumerate(prompts):
        blocks = []
        for start in range(0, len(p.tokens), CHUNK_TOKENS):
            key = p.tokens[: start + CHUNK_TOKENS]
            if len(key) < start + CHUNK_TOKENS:
                key = (*key, -1 - i)
            blocks.append(ids.setdefault(key, len(ids)))
        out.append(tuple(blocks))
    return out


def replay(
    spec: ClusterSpec,
    prompts: Sequence[DemoPrompt],
    arrivals: Mapping[str, float],
    decode_s: Mapping[str, float],
    output_tokens: int,
    *,
    replayed: Mapping[str, Replayed] | None = None,
) -> SimRun:
    """``prompts`` on ``spec``, each arriving at its ``arrivals`` time (s, counted from the
    earliest), holding the decode worker ``decode_s`` seconds and, when in ``replayed``, its
    measured steps and transfer ops (``Request.replayed``); request ids in arrival order. A
    ``ConfigError`` names a prompt without an arrival or a decode."""
    missing = sorted(p.request_id for p in prompts if p.request_id not in arrivals)
    missing += sorted(p.request_id for p in prompts if p.request_id not in decode_s)
    if missing or not prompts:
        raise ConfigError(f"the demo trace has no order or decode for {', '.join(missing)}")
    blocks = _block_ids(prompts)
    t0 = min(arrivals[p.request_id] for p in prompts)
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[prompts[i].request_id], i))
    measured_costs = replayed or {}
    requests = []
    for rid, i in enumerate(order):
        p = prompts[i]
        n, t = len(p.tokens) * SCALE, arrivals[p.request_id] - t0
        held = decode_s[p.request_id]
        costs = measured_costs.get(p.request_id)
        requests.append(Request(rid, t, n, output_tokens, blocks[i], held, costs))
    return simulate(spec, requests)


def check_demo(
    trace: Mapping[str, Any],
    prompts: Sequence[DemoPrompt],
    *,
    output_tokens: int,
    bytes_per_token: int,
    host_slots: int,
) -> Comparison:
    """The demo run of ``trace`` (its prompts, ``--max-new-tokens``, the model's KV bytes per
    token, ``--host-slots``), replayed (:func:`replay`) on the cluster calibrated from its own
    spans, beside its measured TTFT median (to decode start) and overlap."""
    run = read_demo_trace(trace)
    costs = demo_costs(run, {p.request_id: len(p.tokens) for p in prompts}, output_tokens)
    spec = demo_cluster(costs, bytes_per_token, host_slots)
    result, sim = replay(
        spec, prompts, run.arrivals, costs.decode_s, output_tokens, replayed=costs.replayed
    )
    ttft = statistics.median(o.decode_start_s - o.arrival_s for o in sim.outcomes())
    got_ttft, got_overlap = measured(run)
    return Comparison(
        "demo", "pipelined", ttft * 1e3, got_ttft * 1e3, result.overlap_ratio, got_overlap
    )
