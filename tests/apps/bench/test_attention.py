"""``kvplane bench attention`` on a tiny grid: keys, ratios, and choices are consistent."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from kvplane import native as native_build
from kvplane.apps.bench import attention as bench
from kvplane.apps.bench import read_pass


def test_bench_json_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        bench, "QUICK_GRID", {"batch": (1,), "q_len": (1,), "kv_len": (32,), "heads": (2,)}
    )
    monkeypatch.setattr(bench, "QUICK_EXTRA", ((2, 1, 64, 2),))
    monkeypatch.setattr(bench, "DECODE_POINT", (2, 1, 64))
    monkeypatch.setattr(bench, "REPEATS", {True: (3, 3, 600.0)})
    out: dict[str, Any] = bench.run(True, argparse.Namespace(dtype="float32"))
    assert set(out) == {
        "grid", "dtype", "memcpy_gbps", "matmul_gflops", "measured_within_10pct",
        "decode_backend", "readonly_pass", "decode_repeats", "best_decode_gbps",
        "decode_readonly_gbps", "decode_memcpy_gbps", "best_decode_gbps_ratio",
        "best_decode_gbps_vs_copy", "decode_matmul_gflops", "decode_roofline_ratio", "rows",
    }  # fmt: skip
    grid = out["grid"]
    assert isinstance(grid, list) and [(r["batch"], r["kv_len"]) for r in grid] == [
        (1, 32),
        (2, 64),
    ]
    for row in grid:
        fused = {"cpu_fused"} if native_build.compiler() is not None else set()
        assert set(row["seconds"]) == {"torch", "torch_splitkv", "sdpa", *fused}
        assert row["auto"] == "torch"
        assert row["measured"] in row["seconds"]
        assert row["fastest"] == min(row["seconds"], key=row["seconds"].get)
    assert 0.0 <= out["measured_within_10pct"] <= 1.0
    assert out["decode_backend"] == f"{grid[1]['fastest']}, batch 2, kv_len 64"
    kv = torch.zeros(2 * 64 * 576 * 4, dtype=torch.uint8)
    assert out["readonly_pass"] in read_pass.passes(kv)
    rows = out["rows"]
    assert isinstance(rows, list)
    assert [(r["row"], r["unit"], r["repeats"]) for r in rows] == [
        ("decode_gbps_vs_readonly", "GB/s", 3),
        ("decode_gbps_vs_copy", "GB/s", 3),
        ("decode_gflops_vs_matmul", "GFLOP/s", 3),
    ]
    assert rows[0]["limit_name"] == f"read-only pass ({out['readonly_pass']})"
    assert out["decode_repeats"] == 3
    assert round(out["best_decode_gbps_ratio"], 4) == rows[0]["ratio_median"]
    assert round(out["best_decode_gbps_vs_copy"], 4) == rows[1]["ratio_median"]
    assert float(f"{out['decode_readonly_gbps']:.4g}") == rows[0]["limit"]
    assert float(f"{out['decode_memcpy_gbps']:.4g}") == rows[1]["limit"]
    assert all(r["target"] is None and r["met"] is None for r in rows)
    flop_per_byte = 2 * 2 * (2 * 512 + 64) / ((512 + 64) * 4)  # 2 heads, float32
    roofline = out["decode_matmul_gflops"] / flop_per_byte / out["decode_readonly_gbps"]
    assert out["decode_roofline_ratio"] == roofline


def test_no_decode_point_gives_no_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        bench, "QUICK_GRID", {"batch": (1,), "q_len": (1,), "kv_len": (32,), "heads": (2,)}
    )
    monkeypatch.setattr(bench, "QUICK_EXTRA", ())
    out: dict[str, Any] = bench.run(True, argparse.Namespace(dtype="float32"))
    assert out["rows"] == [] and "best_decode_gbps_ratio" not in out
