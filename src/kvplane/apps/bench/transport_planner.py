"""The planner entry of ``kvplane bench transport``: plan a DeepSeek-V3 128k-token MLA transfer.

Not a bench module of its own (it is not in ``BENCHES``): the transport bench appends
:func:`planner_entry` to its results. The workload: 131,072 tokens of a 61-layer MLA pool
(``kv_lora_rank`` 512 + rope 64 = 576 bf16 elements per token per layer, block size 64, so 2,048
blocks and 9.2 GB of KV) between two pools in the per-layer (layer-major) order vLLM and SGLang
use, each side's block table a random sample of a 4,096-block pool. Every (block, layer) pair is
then its own contiguous run on both sides unless two consecutive blocks happen to be consecutive
on both sides, so the plan has ~125k descriptors: the planner's worst realistic case.

``ms`` is the median wall time of :func:`kvplane.transfer.planner.plan_transfer` (after a warm-up
call); ``ops`` the descriptor pairs (byte-range moves) in the plan; ``contiguous_runs`` the fewest
descriptors that could express the same mapping (``TransferPlan.stats``), computed from the
descriptors independently of the planner. Target: ``ms <= 50`` and ``ops == contiguous_runs``,
reported as ``target_met``; ``quick`` and ``repeats`` say how many timed calls the median took.

:func:`contiguous_4k_entry` is the issue's "4 KiB blocks coalesced where contiguous", judged on
the plan (no bytes move): a layer-major MLA pool whose (block, layer) run is 4 KiB, block tables
made of contiguous ranges of blocks in shuffled order; ``target_met`` when the plan's ``ops``
equal its ``contiguous_runs`` and the count derived from the tables (one descriptor per layer
per range that is contiguous on both sides), so every contiguous stretch of 4 KiB blocks is one
descriptor.
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
