"""From a finished :class:`~kvplane.simulate.engine.Simulation` to its :class:`SimResult`, and
the invariants every run must keep (:func:`check_run`).

:func:`simulate` is the one call the command and the tests make: build, run, check, summarise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvplane.metrics import overlap_ratio, transfer_amplification
from kvplane.simulate.engine import Simulation
from kvplane.simulate.result import Outcome, Percentiles, SimResult, TierResult
from kvplane.simulate.spec import ClusterSpec
from kvplane.simulate.tiers import TierCache
from kvplane.simulate.workload import Request


def simulate(spec: ClusterSpec, requests: Sequence[Request]) -> tuple[SimResult, Simulation]:
    """Run ``requests`` on ``spec`` to the end; the summary and the finished simulation."""
    sim = Simulation(spec, requests)
    sim.run()
    check_run(sim)
    return summarize(sim), sim


def check_run(sim: Simulation) -> None:
    """Raise ``AssertionError`` unless every request finished exactly once, every tier's
    stored chunks equal its resident plus evicted ones, and no time runs backwards."""
    twice = [f.req.rid for f in sim.flights if f.finished != 1]
    if twice:
        raise AssertionError(f"{len(twice)} requests did not finish exactly once: {twice[:5]}")
    for tier in all_tiers(sim):
        tier.check_integrity()
    for o in sim.outcomes():
        steps = (o.arrival_s, o.prefill_start_s, o.compute_start_s, o.prefill_end_s, o.ready_s)
        if any(b < a for a, b in itertools.pairwise(steps)):
            raise AssertionError(f"request {o.rid}: times run backwards: {steps}")
        if not o.ready_s <= o.decode_start_s <= o.done_s:
            raise AssertionError(f"request {o.rid}: decode times run backwards")


def all_tiers(sim: Simulation) -> list[TierCache]:
    return [t for p in sim.prefill for t in p.local] + sim.shared


def _tier_results(sim: Simulation, makespan: float) -> tuple[TierResult, ...]:
    by_name: dict[str, list[TierCache]] = {}
    for tier in all_tiers(sim):
        by_name.setdefault(tier.spec.name, []).append(tier)
    out = []
    for spec in sim.spec.tiers:
        tiers = by_name[spec.name]
        size = tiers[0].chunk_bytes
        hits = sum(t.hit_chunks for t in tiers)
        busy = sum(t.lane.busy_s for t in tiers)
        out.append(
            TierResult(
                name=spec.name,
                instances=len(tiers),
                hit_rate=hits * spec.chunk_tokens / sim.lookup_tokens if sim.lookup_tokens else 0.0,
                hit_bytes=hits * size,
                stored_bytes=sum(t.stored for t in tiers) * size,
                evicted_bytes=sum(t.evicted for t in tiers) * size,
                resident_bytes=sum(len(t.keys) for t in tiers) * size,
                utilisation=busy / (makespan * len(tiers)) if makespan else 0.0,
            )
        )
    return tuple(out)


def summarize(sim: Simulation) -> SimResult:
    """The summary of a finished run (latencies over every request's final attempt)."""
    outs: list[Outcome] = sim.outcomes()
    done = [o for o in outs if o.done_s >= 0]
    makespan = max((o.done_s for o in done), default=0.0)
    tpots = [t for o in done if (t := o.tpot_s) is not None]
    hidden = sum(f.hidden_s for f in sim.flights)
    total = sum(f.transfer_s for f in sim.flights)
    logical = (
        sum(f.req.input_tokens for f in sim.flights) * sim.spec.geometry.logical_bytes_per_token
    )
    dec = sim.spec.decode.max_batch

    def frac(busy: float, lanes: int) -> float:
        return busy / (makespan * lanes) if makespan and lanes else 0.0

    links = [p.link for p in sim.prefill]
    return SimResult(
        requests=len(outs),
        completed=len(done),
        events=sim.loop.processed,
        makespan_s=makespan,
        ttft_s=Percentiles.of([o.ttft_s for o in done]),
        tpot_s=Percentiles.of(tpots),
        queue_s=Percentiles.of([o.queue_s for o in done]),
        exposed_tail_s=Percentiles.of([o.exposed_tail_s for o in done]),
        prefix_hit_rate=sim.lookup_hits / sim.lookup_tokens if sim.lookup_tokens else 0.0,
        tiers=_tier_results(sim, makespan),
        transport_bytes=sim.transport_bytes,
        logical_bytes=logical,
        transfer_amplification=transfer_amplification(sim.transport_bytes, logical),
        overlap_ratio=overlap_ratio(min(hidden, total), total),
        prefill_utilisation=frac(sum(p.busy_s for p in sim.prefill), len(sim.prefill)),
        decode_utilisation=frac(sum(d.slot_s for d in sim.decode), len(sim.decode) * dec),
        transport_utilisation=frac(sum(lane.busy_s for lane in links), len(links)),
        failures=tuple(sim.failures),
    )
