"""The simulator against ``kvplane demo``: a run's costs (``demo_costs``) and a replay of a
hand-made trace (exact), and a real run (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvplane.pipeline.timeline import Mark, TimelineEvent
from kvplane.pipeline.trace import chrome_trace
from kvplane.simulate.demo_costs import (
    accept_s,
    demo_costs,
    fit_steps,
    free_lags,
    lag_s,
    switch_s,
)
from kvplane.simulate.demo_trace import DemoRun, TraceSpan, measured, read_demo_trace
from kvplane.simulate.validate_demo import DemoPrompt, check_demo

EXACT = 1e-9
BYTES = 1e-6  # the link and tiers move bytes at 1e15 B/s: picoseconds
SHARED = tuple(range(32))  # r1 starts with r0's first 32-token chunk


def _x(pid: int, cat: str, request: str, ms: float, dur_ms: float, **args: Any) -> dict[str, Any]:
    return {
        "ph": "X", "cat": cat, "name": cat, "pid": pid, "tid": 1, "ts": ms * 1e3,
        "dur": dur_ms * 1e3, "args": {"request": request, "slice": args.get("slice"),
                                      "detail": args.get("detail", "")},
    }  # fmt: skip


def _order(pid: int, request: str, ms: float) -> dict[str, Any]:
    return {"ph": "i", "name": "order", "pid": pid, "ts": ms * 1e3, "args": {"request": request}}


# r0: 64 tokens in 2 steps of 10 ms; r1: 40 tokens, its first chunk loaded (1 ms), one 4 ms
# step; slices 2 ms each; 16 tokens decoded in 30 ms; the prefill order 1 ms after the decode's
TRACE: dict[str, Any] = {
    "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "decode"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "prefill"}},
        _order(1, "r0", 0.0),
        _order(2, "r0", 1.0),
        _x(2, "prefill step", "r0", 2.0, 10.0, slice=0),
        _x(2, "prefill step", "r0", 12.0, 10.0, slice=1),
        _x(2, "slice transfer", "r0", 12.0, 2.0, slice=0),
        _x(2, "slice transfer", "r0", 22.0, 2.0, slice=1),
        _x(1, "decode", "r0", 25.0, 30.0),
        _order(1, "r1", 59.0),
        _order(2, "r1", 60.0),
        _x(2, "offload load", "r1", 60.0, 1.0, detail="1 chunks"),
        _x(2, "prefill step", "r1", 61.0, 4.0, slice=1),
        _x(2, "slice transfer", "r1", 66.0, 2.0, slice=1),
        _x(1, "decode", "r1", 69.0, 30.0),
    ]
}
PROMPTS = [
    DemoPrompt("r0", SHARED + tuple(range(100, 132))),
    DemoPrompt("r1", SHARED + tuple(range(200, 208))),
]


def test_measured_figures_and_costs_of_a_trace() -> None:
    run = read_demo_trace(TRACE)
    assert run.arrivals == {"r0": 0.0, "r1": 0.059}
    assert (run.prefill_orders, run.decode_orders) == (
        {"r0": 0.001, "r1": 0.06},
        {"r0": 0.0, "r1": 0.059},
    )
    ttft, overlap = measured(run)
    assert ttft == pytest.approx((0.025 + 0.010) / 2, rel=EXACT)
    assert overlap == pytest.approx(2 / 6, rel=EXACT)  # only r0's first slice ran beside a step
    costs = demo_costs(run, {"r0": 64, "r1": 40}, 16)
    # steps (32 tokens, 10 ms) twice and (8, 4 ms): 2 ms a step + 0.25 ms a token, exactly
    assert (costs.step_s, costs.prefill_token_s) == pytest.approx((2e-3, 0.25e-3), rel=EXACT)
    assert costs.decode_s == pytest.approx({"r0": 0.03, "r1": 0.03}, rel=EXACT)  # no switch
    assert costs.decode_token_s == pytest.approx(2e-3, rel=EXACT)  # 30 ms over 15 tokens
    r0_costs = (0.01, 0.01, 0, 0, 2e-3, 2e-3, 0, 0)  # steps, time after them, ops, delays
    # replayed: r0's steps back to back; r1's step 39 ms after r0's last, but r1 was ordered
    # at 60 ms, so the worker waited for work: no time of its own after either
    r0, r1 = costs.replayed["r0"], costs.replayed["r1"]
    assert (*r0.step_s, *r0.after_s, *(r0.op_s or ()), *r0.submit_s) == pytest.approx(r0_costs)
    # r1's slice submitted 1 ms after its step ended (its order taken at 59 ms, before)
    r1_costs = (4e-3, 0, 2e-3, 1e-3)
    assert (*r1.step_s, *r1.after_s, *(r1.op_s or ()), *r1.submit_s) == pytest.approx(r1_costs)
    assert (costs.slice_op_s, costs.chunk_op_s, costs.setup_s) == pytest.approx((2e-3, 1e-3, 1e-3))
    # r0 and r1 each decoded 1 ms after its KV landed
    assert (costs.lag_s, costs.switch_s) == pytest.approx((1e-3, 0.0), rel=EXACT)
    assert costs.accept_s == 0.0  # each decode order came before its prefill's last step


def test_fitted_steps_stay_non_negative() -> None:
    assert fit_steps([(32, 0.010), (8, 0.004)]) == pytest.approx((0.002, 0.00025), rel=EXACT)
    assert fit_steps([(32, 0.010), (8, 0.012)]) == pytest.approx((0.011, 0.0), rel=EXACT)
    # a line below 0 at no token is refitted through 0: sum(x * y) / sum(x * x)
    assert fit_steps([(32, 0.010), (8, 0.001)]) == pytest.approx((0.0, 0.328 / 1088), rel=EXACT)
    assert fit_steps([(32, 0.010), (32, 0.006)]) == pytest.approx((0.008, 0.0), rel=EXACT)


def _span(cat: str, request: str, start_ms: float, end_ms: float) -> TraceSpan:
    return TraceSpan(cat, request, 0, start_ms / 1e3, end_ms / 1e3)


def test_lag_switch_and_accept_from_free_back_to_back_and_held_requests() -> None:
    # a: free (ordered at 0, decoder idle when its KV landed): lag 14 - 13 ms;
    # b: landed at 22 ms while a decoded, started 1 ms after a ended (the switch), not free;
    # c: its decode order (61 ms) came after its prefill ended (60 ms): gated, not free, but
    # the decoder was idle when it arrived: not held; d: arrived at 66 ms while c decoded
    # (65-70 ms), its order taken at 72 ms, after its prefill: held, the order 72 - 70 ms -
    # the 1 ms switch behind
    spans = [
        _span("prefill step", "a", 0, 10), _span("slice transfer", "a", 11, 13),
        _span("decode", "a", 14, 30), _span("prefill step", "b", 12, 20),
        _span("slice transfer", "b", 21, 22), _span("decode", "b", 31, 40),
        _span("prefill step", "c", 50, 60), _span("slice transfer", "c", 63, 64),
        _span("decode", "c", 65, 70), _span("prefill step", "d", 66, 68),
        _span("slice transfer", "d", 73, 74), _span("decode", "d", 75, 80),
    ]  # fmt: skip
    orders = {"a": 0.0, "b": 0.001, "c": 0.061, "d": 0.066}
    run = DemoRun(tuple(spans), orders, orders, {**orders, "d": 0.072})
    assert lag_s(run) == pytest.approx(1e-3, rel=EXACT)
    assert switch_s(run) == pytest.approx(1e-3, rel=EXACT)
    assert accept_s(run, switch_s(run)) == pytest.approx(1e-3, rel=EXACT)


def test_simulated_demo_by_hand() -> None:
    got = check_demo(TRACE, PROMPTS, output_tokens=16, bytes_per_token=1024, host_slots=6)
    # replayed at the measured arrivals, 0 and 59 ms, with the measured steps (2 + 32 x 0.25
    # ms = 10 ms and 2 + 8 x 0.25 = 4 ms: the fitted line's own). r0: 1 ms setup, steps end at
    # 11 and 21 ms; its ops go as each step ends (no submission delay), take their measured
    # 2 ms and land 1 ms (the lag) later: the last lands at 24 ms, decoded at once (30 ms,
    # its own). r1: 1 ms setup, its shared chunk loaded from host (1 ms); its loaded prefix
    # is an op the run did not make (0 s), its 8 tokens compute (61-65 ms), its one measured
    # op is submitted 1 ms later (66-68 ms) and lands at 69 ms: TTFT 10 ms
    assert got.predicted_ttft_ms == pytest.approx((24 + 10) / 2, rel=BYTES)
    assert got.measured_ttft_ms == pytest.approx(17.5, rel=EXACT)
    # an op's transfer time is its span (the lag after it is not): r0's first op (11-13 ms)
    # hidden under its second step, its last (21-23 ms) and r1's (66-68 ms) not: 2 of 6 ms
    assert got.predicted_overlap == pytest.approx(2 / 6, rel=BYTES)
    assert got.measured_overlap == pytest.approx(1 / 3, rel=EXACT)


def test_a_release_keeps_the_decode_worker_busy_and_its_decode_held() -> None:
    # a decodes 14-30 ms and releases at 33 ms; b's KV landed at 31 ms, during the release:
    # not free, so the only free lag is a's (14 - 13 ms); a holds the worker to its release
    spans = [
        _span("prefill step", "a", 0, 10), _span("slice transfer", "a", 11, 13),
        _span("decode", "a", 14, 30), _span("prefill step", "b", 12, 20),
        _span("slice transfer", "b", 21, 31), _span("decode", "b", 34, 40),
    ]  # fmt: skip
    orders = {"a": 0.0, "b": 0.001}
    run = DemoRun(tuple(spans), orders, orders, orders, orders, {"a": 0.033, "b": 0.041})
    assert free_lags(run) == pytest.approx({"a": 1e-3}, rel=EXACT)
    costs = demo_costs(run, {"a": 32, "b": 32}, 16)
    assert costs.decode_s == pytest.approx({"a": 0.019, "b": 0.007}, rel=EXACT)
    assert costs.replayed["a"].lag_s == pytest.approx(1e-3, rel=EXACT)
    assert costs.replayed["b"].lag_s is None  # the link's rtt_s: the median lag


def _ev(ms: float, worker: str, mark: Mark, slice_id: int | None = None) -> TimelineEvent:
    detail = "16" if mark is Mark.DECODE_DONE else ""
    return TimelineEvent(100.0 + ms / 1e3, worker, mark.value, "r0", slice_id, 0, detail)


def test_a_run_with_its_order_handling_replays_exactly() -> None:
    # r0 (64 tokens): its decode order received at 0 ms and accepted 0.5-1.5 ms, its prefill
    # order taken at 1 ms, steps 2-12 and 12-22 ms, slices 12-14 and 22-24 ms, decoded from
    # 26 ms, released at 57 ms. Replayed: the loop holds the accept 0-1 ms, the prefill order
    # joins at 1 ms, its setup (to its first step) 1 ms, the measured steps and ops, the
    # measured lag 2 ms: decoded at 26 ms, the first op hidden under the second step
    events = [
        _ev(0.0, "decode", Mark.ORDER_RECEIVED), _ev(0.5, "decode", Mark.ACCEPT_START),
        _ev(1.0, "decode", Mark.ORDER), _ev(1.0, "prefill", Mark.ORDER),
        _ev(1.5, "decode", Mark.ACCEPT_DONE),
        _ev(2.0, "prefill", Mark.STEP_START, 0), _ev(12.0, "prefill", Mark.STEP_END, 0),
        _ev(12.0, "prefill", Mark.SLICE_SUBMIT, 0), _ev(14.0, "prefill", Mark.SLICE_DONE, 0),
        _ev(12.0, "prefill", Mark.STEP_START, 1), _ev(22.0, "prefill", Mark.STEP_END, 1),
        _ev(22.0, "prefill", Mark.SLICE_SUBMIT, 1), _ev(24.0, "prefill", Mark.SLICE_DONE, 1),
        _ev(26.0, "decode", Mark.DECODE_READY), _ev(56.0, "decode", Mark.DECODE_DONE),
        _ev(57.0, "decode", Mark.RELEASED),
    ]  # fmt: skip
    prompt = [DemoPrompt("r0", tuple(range(64)))]
    got = check_demo(
        chrome_trace(events), prompt, output_tokens=16, bytes_per_token=1024, host_slots=6
    )
    assert (got.predicted_ttft_ms, got.measured_ttft_ms) == pytest.approx((26.0, 26.0))
    assert (got.predicted_overlap, got.measured_overlap) == pytest.approx((0.5, 0.5))


@pytest.mark.slow
def test_predicts_a_measured_demo_within_15_percent(tmp_path: Path) -> None:
    """``kvplane demo --pipelining on --out DIR`` (about 20 s), then the simulator calibrated
    from that run's spans, its costs and order handling replayed, predicts its TTFT median
    and overlap within 15%."""
    from kvplane.apps.demo import demo_prompts

    argv = [sys.executable, "-m", "kvplane", "demo", "--json", "--pipelining", "on"]
    done = subprocess.run(
        [*argv, "--out", str(tmp_path)], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    trace = json.loads((tmp_path / "trace.json").read_text())
    prompts = [DemoPrompt(p.request_id, p.tokens) for p in demo_prompts(1024)]
    got = check_demo(trace, prompts, output_tokens=16, bytes_per_token=1024, host_slots=6)
    assert abs(got.ttft_error) <= 0.15, got
    assert abs(got.overlap_error) <= 0.15, got
