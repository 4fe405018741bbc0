"""``kvplane bench pd`` at a toy size: the JSON keys of the issue, one row per mode."""

from __future__ import annotations

import argparse

from kvplane.runtime.benches import pd


def test_bench_reports_every_key_for_both_modes() -> None:
    args = argparse.Namespace(transports="tcp,nope", requests=1, tokens=64, step=16, layers=1)
    out = pd.run(True, args)
    rows = out["rows"]
    assert isinstance(rows, list)
    modes = [r["mode"] for r in rows if r["transport"] == "tcp"]
    assert modes == ["pipelined", "non_pipelined"]
    for row in rows[:2]:
        assert set(row) >= {
            "transport",
            "mode",
            "ttft_ms",
            "exposed_tail_ms",
            "overlap_ratio",
            "slice_transfer_ms",
        }
        assert row["ttft_ms"] > 0 and 0.0 <= row["overlap_ratio"] <= 1.0
    assert rows[1]["overlap_ratio"] == 0.0  # nothing overlaps when sending after the prefill
    assert rows[2] == {"transport": "nope", "skipped": "unknown transport"}
    targets = out["targets"]
    assert isinstance(targets, dict) and set(targets["tcp"]) == {
        "exposed_tail_le_1.5x_slice",
        "ttft_le_0.7x_non_pipelined",
        "overlap_ge_0.8",
    }
