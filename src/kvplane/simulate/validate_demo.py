"""The simulator against a measured ``kvplane demo`` run: its workload simulated and compared.

:func:`check_demo` reads the run's saved trace (:mod:`~kvplane.simulate.demo_trace`),
calibrates a one-prefill, one-decode cluster from that run's own spans (:func:`demo_costs`),
replays its requests at their measured arrivals with their measured steps, slice ops and
decodes (:func:`replay`) and sets the predicted TTFT median (to the serial decode worker's
start of the request) and overlap beside the measured ones. A demo chunk is
:data:`CHUNK_TOKENS` tokens, the simulator's block 512: one demo token is :data:`SCALE`
simulated tokens (costs and bytes divided to match). Runs no demo, imports no serving module.
See docs/simulate.md.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.errors import ConfigError
from kvplane.simulate.demo_trace import (
    DemoRun,
    TraceSpan,
    measured,
    read_demo_trace,
    replayed_costs,
)
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

CHUNK_TOKENS = 32
"""The demo's offload chunk (2 blocks of 16 tokens) and prefill step."""
SCALE = TRACE_BLOCK_TOKENS // CHUNK_TOKENS
"""Simulated tokens per demo token: a demo chunk is one simulated block."""
DISK_SLOTS = 64
"""The demo's disk tier, in chunks."""
SimRun = tuple[SimResult, Simulation]


@dataclass(frozen=True, slots=True)
class DemoCosts:
    """The run's own costs (s): a prefill step's fixed part and its cost per demo token
    (:func:`fit_steps`); each request's decode (its span plus ``switch_s``, by request id) and
    their mean per token after the first; each request's measured steps and slice ops
    (:func:`~kvplane.simulate.demo_trace.replayed_costs`) and one slice op on average (for a
    request without them); one offload chunk op; a request's setup before its prefill;
    ``lag_s``, a free request's KV landed to its decode's start; ``switch_s``, the serial
    decode worker's gap between back-to-back sequences; ``accept_s``, its taking a held
    order behind that gap."""

    step_s: float
    prefill_token_s: float
    decode_s: Mapping[str, float]
    decode_token_s: float
    replayed: Mapping[str, Replayed]
    slice_op_s: float
    chunk_op_s: float
    setup_s: float
    lag_s: float
    switch_s: float
    accept_s: float


def _step_tokens(prompt_tokens: int, slice_id: int) -> int:
    return max(0, min(CHUNK_TOKENS * (slice_id + 1), prompt_tokens) - CHUNK_TOKENS * slice_id)


def fit_steps(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(step_s, token_s)``: the least-squares line ``seconds = step_s + token_s * tokens``
    through ``points`` (tokens, seconds), both kept >= 0 (a negative slope gives the mean
    step, a negative intercept the line through 0); one token count: its mean, per step."""
    n = len(points)
    if n == 0:
        raise ConfigError("no prefill step to fit")
    sx = sum(x for x, _ in points)
    sy = sum(y for _, y in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    var = n * sxx - sx * sx
    slope = (n * sxy - sx * sy) / var if var > 0 else 0.0
    if slope <= 0:
        return sy / n, 0.0
    step = (sy - slope * sx) / n
    if step < 0:
        return 0.0, sxy / sxx
    return step, slope


def _busy_s(spans: Sequence[TraceSpan]) -> float:
    """Seconds when at least one of ``spans`` (sorted by start) ran."""
    total, end = 0.0, float("-inf")
    for s in spans:
        if s.end > end:
            total += s.end - max(s.start, end)
            end = s.end
    return total


def switch_s(run: DemoRun) -> float:
    """The median gap between one decode's end and the next one's start, where the next
    request's KV had landed before the first ended (the worker went straight on); 0 if none."""
    decodes = run.of("decode")
    gaps = [
        b.start - a.end for a, b in itertools.pairwise(decodes) if run.landed(b.request) <= a.end
    ]
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def accept_s(run: DemoRun, switch: float) -> float:
    """The median delay of a held request's order at the serial decode worker behind the end
    of the decode it waited for plus ``switch`` (when the replay frees the worker; its slices'
    submissions after that are replayed). Held: a decode ran when it arrived, and its decode
    order came after its last prefill step (every slice waited). 0 if none."""
    ends = [d.end for d in run.of("decode")]
    delays = []
    for r, ordered in run.decode_orders.items():
        steps, ops = run.of("prefill step", r), run.of("slice transfer", r)
        waited = max((e for e in ends if e <= ordered), default=float("-inf"))
        if steps and ops and waited > run.arrivals[r] and ordered > steps[-1].end:
            delays.append(ordered - waited - switch)
    return max(0.0, statistics.median(delays)) if delays else 0.0


def lag_s(run: DemoRun) -> float:
    """The median latency of a free request's KV landed (its last slice's end) to its
    decode's start. Free: the decode worker took its order before its prefill ended and
    decoded nothing else when its KV landed. 0 if no request was free."""
    lags = []
    for r in run.arrivals:
        steps, decodes = run.of("prefill step", r), run.of("decode", r)
        if not steps or not decodes:
            continue
        end, start, landed = steps[-1].end, decodes[0].start, run.landed(r)
        busy = any(d.request != r and d.start < start and d.end > landed for d in run.of("decode"))
        if run.decode_orders.get(r, end) > end or busy:
            continue
        lags.append(start - landed)
    return max(0.0, statistics.median(lags)) if lags else 0.0


def demo_costs(run: DemoRun, prompt_tokens: Mapping[str, int], output_tokens: int) -> DemoCosts:
    """The run's costs (see :class:`DemoCosts`): steps fitted over their tokens (step ``k``
    computes demo tokens ``[32k, 32k + 32)`` of its prompt), a slice op (the time any slice
    was in flight over their count: ops in flight together share the link), a chunk load
    (load seconds over the chunks they loaded, from each load's ``N chunks`` detail), the
    setup (the mean lag of the prefill worker's order behind the request's first). A
    ``ConfigError`` when steps, slices or decodes are missing."""
    steps, slices, decodes = run.of("prefill step"), run.of("slice transfer"), run.of("decode")
    loads = run.of("offload load")
    if not steps or not slices or not decodes or output_tokens < 2:
        raise ConfigError("the demo trace lacks prefill steps, slices or decodes")
    step, per_token = fit_steps(
        [(_step_tokens(prompt_tokens[s.request], s.slice_id or 0), s.end - s.start) for s in steps]
    )
    chunks = sum(int(s.detail.split()[0]) for s in loads if s.detail[:1].isdigit())
    switch = switch_s(run)
    return DemoCosts(
        step_s=step,
        prefill_token_s=per_token,
        decode_s={s.request: s.end - s.start + switch for s in decodes},
        decode_token_s=sum(s.end - s.start for s in decodes) / len(decodes) / (output_tokens - 1),
        replayed=replayed_costs(run),
        slice_op_s=_busy_s(slices) / len(slices),
        chunk_op_s=sum(s.end - s.start for s in loads) / chunks if chunks else 0.0,
        setup_s=statistics.mean(
            t - run.arrivals[r] for r, t in run.prefill_orders.items() if r in prompt_tokens
        )
        if run.prefill_orders
        else 0.0,
        lag_s=lag_s(run),
        switch_s=switch,
        accept_s=accept_s(run, switch),
    )


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
