"""What ``kvplane bench pd`` derives from timelines and how it judges its targets, on made-up
times: the tail target uses a slice's own (busy) transfer, missing data is null and fails the
targets, calibration is checked against the measured run. No timing is asserted."""

from __future__ import annotations

import pytest
import torch

from kvplane.apps.bench import pd_metrics as m
from kvplane.errors import InvalidArgumentError
from kvplane.pipeline.timeline import Mark, RequestTimes, Timeline, TimelineEvent, request_times


def _queued_request() -> RequestTimes:
    """Four one-step slices submitted 1 ms apart, each taking 2 ms once it runs: slice i waits
    behind the earlier ones, so submit -> done grows (2, 3, 4, 5 ms) while each is busy 2 ms;
    the decode side is ready 3.5 ms after the last step ends."""
    t = Timeline("p")
    for i in range(4):
        t.record(Mark.STEP_START, "r", t=i * 1e-3)
        t.record(Mark.STEP_END, "r", t=(i + 1) * 1e-3)
        t.record(Mark.SLICE_SUBMIT, "r", slice_id=i, t=(i + 1) * 1e-3)
        t.record(Mark.SLICE_DONE, "r", slice_id=i, t=(2 * i + 3) * 1e-3)
    t.record(Mark.DECODE_READY, "r", t=7.5e-3)
    return request_times(t.events("r"))


def test_slice_transfer_is_busy_time_and_latency_is_kept_apart() -> None:
    got = m.request_fields(_queued_request(), truncated=False)
    assert got["slice_transfer_ms"] == pytest.approx(2.0)
    assert got["slice_submit_to_done_ms"] == pytest.approx(3.5)
    assert got["exposed_tail_ms"] == pytest.approx(3.5)
    assert got["step_compute_ms"] == pytest.approx(1.0)


def test_tail_target_compares_with_the_busy_slice_not_the_queued_one() -> None:
    got = m.request_fields(_queued_request(), truncated=False)
    row = {k: m.median_or_none([v]) for k, v in got.items()}
    row["ttft_ratio"] = 0.5
    # 3.5 ms tail: within 1.5 x the queue-inclusive 3.5 ms, not within 1.5 x the busy 2 ms
    assert m.targets(row)["exposed_tail_le_1.5x_slice"] is False
    row["exposed_tail_ms"] = 2.9
    assert m.targets(row)["exposed_tail_le_1.5x_slice"] is True
    assert "busy" in m.TARGET_DEFINITIONS["exposed_tail_le_1.5x_slice"]


def test_missing_events_are_null_never_zero() -> None:
    t = Timeline("p")
    t.record(Mark.STEP_START, "q", t=0.0)
    t.record(Mark.STEP_END, "q", t=1.0)
    no_slices = m.request_fields(request_times(t.events("q")), truncated=False)
    assert no_slices["slice_transfer_ms"] is None and no_slices["overlap_ratio"] is None
    assert no_slices["exposed_tail_ms"] is None
    assert no_slices["step_compute_ms"] == pytest.approx(1e3)
    t.record(Mark.SLICE_SUBMIT, "q", slice_id=0, t=1.0)
    t.record(Mark.SLICE_DONE, "q", slice_id=0, t=1.5)
    no_ready = m.request_fields(request_times(t.events("q")), truncated=False)
    assert no_ready["exposed_tail_ms"] is None and no_ready["slice_transfer_ms"] == 500.0
    truncated = m.request_fields(_queued_request(), truncated=True)
    assert set(truncated.values()) == {None}


def test_a_missing_value_fails_every_target_that_needs_it() -> None:
    assert m.median_or_none([1.0, None, 3.0]) is None
    assert m.median_or_none([]) is None
    assert m.median_or_none([1.0, 2.0, 4.0]) == 2.0
    row: dict[str, object] = {"exposed_tail_ms": None, "slice_transfer_ms": 2.0,
                              "ttft_ratio": 0.5, "overlap_ratio": None}  # fmt: skip
    assert m.targets(row) == {
        "exposed_tail_le_1.5x_slice": False,
        "ttft_le_0.7x_non_pipelined": True,
        "overlap_ge_0.8": False,
    }
    row["exposed_tail_ms"], row["slice_transfer_ms"] = 0.0, None
    assert m.targets(row)["exposed_tail_le_1.5x_slice"] is False


def test_calibration_is_checked_against_the_measured_run() -> None:
    ok = m.calibration({"step_compute_ms": 11.0, "slice_transfer_ms": 10.0}, 9.5)
    assert ok == {"calibrated_step_compute_ms": 9.5, "step_compute_ms": 11.0,
                  "slice_transfer_ms": 10.0, "calibration_ok": True}  # fmt: skip
    off = m.calibration({"step_compute_ms": 13.0, "slice_transfer_ms": 10.0}, 9.5)
    assert off["calibration_ok"] is False  # 30% off
    low = m.calibration({"step_compute_ms": 7.0, "slice_transfer_ms": 10.0}, 9.5)
    assert low["calibration_ok"] is False
    missing = m.calibration({"step_compute_ms": 10.0, "slice_transfer_ms": None}, 9.5)
    assert missing["calibration_ok"] is False
    assert "calibration_ok" in m.TARGET_DEFINITIONS["ttft_le_0.7x_non_pipelined"]


def test_memcpy_limit_reads_written_memory_on_one_thread() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    with m.one_torch_thread():
        seen.append(torch.get_num_threads())
    assert seen == [1] and torch.get_num_threads() == before
    data = m.filled(1 << 16)
    assert data.dtype == torch.uint8 and int(data.count_nonzero()) > (1 << 16) * 0.9
    contiguous, scattered = m.memcpy_slice_ms(1 << 16, 1 << 12, reps=3)
    assert contiguous > 0 and scattered > 0
    assert torch.get_num_threads() == before
    with pytest.raises(InvalidArgumentError):
        m.memcpy_slice_ms(1000, 300)


def test_bench_rows_pair_ttft_and_tail_request_by_request() -> None:
    ttft = {"pipelined": [60.0, 70.0, 80.0], "non_pipelined": [100.0, 100.0, 100.0]}
    fields: list[dict[str, float | None]] = [
        {"exposed_tail_ms": 3.0, "slice_transfer_ms": 2.0},
        {"exposed_tail_ms": None, "slice_transfer_ms": 2.0},  # left out: no tail
        {"exposed_tail_ms": 2.0, "slice_transfer_ms": 2.0},
    ]
    ttft_row, tail_row = m.bench_rows("tcp", ttft, fields, ttft_target=0.7)
    assert ttft_row == {
        "bench": "pd", "row": "tcp_ttft_pipelined_vs_non_pipelined", "figure": 70.0,
        "unit": "ms", "limit": 100.0, "limit_name": "non-pipelined", "repeats": 3,
        "ratio_min": 0.6, "ratio_median": 0.7, "ratio_max": 0.8, "stable": False,
        "target": 0.7, "met": True, "layout": "1->1",
    }  # fmt: skip
    assert tail_row["row"] == "tcp_exposed_tail_vs_slice" and tail_row["repeats"] == 2
    assert (tail_row["figure"], tail_row["limit"], tail_row["ratio_median"]) == (2.5, 2.0, 1.25)
    assert tail_row["target"] == 1.5 and tail_row["met"] is True
    only = m.bench_rows("model", ttft, fields[1:2], ttft_target=None, layout="pp2->1")
    assert len(only) == 1 and only[0]["met"] is None  # no tail row without a tail
    assert only[0]["layout"] == "pp2->1"


def _rank(t0: float, steps: int, slice_ms: float) -> list[TimelineEvent]:
    """One rank's events of request ``r``: ``steps`` steps of 1 ms from ``t0`` (ms), each
    step's slice submitted at its end and done ``slice_ms`` later."""
    t = Timeline("p")
    for i in range(steps):
        start = (t0 + i) * 1e-3
        t.record(Mark.STEP_START, "r", t=start)
        t.record(Mark.STEP_END, "r", t=start + 1e-3)
        t.record(Mark.SLICE_SUBMIT, "r", slice_id=i, t=start + 1e-3)
        t.record(Mark.SLICE_DONE, "r", slice_id=i, t=start + 1e-3 + slice_ms * 1e-3)
    return t.events("r")


def test_a_gather_adds_up_its_ranks_and_ends_at_the_last_one() -> None:
    d = Timeline("d")
    d.record(Mark.DECODE_READY, "r", t=10e-3)
    ready = d.events("r")
    # rank 0: steps [0, 1), [1, 2) ms, slices [1, 1.5), [2, 2.5): the first hidden under step 2
    # rank 1: steps [4, 5), [5, 6), [6, 7) ms, slices 0.25 ms each, the last two hidden
    got = m.gather_times([[*_rank(0.0, 2, 0.5), *ready], [*_rank(4.0, 3, 0.25), *ready]])
    assert got.steps == 5 and got.compute_s == pytest.approx(5e-3)
    assert got.transfer_s == pytest.approx(1.75e-3) and got.hidden_s == pytest.approx(1e-3)
    assert got.overlap_ratio == pytest.approx(1 / 1.75)
    assert (got.prefill_end, got.decode_ready) == pytest.approx((7e-3, 10e-3))
    assert got.exposed_tail_s == pytest.approx(3e-3)  # from the last rank's last step
    assert got.slice_busy_s == pytest.approx((0.5e-3,) * 2 + (0.25e-3,) * 3)
    fields = m.request_fields(got, truncated=False)
    assert fields["slice_transfer_ms"] == pytest.approx(0.35)
    assert fields["step_compute_ms"] == pytest.approx(1.0)
    one = [*_rank(0.0, 2, 0.5), *ready]
    assert m.gather_times([one]) == request_times(one)  # one rank: its own times
    with pytest.raises(InvalidArgumentError):
        m.gather_times([])
