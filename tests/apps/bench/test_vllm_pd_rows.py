"""What ``kvplane bench vllm-pd`` derives from a PD pair's records, on made-up times (seconds
of one monotonic clock): per-request TTFT and tails by mode, rows, paired ratios and the
targets, including a connector that could not run."""

from __future__ import annotations

import pytest

from kvplane.apps.bench import vllm_pd_rows as m
from kvplane.errors import InvalidArgumentError


def _pull(slot: int, prompt: int, t0: float, prefill_s: float, decode_s: float) -> m.Sample:
    """A pull request: prefilled from t0, its params handed over 5 ms later, decoded."""
    p = {"added_at": t0, "finished_at": t0 + prefill_s, "tokens": [9]}
    d = {"added_at": t0 + prefill_s + 0.005, "first_at": t0 + prefill_s + 0.005 + decode_s}
    return m.sample("kvplane", "pull", slot, prompt, prefill=p, decode={**d, "tokens": [1, 2]})


def test_pull_ttft_is_prefill_plus_decode_and_leaves_the_hand_over_out() -> None:
    s = _pull(0, 7, t0=100.0, prefill_s=0.5, decode_s=0.04)
    assert s.prefill_ms == pytest.approx(500.0)
    assert s.decode_ttft_ms == pytest.approx(40.0)
    assert s.ttft_ms == pytest.approx(540.0)
    assert s.exposed_tail_ms == pytest.approx(45.0)  # hand-over + decode's first forward
    assert s.transfer_tail_ms is None
    assert (s.slot, s.prompt, s.tokens) == (0, 7, (1, 2))


def test_pipelined_ttft_counts_from_the_prefill_add_not_the_early_decode_add() -> None:
    p = {"added_at": 10.0, "finished_at": 10.4}
    d = {"added_at": 9.7, "first_at": 10.43, "tokens": [3]}
    s = m.sample("kvplane", "pipelined", 1, 2, prefill=p, decode=d, slice_done_at=10.41)
    assert s.ttft_ms == pytest.approx(430.0)
    assert s.decode_ttft_ms == pytest.approx(730.0)  # includes the wait for the prefill
    assert s.exposed_tail_ms == pytest.approx(30.0)
    assert s.transfer_tail_ms == pytest.approx(10.0)


def test_a_missing_time_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="first_at"):
        m.sample("nixl", "pull", 0, 0, prefill={"added_at": 0.0, "finished_at": 1.0},
                 decode={"added_at": 1.0})  # fmt: skip


def test_row_takes_medians_and_checks_every_request_against_the_reference() -> None:
    samples = [
        _pull(0, 0, 0.0, 0.5, 0.04),
        _pull(1, 1, 10.0, 0.3, 0.02),
        _pull(2, 2, 20.0, 0.9, 0.06),
    ]
    ref = {0: [1, 2], 1: [1, 2], 2: [1, 2]}
    got = m.row("kvplane", "pull", samples, ref)
    assert got == {
        "connector": "kvplane",
        "mode": "pull",
        "tp": 1,
        "ttft_ms": 540.0,
        "ttft_range_ms": [320.0, 960.0],
        "decode_ttft_ms": 40.0,
        "prefill_ms": 500.0,
        "exposed_tail_ms": 45.0,
        "transfer_tail_ms": None,
        "tokens_equal": True,
        "repeats": 3,
    }
    assert m.row("kvplane", "pull", samples, {**ref, 1: [1, 3]})["tokens_equal"] is False
    assert m.row("kvplane", "pull", samples, {0: [1, 2]})["tokens_equal"] is False  # no ref
    with pytest.raises(InvalidArgumentError):
        m.row("kvplane", "pull", [], ref)
    tp2 = m.Sample("kvplane", "pull", 3, 3, 1.0, 1.0, 2.0, 0.0, None, (1, 2), tp=2)
    with pytest.raises(InvalidArgumentError, match=r"TP sizes \[1, 2\]"):
        m.row("kvplane", "pull", [*samples, tp2], ref)


def test_ratios_pair_by_slot_and_ignore_unpaired_samples() -> None:
    ours = [_pull(0, 0, 0.0, 0.5, 0.05), _pull(1, 1, 0.0, 0.5, 0.05), _pull(9, 9, 0, 1, 1)]
    theirs = [_pull(0, 0, 0.0, 0.5, 0.10), _pull(1, 1, 0.0, 0.4, 0.10)]
    got = m.time_ratio(ours, theirs)
    assert got == {"ratio": 1.008, "range": [0.917, 1.1], "pairs": 2}  # 550/600, 550/500
    assert m.time_ratio(ours, theirs, "decode_ttft_ms") == {
        "ratio": 0.5, "range": [0.5, 0.5], "pairs": 2,
    }  # fmt: skip
    assert m.time_ratio(ours, []) is None


def test_targets_are_met_only_when_measured_and_within_their_limits() -> None:
    rows = [
        {"connector": "kvplane", "mode": "pull", "tokens_equal": True},
        {"connector": "kvplane", "mode": "pipelined", "tokens_equal": True},
        {"connector": "nixl", "mode": "pull", "tokens_equal": True},
    ]
    ratios = {
        "kvplane_pull_vs_nixl_pull": {"ratio": 0.9, "range": [0.8, 1.0], "pairs": 4},
        "pipelined_vs_pull": {"ratio": 0.85, "range": [0.8, 0.9], "pairs": 4},
    }
    got = m.targets(rows, ratios)
    assert got == {
        "tokens_equal": {"met": True, "value": True, "limit": True},
        "kvplane_pull_le_nixl_pull": {"met": True, "value": 0.9, "limit": 1.0},
        "pipelined_le_0.8x_pull": {"met": False, "value": 0.85, "limit": 0.8},
    }


def test_a_connector_that_did_not_run_fails_the_targets_it_enters_and_says_so() -> None:
    rows = [
        {"connector": "kvplane", "mode": "pull", "tokens_equal": True},
        {"connector": "nixl", "mode": "pull", "error": "nixl does not import"},
    ]
    got = m.targets(rows, {"kvplane_pull_vs_nixl_pull": None, "pipelined_vs_pull": None})
    assert got["tokens_equal"] == {
        "met": False, "value": True, "limit": True, "why": "not run: nixl/pull",
    }  # fmt: skip
    assert got["kvplane_pull_le_nixl_pull"] == {
        "met": False, "value": None, "limit": 1.0, "why": "not measured",
    }  # fmt: skip


def _at(
    connector: str, mode: str, slot: int, ttft: float, decode: float = 10.0, *, tp: int = 1
) -> m.Sample:
    return m.Sample(connector, mode, slot, slot, 0.0, decode, ttft, 0.0, None, (), tp)


def test_bench_rows_carry_the_spread_of_the_per_slot_ratios() -> None:
    samples: dict[m.Key, list[m.Sample]] = {
        ("kvplane", "pull", 1): [
            _at("kvplane", "pull", s, t) for s, t in enumerate([100, 200, 300])
        ],
        ("nixl", "pull", 1): [
            _at("nixl", "pull", s, t, 20.0) for s, t in enumerate([200, 200, 200])
        ],
        ("kvplane", "pipelined", 1): [_at("kvplane", "pipelined", s, 90.0) for s in range(3)],
    }
    rows = m.bench_rows(samples)  # no NIXL push: its row is left out
    assert [r["row"] for r in rows] == [
        "kvplane_pull_vs_nixl_pull", "pipelined_vs_pull", "decode_ttft_kvplane_pull_vs_nixl_pull",
    ]  # fmt: skip
    assert rows[0] == {
        "bench": "vllm_pd", "row": "kvplane_pull_vs_nixl_pull", "figure": 200.0, "unit": "ms",
        "limit": 200.0, "limit_name": "NixlConnector pull", "repeats": 3, "ratio_min": 0.5,
        "ratio_median": 1.0, "ratio_max": 1.5, "stable": False, "target": 1.0, "met": True,
    }  # fmt: skip
    assert (rows[1]["ratio_min"], rows[1]["ratio_median"], rows[1]["ratio_max"]) == (0.3, 0.45, 0.9)
    assert rows[1]["target"] == 0.8 and rows[1]["met"] is True
    assert rows[2]["ratio_median"] == 0.5 and rows[2]["stable"] is True and rows[2]["met"] is None


def test_a_sample_keeps_the_tp_size_its_pair_ran_at() -> None:
    p = {"added_at": 1.0, "finished_at": 1.5}
    d = {"added_at": 1.6, "first_at": 1.7, "tokens": [4]}
    assert m.sample("kvplane", "pull", 0, 0, prefill=p, decode=d).tp == 1
    s = m.sample("kvplane", "pull", 0, 0, prefill=p, decode=d, tp=2)
    assert (s.tp, s.transfer_tail_ms) == (2, None)
    assert s.ttft_ms == pytest.approx(600.0)


def test_names_at_tp_2_carry_a_suffix_and_tp_1_names_stay() -> None:
    assert m.at_tp("pipelined_vs_pull", 1) == "pipelined_vs_pull"
    assert m.at_tp("pipelined_vs_pull", 2) == "pipelined_vs_pull_tp2"


def test_tp_2_ratios_and_bench_rows_pair_only_tp_2_samples() -> None:
    samples: dict[m.Key, list[m.Sample]] = {
        ("kvplane", "pull", 1): [_at("kvplane", "pull", s, 100.0) for s in range(2)],
        ("kvplane", "pull", 2): [
            _at("kvplane", "pull", s, t, tp=2) for s, t in [(0, 200), (1, 400)]
        ],
        ("kvplane", "pipelined", 2): [
            _at("kvplane", "pipelined", s, 100.0, tp=2) for s in range(2)
        ],
    }
    got = m.ratios_at(samples, 2)
    assert got == {
        "kvplane_pull_vs_nixl_pull_tp2": None,
        "pipelined_vs_pull_tp2": {"ratio": 0.375, "range": [0.25, 0.5], "pairs": 2},
        "pipelined_vs_nixl_push_tp2": None,
        "decode_ttft_kvplane_pull_vs_nixl_pull_tp2": None,
        "prefill_kvplane_pull_vs_nixl_pull_tp2": None,
    }
    assert m.ratios_at(samples, 1)["pipelined_vs_pull"] is None  # no TP 1 pipelined samples
    rows = m.bench_rows(samples, 2)
    assert rows == [
        {
            "bench": "vllm_pd", "row": "pipelined_vs_pull_tp2", "figure": 100.0, "unit": "ms",
            "limit": 300.0, "limit_name": "kvplane pull at TP 2", "repeats": 2,
            "ratio_min": 0.25, "ratio_median": 0.375, "ratio_max": 0.5, "stable": False,
            "target": 0.8, "met": True,
        }
    ]  # fmt: skip
    assert m.bench_rows(samples, 1) == []


def test_targets_per_tp_size_and_an_error_row_named_with_its_tp() -> None:
    rows = [
        {"connector": "kvplane", "mode": "pull", "tp": 1, "tokens_equal": True},
        {"connector": "kvplane", "mode": "pull", "tp": 2, "tokens_equal": True},
        {"connector": "nixl", "mode": "pull", "tp": 2, "error": "TP 2 needs a core per rank"},
    ]
    ratios = {
        "pipelined_vs_pull": {"ratio": 0.7, "range": [0.6, 0.8], "pairs": 4},
        "pipelined_vs_pull_tp2": {"ratio": 0.9, "range": [0.8, 1.0], "pairs": 4},
    }
    got = m.targets(rows, ratios, (1, 2))
    assert got == {
        "tokens_equal": {
            "met": False, "value": True, "limit": True, "why": "not run: nixl/pull_tp2",
        },
        "kvplane_pull_le_nixl_pull": {
            "met": False, "value": None, "limit": 1.0, "why": "not measured",
        },
        "pipelined_le_0.8x_pull": {"met": True, "value": 0.7, "limit": 0.8},
        "kvplane_pull_le_nixl_pull_tp2": {
            "met": False, "value": None, "limit": 1.0, "why": "not measured",
        },
        "pipelined_le_0.8x_pull_tp2": {"met": False, "value": 0.9, "limit": 0.8},
    }  # fmt: skip
