"""The simulator against ``kvplane demo``: a hand-made trace (exact), and a real run (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvplane.simulate.validate_demo import (
    DemoPrompt,
    check_demo,
    demo_costs,
    measured,
    read_demo_trace,
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
    DemoPrompt("r0", SHARED + tuple(range(100, 132)), 0),
    DemoPrompt("r1", SHARED + tuple(range(200, 208)), 1),
]


def test_measured_figures_and_costs_of_a_trace() -> None:
    run = read_demo_trace(TRACE)
    assert run.arrivals == {"r0": 0.0, "r1": 0.059}
    ttft, overlap = measured(run)
    assert ttft == pytest.approx((0.025 + 0.010) / 2, rel=EXACT)
    assert overlap == pytest.approx(2 / 6, rel=EXACT)  # only r0's first slice ran beside a step
    costs = demo_costs(run, {"r0": 64, "r1": 40}, 16)
    assert costs.prefill_token_s == pytest.approx(24e-3 / 72, rel=EXACT)  # 32 + 32 + 8 tokens
    assert costs.decode_token_s == pytest.approx(2e-3, rel=EXACT)  # 30 ms over 15 tokens
    assert (costs.slice_op_s, costs.chunk_op_s, costs.setup_s) == pytest.approx((2e-3, 1e-3, 1e-3))


def test_simulated_demo_by_hand() -> None:
    got = check_demo(
        TRACE, PROMPTS, concurrency=4, output_tokens=16, bytes_per_token=1024, host_slots=6
    )
    # r0: 1 ms setup, steps of 32 x 1/3 ms ending 11.67 and 22.33 ms, the last slice lands
    # 2 ms later: decoded from 24.33 ms to 54.33 ms. The client's reference for r0 (64 x
    # 1/3 ms + 15 x 2 ms = 51.3 ms) ends first, so r1 is sent at 54.33 ms: 1 ms setup, its
    # shared chunk loaded from host (1 ms) and sent (2 ms) while its 8 tokens compute (2.67
    # ms), its slice from 59 ms lands at 61 ms: TTFT 6.67 ms
    assert got.predicted_ttft_ms == pytest.approx((24 + 1 / 3 + 6 + 2 / 3) / 2, rel=BYTES)
    assert got.measured_ttft_ms == pytest.approx(17.5, rel=EXACT)
    assert got.predicted_overlap == pytest.approx(4 / 8, rel=BYTES)  # each first op hidden
    assert got.measured_overlap == pytest.approx(1 / 3, rel=EXACT)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="not met on the shared 2-core host: TTFT -21%, -22%, +86% in three runs"
    " (docs/simulate.md): 15 requests queueing behind decodes whose time varies 4x in a run",
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
    prompts = [DemoPrompt(p.request_id, p.tokens, p.wave) for p in demo_prompts(1024)]
    got = check_demo(
        trace, prompts, concurrency=4, output_tokens=16, bytes_per_token=1024, host_slots=6
    )
    assert abs(got.ttft_error) <= 0.15, got
    assert abs(got.overlap_error) <= 0.15, got
