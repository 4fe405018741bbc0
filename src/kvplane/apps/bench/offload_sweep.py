"""The ``blocks_per_chunk`` sweep of ``kvplane bench offload``: the per-op cost of a store
amortised over the blocks of a chunk, at 1, 4, 16 and 64 blocks per chunk.

Owns the sweep's cascades (one per chunk size, over one pool) and its ``bench all`` row (16
against 1 block per chunk, lower is better). Touches no tier below the host.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvplane.apps.bench.offload_rows import BENCH, repeat, seconds
from kvplane.apps.bench.spread import SETTLE_S, Row, spread
from kvplane.ids import BlockId, ChunkKey
from kvplane.layout import KVLayout
from kvplane.offload import OffloadConfig, TierCascade, build_cascade

SWEEP = (1, 4, 16, 64)
SWEEP_BLOCKS = {True: 256, False: 1024}
"""16 KiB blocks stored per variant and repeat, per ``--quick``."""
SWEEP_TARGET = 0.2
"""Target: us/block at 16 blocks per chunk <= this x us/block at 1."""


def layout(num_blocks: int) -> KVLayout:
    """16 KiB blocks: 4 layers x K/V x 16 tokens x 2 heads x 32 dims x bf16."""
    return KVLayout.gqa(num_blocks=num_blocks, block_size=16, num_layers=4, kv_heads=2, head_dim=32)


def fresh_keys(n: int) -> list[ChunkKey]:
    """Keys no tier holds yet (random, like block hashes of new content)."""
    return [ChunkKey(os.urandom(32)) for _ in range(n)]


def sweep(total_blocks: int, quick: bool) -> tuple[list[dict[str, Any]], dict[str, object]]:
    """Store ``total_blocks`` 16 KiB blocks as chunks of ``bpc`` blocks, one store op per chunk
    (``us_per_block``) and all chunks in one call (``us_per_block_one_call``), every variant
    in every repeat; repeated until the paired ratio of 16 to 1 block per chunk is stable. Its
    row: us/block at 16 against 1 block per chunk (lower is better)."""
    kv = layout(total_blocks)
    pool = torch.randn(kv.shape).to(kv.dtype)
    blocks = [BlockId(b) for b in range(total_blocks)]
    cascades: dict[int, TierCascade] = {}
    runs: dict[tuple[str, int], Callable[[list[ChunkKey]], None]] = {}
    for bpc in SWEEP:
        c = cascades[bpc] = build_cascade(
            OffloadConfig(host_slots=total_blocks // bpc, admission_min_lookups=0),
            kv,
            bpc,
            pool,
        )

        def per_op(keys: list[ChunkKey], c: TierCascade = c, bpc: int = bpc) -> None:
            for i, k in enumerate(keys):
                c.store([k], blocks[i * bpc : (i + 1) * bpc])
            c.drain()

        def one_call(keys: list[ChunkKey], c: TierCascade = c) -> None:
            c.store(keys, blocks)
            c.drain()

        runs[("op", bpc)], runs[("call", bpc)] = per_op, one_call
    times: dict[tuple[str, int], list[float]] = {k: [] for k in runs}

    def pair() -> tuple[float, float]:
        for (kind, bpc), fn in runs.items():
            keys = fresh_keys(total_blocks // bpc)
            time.sleep(SETTLE_S)
            times[(kind, bpc)].append(seconds(lambda f=fn, k=keys: f(k)))  # type: ignore[misc]
        return times[("op", 16)][-1], times[("op", 1)][-1]

    def drop_warmup() -> None:
        for t in times.values():
            t.clear()

    ours, limit = repeat(pair, quick, after_warmup=drop_warmup)
    for c in cascades.values():
        c.check_integrity()
        c.close()

    def us(kind: str, bpc: int) -> float:
        return statistics.median(times[(kind, bpc)]) / total_blocks * 1e6

    sweep = [
        {"blocks_per_chunk": bpc, "us_per_block": round(us("op", bpc), 3),
         "us_per_block_one_call": round(us("call", bpc), 3)}
        for bpc in SWEEP
    ]  # fmt: skip
    row = Row(
        BENCH, "sweep_us_per_block_16_vs_1", us("op", 16), "µs/block", us("op", 1),
        "1 block per chunk", spread(ours, limit, higher_is_better=False), SWEEP_TARGET, False,
    )  # fmt: skip
    return sweep, row.as_dict()
