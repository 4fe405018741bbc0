"""``kvplane bench pd`` at a toy size: the JSON keys of the issue, one mode row per mode, the
``bench all`` rows with their spreads and layout, and the real-model comparison (the layout
rows' own run: test_pd_layouts.py)."""

from __future__ import annotations

import argparse

import pytest

from kvplane.apps.bench import pd


def test_bench_reports_every_key_for_both_modes() -> None:
    args = argparse.Namespace(
        transports="tcp,nope", requests=1, tokens=64, step=16, layers=1, layouts=False
    )
    out = pd.run(False, args)  # the full run: --quick leaves the real model out
    rows = out["modes"]
    assert isinstance(rows, list)
    modes = [r["mode"] for r in rows if r["transport"] == "tcp"]
    assert modes == ["pipelined", "non_pipelined", "auto"]
    assert rows[2]["ttft_vs_best_fixed"] > 0
    for row in rows[:2]:
        assert set(row) >= {
            "transport",
            "layout",
            "mode",
            "ttft_ms",
            "exposed_tail_ms",
            "overlap_ratio",
            "slice_transfer_ms",
            "slice_submit_to_done_ms",
            "step_compute_ms",
            "timeline_truncated",
        }
        assert row["slice_transfer_ms"] > 0 and row["exposed_tail_ms"] is not None
        assert row["slice_submit_to_done_ms"] >= row["slice_transfer_ms"]
        assert row["timeline_truncated"] == 0
        assert row["ttft_ms"] > 0 and 0.0 <= row["overlap_ratio"] <= 1.0
    assert rows[0]["ttft_ratio"] > 0 and rows[1]["per_step_transfer_ms"] >= 0
    assert rows[0]["zero_stretch_ttft_ratio"] > 0
    assert rows[1]["overlap_ratio"] == 0.0  # nothing overlaps when sending after the prefill
    assert rows[3] == {"transport": "nope", "skipped": "unknown transport"}
    targets = out["targets"]
    assert isinstance(targets, dict) and set(targets["tcp"]) == {
        "exposed_tail_le_1.5x_slice",
        "ttft_le_0.7x_non_pipelined",
        "overlap_ge_0.8",
    }
    assert set(out["target_definitions"]) == set(targets["tcp"])  # type: ignore[arg-type]
    calib = out["calibration"]
    assert isinstance(calib, dict) and isinstance(calib["tcp"]["calibration_ok"], bool)
    assert calib["tcp"]["slice_transfer_ms"] == rows[0]["slice_transfer_ms"]
    assert out["memcpy_slice_ms"] > 0 and out["memcpy_slice_scattered_ms"] > 0  # type: ignore[operator]
    assert set(out["compute_model"]) == {"synthetic", "model"}  # type: ignore[arg-type]
    assert "sleep after streaming-store write" in out["compute_model"]["synthetic"]  # type: ignore[index]
    lines = out["rows"]
    assert isinstance(lines, list)
    assert [r["row"] for r in lines] == [
        "tcp_ttft_pipelined_vs_non_pipelined",
        "tcp_exposed_tail_vs_slice",
        "tcp_ttft_auto_vs_best_fixed",
        "model_ttft_pipelined_vs_non_pipelined",
        "model_exposed_tail_vs_slice",
    ]
    assert [r["target"] for r in lines] == [0.7, 1.5, 1.1, None, 1.5]
    assert all(r["bench"] == "pd" and r["repeats"] == 2 and not r["stable"] for r in lines)
    assert {r["layout"] for r in [*lines, *rows[:3], *out["model"]["modes"]]} == {"1->1"}  # type: ignore[index]
    assert out["layouts"] is None  # --no-layouts (off by default with --quick)
    assert lines[0]["ratio_median"] == round(rows[0]["ttft_ratio"], 4)
    model = out["model"]
    assert isinstance(model, dict)
    assert (model["model"], model["transport"], model["tokens"]) == ("tiny-deepseek", "tcp", 64)
    assert model["tokens_equal"] is True and model["rows"] == lines[3:]
    assert [m["mode"] for m in model["modes"]] == ["pipelined", "non_pipelined"]


def test_auto_row_pairs_each_request_with_its_better_fixed_mode() -> None:
    ttft = {"pipelined": [10.0, 30.0, 50.0], "non_pipelined": [20.0, 15.0, 40.0],
            "auto": [11.0, 15.0, 40.0]}  # fmt: skip
    row = pd.auto_row("shm", ttft)
    assert (row["row"], row["figure"], row["limit"]) == ("shm_ttft_auto_vs_best_fixed", 15, 15)
    assert (row["ratio_min"], row["ratio_median"], row["ratio_max"]) == (1.0, 1.0, 1.1)
    assert (row["target"], row["met"]) == (1.1, True)


def test_ttft_ratio_pairs_requests_not_medians() -> None:
    # two pairs at half; load hit the third pair's non-pipelined run less than its pipelined
    pipelined = [10.0, 60.0, 70.0]
    non_pipelined = [20.0, 120.0, 65.0]
    assert pd.ttft_ratio(pipelined, non_pipelined) == 0.5  # the medians' ratio: 60 / 65


def test_zero_stretch_ratio() -> None:
    # 8 steps of 4 ms + a 4 ms lone slice = 36 ms, against 8 x 4 + 8 x 2 ms of bulk = 48 ms
    assert pd.zero_stretch_ratio(8, 4.0, 2.0) == 0.75
    # a bulk transfer no cheaper per step than a lone slice: (N + 1) / 2N
    assert pd.zero_stretch_ratio(8, 4.0, 4.0) == 9 / 16


def test_quick_runs_tcp_without_the_model_and_the_full_run_tcp_shm_and_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pd, "available", lambda: {"tcp": "off here", "shm": "off here"})
    for quick, want in ((True, ["tcp"]), (False, ["tcp", "shm"])):
        args = argparse.Namespace(transports=None, requests=1, tokens=64, step=16, layers=1)
        out = pd.run(quick, args)
        assert out["modes"] == [{"transport": t, "skipped": "off here"} for t in want]
        assert out["rows"] == [] and out["model"] is None and out["layouts"] is None
        assert out.get("model_skipped") == (pd.NO_MODEL_IN_QUICK if quick else None)


def test_each_mode_names_its_pipelining_since_serve_defaults_to_auto() -> None:
    from kvplane.apps import serve
    from kvplane.apps.bench.pd_pair import MODE_FLAGS

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)

    def pipelining(*flags: str) -> str:
        args = parser.parse_args(["prefill", *flags])
        serve.settle(args)  # defaults are filled after the config file and the environment
        return str(args.pipelining)

    assert pipelining() == "auto"
    got = {mode: pipelining(*flags) for mode, flags in MODE_FLAGS.items()}
    assert got == {"pipelined": "on", "non_pipelined": "off", "auto": "auto"}
