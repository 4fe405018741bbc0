"""A saved ``kvplane demo`` run (``demo --out DIR``: ``trace.json``) as plain data.

:func:`read_demo_trace` turns the Chrome trace into spans (prefill steps, slice transfers,
offload loads, decodes, the decode worker's order accepts) and each request's order times at
the prefill and decode workers (and its decode order's receipt, in a trace that has it);
:func:`measured` gives the run's TTFT median and overlap ratio, the figures the simulator is
compared with (:mod:`kvplane.simulate.validate_demo`), and :func:`replayed_costs` each
request's measured steps, slice ops and order handling, which the comparison replays. Imports
no serving module.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvplane.errors import ConfigError
from kvplane.simulate.workload import Replayed

PREFILL = "prefill"
"""The demo's prefill worker's name (its trace process)."""
ACCEPT = "order accept"
"""The decode worker's span from its loop taking a request's order to its session open."""
RECEIVED = "order_received"
"""A worker's instant: a request's order reached its order thread (the decode worker's; the
prefill worker's too in a trace of a later run)."""


@dataclass(frozen=True, slots=True)
class TraceSpan:
    """One complete span of the trace: its category (``prefill step``, ``slice transfer``,
    ``offload load``, ``offload store``, ``decode``, :data:`ACCEPT`), request, slice id and
    times (s)."""

    cat: str
    request: str
    slice_id: int | None
    start: float
    end: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class DemoRun:
    """A saved demo run: its spans, each request's first order (its arrival, s), the
    prefill worker's and the decode worker's orders (when each worker took the request),
    when each decode order reached the decode worker (``received``; empty in a trace without
    :data:`RECEIVED` events), when the decode worker released each request's memory after
    its decode (``released``: its loop free again), and when each prefill order reached the
    prefill worker (``prefill_received``; empty in a trace from before it was recorded)."""

    spans: tuple[TraceSpan, ...]
    arrivals: Mapping[str, float]
    prefill_orders: Mapping[str, float]
    decode_orders: Mapping[str, float]
    received: Mapping[str, float] = field(default_factory=dict)
    released: Mapping[str, float] = field(default_factory=dict)
    prefill_received: Mapping[str, float] = field(default_factory=dict)

    def of(self, cat: str, request: str | None = None) -> list[TraceSpan]:
        """The spans of ``cat`` (of ``request`` when given), by start."""
        got = [s for s in self.spans if s.cat == cat and request in (None, s.request)]
        return sorted(got, key=lambda s: s.start)

    def accepted(self, request: str) -> float | None:
        """When the decode worker's accept of ``request``'s order ended (its KV free to go);
        without an accept span, its decode order's time; ``None`` without either."""
        spans = self.of(ACCEPT, request)
        return spans[-1].end if spans else self.decode_orders.get(request)

    def landed(self, request: str) -> float:
        """When ``request``'s last slice transfer ended (its KV landed at the decode worker);
        ``ConfigError`` when it has none."""
        ends = [s.end for s in self.of("slice transfer", request)]
        if not ends:
            raise ConfigError(f"the demo trace has no slice transfer of {request}")
        return max(ends)


def read_demo_trace(trace: Mapping[str, Any]) -> DemoRun:
    """The spans, orders and order receipts of a ``chrome_trace`` document (a request's
    arrival: the first of its orders and receipt); ``ConfigError`` when it has none."""
    rows = trace.get("traceEvents")
    if not isinstance(rows, list):
        raise ConfigError("not a kvplane trace (no traceEvents list)")
    spans: list[TraceSpan] = []
    arrivals: dict[str, float] = {}
    prefill: dict[str, float] = {}
    decode: dict[str, float] = {}
    received: dict[str, float] = {}
    released: dict[str, float] = {}
    prefill_received: dict[str, float] = {}
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
        elif ev.get("ph") == "i" and ev.get("name") == "released":
            if names.get(ev.get("pid")) != PREFILL:
                released[request] = t
        elif ev.get("ph") == "i" and ev.get("name") in ("order", RECEIVED):
            arrivals[request] = min(t, arrivals.get(request, t))
            at_prefill = names.get(ev.get("pid")) == PREFILL
            if ev.get("name") == RECEIVED:
                (prefill_received if at_prefill else received)[request] = t
            else:
                (prefill if at_prefill else decode)[request] = t
    if not arrivals or not spans:
        raise ConfigError("the trace holds no request (no order event or no span)")
    return DemoRun(tuple(spans), arrivals, prefill, decode, received, released, prefill_received)


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


def prefill_receipts(run: DemoRun) -> dict[str, float]:
    """Per request with a prefill order, when it reached the prefill worker's inbox: the
    prefill worker's :data:`RECEIVED` mark where the trace has it; else, as far as the trace
    shows, its arrival, or the middle of the worker's last step begun before the order was
    taken if later (the worker takes every order waiting in its inbox before a step, so that
    order came during or after that step: the middle keeps it in the same step of a replay
    whose times drift by less than half a step); never after the order's time."""
    steps = run.of("prefill step")
    out = {}
    for r, t in run.prefill_orders.items():
        if r in run.prefill_received:
            out[r] = min(t, run.prefill_received[r])
            continue
        before = [(s.start + s.end) / 2 for s in steps if s.start < t]
        out[r] = min(t, max(run.arrivals[r], before[-1] if before else float("-inf")))
    return out


def order_setups(run: DemoRun) -> dict[str, float]:
    """Per request with a prefill order, the prefill worker's setup after taking it (its
    lookup, and any time it stepped nothing): to its next act when that was a step or load
    (any request's); when it was another order, to that order's receipt
    (:func:`prefill_receipts`) if later (it was not stepping meanwhile), else 0 (that order
    was waiting). None after the last act."""
    receipts = prefill_receipts(run)
    acts = sorted(
        [(s.start, "") for s in (*run.of("prefill step"), *run.of("offload load"))]
        + [(t, r) for r, t in run.prefill_orders.items()]
    )
    out = {}
    for r, t in run.prefill_orders.items():
        nxt = next(((a, who) for a, who in acts if a > t), None)
        if nxt is not None:
            out[r] = max(0.0, (receipts[nxt[1]] if nxt[1] else nxt[0]) - t)
    return out


def _covered(start: float, end: float, taking: list[tuple[float, float, float]]) -> float:
    """Seconds of ``[start, end]`` within the handling ``(receipt, done)`` of the orders of
    ``taking`` (order time, receipt, done) taken inside it."""
    spans = sorted(
        (max(start, a), min(end, b)) for t, a, b in taking if start < t <= end and a < end
    )
    total, reach = 0.0, start
    for a, b in spans:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def replayed_costs(run: DemoRun, setup_s: float = 0.0) -> dict[str, Replayed]:
    """Each request's measured prefill steps, slice ops and decode order, by slice id: a
    step's seconds; the prefill worker's time from its end to its next step (any request's)
    when that step's request had been ordered by then (the worker had work: the gap is its
    own -- stores, submissions, being descheduled; else it waited for work: 0); each
    slice transfer's span, submission to done, and its submission's delay behind both its
    step's end and the decode worker's accepting the order (:meth:`DemoRun.accepted`: when
    the run allowed it to go). A trace with the decode worker's order receipts
    (:data:`RECEIVED`) also gives its prefill order's delays behind its arrival (to the
    worker's inbox, :func:`prefill_receipts`, and to its taking it), its decode order's, its
    accept span's seconds and its setup (:func:`order_setups`, else ``setup_s``); the
    prefill worker's time taking an order (from its receipt to its order's time plus its
    setup) is then replayed as such, not as time after a step."""
    steps = run.of("prefill step")
    setups = order_setups(run) if run.received else {}
    receipts = prefill_receipts(run) if run.received else {}
    taking = (
        [  # each order's handling: from its receipt to its order's time plus its setup
            (t, receipts[r], t + setups.get(r, setup_s)) for r, t in run.prefill_orders.items()
        ]
        if run.received
        else []
    )
    after = {
        a: max(0.0, b.start - a.end - _covered(a.end, b.start, taking))
        for a, b in itertools.pairwise(steps)
        if run.prefill_orders.get(b.request, float("inf")) <= a.end
    }

    def by_slice(cat: str, request: str) -> list[TraceSpan]:
        return sorted(run.of(cat, request), key=lambda s: (s.slice_id or 0, s.start))

    out = {}
    for r in run.arrivals:
        mine, ops = by_slice("prefill step", r), by_slice("slice transfer", r)
        ends = {s.slice_id: s.end for s in mine}
        gate = run.accepted(r)
        gate = float("-inf") if gate is None else gate
        accepts = run.of(ACCEPT, r)
        out[r] = Replayed(
            tuple(s.end - s.start for s in mine),
            tuple(after.get(s, 0.0) for s in mine),
            tuple(s.end - s.start for s in ops),
            tuple(max(0.0, s.start - max(ends.get(s.slice_id, s.start), gate)) for s in ops),
            run.prefill_orders.get(r, run.arrivals[r]) - run.arrivals[r] if run.received else None,
            receipts.get(r, run.arrivals[r]) - run.arrivals[r],
            run.received.get(r, run.arrivals[r]) - run.arrivals[r],
            accepts[-1].end - accepts[-1].start if accepts else None,
            setups.get(r),
        )
    return out
