"""A saved ``kvplane demo`` trace read as plain data: spans, orders per worker, measured figures."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.errors import ConfigError
from kvplane.pipeline.timeline import Mark, TimelineEvent
from kvplane.pipeline.trace import chrome_trace
from kvplane.simulate.demo_trace import (
    DemoRun,
    TraceSpan,
    measured,
    order_setups,
    prefill_receipts,
    read_demo_trace,
    replayed_costs,
)

EXACT = 1e-9


def _x(pid: int, cat: str, ms: float, dur_ms: float, slice_id: int | None = None) -> dict[str, Any]:
    args = {"request": "a", "slice": slice_id, "detail": "16" if cat == "decode" else ""}
    return {"ph": "X", "cat": cat, "pid": pid, "ts": ms * 1e3, "dur": dur_ms * 1e3, "args": args}


# one request "a": ordered at the decode worker (pid 1) at 0 ms and the prefill (pid 2) at 2 ms;
# two 10 ms steps, slices 12-15 and 22-24 ms, decoded 26-56 ms
TRACE: dict[str, Any] = {
    "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "decode"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "prefill"}},
        {"ph": "i", "name": "order", "pid": 1, "ts": 0.0, "args": {"request": "a"}},
        {"ph": "i", "name": "order", "pid": 2, "ts": 2e3, "args": {"request": "a"}},
        _x(2, "prefill step", 2.0, 10.0, 0),
        _x(2, "prefill step", 12.0, 10.0, 1),
        _x(2, "slice transfer", 12.0, 3.0, 0),
        _x(2, "slice transfer", 22.0, 2.0, 1),
        _x(1, "decode", 26.0, 30.0),
    ]
}


def test_spans_and_orders_of_each_worker() -> None:
    run = read_demo_trace(TRACE)
    assert (run.arrivals, run.prefill_orders, run.decode_orders) == (
        {"a": 0.0},
        {"a": 0.002},
        {"a": 0.0},
    )
    (decode,) = run.of("decode")
    assert (decode.cat, decode.request, decode.slice_id, decode.detail) == (
        "decode",
        "a",
        None,
        "16",
    )
    assert (decode.start, decode.end) == pytest.approx((0.026, 0.056), rel=EXACT)
    assert [s.slice_id for s in run.of("slice transfer", "a")] == [0, 1]
    assert run.landed("a") == pytest.approx(0.024, rel=EXACT)


def test_measured_ttft_and_overlap() -> None:
    ttft, overlap = measured(read_demo_trace(TRACE))
    assert ttft == pytest.approx(0.026, rel=EXACT)  # order at 0 ms, decode started at 26 ms
    assert overlap == pytest.approx(3 / 5, rel=EXACT)  # the first slice ran beside step 1


def test_replayed_costs_of_each_request() -> None:
    # "a": steps 2-12 and 12-22 ms back to back (no time of the worker's own between them),
    # slices of 3 and 2 ms
    (got,) = replayed_costs(read_demo_trace(TRACE)).items()
    assert got[0] == "a"
    assert got[1].step_s == pytest.approx((0.01, 0.01), rel=EXACT)
    assert got[1].after_s == (0.0, 0.0)
    assert got[1].op_s == pytest.approx((0.003, 0.002), rel=EXACT)
    assert got[1].submit_s == (0.0, 0.0)  # each submitted as its step ended
    # a 5 ms gap before the second step, "a" ordered long before: the worker's own time
    late = [*TRACE["traceEvents"][:5], _x(2, "prefill step", 17.0, 10.0, 1)]
    (gap,) = replayed_costs(read_demo_trace({"traceEvents": late})).values()
    assert gap.after_s == pytest.approx((0.005, 0.0), rel=EXACT)


def test_what_is_not_a_demo_run_is_one_line() -> None:
    with pytest.raises(ConfigError, match="no traceEvents"):
        read_demo_trace({})
    with pytest.raises(ConfigError, match="holds no request"):
        read_demo_trace({"traceEvents": TRACE["traceEvents"][:4]})
    no_decode = read_demo_trace({"traceEvents": TRACE["traceEvents"][:-1]})
    with pytest.raises(ConfigError, match="has no decode"):
        measured(no_decode)
    with pytest.raises(ConfigError, match="no slice transfer of b"):
        no_decode.landed("b")


def _ev(
    ms: float, worker: str, mark: Mark, request: str, slice_id: int | None = None
) -> TimelineEvent:
    detail = "16" if mark is Mark.DECODE_DONE else ""
    return TimelineEvent(100.0 + ms / 1e3, worker, mark.value, request, slice_id, 0, detail)


# "a" and "b" as the workers record them: the decode worker's receipts, accepts (loop took the
# order .. its session opened) and releases; the prefill worker's orders, steps and slices
EVENTS = [
    _ev(0.0, "decode", Mark.ORDER_RECEIVED, "a"), _ev(0.5, "decode", Mark.ACCEPT_START, "a"),
    _ev(1.0, "decode", Mark.ORDER, "a"), _ev(1.0, "prefill", Mark.ORDER, "a"),
    _ev(1.5, "decode", Mark.ACCEPT_DONE, "a"), _ev(2.0, "decode", Mark.ORDER_RECEIVED, "b"),
    _ev(2.5, "decode", Mark.ACCEPT_START, "b"), _ev(3.0, "decode", Mark.ORDER, "b"),
    _ev(3.0, "prefill", Mark.ORDER, "b"), _ev(4.0, "decode", Mark.ACCEPT_DONE, "b"),
    _ev(5.0, "prefill", Mark.STEP_START, "a", 0), _ev(15.0, "prefill", Mark.STEP_END, "a", 0),
    _ev(15.0, "prefill", Mark.SLICE_SUBMIT, "a", 0), _ev(17.0, "prefill", Mark.SLICE_DONE, "a", 0),
    _ev(15.0, "prefill", Mark.STEP_START, "b", 0), _ev(20.0, "prefill", Mark.STEP_END, "b", 0),
    _ev(20.0, "prefill", Mark.SLICE_SUBMIT, "b", 0), _ev(21.0, "prefill", Mark.SLICE_DONE, "b", 0),
    _ev(22.0, "prefill", Mark.STEP_START, "a", 1), _ev(30.0, "prefill", Mark.STEP_END, "a", 1),
    _ev(30.0, "prefill", Mark.SLICE_SUBMIT, "a", 1), _ev(32.0, "prefill", Mark.SLICE_DONE, "a", 1),
    _ev(22.0, "decode", Mark.DECODE_READY, "b"), _ev(40.0, "decode", Mark.DECODE_DONE, "b"),
    _ev(41.0, "decode", Mark.RELEASED, "b"), _ev(41.0, "decode", Mark.DECODE_READY, "a"),
    _ev(60.0, "decode", Mark.DECODE_DONE, "a"), _ev(61.0, "decode", Mark.RELEASED, "a"),
]  # fmt: skip


def test_order_receipts_accepts_and_releases_from_the_workers_events() -> None:
    run = read_demo_trace(chrome_trace(EVENTS))
    ms = pytest.approx
    assert run.arrivals == ms({"a": 0.0, "b": 0.002})  # b's receipt came before its orders
    assert run.received == ms({"a": 0.0, "b": 0.002})
    assert run.prefill_orders == run.decode_orders == ms({"a": 0.001, "b": 0.003})
    assert run.released == ms({"a": 0.061, "b": 0.041})  # the decode worker's only
    assert [(s.start, s.end) for s in run.of("order accept", "b")] == [ms((0.0025, 0.004))]
    assert (run.accepted("a"), run.accepted("b")) == ms((0.0015, 0.004))
    # a's order was followed by b's (which arrived 1 ms after it: the worker stepped nothing
    # meanwhile); b's by a's first step, 2 ms later
    assert order_setups(run) == ms({"a": 0.001, "b": 0.002})


def test_replayed_order_handling() -> None:
    a, b = replayed_costs(read_demo_trace(chrome_trace(EVENTS))).values()
    assert (a.prefill_s, a.order_s, a.accept_s, a.setup_s) == pytest.approx((1e-3, 0, 1e-3, 1e-3))
    assert (b.prefill_s, b.order_s, b.accept_s, b.setup_s) == pytest.approx((1e-3, 0, 1.5e-3, 2e-3))
    assert (*a.step_s, *b.step_s) == pytest.approx((0.01, 0.008, 0.005))
    assert (*a.after_s, *b.after_s) == pytest.approx((0.0, 0.0, 0.002))
    assert (a.submit_s, b.submit_s) == ((0.0, 0.0), (0.0,))  # each as its step ended
    # without receipts nothing of the orders is replayed
    (old,) = replayed_costs(read_demo_trace(TRACE)).values()
    assert (old.prefill_s, old.order_s, old.accept_s, old.setup_s) == (None, 0.0, None, None)


def test_the_time_taking_an_order_is_not_the_workers_own_after_a_step() -> None:
    # x steps 1-10 and 20-30 ms; y's order arrives at 12 ms and is taken at 14 ms, then the
    # worker's next act is x's step at 20 ms: y's setup, 6 ms. Of the 10 ms gap after x's
    # first step, y's order and setup are 12-20 ms: x owes the 2 ms before y came -- the
    # whole gap in a trace without receipts (orders are then not replayed)
    spans = (
        TraceSpan("prefill step", "x", 0, 0.001, 0.01),
        TraceSpan("prefill step", "x", 1, 0.02, 0.03),
    )
    arrivals = {"x": 0.0, "y": 0.012}
    orders = {"x": 0.0, "y": 0.014}
    run = DemoRun(spans, arrivals, orders, orders, arrivals)
    assert prefill_receipts(run) == pytest.approx(arrivals)
    assert order_setups(run) == pytest.approx({"x": 0.001, "y": 0.006})
    assert replayed_costs(run)["x"].after_s == pytest.approx((0.002, 0.0))
    assert replayed_costs(run)["y"].inbox_s == 0.0
    old = DemoRun(spans, arrivals, orders, orders)
    assert replayed_costs(old)["x"].after_s == pytest.approx((0.01, 0.0))


def test_an_order_taken_after_a_step_came_during_it() -> None:
    # the worker steps x 1-11 ms, then takes y's order (13 ms) although y arrived at 0.5 ms:
    # it took every waiting order before that step, so y's reached it during the step (its
    # middle, 6 ms, stands for it)
    spans = (TraceSpan("prefill step", "x", 0, 0.001, 0.011),)
    arrivals = {"x": 0.0, "y": 0.0005}
    orders = {"x": 0.0, "y": 0.013}
    run = DemoRun(spans, arrivals, orders, orders, arrivals)
    assert prefill_receipts(run) == pytest.approx({"x": 0.0, "y": 0.006})
    assert replayed_costs(run)["y"].inbox_s == pytest.approx(0.0055)


def test_a_prefill_receipt_mark_replaces_the_estimate() -> None:
    # as above, but the prefill worker marked y's order reaching its inbox at 9 ms (during
    # x's step): that is its receipt, not the step's middle; x's mark, at its order, too
    events = [
        _ev(0.0, "prefill", Mark.ORDER_RECEIVED, "x"), _ev(0.0, "prefill", Mark.ORDER, "x"),
        _ev(1.0, "prefill", Mark.STEP_START, "x", 0), _ev(11.0, "prefill", Mark.STEP_END, "x", 0),
        _ev(0.5, "decode", Mark.ORDER_RECEIVED, "y"), _ev(9.0, "prefill", Mark.ORDER_RECEIVED, "y"),
        _ev(13.0, "prefill", Mark.ORDER, "y"), _ev(13.0, "decode", Mark.ORDER, "y"),
        _ev(14.0, "prefill", Mark.STEP_START, "y", 0), _ev(20.0, "prefill", Mark.STEP_END, "y", 0),
        _ev(20.0, "decode", Mark.DECODE_READY, "y"), _ev(21.0, "decode", Mark.DECODE_DONE, "y"),
    ]  # fmt: skip
    run = read_demo_trace(chrome_trace(events))
    ms = pytest.approx
    assert run.prefill_received == ms({"x": 0.0, "y": 0.009})
    assert run.received == ms({"y": 0.0005})  # the decode worker's receipts stay apart
    assert run.arrivals == ms({"x": 0.0, "y": 0.0005})
    assert prefill_receipts(run) == ms({"x": 0.0, "y": 0.009})
    assert replayed_costs(run)["y"].inbox_s == ms(0.0085)
    # the same trace without the prefill worker's marks: the estimate (x's step's middle)
    old = read_demo_trace(chrome_trace([e for e in events if e.worker == "decode"
                                        or e.mark != Mark.ORDER_RECEIVED.value]))  # fmt: skip
    assert old.prefill_received == {}
    assert prefill_receipts(old) == ms({"x": 0.0, "y": 0.006})
