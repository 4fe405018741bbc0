"""The planner entry of ``kvplane bench transport``: shape of the entry, and the benchmark plan
is exact (validates) and maximally coalesced (descriptors == contiguous runs == the count
derived here from the block tables). Timing is reported by the bench, never asserted."""

from __future__ import annotations

import numpy as np

from kvplane.apps.bench import transport_planner as tp
from kvplane.apps.bench.transport_planner import LAYERS, deepseek_v3_sides, planner_entry
from kvplane.ids import RegionId
from kvplane.transfer.planner import plan_transfer


def test_planner_entry() -> None:
    entry = planner_entry(quick=True)
    assert set(entry) == {"planner", "ms", "ops", "contiguous_runs", "target_met", "quick",
                          "repeats"}  # fmt: skip
    assert (entry["quick"], entry["repeats"]) == (True, 5)
    assert isinstance(entry["ms"], float)
    assert entry["target_met"] is (entry["ms"] <= tp.TARGET_MS)  # ops == runs is asserted below
    assert entry["planner"] == "deepseek_v3_128k"
    assert isinstance(entry["ms"], float) and entry["ms"] > 0
    src, dst, _ = deepseek_v3_sides()
    # layer-major: a (block, layer) run joins the next block's only if both tables step by one
    joins = int(np.count_nonzero((np.diff(src.block_ids) == 1) & (np.diff(dst.block_ids) == 1)))
    assert entry["ops"] == entry["contiguous_runs"] == LAYERS * (len(src.block_ids) - joins)


def test_benchmark_plan_validates() -> None:
    src, dst, tokens = deepseek_v3_sides(seed=7)
    plan = plan_transfer(src, dst, tokens)
    plan.validate({RegionId(0): src.pool_end}, {RegionId(1): dst.pool_end})
    assert plan.num_bytes == plan.logical_bytes == 128 * 1024 * 61 * 576 * 2


def test_contiguous_4k_blocks_coalesce_into_one_op_per_layer_per_range() -> None:
    src, dst, tokens, expected = tp.contiguous_4k_sides()
    plan = plan_transfer(src, dst, tokens)
    plan.validate({RegionId(0): src.pool_end}, {RegionId(1): dst.pool_end})
    blocks = len(src.block_ids)
    assert plan.num_bytes == blocks * tp.SMALL_LAYERS * tp.SMALL_BLOCK_BYTES  # 4 KiB runs
    assert expected == tp.SMALL_LAYERS * tp.SMALL_RANGES  # the ranges never join
    assert plan.stats().descriptors == plan.stats().contiguous_runs == expected < blocks
    entry = tp.contiguous_4k_entry()
    assert entry["ops"] == entry["contiguous_runs"] == entry["expected_ops"] == expected
    assert entry["block_bytes"] == 4096 and entry["target_met"] is True
