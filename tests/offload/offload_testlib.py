"""Helpers shared by the offload tests: deterministic chunk keys, a tiny layout, pools."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from kvplane.ids import ChunkKey
from kvplane.layout import KVLayout


def key(i: int) -> ChunkKey:
    """A deterministic 32-byte chunk key (like a block hash)."""
    return ChunkKey(hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest())


def keys(*idx: int) -> list[ChunkKey]:
    return [key(i) for i in idx]


def tiny_layout(num_blocks: int = 32) -> KVLayout:
    """GQA, 2 layers x K/V x 4 tokens x 2 heads x 16 dims x fp32 = 2048 bytes per block."""
    return KVLayout.gqa(
        num_blocks=num_blocks, block_size=4, num_layers=2, kv_heads=2, head_dim=16,
        dtype=torch.float32,
    )  # fmt: skip


def filled_pool(layout: KVLayout, seed: int = 0) -> torch.Tensor:
    """A pool whose every element is distinct (block-dependent), deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=g).to(layout.dtype)


BAD_IDS: list[object] = [
    # block ids every block-id argument of the offload package refuses (check_block_ids)
    [0.5, 1.5],
    [1, True],
    [True, False],
    [np.True_],
    ["a"],
    None,
    5,
    "01",
    [[0, 1]],
    [[0], [1, 2]],
    np.array([1.0, 2.0]),
    np.array([True]),
    np.zeros((1, 2), dtype=np.int64),
    torch.tensor([0.0, 1.0]),
    torch.tensor([True]),
]
