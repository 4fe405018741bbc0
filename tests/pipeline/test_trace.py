"""Trace export and the report's summary: exact spans, Chrome JSON shape, round trip, redraw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.apps.report import draw_timeline, metrics_table, summarize
from kvplane.errors import InvalidArgumentError
from kvplane.pipeline.timeline import TimelineEvent
from kvplane.pipeline.trace import chrome_trace, events_from_dicts, read_trace, spans, write_trace


def ev(
    t: float, worker: str, mark: str, rid: str = "r0", slice_id: int | None = None
) -> TimelineEvent:
    return TimelineEvent(t, worker, mark, rid, slice_id)


EVENTS = [
    ev(10.000, "prefill", "order"),
    ev(10.001, "prefill", "load_start"),
    ev(10.002, "prefill", "load_done"),
    ev(10.002, "prefill", "step_start", slice_id=1),
    ev(10.006, "prefill", "step_end", slice_id=1),
    ev(10.003, "prefill", "slice_submit", slice_id=0),
    ev(10.005, "prefill", "slice_done", slice_id=0),
    ev(10.006, "prefill", "slice_submit", slice_id=1),
    ev(10.008, "prefill", "slice_done", slice_id=1),
    ev(10.009, "decode", "decode_ready"),
    ev(10.019, "decode", "decode_done"),
    ev(10.020, "decode", "released"),
    ev(10.030, "prefill", "step_start", rid="r1", slice_id=0),  # never ended: an instant
]


def test_spans_pair_starts_with_their_ends() -> None:
    done, instants = spans(EVENTS)
    got = sorted((s.worker, s.name, s.slice_id, round((s.end - s.start) * 1e3, 3)) for s in done)
    assert got == [
        ("decode", "decode", None, 10.0),
        ("prefill", "offload load", None, 1.0),
        ("prefill", "prefill step", 1, 4.0),
        ("prefill", "slice transfer", 0, 2.0),
        ("prefill", "slice transfer", 1, 2.0),
    ]
    assert [(e.mark, e.request_id) for e in instants] == [
        ("order", "r0"),
        ("released", "r0"),
        ("step_start", "r1"),
    ]


def test_chrome_trace_is_valid_trace_event_json(tmp_path: Path) -> None:
    trace = chrome_trace(EVENTS, other={"metrics": {"x": 1.0}, "parity": True})
    path = tmp_path / "trace.json"
    write_trace(path, trace)
    data = json.loads(path.read_text())
    rows = data["traceEvents"]
    assert {r["ph"] for r in rows} == {"M", "X", "i"}
    procs = {r["args"]["name"]: r["pid"] for r in rows if r["name"] == "process_name"}
    assert procs == {"decode": 1, "prefill": 2}
    xs = [r for r in rows if r["ph"] == "X"]
    assert len(xs) == 5
    for r in xs:
        assert set(r) >= {"name", "pid", "tid", "ts", "dur"} and r["dur"] >= 0
    step = next(r for r in xs if r["name"] == "prefill step 1")
    assert (step["pid"], step["tid"], step["ts"], step["dur"]) == (2, 1, 2000.0, 4000.0)
    assert sum(r["ph"] == "i" for r in rows) == 3
    assert data["otherData"]["parity"] is True and data["otherData"]["t0"] == 10.0
    back, other = read_trace(path)
    assert sorted((s.worker, s.name, s.slice_id) for s in back) == sorted(
        (s.worker, s.name, s.slice_id) for s in spans(EVENTS)[0]
    )
    assert other["metrics"] == {"x": 1.0}
    draw_timeline(back, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_traces_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no trace at"):
        read_trace(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="is not a JSON trace"):
        read_trace(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match="has no traceEvents list"):
        read_trace(tmp_path / "empty.json")
    with pytest.raises(InvalidArgumentError, match="timeline event 0 is malformed"):
        events_from_dicts([{"t": 1.0}])
    with pytest.raises(InvalidArgumentError, match="no spans to draw"):
        draw_timeline([], tmp_path / "x.png")


def test_summary_derives_the_seed_metrics_exactly() -> None:
    counters = {
        "prefill": {
            "pd_bytes_moved": 300, "pd_logical_bytes": 200,
            "kvplane_pd_blocks_per_op_bucket:2.0": 1, "kvplane_pd_blocks_per_op_bucket:4.0": 3,
            "kvplane_pd_blocks_per_op_bucket:+Inf": 3, "kvplane_pd_blocks_per_op_count": 3,
            "kvplane_pd_blocks_per_op_sum_nano": 9 * 10**9, "offload_hit_chunks_host": 2,
            "offload_hit_chunks_disk": 1, "attention_plans": 6, "attention_fallbacks": 0,
        },
        "decode": {"attention_plans": 4, "attention_fallbacks": 1},
    }  # fmt: skip
    m = summarize(counters, EVENTS)
    # r0: transfers [3,5] and [6,8] ms; compute [2,6] ms: 2 ms hidden of 4 ms; tail 6->9 ms
    assert m["overlap_ratio_mean"] == pytest.approx(0.5)
    assert m["exposed_tail_ms_mean"] == pytest.approx(3.0)
    assert m["requests_timed"] == 1.0
    assert m["transfer_amplification"] == 1.5
    assert m["blocks_per_op_mean"] == 3.0
    assert (m["chunk_hits_host"], m["chunk_hits_disk"], m["offload_hit_chunks"]) == (2.0, 1.0, 3.0)
    assert "chunk_hits_remote" not in m
    assert m["fallback_ratio"] == 0.1
    assert m["blocks_per_op_p50"] == pytest.approx(2.0 + 2.0 * (1.5 - 1) / 2)
    assert (m["releases_after_failure"], m["release_latency_ms_p99"]) == (0.0, 0.0)
    assert metrics_table(m).row_count == 13  # every row but remote chunk hits
