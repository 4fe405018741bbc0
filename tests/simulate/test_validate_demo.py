"""The simulator against ``kvplane demo``: its costs and a replay of a hand-made trace (exact),
and a real run (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvplane.simulate.demo_trace import DemoRun, TraceSpan, measured, read_demo_trace
from kvplane.simulate.validate_demo import (
    DemoPrompt,
    check_demo,
    demo_costs,
    fit_steps,
    lag_s,
    switch_s,
)

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
    assert (costs.slice_op_s, costs.chunk_op_s, costs.setup_s) == pytest.approx((2e-3, 1e-3, 1e-3))
    # r0: its last slice submitted as its last step ended, decoded 1 ms after it landed; r1:
    # submitted 1 ms after its step, decoded 1 ms after: the median of 1 and 2 ms
    assert (costs.lag_s, costs.switch_s) == pytest.approx((1.5e-3, 0.0), rel=EXACT)


def test_fitted_steps_stay_non_negative() -> None:
    assert fit_steps([(32, 0.010), (8, 0.004)]) == pytest.approx((0.002, 0.00025), rel=EXACT)
    assert fit_steps([(32, 0.010), (8, 0.012)]) == pytest.approx((0.011, 0.0), rel=EXACT)
    # a line below 0 at no token is refitted through 0: sum(x * y) / sum(x * x)
    assert fit_steps([(32, 0.010), (8, 0.001)]) == pytest.approx((0.0, 0.328 / 1088), rel=EXACT)
    assert fit_steps([(32, 0.010), (32, 0.006)]) == pytest.approx((0.008, 0.0), rel=EXACT)


def _span(cat: str, request: str, start_ms: float, end_ms: float) -> TraceSpan:
    return TraceSpan(cat, request, 0, start_ms / 1e3, end_ms / 1e3)


def test_lag_and_switch_from_free_and_back_to_back_requests() -> None:
    # a: free (ordered at 0, decoder idle when its KV landed): lag (11 - 10) + (14 - 13) ms;
    # b: landed at 22 ms while a decoded, started 1 ms after a ended (the switch), not free;
    # c: its decode order (61 ms) came after its prefill ended (60 ms): gated, not free
    spans = [
        _span("prefill step", "a", 0, 10), _span("slice transfer", "a", 11, 13),
        _span("decode", "a", 14, 30), _span("prefill step", "b", 12, 20),
        _span("slice transfer", "b", 21, 22), _span("decode", "b", 31, 40),
        _span("prefill step", "c", 50, 60), _span("slice transfer", "c", 63, 64),
        _span("decode", "c", 65, 70),
    ]  # fmt: skip
    orders = {"a": 0.0, "b": 0.001, "c": 0.061}
    run = DemoRun(tuple(spans), orders, orders, orders)
    assert lag_s(run) == pytest.approx(2e-3, rel=EXACT)
    assert switch_s(run) == pytest.approx(1e-3, rel=EXACT)


def test_simulated_demo_by_hand() -> None:
    got = check_demo(TRACE, PROMPTS, output_tokens=16, bytes_per_token=1024, host_slots=6)
    # replayed at the measured arrivals, 0 and 59 ms. r0: 1 ms setup, two steps of 2 + 32 x
    # 0.25 ms end at 11 and 21 ms; each op takes 2 ms and lands 1.5 ms later: the last lands
    # at 24.5 ms, decoded at once (30 ms, its own). r1: 1 ms setup, its shared chunk loaded
    # from host (1 ms) and sent (61-64.5 ms) while its 8 tokens compute (61-65 ms), its slice
    # lands at 68.5 ms: TTFT 9.5 ms
    assert got.predicted_ttft_ms == pytest.approx((24.5 + 9.5) / 2, rel=BYTES)
    assert got.measured_ttft_ms == pytest.approx(17.5, rel=EXACT)
    # each request's first op (3.5 ms with its lag) hidden, its last (3.5 ms) not
    assert got.predicted_overlap == pytest.approx(7 / 14, rel=BYTES)
    assert got.measured_overlap == pytest.approx(1 / 3, rel=EXACT)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="overlap not reliably within 15% on the shared 2-core host: TTFT -7%, -3%, -4% but"
    " overlap -18%, -9%, +14% in three runs (docs/simulate.md): slice ops vary 2x in a run",
)
def test_predicts_a_measured_demo_within_15_percent(tmp_path: Path) -> None:
    """``kvplane demo --pipelining on --out DIR`` (about 20 s), then the simulator calibrated
    from that run's spans predicts its TTFT median and overlap within 15%."""
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
