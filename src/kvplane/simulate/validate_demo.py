"""The simulator against a measured ``kvplane demo`` run: its workload simulated and compared.

:func:`check_demo` reads the run's saved trace (``demo --out DIR``: ``trace.json`` as plain
data), calibrates a one-prefill, one-decode cluster from that run's own spans
(:func:`demo_costs`), simulates the demo's client (:func:`closed_loop`) and sets the predicted
TTFT median (to the serial decode worker's start of the request) and overlap beside the
measured ones. A demo chunk is :data:`CHUNK_TOKENS` tokens, the simulator's block 512: one demo
token is :data:`SCALE` simulated tokens (costs and bytes divided to match). Runs no demo,
imports no serving module. See docs/simulate.md.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.errors import ConfigError
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
from kvplane.simulate.workload import Request

CHUNK_TOKENS = 32
"""The demo's offload chunk (2 blocks of 16 tokens) and prefill step."""
SCALE = TRACE_BLOCK_TOKENS // CHUNK_TOKENS
"""Simulated tokens per demo token: a demo chunk is one simulated block."""
DISK_SLOTS = 64
"""The demo's disk tier, in chunks."""
SimRun = tuple[SimResult, Simulation]
PREFILL = "prefill"
"""The demo's prefill worker's name (its trace process)."""


@dataclass(frozen=True, slots=True)
class TraceSpan:
    """One complete span of the trace: its category (``prefill step``, ``slice transfer``,
    ``offload load``, ``offload store``, ``decode``), request, slice id and times (s)."""

    cat: str
    request: str
    slice_id: int | None
    start: float
    end: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class DemoRun:
    """A saved demo run: its spans, each request's first order (its arrival, s) and the
    prefill worker's order (the router sends the decode worker's first)."""

    spans: tuple[TraceSpan, ...]
    arrivals: Mapping[str, float]
    prefill_orders: Mapping[str, float]

    def of(self, cat: str, request: str | None = None) -> list[TraceSpan]:
        """The spans of ``cat`` (of ``request`` when given), by start."""
        got = [s for s in self.spans if s.cat == cat and request in (None, s.request)]
        return sorted(got, key=lambda s: s.start)


@dataclass(frozen=True, slots=True)
class DemoCosts:
    """The run's own costs (s): prefill per demo token, decode per token after the first, one
    slice transfer op, one offload chunk op, a request's setup before its prefill."""

    prefill_token_s: float
    decode_token_s: float
    slice_op_s: float
    chunk_op_s: float
    setup_s: float


def read_demo_trace(trace: Mapping[str, Any]) -> DemoRun:
    """The spans and arrivals of a ``chrome_trace`` document; ``ConfigError`` when it has none."""
    rows = trace.get("traceEvents")
    if not isinstance(rows, list):
        raise ConfigError("not a kvplane trace (no traceEvents list)")
    spans: list[TraceSpan] = []
    arrivals: dict[str, float] = {}
    prefill: dict[str, float] = {}
    names = {
        ev.get("pid"): ev["args"].get("name")
        for ev in rows
        if isinstance(ev, dict) and ev.get("name") == "process_name" and "args" in ev
    }
    for ev in rows:
        if not isinstance(ev, dict) or not isinstance(ev.get("args"), dict):
            continue
        request, t = str(ev["args"].get("request")), float(ev.get("ts", 0.0)) / 1e6
        if ev.get("ph") == "X":
            sid = ev["args"].get("slice")
            dur = float(ev.get("dur", 0.0)) / 1e6
            detail = str(ev["args"].get("detail", ""))
            spans.append(TraceSpan(str(ev.get("cat")), request, sid, t, t + dur, detail))
        elif ev.get("ph") == "i" and ev.get("name") == "order":
            arrivals[request] = min(t, arrivals.get(request, t))
            if names.get(ev.get("pid")) == PREFILL:
                prefill[request] = t
    if not arrivals or not spans:
        raise ConfigError("the trace holds no request (no order event or no span)")
    return DemoRun(tuple(spans), arrivals, prefill)


def measured(run: DemoRun) -> tuple[float, float]:
    """The run's TTFT median (order → decode start, s) and overlap ratio (slice transfer time
    before the request's last prefill step ended, over all slice transfer time)."""
    ttft = [
        run.of("decode", r)[0].start - t for r, t in run.arrivals.items() if run.of("decode", r)
    ]
    hidden = total = 0.0
    for r in run.arrivals:
        steps = run.of("prefill step", r)
        end = steps[-1].end if steps else float("-inf")
        for s in run.of("slice transfer", r):
            total += s.end - s.start
            hidden += max(0.0, min(s.end, end) - s.start)
    return statistics.median(ttft), (hidden / total if total > 0 else 0.0)


def _step_tokens(prompt_tokens: int, slice_id: int) -> int:
    return max(0, min(CHUNK_TOKENS * (slice_id + 1), prompt_tokens) - CHUNK_TOKENS * slice_id)


def demo_costs(run: DemoRun, prompt_tokens: Mapping[str, int], output_tokens: int) -> DemoCosts:
    """The run's mean costs: prefill seconds over tokens computed (step ``k`` computes demo
    tokens ``[32k, 32k + 32)`` of its prompt), decode seconds over ``output_tokens - 1`` a
    request, a slice op (the time any slice was in flight over their count: ops in flight
    together share the link), a chunk load (load seconds over the chunks they loaded, from
    each load's ``N chunks`` detail; stores run beside the steps and are not timed), the
    setup (the mean lag of the prefill worker's order behind the request's first). A
    ``ConfigError`` when steps, slices or decodes are missing."""
    steps, slices, decodes = run.of("prefill step"), run.of("slice transfer"), run.of("decode")
    loads = run.of("offload load")
    if not steps or not slices or not decodes or output_tokens < 2:
        raise ConfigError("the demo trace lacks prefill steps, slices or decodes")
    tokens = sum(_step_tokens(prompt_tokens[s.request], s.slice_id or 0) for s in steps)
    chunks = sum(int(s.detail.split()[0]) for s in loads if s.detail[:1].isdigit())
    return DemoCosts(
        prefill_token_s=sum(s.end - s.start for s in steps) / tokens,
        decode_token_s=sum(s.end - s.start for s in decodes) / len(decodes) / (output_tokens - 1),
        slice_op_s=_busy_s(slices) / len(slices),
        chunk_op_s=sum(s.end - s.start for s in loads) / chunks if chunks else 0.0,
        setup_s=statistics.mean(
            t - run.arrivals[r] for r, t in run.prefill_orders.items() if r in prompt_tokens
        )
        if run.prefill_orders
        else 0.0,
    )


def _busy_s(spans: Sequence[TraceSpan]) -> float:
    """Seconds when at least one of ``spans`` (sorted by start) ran."""
    total, end = 0.0, float("-inf")
    for s in spans:
        if s.end > end:
            total += s.end - max(s.start, end)
            end = s.end
    return total


def demo_cluster(costs: DemoCosts, bytes_per_token: int, host_slots: int) -> ClusterSpec:
    """The demo's cluster in simulated tokens: one prefill worker computing pipelined
    32-token steps, one serial decode worker, a ``host_slots``-chunk host tier and a
    :data:`DISK_SLOTS`-chunk disk tier (each chunk op ``costs.chunk_op_s``), a link whose op
    takes ``costs.slice_op_s`` whatever its (small) size."""
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
            slice_tokens=TRACE_BLOCK_TOKENS,
            setup_s=costs.setup_s,
            interleave=True,
        ),
        decode=DecodeSpec(token_s=costs.decode_token_s, serial=True),
        transport=TransportSpec(bandwidth_bytes_s=1e15, op_overhead_s=costs.slice_op_s),
        prefill_workers=1,
        decode_workers=1,
        tiers=(tier("host", host_slots), tier("disk", DISK_SLOTS)),
    )


@dataclass(frozen=True, slots=True)
class DemoPrompt:
    """One demo request: its id, prompt and wave (a wave starts once every earlier one ended)."""

    request_id: str
    tokens: tuple[int, ...]
    wave: int


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


def closed_loop(
    spec: ClusterSpec,
    prompts: Sequence[DemoPrompt],
    concurrency: int,
    output_tokens: int,
    reference_s: Sequence[float],
) -> SimRun:
    """The demo's client on ``spec``: wave by wave, ``concurrency`` requests sent at once,
    then it takes the oldest in flight, computes that prompt's reference answer itself
    (``reference_s[i]`` seconds, one thread), waits for the request to end, and sends the
    next; the next wave starts when the last one's turn is over. A send time comes from a
    run of the requests sent before it (the model is causal); the last run is returned."""
    if not prompts:
        raise ConfigError("the demo has no prompt")
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].wave)
    blocks = _block_ids(prompts)
    sent: list[Request] = []
    rid_of: dict[int, int] = {}
    t = 0.0

    def send(i: int) -> None:
        rid_of[i] = len(sent)
        n = len(prompts[i].tokens) * SCALE
        sent.append(Request(len(sent), t, n, output_tokens, blocks[i]))

    for wave in sorted({p.wave for p in prompts}):
        pending = deque(i for i in order if prompts[i].wave == wave)
        flying: deque[int] = deque()
        while pending and len(flying) < concurrency:
            flying.append(pending.popleft())
            send(flying[-1])
        while flying:
            i = flying.popleft()
            done = simulate(spec, sent)[1].outcomes()[rid_of[i]].done_s
            t = max(t + reference_s[i], done)
            if pending:
                flying.append(pending.popleft())
                send(flying[-1])
    return simulate(spec, sent)


def check_demo(
    trace: Mapping[str, Any],
    prompts: Sequence[DemoPrompt],
    *,
    concurrency: int,
    output_tokens: int,
    bytes_per_token: int,
    host_slots: int,
) -> Comparison:
    """The demo run of ``trace`` (its prompts, ``--concurrency``, ``--max-new-tokens``, the
    model's KV bytes per token, ``--host-slots``), simulated on the cluster calibrated from its
    own spans with the demo's client (:func:`closed_loop`), beside its measured TTFT median
    (to decode start) and overlap."""
    run = read_demo_trace(trace)
    missing = sorted({p.request_id for p in prompts} - set(run.arrivals))
    if missing:
        raise ConfigError(f"the trace has no order for {', '.join(missing)}")
    costs = demo_costs(run, {p.request_id: len(p.tokens) for p in prompts}, output_tokens)
    spec = demo_cluster(costs, bytes_per_token, host_slots)
    reference = [
        len(p.tokens) * costs.prefill_token_s + (output_tokens - 1) * costs.decode_token_s
        for p in prompts
    ]
    result, sim = closed_loop(spec, prompts, concurrency, output_tokens, reference)
    ttft = statistics.median(o.decode_start_s - o.arrival_s for o in sim.outcomes())
    got_ttft, got_overlap = measured(run)
    return Comparison(
        "demo", "pipelined", ttft * 1e3, got_ttft * 1e3, result.overlap_ratio, got_overlap
    )
