"""A measured ``kvplane demo`` run's own costs, from its trace, for the simulator to replay.

:func:`demo_costs` gathers them (:class:`DemoCosts`): fitted prefill steps, each request's
hold of the decode worker, its measured steps, slice ops and order handling
(:func:`~kvplane.simulate.demo_trace.replayed_costs`), and the medians a request without its
own measurement costs (setup, lag, switch, accept). Used by
:mod:`kvplane.simulate.validate_demo`. See docs/simulate.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvplane.errors import ConfigError
from kvplane.simulate.demo_trace import (
    ACCEPT,
    DemoRun,
    TraceSpan,
    order_setups,
    replayed_costs,
)
from kvplane.simulate.workload import Replayed

CHUNK_TOKENS = 32
"""The demo's offload chunk (2 blocks of 16 tokens) and prefill step."""


@dataclass(frozen=True, slots=True)
class DemoCosts:
    """The run's own costs (s): a prefill step's fixed part and its cost per demo token
    (:func:`fit_steps`); each request's hold of the decode worker (its decode span to its
    release, else plus ``switch_s``; by request id) and their mean per token after the first;
    each request's measured steps, slice ops and orders
    (:func:`~kvplane.simulate.demo_trace.replayed_costs`, with its free lag) and one slice op
    on average (for a request without them); one offload chunk op; a request's setup
    (:func:`setup_s`); ``lag_s``, a free request's KV landed to its decode's start;
    ``switch_s``, the serial decode worker's gap between back-to-back sequences;
    ``accept_s``, its taking an order (:func:`accept_s`). The last four are what a request
    without its own measurement costs."""

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
    """With the decode worker's accept spans in the trace: their median. Without: the
    median delay of a held request's order at the serial decode worker behind the end
    of the decode it waited for plus ``switch`` (when the replay frees the worker; its slices'
    submissions after that are replayed). Held: a decode ran when it arrived, and its decode
    order came after its last prefill step (every slice waited). 0 if none."""
    spans = run.of(ACCEPT)
    if spans:
        return statistics.median(s.end - s.start for s in spans)
    ends = [d.end for d in run.of("decode")]
    delays = []
    for r, ordered in run.decode_orders.items():
        steps, ops = run.of("prefill step", r), run.of("slice transfer", r)
        waited = max((e for e in ends if e <= ordered), default=float("-inf"))
        if steps and ops and waited > run.arrivals[r] and ordered > steps[-1].end:
            delays.append(ordered - waited - switch)
    return max(0.0, statistics.median(delays)) if delays else 0.0


def setup_s(run: DemoRun) -> float:
    """The prefill worker's setup of a request (the engine's ``setup_s``, for one without
    its own). With the decode worker's order receipts in the trace (each order's delay is
    then replayed): the median of :func:`~kvplane.simulate.demo_trace.order_setups`.
    Without: the mean lag of the prefill order behind the request's first. 0 with neither."""
    if not run.received:
        lags = [t - run.arrivals[r] for r, t in run.prefill_orders.items()]
        return statistics.mean(lags) if lags else 0.0
    setups = order_setups(run).values()
    return statistics.median(setups) if setups else 0.0


def free_lags(run: DemoRun) -> dict[str, float]:
    """Per free request, the latency of its KV landed (its last slice's end) to its decode's
    start. Free: the decode worker took its order before its prefill ended (or, with order
    receipts in the trace, at all) and was not decoding (nor releasing) another request
    when its KV landed."""
    lags = {}
    for r in run.arrivals:
        steps, decodes = run.of("prefill step", r), run.of("decode", r)
        if not steps or not decodes:
            continue
        end, start, landed = steps[-1].end, decodes[0].start, run.landed(r)
        busy = any(
            d.request != r and d.start < start and run.released.get(d.request, d.end) > landed
            for d in run.of("decode")
        )
        if busy or run.decode_orders.get(r, end) > (landed if run.received else end):
            continue
        lags[r] = max(0.0, start - landed)
    return lags


def lag_s(run: DemoRun) -> float:
    """The median of :func:`free_lags`; 0 if no request was free."""
    lags = free_lags(run).values()
    return statistics.median(lags) if lags else 0.0


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
    switch, setup = switch_s(run), setup_s(run)
    lags = free_lags(run) if run.received else {}
    return DemoCosts(
        step_s=step,
        prefill_token_s=per_token,
        decode_s={
            s.request: run.released.get(s.request, s.end + switch) - s.start for s in decodes
        },
        decode_token_s=sum(s.end - s.start for s in decodes) / len(decodes) / (output_tokens - 1),
        replayed={
            r: dataclasses.replace(c, lag_s=lags.get(r))
            for r, c in replayed_costs(run, setup).items()
        },
        slice_op_s=_busy_s(slices) / len(slices),
        chunk_op_s=sum(s.end - s.start for s in loads) / chunks if chunks else 0.0,
        setup_s=setup,
        lag_s=lag_s(run),
        switch_s=switch,
        accept_s=accept_s(run, switch),
    )
