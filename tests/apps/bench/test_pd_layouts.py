"""``kvplane bench pd``'s layout rows (TP 2->1, PP 2->1 beside 1->1): their assembly and
verdicts on made-up times (exact values), and one toy-size run of real rank processes (no
timing asserted)."""

from __future__ import annotations

import pytest

from kvplane.apps.bench import pd_layouts as pl
from kvplane.apps.bench.pd_metrics import targets
from kvplane.apps.bench.pd_model import model_spec
from kvplane.apps.bench.pd_pair import Interleaved
from kvplane.apps.bench.pd_ranks import LAYOUTS
from kvplane.errors import InvalidArgumentError

ALL_TARGETS = {
    "exposed_tail_le_1.5x_slice",
    "ttft_le_0.7x_non_pipelined",
    "overlap_ge_0.8",
    "ttft_ratio_le_1.1x_1->1",
    "overlap_ge_1->1_minus_0.1",
}


def _fields(tail: float, busy: float, overlap: float) -> dict[str, float | None]:
    return {"exposed_tail_ms": tail, "overlap_ratio": overlap, "slice_transfer_ms": busy,
            "slice_submit_to_done_ms": busy + 1.0, "step_compute_ms": 4.0}  # fmt: skip


def _served(pipelined: list[float], non_pipelined: list[float]) -> Interleaved:
    rids = [f"r{i}" for i in range(len(pipelined))]
    return Interleaved(rids, {"pipelined": pipelined, "non_pipelined": non_pipelined})


def _times(overlap: float) -> pl.Times:
    return {
        "pipelined": ([_fields(3.0, 2.0, overlap), _fields(2.0, 2.0, overlap)], 0),
        "non_pipelined": ([_fields(9.0, 8.0, 0.0), _fields(7.0, 8.0, 0.0)], 0),
    }


def test_layout_targets_hold_as_for_one_to_one() -> None:
    base = {"ttft_ratio": 0.8, "overlap_ratio": 0.9}
    row: dict[str, object] = {"ttft_ratio": 0.88, "overlap_ratio": 0.8, "exposed_tail_ms": 3.0,
                              "slice_transfer_ms": 2.0}  # fmt: skip
    assert pl.layout_targets(row, base) == {
        "exposed_tail_le_1.5x_slice": True,  # 3 <= 1.5 x 2
        "ttft_le_0.7x_non_pipelined": False,
        "overlap_ge_0.8": True,
        "ttft_ratio_le_1.1x_1->1": True,  # 0.88 <= 1.1 x 0.8
        "overlap_ge_1->1_minus_0.1": True,  # 0.8 >= 0.9 - 0.1
    }
    row["ttft_ratio"], row["overlap_ratio"] = 0.9, 0.79
    got = pl.layout_targets(row, base)
    assert (got["ttft_ratio_le_1.1x_1->1"], got["overlap_ge_1->1_minus_0.1"]) == (False, False)
    missing = pl.layout_targets({"ttft_ratio": 0.5, "overlap_ratio": None}, base)
    assert (missing["ttft_ratio_le_1.1x_1->1"], missing["overlap_ge_1->1_minus_0.1"]) == (
        True,
        False,
    )
    no_base = pl.layout_targets(row, {"ttft_ratio": None, "overlap_ratio": 0.9})
    assert no_base["ttft_ratio_le_1.1x_1->1"] is False
    assert set(pl.LAYOUT_TARGET_DEFINITIONS) == ALL_TARGETS - set(targets(row))


def test_entries_carry_their_layout_and_are_judged_against_one_to_one() -> None:
    base = pl.layout_entry("1->1", "tcp", _served([80.0, 90.0], [100.0, 100.0]), _times(0.9), None)
    assert (base["layout"], base["ranks"], base["ttft_ratio"], base["requests"]) == (
        "1->1",
        1,
        0.85,
        2,
    )
    pipelined, non_pipelined = base["modes"]
    assert pipelined == {
        "transport": "tcp", "layout": "1->1", "mode": "pipelined", "ttft_ms": 85.0,
        "exposed_tail_ms": 2.5, "overlap_ratio": 0.9, "slice_transfer_ms": 2.0,
        "slice_submit_to_done_ms": 3.0, "step_compute_ms": 4.0, "timeline_truncated": 0,
        "ttft_ratio": 0.85, "requests": 2,
    }  # fmt: skip
    assert (non_pipelined["layout"], non_pipelined["mode"]) == ("1->1", "non_pipelined")
    ttft_row, tail_row = base["rows"]
    assert ttft_row == {
        "bench": "pd", "row": "tiny-llama_1->1_ttft_pipelined_vs_non_pipelined", "figure": 85.0,
        "unit": "ms", "limit": 100.0, "limit_name": "non-pipelined", "repeats": 2,
        "ratio_min": 0.8, "ratio_median": 0.85, "ratio_max": 0.9, "stable": False,
        "target": None, "met": None, "layout": "1->1",
    }  # fmt: skip
    assert (tail_row["row"], tail_row["ratio_median"], tail_row["layout"]) == (
        "tiny-llama_1->1_exposed_tail_vs_slice",
        1.25,
        "1->1",
    )
    assert base["targets"]["ttft_ratio_le_1.1x_1->1"] is True  # 1->1 against itself
    tp = pl.layout_entry("tp2->1", "tcp", _served([90.0, 100.0], [100.0, 100.0]), _times(0.7), base)
    assert (tp["ranks"], tp["ttft_ratio"]) == (2, 0.95)
    assert tp["rows"][0]["target"] == 0.935 and tp["rows"][0]["met"] is False  # 1.1 x 0.85
    assert {r["layout"] for r in [*tp["rows"], *tp["modes"]]} == {"tp2->1"}
    assert tp["targets"] == {
        "exposed_tail_le_1.5x_slice": True,
        "ttft_le_0.7x_non_pipelined": False,
        "overlap_ge_0.8": False,
        "ttft_ratio_le_1.1x_1->1": False,  # 0.95 > 0.935
        "overlap_ge_1->1_minus_0.1": False,  # 0.7 < 0.9 - 0.1
    }


def test_tokens_equal_compares_the_requests_every_group_served() -> None:
    a = {"r0": (1, 2), "r1": (3,)}
    assert pl.tokens_equal([a, {"r0": (1, 2)}, {"r0": (1, 2), "r2": (9,)}]) is True
    assert pl.tokens_equal([a, {"r1": (4,)}]) is False
    assert pl.tokens_equal([]) is True


def test_layout_rows_serve_the_tiny_gqa_model_capped_at_its_positions() -> None:
    spec = model_spec("shm", 4096, 256, pl.MODEL)
    assert (spec.transport, spec.tokens, spec.step, spec.num_blocks) == ("shm", 2048, 256, 264)
    assert spec.producer == ("--model", "tiny-llama", "--model-dtype", "float32", "--seed", "0")
    assert set(LAYOUTS) == {"1->1", "tp2->1", "pp2->1"}
    with pytest.raises(InvalidArgumentError):
        pl.layout_result("tcp", 64, 16, (1, 1), 0.1, layouts=("tp2->1",))


@pytest.mark.parametrize(
    "layouts",
    [
        ("1->1", "tp2->1"),
        pytest.param(("1->1", "tp2->1", "pp2->1"), marks=pytest.mark.slow),
    ],
)
def test_rank_processes_serve_every_layout_at_a_toy_size(layouts: tuple[str, ...]) -> None:
    """Real rank processes at a toy size (64 tokens); the default suite runs TP 2->1 beside its
    baseline, the slow one every layout (PP stages feed a decode process in
    tests/apps/test_serve_ranks_gather.py too)."""
    out = pl.layout_result("tcp", 64, 16, (1, 1), 0.1, layouts=layouts)
    assert (out["model"], out["transport"], out["tokens"], out["step"]) == (
        "tiny-llama",
        "tcp",
        64,
        16,
    )
    assert out["tokens_equal"] is True  # every layout and mode decoded the same tokens
    entries = out["layouts"]
    ranks = {"1->1": 1, "tp2->1": 2, "pp2->1": 2}
    assert [(e["layout"], e["ranks"], e["requests"]) for e in entries] == [
        (x, ranks[x], 1) for x in layouts
    ]
    for e in entries:
        assert set(e["targets"]) == ALL_TARGETS
        assert [m["mode"] for m in e["modes"]] == ["pipelined", "non_pipelined"]
        for m in e["modes"]:
            assert m["layout"] == e["layout"] and m["timeline_truncated"] == 0
            assert m["ttft_ms"] > 0 and m["slice_transfer_ms"] > 0
            assert m["step_compute_ms"] > 0 and m["exposed_tail_ms"] is not None
        assert e["modes"][1]["overlap_ratio"] == 0.0  # nothing overlaps after the prefill
        assert 0.0 <= e["modes"][0]["overlap_ratio"] <= 1.0
    names = [r["row"] for r in out["rows"]]
    assert names[0::2] == [f"tiny-llama_{x}_ttft_pipelined_vs_non_pipelined" for x in layouts]
    assert [r["layout"] for r in out["rows"]] == [x for x in layouts for _ in range(2)]
