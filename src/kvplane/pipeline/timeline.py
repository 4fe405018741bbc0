"""The request timeline: what happened when, per request, as plain data, and what it implies.

:class:`Timeline` (bounded, thread-safe) and :func:`request_times` (overlap ratio, exposed
tail, slice times). See docs/pipeline.md.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kvplane.metrics import overlap_ratio
from kvplane.validators import require_int


class Mark(enum.Enum):
    """Kinds of timeline events. ``ORDER_RECEIVED``: an order reached the worker's order
    thread (its loop takes it later); ``ACCEPT_START`` / ``ACCEPT_DONE``: a decode worker's loop
    took the order / opened its receiver session (from then the prefill may send its KV)."""

    ORDER = "order"
    ORDER_RECEIVED = "order_received"
    ACCEPT_START = "accept_start"
    ACCEPT_DONE = "accept_done"
    STEP_START = "step_start"
    STEP_END = "step_end"
    SLICE_SUBMIT = "slice_submit"
    SLICE_DONE = "slice_done"
    SLICE_FAILED = "slice_failed"
    SESSION_END = "session_end"
    RELEASED = "released"
    DECODE_READY = "decode_ready"
    DECODE_DONE = "decode_done"
    LOAD_START = "load_start"
    LOAD_DONE = "load_done"
    STORE_START = "store_start"
    STORE_DONE = "store_done"


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One event: monotonic time ``t`` (s), the worker, the kind, the request and detail."""

    t: float
    worker: str
    mark: str
    request_id: str
    slice_id: int | None = None  # None: the event is not about one slice
    nbytes: int = 0
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Timeline:
    """A bounded, thread-safe log of :class:`TimelineEvent` s of one worker, indexed by request
    (the events of the latest ``max_requests`` requests are kept)."""

    def __init__(self, worker: str, max_requests: int = 20_000) -> None:
        self.worker = worker
        self._max = require_int("max_requests", max_requests, min=1)
        self._requests: OrderedDict[str, list[TimelineEvent]] = OrderedDict()
        self._lock = threading.Lock()

    def record(
        self,
        mark: Mark,
        request_id: str,
        *,
        slice_id: int | None = None,
        nbytes: int = 0,
        detail: str = "",
        t: float | None = None,
    ) -> TimelineEvent:
        ev = TimelineEvent(
            time.monotonic() if t is None else t,
            self.worker,
            mark.value,
            request_id,
            slice_id,
            nbytes,
            detail,
        )
        with self._lock:
            evs = self._requests.get(request_id)
            if evs is None:
                evs = self._requests[request_id] = []
                if len(self._requests) > self._max:
                    self._requests.popitem(last=False)
            evs.append(ev)
        return ev

    def events(self, request_id: str | None = None) -> list[TimelineEvent]:
        """One request's events in record order, or every kept event in time order."""
        with self._lock:
            if request_id is not None:
                return list(self._requests.get(request_id, ()))
            out = [e for evs in self._requests.values() for e in evs]
        return sorted(out, key=lambda e: e.t)

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._requests.values()))


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One request's derived times (seconds); ``None`` where the events are missing.

    ``slice_transfer_s``: per slice, in order of completion, submit → done (waiting behind
    earlier slices included). ``slice_busy_s``: per slice, same order, the slice's own
    transfer time, ``done - max(submit, previous slice's done)`` (never negative; with one
    ordered queue their sum is ``transfer_s``). ``steps``: prefill steps with both a start
    and an end event."""

    compute_s: float
    transfer_s: float
    hidden_s: float
    overlap_ratio: float
    prefill_end: float | None
    decode_ready: float | None
    exposed_tail_s: float | None
    slice_transfer_s: tuple[float, ...]
    slice_busy_s: tuple[float, ...] = ()
    steps: int = 0


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _measure(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total = 0.0
    for a, b in xs:
        for c, d in ys:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def _busy(transfers: list[tuple[float, float]]) -> tuple[float, ...]:
    """Per interval in order of end, the time it spent alone past the earlier ones' ends."""
    out: list[float] = []
    prev_end = float("-inf")
    for a, b in sorted(transfers, key=lambda iv: iv[1]):
        out.append(max(0.0, b - max(a, prev_end)))
        prev_end = max(prev_end, b)
    return tuple(out)


def request_times(events: Iterable[TimelineEvent]) -> RequestTimes:
    """Derive :class:`RequestTimes` from one request's events (either or both workers)."""
    evs = sorted(events, key=lambda e: e.t)
    starts: dict[int, float] = {}
    compute: list[tuple[float, float]] = []
    transfers: list[tuple[float, float]] = []
    step_start: float | None = None
    prefill_end = decode_ready = None
    for e in evs:
        if e.mark == Mark.STEP_START.value:
            step_start = e.t
        elif e.mark == Mark.STEP_END.value and step_start is not None:
            compute.append((step_start, e.t))
            prefill_end = e.t
            step_start = None
        elif e.mark == Mark.SLICE_SUBMIT.value and e.slice_id is not None:
            starts[e.slice_id] = e.t
        elif e.mark in (Mark.SLICE_DONE.value, Mark.SLICE_FAILED.value) and e.slice_id in starts:
            transfers.append((starts.pop(e.slice_id), e.t))
        elif e.mark == Mark.DECODE_READY.value:
            decode_ready = e.t
    busy = _union(transfers)
    comp = _union(compute)
    total = _measure(busy)
    hidden = min(total, _intersect(busy, comp))
    tail = None
    if prefill_end is not None and decode_ready is not None:
        tail = max(0.0, decode_ready - prefill_end)
    return RequestTimes(
        compute_s=_measure(comp),
        transfer_s=total,
        hidden_s=hidden,
        overlap_ratio=overlap_ratio(hidden, total),
        prefill_end=prefill_end,
        decode_ready=decode_ready,
        exposed_tail_s=tail,
        slice_transfer_s=tuple(b - a for a, b in sorted(transfers, key=lambda iv: iv[1])),
        slice_busy_s=_busy(transfers),
        steps=len(compute),
    )
