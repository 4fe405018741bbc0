"""Prefix offload reads chunk keys from the request's block table: the keys are the table's
block hashes at chunk ends, and a counting hasher shows every block of a request is hashed once
(at admission and as tokens are appended) -- storing, looking up and loading hash nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.blocks.hashing import ExtraKey, TokenIds
from kvplane.ids import BlockHash, RequestId
from kvplane.layout import KVLayout
from kvplane.offload import OffloadConfig
from kvplane.serving.prefix_offload import (
    LoadFinished,
    PrefixOffload,
    PrefixSettings,
    StoreFinished,
)
from kvplane.serving.producers.base import PoolTensor

BS, BPC = 4, 2


class CountingHasher(BlockHasher):
    """A :class:`BlockHasher` that counts the blocks it hashes (in a list: the hasher is a
    frozen dataclass)."""

    def __init__(self) -> None:
        super().__init__(seed=7, fingerprint=b"test-model")
        object.__setattr__(self, "_count", [0])

    @property
    def blocks(self) -> int:
        return int(self._count[0])

    def hash_blocks(
        self, token_ids: TokenIds, block_size: int, extra_keys: tuple[ExtraKey, ...] = (),
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:  # fmt: skip
        out = super().hash_blocks(token_ids, block_size, extra_keys, parent)
        self._count[0] += len(out)
        return out


def _offload(pool: BlockPool) -> PrefixOffload:
    layout = KVLayout.gqa(num_blocks=pool.num_blocks, block_size=BS, num_layers=2, kv_heads=2,
                          head_dim=8, dtype=torch.float32)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    kv = PoolTensor(layout, torch.randn(layout.shape, generator=g))
    config = OffloadConfig(host_slots=8, admission_min_lookups=0, pin_memory=False)
    return PrefixOffload(PrefixSettings(config, BPC), kv, pool)


def _drain(off: PrefixOffload) -> list[object]:
    events: list[object] = []
    while off.busy or off.loading:
        events += off.wait(1.0)
    return events


def _admit(pool: BlockPool, hasher: BlockHasher, rid: str, tokens: Sequence[int]) -> BlockTable:
    """A prefill-side table: admitted, never registered in the pool's prefix cache."""
    table = BlockTable(RequestId(rid), BS, hasher)
    assert table.admit(pool, tokens) is not None
    return table


def test_chunk_keys_are_the_tables_hashes_and_every_block_is_hashed_once() -> None:
    pool = BlockPool(32, BS)
    hasher = CountingHasher()
    off = _offload(pool)
    prompt = list(range(100, 119))  # 19 tokens: 4 full blocks (2 chunks) and a partial one
    first = _admit(pool, hasher, "a", prompt)
    assert hasher.blocks == 4
    keys = off.chunk_keys(first)
    assert keys == [first.block_hashes[1], first.block_hashes[3]]
    assert off.begin_load(RequestId("a"), first) is None  # nothing stored yet
    assert off.store(RequestId("a"), first) == 2
    assert [e for e in _drain(off) if isinstance(e, StoreFinished)] == [
        StoreFinished(RequestId("a"), 2)
    ]
    assert hasher.blocks == 4  # lookups and the store read the table's hashes
    assert first.append_tokens(pool, [7, 8, 9, 10, 11])  # 24 tokens: 6 full blocks
    assert hasher.blocks == 6  # only the two newly full blocks
    assert off.chunk_keys(first) == [first.block_hashes[i] for i in (1, 3, 5)]
    first.release(pool)
    second = _admit(pool, hasher, "b", [*prompt[:16], 1, 2, 3])  # same 2 chunks, other tail
    assert hasher.blocks == 6 + 4
    assert off.chunk_keys(second) == keys
    started = off.begin_load(RequestId("b"), second)
    assert started is not None and started.chunks == 2 and started.sources == ("host", "host")
    assert _drain(off) == [LoadFinished(RequestId("b"), 2 * BPC * BS, 2, 0)]
    assert hasher.blocks == 10
    second.release(pool)
    off.close()
    off.check_integrity()
    pool.check_integrity()


def test_a_refused_append_hashes_nothing() -> None:
    pool = BlockPool(2, BS)
    hasher = CountingHasher()
    table = _admit(pool, hasher, "a", list(range(8)))  # both blocks taken
    assert hasher.blocks == 2
    assert not table.append_tokens(pool, np.arange(4))  # a third block: none free
    assert hasher.blocks == 2 and table.num_tokens == 8
    table.release(pool)
    pool.check_integrity()
