"""A saved ``kvplane demo`` run (``demo --out DIR``: ``trace.json``) as plain data.

:func:`read_demo_trace` turns the Chrome trace into spans (prefill steps, slice transfers,
offload loads, decodes) and each request's order times at the prefill and decode workers;
:func:`measured` gives the run's TTFT median and overlap ratio, the figures the simulator is
compared with (:mod:`kvplane.simulate.validate_demo`), and :func:`replayed_costs` each
request's measured steps and slice ops, which the comparison replays. Imports no serving
module.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.errors import ConfigError
from kvplane.simulate.workload import Replayed

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
    """A saved demo run: its spans, each request's first order (its arrival, s), and the
    prefill worker's and the decode worker's orders (when each worker took the request)."""

    spans: tuple[TraceSpan, ...]
    arrivals: Mapping[str, float]
    prefill_orders: Mapping[str, float]
    decode_orders: Mapping[str, float]

    def of(self, cat: str, request: str | None = None) -> list[TraceSpan]:
        """The spans of ``cat`` (of ``request`` when given), by start."""
        got = [s for s in self.spans if s.cat == cat and request in (None, s.request)]
        return sorted(got, key=lambda s: s.start)

    def landed(self, request: str) -> float:
        """When ``request``'s last slice transfer ended (its KV landed at the decode worker);
        ``ConfigError`` when it has none."""
        ends = [s.end for s in self.of("slice transfer", request)]
        if not ends:
            raise ConfigError(f"the demo trace has no slice transfer of {request}")
        return max(ends)


def read_demo_trace(trace: Mapping[str, Any]) -> DemoRun:
    """The spans and orders of a ``chrome_trace`` document; ``ConfigError`` when it has none."""
    rows = trace.get("traceEvents")
    if not isinstance(rows, list):
        raise ConfigError("not a kvplane trace (no traceEvents list)")
    spans: list[TraceSpan] = []
    arrivals: dict[str, float] = {}
    prefill: dict[str, float] = {}
    decode: dict[str, float] = {}
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
            (prefill if names.get(ev.get("pid")) == PREFILL else decode)[request] = t
    if not arrivals or not spans:
        raise ConfigError("the trace holds no request (no order event or no span)")
    return DemoRun(tuple(spans), arrivals, prefill, decode)


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
    if not ttft:
        raise ConfigError("the demo trace has no decode")
    return statistics.median(ttft), (hidden / total if total > 0 else 0.0)


def replayed_costs(run: DemoRun) -> dict[str, Replayed]:
    """Each request's measured prefill steps and slice ops, by slice id: a step's seconds;
    the prefill worker's time from its end to its next step (any request's) when that step's
    request had been ordered by then (the worker had work: the gap is its own -- orders,
    stores, submissions, being descheduled; else it waited for work: 0); each slice
    transfer's span, submission to done, and its submission's delay behind both its step's
    end and the decode worker's taking the order (when the run allowed it to go)."""
    steps = run.of("prefill step")
    after = {
        a: max(0.0, b.start - a.end)
        for a, b in itertools.pairwise(steps)
        if run.prefill_orders.get(b.request, float("inf")) <= a.end
    }

    def by_slice(cat: str, request: str) -> list[TraceSpan]:
        return sorted(run.of(cat, request), key=lambda s: (s.slice_id or 0, s.start))

    out = {}
    for r in run.arrivals:
        mine, ops = by_slice("prefill step", r), by_slice("slice transfer", r)
        ends = {s.slice_id: s.end for s in mine}
        taken = run.decode_orders.get(r, float("-inf"))
        out[r] = Replayed(
            tuple(s.end - s.start for s in mine),
            tuple(after.get(s, 0.0) for s in mine),
            tuple(s.end - s.start for s in ops),
            tuple(max(0.0, s.start - max(ends.get(s.slice_id, s.start), taken)) for s in ops),
        )
    return out
