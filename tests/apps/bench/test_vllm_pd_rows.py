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
    with pytest.raises(InvalidArgumentError):
        m.row("kvplane", "pull", [], ref)


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


def _at(connector: str, mode: str, slot: int, ttft: float, decode: float = 10.0) -> m.Sample:
    return m.Sample(connector, mode, slot, slot, 0.0, decode, ttft, 0.0, None, ())


def test_bench_rows_carry_the_spread_of_the_per_slot_ratios() -> None:
    samples = {
        ("kvplane", "pull"): [_at("kvplane", "pull", s, t) for s, t in enumerate([100, 200, 300])],
        ("nixl", "pull"): [_at("nixl", "pull", s, t, 20.0) for s, t in enumerate([200, 200, 200])],
        ("kvplane", "pipelined"): [_at("kvplane", "pipelined", s, 90.0) for s in range(3)],
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
