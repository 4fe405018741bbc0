"""Pieces of ``kvplane bench transport`` that decide what is compared with what."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import pytest

from kvplane.apps.bench import transport
from kvplane.apps.bench.spread import Row
from kvplane.apps.bench.transport import (
    BLOCKS,
    NIXL_TCP,
    UCX_TCP,
    _Case,
    _environ,
    _measure_cases,
    _row,
    _tls,
    tcp_vs_nixl,
)


def test_environ_sets_then_restores_values_and_absences(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_TEST_KEEP", "before")
    monkeypatch.delenv("KVPLANE_TEST_NEW", raising=False)
    with _environ({"KVPLANE_TEST_KEEP": "during", "KVPLANE_TEST_NEW": "x"}):
        assert os.environ["KVPLANE_TEST_KEEP"] == "during"
        assert os.environ["KVPLANE_TEST_NEW"] == "x"
    assert os.environ["KVPLANE_TEST_KEEP"] == "before"
    assert "KVPLANE_TEST_NEW" not in os.environ


def test_environ_restores_after_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    with pytest.raises(RuntimeError), _environ(UCX_TCP):
        assert os.environ["UCX_TLS"] == "tcp"
        raise RuntimeError("bench failed")
    assert "UCX_TLS" not in os.environ


def test_only_tcp_restricted_nixl_rows_get_a_label() -> None:
    assert _tls({"transport": "nixl", "ucx_tls": "tcp"}) == " (UCX_TLS=tcp)"
    assert _tls({"transport": "nixl", "ucx_tls": "default"}) == ""
    assert _tls({"transport": "tcp"}) == ""


def test_each_row_says_whether_it_meets_its_target() -> None:
    # ratios 0.9 (kvplane 1 s against a 0.9 s limit) and 0.5
    fast, _ = _row("tcp", 4096, ([1.0, 1.0, 1.0], [], [0.9, 0.9, 0.9], [], []))
    slow, lines = _row("nixl", 4096, ([2.0, 2.0, 2.0], [], [1.0, 1.0, 1.0], [], []))
    assert (fast["target"], fast["target_met"]) == (0.85, True)
    assert (slow["target"], slow["target_met"]) == (0.9, False)
    assert [(r.row, r.met) for r in lines] == [("nixl 4 KiB fresh", False)]


def test_a_row_reports_fresh_and_cached_lists_with_their_spreads() -> None:
    total = transport.TOTAL
    fresh = [total / 1e9, total / 2e9, total / 1e9, total / 1e9]  # 1, 2, 1, 1 GB/s
    cached = [total / 2e9] * 4
    limit = [total / 2e9] * 4
    out, lines = _row("local", 256 << 10, (fresh, cached, limit, [], []), "here")
    assert out["gbps"] == 1.0 and out["limit_gbps"] == 2.0
    assert (out["ratio"], out["ratio_min"], out["ratio_max"]) == (0.5, 0.5, 1.0)
    assert out["repeats"] == 4 and out["stable"] is True  # sorted 0.5, 0.5, 0.5, 1: middle 0.5
    assert (out["cached_gbps"], out["cached_ratio"]) == (2.0, 1.0)
    assert [
        (r.row, r.as_dict()["figure"], r.as_dict()["limit"], r.spread.ratio_median, r.met)
        for r in lines
    ] == [
        ("here 256 KiB fresh", 1.0, 2.0, 0.5, False),
        ("here 256 KiB cached", 2.0, 2.0, 1.0, True),
    ]
    assert lines[0].limit_name == transport.LIMITS["local"]


def test_tcp_vs_nixl_labels_the_tcp_restricted_comparison_as_the_target() -> None:
    rows = [
        {"transport": "tcp", "block_bytes": 4096, "gbps": 1.0},
        {"transport": "nixl", "ucx_tls": "tcp", "block_bytes": 4096, "gbps": 0.8},
        {"transport": "nixl", "ucx_tls": "default", "block_bytes": 4096, "gbps": 2.0},
        {"planner": "contiguous_4k", "ops": 1},
    ]
    got, target = tcp_vs_nixl(rows)
    assert len(got) == 2 and len(target) == 1
    assert NIXL_TCP in target[0] and got[target[0]] is True
    (info,) = set(got) - set(target)
    assert got[info] is False and "cma" in info
    assert "UCX_TLS=tcp" in transport.TCP_VS_NIXL_NOTE


def test_result_records_quick_and_repeats_and_the_planner_targets() -> None:
    args = argparse.Namespace(only=["no-such-transport"])
    out = transport.run(True, args)
    low, high, cap = transport.REPEATS[True]
    assert out["quick"] is True and out["repeats"] == {"min": low, "max": high, "cap_s": cap}
    assert out["rows"] == []
    assert out["tcp_vs_nixl"] == {} and out["tcp_vs_nixl_target"] == []
    results = out["results"]
    assert isinstance(results, list)
    assert [r["planner"] for r in results] == ["deepseek_v3_128k", "contiguous_4k"]
    assert all(isinstance(r["target_met"], bool) for r in results)
    assert results[1]["target_met"] is True


def test_cases_are_interleaved_repeat_by_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "SETTLE_S", 0.0)
    monkeypatch.setattr(transport, "REPEATS", {True: (2, 2, 600.0)})
    calls: list[str] = []

    def step(what: str) -> Callable[[int], None]:
        return lambda block: calls.append(f"{what}{block >> 10}")

    cases = [_Case("tcp", step("t"), step("c"), step("T")),
             _Case("nixl", step("n"), step("d"), step("N"), label="nixl (x)")]  # fmt: skip
    rows, kv_s, lines = _measure_cases(cases, True)
    first = BLOCKS[0] >> 10
    # warm-ups, then each repeat times tcp (fresh, cached, limit) and then nixl's
    assert calls[:18] == [f"{x}{first}" for x in "tcTndN" * 3]
    assert [[r["transport"] for r in case] for case in rows] == [["tcp"] * 2, ["nixl"] * 2]
    assert [sorted(k) for k in kv_s] == [sorted(BLOCKS)] * 2
    assert all(len(v) == 2 for k in kv_s for v in k.values())
    assert [r.row for r in lines[:4]] == [
        f"tcp {first} KiB fresh", f"tcp {first} KiB cached",
        f"nixl (x) {first} KiB fresh", f"nixl (x) {first} KiB cached",
    ]  # fmt: skip


def test_the_target_uses_the_paired_ratio_when_there_is_one() -> None:
    rows = [
        {"transport": "tcp", "block_bytes": 4096, "gbps": 1.0},
        {"transport": "nixl", "ucx_tls": "tcp", "block_bytes": 4096, "gbps": 0.8},
    ]
    got, (label,) = tcp_vs_nixl(rows, {4096: 0.95})  # medians say faster, pairs say slower
    assert got == {label: False}
    assert tcp_vs_nixl(rows, {4096: 1.2})[0] == {label: True}


def test_tcp_rows_come_from_its_own_run_and_the_nixl_pairing_from_the_interleaved_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def row(name: str, tag: str, **extra: object) -> list[dict[str, object]]:
        return [{"transport": name, "block_bytes": b, "gbps": 1.0, "limit_gbps": 1.0,
                 "ratio": 1.0, "tag": tag, **extra} for b in BLOCKS]  # fmt: skip

    def cross(name: str, quick: bool, label: str = "") -> tuple[list[dict[str, object]], list[Row]]:
        calls.append(f"alone {name}")
        return row(name, "alone"), []

    def with_nixl(
        quick: bool,
    ) -> tuple[list[dict[str, object]], list[dict[str, object]], dict[int, float], list[Row]]:
        calls.append("interleaved")
        return (row("tcp", "beside nixl"), row("nixl", "paired", ucx_tls="tcp"), {4096: 1.5},
                [])  # fmt: skip

    monkeypatch.setattr(transport, "available", lambda: {"tcp": None, "nixl": None})
    monkeypatch.setattr(transport, "_cross", cross)
    monkeypatch.setattr(transport, "_tcp_with_nixl", with_nixl)
    monkeypatch.setattr(transport, "_planner", lambda quick: [])
    got = transport.run(False, argparse.Namespace(only=None))
    # tcp alone first (no UCX thread alive), then tcp with NIXL over TCP, then NIXL's default
    assert calls == ["alone tcp", "interleaved", "alone nixl"]
    results = got["results"]
    assert isinstance(results, list)
    assert [(r["transport"], r.get("ucx_tls"), r["tag"]) for r in results][::2] == [
        ("tcp", None, "alone"), ("nixl", "default", "alone"), ("nixl", "tcp", "paired"),
    ]  # fmt: skip
    assert got["tcp_vs_nixl_paired_ratio"] == {"4 KiB": 1.5}


def test_quick_runs_tcp_alone_then_beside_nixl_and_leaves_out_nixls_default_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def row(name: str, **extra: object) -> list[dict[str, object]]:
        return [{"transport": name, "block_bytes": b, "gbps": 1.0, "limit_gbps": 1.0,
                 "ratio": 1.0, **extra} for b in BLOCKS]  # fmt: skip

    def cross(name: str, quick: bool, label: str = "") -> tuple[list[dict[str, object]], list[Row]]:
        calls.append(f"alone {name}")
        return row(name), []

    def with_nixl(
        quick: bool,
    ) -> tuple[list[dict[str, object]], list[dict[str, object]], dict[int, float], list[Row]]:
        calls.append("interleaved")
        return row("tcp"), row("nixl", ucx_tls="tcp"), {4096: 1.5}, []

    monkeypatch.setattr(transport, "available", lambda: {"tcp": None, "nixl": None})
    monkeypatch.setattr(transport, "_cross", cross)
    monkeypatch.setattr(transport, "_tcp_with_nixl", with_nixl)
    monkeypatch.setattr(transport, "_planner", lambda quick: [])
    got = transport.run(True, argparse.Namespace(only=None))
    assert calls == ["alone tcp", "interleaved"]  # tcp's own rows with no NIXL agent alive
    results = got["results"]
    assert isinstance(results, list)
    assert [(r["transport"], r.get("ucx_tls")) for r in results][::2] == [
        ("tcp", None), ("nixl", "tcp"),
    ]  # fmt: skip
    assert got["skipped"] == {"nixl (UCX default)": transport.QUICK_DROPPED}
    assert got["tcp_vs_nixl_paired_ratio"] == {"4 KiB": 1.5}
