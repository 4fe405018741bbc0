"""The planner entries of ``kvplane bench transport``: plans judged, no bytes moved.

:func:`planner_entry` times a 128k-token DeepSeek-V3 MLA plan between shuffled block tables
(target: 50 ms, ops == contiguous runs); :func:`contiguous_4k_entry` checks that contiguous
4 KiB blocks coalesce. Not a bench of its own. See docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kvplane.ids import RegionId, TokenRange
from kvplane.layout import LAYER_MAJOR, KVLayout
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import PlanSide

TOKENS = 128 * 1024
LAYERS = 61
BLOCK_SIZE = 64
POOL_BLOCKS = 4096
TARGET_MS = 50.0
SMALL_BLOCK_BYTES = 4 << 10
"""The small-transfer regime's block: 16 tokens × (64 + 64) bf16 per layer."""
SMALL_LAYERS = 4
SMALL_RANGES = 16
SMALL_RANGE_BLOCKS = 32


def deepseek_v3_sides(seed: int = 0) -> tuple[PlanSide, PlanSide, TokenRange]:
    """The two sides and the token range of the benchmark plan (shuffled block tables)."""
    layout = KVLayout.mla(
        num_blocks=POOL_BLOCKS,
        block_size=BLOCK_SIZE,
        num_layers=LAYERS,
        latent_dim=512,
        rope_dim=64,
        dtype=torch.bfloat16,
        order=LAYER_MAJOR,
    )
    rng = np.random.default_rng(seed)
    blocks = TOKENS // BLOCK_SIZE
    src = PlanSide(layout, rng.permutation(POOL_BLOCKS)[:blocks], RegionId(0))
    dst = PlanSide(layout, rng.permutation(POOL_BLOCKS)[:blocks], RegionId(1))
    return src, dst, TokenRange(0, TOKENS)


def planner_entry(quick: bool) -> dict[str, object]:
    """``{"planner": "deepseek_v3_128k", "ms", "ops", "contiguous_runs", "target_met",
    "quick", "repeats"}`` (see module doc)."""
    src, dst, tokens = deepseek_v3_sides()
    plan = plan_transfer(src, dst, tokens)  # warm-up: first-touch numpy paths
    times = []
    repeats = 5 if quick else 21
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_transfer(src, dst, tokens)
        times.append(time.perf_counter() - start)
    stats = plan.stats()
    ms = round(statistics.median(times) * 1e3, 3)
    return {
        "planner": "deepseek_v3_128k",
        "ms": ms,
        "ops": stats.descriptors,
        "contiguous_runs": stats.contiguous_runs,
        "target_met": ms <= TARGET_MS and stats.descriptors == stats.contiguous_runs,
        "quick": quick,
        "repeats": repeats,
    }


def contiguous_4k_sides(seed: int = 0) -> tuple[PlanSide, PlanSide, TokenRange, int]:
    """Two sides whose block tables are :data:`SMALL_RANGES` contiguous ranges of
    :data:`SMALL_RANGE_BLOCKS` blocks (in shuffled order, at different places on each side),
    the token range of all of them, and the descriptors a perfectly coalesced plan needs:
    one per layer per range contiguous on both sides."""
    pool = 2 * SMALL_RANGES * SMALL_RANGE_BLOCKS
    layout = KVLayout.mla(
        num_blocks=pool, block_size=16, num_layers=SMALL_LAYERS, latent_dim=64, rope_dim=64,
        dtype=torch.bfloat16, order=LAYER_MAJOR,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    starts = np.arange(0, pool, 2 * SMALL_RANGE_BLOCKS)  # gaps between ranges: none join
    runs = np.arange(SMALL_RANGE_BLOCKS)

    def table() -> np.ndarray[tuple[int], np.dtype[np.int64]]:
        order = rng.permutation(starts)[:SMALL_RANGES]
        return (order[:, None] + runs[None, :]).reshape(-1).astype(np.int64)

    src_ids, dst_ids = table(), table()
    joins = int(np.count_nonzero((np.diff(src_ids) == 1) & (np.diff(dst_ids) == 1)))
    expected = SMALL_LAYERS * (len(src_ids) - joins)
    src = PlanSide(layout, src_ids, RegionId(0))
    dst = PlanSide(layout, dst_ids, RegionId(1))
    return src, dst, TokenRange(0, len(src_ids) * 16), expected


def contiguous_4k_entry() -> dict[str, object]:
    """``{"planner": "contiguous_4k", "block_bytes", "blocks", "ops", "contiguous_runs",
    "expected_ops", "target_met"}`` (see module doc); no bytes move, nothing is timed."""
    src, dst, tokens, expected = contiguous_4k_sides()
    stats = plan_transfer(src, dst, tokens).stats()
    return {
        "planner": "contiguous_4k",
        "block_bytes": SMALL_BLOCK_BYTES,
        "blocks": len(src.block_ids),
        "ops": stats.descriptors,
        "contiguous_runs": stats.contiguous_runs,
        "expected_ops": expected,
        "target_met": stats.descriptors == stats.contiguous_runs == expected,
    }
