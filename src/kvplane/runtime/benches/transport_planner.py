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
descriptors independently of the planner. Target: ``ms <= 50`` and ``ops == contiguous_runs``.
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
    """``{"planner": "deepseek_v3_128k", "ms", "ops", "contiguous_runs"}`` (see module doc)."""
    src, dst, tokens = deepseek_v3_sides()
    plan = plan_transfer(src, dst, tokens)  # warm-up: first-touch numpy paths
    times = []
    for _ in range(5 if quick else 21):
        start = time.perf_counter()
        plan = plan_transfer(src, dst, tokens)
        times.append(time.perf_counter() - start)
    stats = plan.stats()
    return {
        "planner": "deepseek_v3_128k",
        "ms": round(statistics.median(times) * 1e3, 3),
        "ops": stats.descriptors,
        "contiguous_runs": stats.contiguous_runs,
    }
