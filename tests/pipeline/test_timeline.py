"""The timeline and the seed's derived per-request metrics."""

from __future__ import annotations

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.pipeline.timeline import Mark, Timeline, request_times


def test_overlap_and_exposed_tail_from_events() -> None:
    p, d = Timeline("prefill"), Timeline("decode")
    for mark, t, sid in [
        (Mark.STEP_START, 0.0, 0),
        (Mark.STEP_END, 1.0, 0),
        (Mark.SLICE_SUBMIT, 1.0, 0),
        (Mark.STEP_START, 1.0, 1),
        (Mark.SLICE_DONE, 1.5, 0),
        (Mark.STEP_END, 2.0, 1),
        (Mark.SLICE_SUBMIT, 2.0, 1),
        (Mark.SLICE_DONE, 2.75, 1),
    ]:
        p.record(mark, "r", slice_id=sid, t=t)
    d.record(Mark.DECODE_READY, "r", t=3.0)
    times = request_times(p.events("r") + d.events("r"))
    assert times.compute_s == 2.0
    assert times.transfer_s == 1.25
    assert times.hidden_s == 0.5
    assert times.overlap_ratio == 0.4
    assert (times.prefill_end, times.decode_ready, times.exposed_tail_s) == (2.0, 3.0, 1.0)
    assert times.slice_transfer_s == (0.5, 0.75)


def test_no_transfer_means_no_overlap_and_no_tail_without_decode() -> None:
    t = Timeline("x")
    t.record(Mark.STEP_START, "q", t=0.0)
    t.record(Mark.STEP_END, "q", t=1.0)
    times = request_times(t.events("q"))
    assert (times.overlap_ratio, times.exposed_tail_s, times.transfer_s) == (0.0, None, 0.0)


def test_timeline_keeps_the_latest_requests() -> None:
    t = Timeline("w", max_requests=2)
    for rid in ("a", "b", "c"):
        t.record(Mark.ORDER, rid, t=float(ord(rid)))
    assert t.events("a") == [] and len(t) == 2
    assert [e.request_id for e in t.events()] == ["b", "c"]
    assert t.events("c")[0].as_dict()["mark"] == "order"
    with pytest.raises(InvalidArgumentError, match="max_requests"):
        Timeline("w", max_requests=0)


def test_slice_busy_time_excludes_waiting_behind_earlier_slices() -> None:
    # three slices submitted at once through one ordered queue: each waits for the one before
    t = Timeline("p")
    for sid, (sub, done) in enumerate([(0.0, 1.0), (0.0, 3.0), (0.5, 3.5)]):
        t.record(Mark.SLICE_SUBMIT, "r", slice_id=sid, t=sub)
        t.record(Mark.SLICE_DONE, "r", slice_id=sid, t=done)
    t.record(Mark.STEP_START, "r", t=0.0)
    t.record(Mark.STEP_END, "r", t=0.5)
    times = request_times(t.events("r"))
    assert times.slice_transfer_s == (1.0, 3.0, 3.0)  # submit -> done: queueing included
    assert times.slice_busy_s == (1.0, 2.0, 0.5)  # the slice's own transfer time
    assert sum(times.slice_busy_s) == times.transfer_s
    assert times.steps == 1


def test_a_lone_slice_is_busy_from_its_submit() -> None:
    t = Timeline("p")
    t.record(Mark.SLICE_SUBMIT, "r", slice_id=0, t=2.0)
    t.record(Mark.SLICE_DONE, "r", slice_id=0, t=2.25)
    t.record(Mark.SLICE_SUBMIT, "r", slice_id=1, t=5.0)
    t.record(Mark.SLICE_DONE, "r", slice_id=1, t=5.5)
    times = request_times(t.events("r"))
    assert times.slice_busy_s == times.slice_transfer_s == (0.25, 0.5)
    assert times.steps == 0
