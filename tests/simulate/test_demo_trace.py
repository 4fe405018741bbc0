"""A saved ``kvplane demo`` trace read as plain data: spans, orders per worker, measured figures."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.errors import ConfigError
from kvplane.simulate.demo_trace import measured, read_demo_trace, replayed_costs

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
