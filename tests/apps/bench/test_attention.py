"""``kvplane bench attention`` on a tiny grid: keys, ratios, and choices are consistent."""

from __future__ import annotations

import argparse

import pytest

from kvplane import native as native_build
from kvplane.apps.bench import attention as bench
from kvplane.apps.bench.attention import MEMCPY


def test_bench_json_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        bench, "QUICK_GRID", {"batch": (1,), "q_len": (1,), "kv_len": (32,), "heads": (2,)}
    )
    monkeypatch.setattr(bench, "QUICK_EXTRA", ((2, 1, 64, 2),))
    monkeypatch.setattr(bench, "DECODE_POINT", (2, 1, 64))
    out = bench.run(True, argparse.Namespace(dtype="float32"))
    assert set(out) == {
        "grid", "dtype", "memcpy_gbps", "matmul_gflops", "measured_within_10pct",
        "best_decode_gbps", "decode_memcpy_gbps", "best_decode_gbps_ratio",
        "decode_roofline_ratio",
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
    assert out["best_decode_gbps"] == max(grid[1]["gbps"].values())
    # the decode point's limit was timed with its backends; the other point has none
    assert "memcpy_gbps" not in grid[0] and grid[1]["memcpy_gbps"] > 0
    assert MEMCPY not in grid[1]["seconds"]
    assert out["decode_memcpy_gbps"] == grid[1]["memcpy_gbps"]
    assert out["best_decode_gbps_ratio"] == out["best_decode_gbps"] / out["decode_memcpy_gbps"]
    flop_per_byte = 2 * 2 * (2 * 512 + 64) / ((512 + 64) * 4)  # 2 heads, float32
    roofline = out["matmul_gflops"] / flop_per_byte / out["decode_memcpy_gbps"]
    assert out["decode_roofline_ratio"] == roofline
