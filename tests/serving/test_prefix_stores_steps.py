"""A request's prefix stores go out step by step: each step's newly full chunks as one job (up
to a boundary of a lower tier's larger chunks), each chunk once, at most ``host_slots`` of a
prompt (the rest counted once, after the last step), a chunk a tier holds never again; the
positions the request must keep (``store_reads``) follow the stores not issued yet or in
flight. Real tiers (host, and a disk tier of 2-host-chunk chunks); the ledgers balance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId
from kvplane.layout import KVLayout
from kvplane.offload import OffloadConfig
from kvplane.serving.prefix_offload import PrefixOffload, PrefixSettings, StoreFinished
from kvplane.serving.producers.base import PoolTensor

BS, BPC, TPC = 4, 2, 8
A, B = RequestId("a"), RequestId("b")


def _offload(pool: BlockPool, **tiers: Any) -> PrefixOffload:
    layout = KVLayout.gqa(num_blocks=pool.num_blocks, block_size=BS, num_layers=2, kv_heads=2,
                          head_dim=8, dtype=torch.float32)  # fmt: skip
    kv = PoolTensor(layout, torch.randn(layout.shape, generator=torch.Generator().manual_seed(0)))
    config = OffloadConfig(admission_min_lookups=0, pin_memory=False, **tiers)
    return PrefixOffload(PrefixSettings(config, BPC, pending_wait_s=0.0), kv, pool)


def _table(pool: BlockPool, rid: RequestId, n: int) -> BlockTable:
    table = BlockTable(rid, BS, BlockHasher(seed=1, fingerprint=b"steps"))
    assert table.admit(pool, np.arange(n) % 97) is not None
    return table


def _drain(off: PrefixOffload) -> list[StoreFinished]:
    out: list[StoreFinished] = []
    while off.busy:
        out += [e for e in off.wait(1.0) if isinstance(e, StoreFinished)]
    return out


def test_each_step_stores_its_new_chunks_once_within_the_host_slots() -> None:
    pool = BlockPool(32, BS)
    off = _offload(pool, host_slots=2)
    table = _table(pool, A, 27)  # 3 full chunks of 8; the host holds 2 of a prompt
    assert off.store_reads(table) == (0,)  # chunk 0 will be stored
    assert off.store(A, table, upto=5) == 0  # no chunk full yet
    assert off.store(A, table, upto=12) == 1  # chunk 0
    assert off.store_reads(table) == (0,)  # in flight
    assert _drain(off) == [StoreFinished(A, 1)]
    assert off.store_reads(table) == (8,)  # chunk 1 is next
    assert off.store(A, table, upto=16) == 1  # chunk 1
    assert off.store(A, table, upto=24) == 0  # chunk 2: past the host slots
    assert off.store(A, table) == 0  # the last step's: nothing left
    assert off.counts["chunks_unstored"] == 1  # counted once, at the end
    assert _drain(off) == [StoreFinished(A, 1)]
    assert off.store_reads(table) == (None,)
    assert (off.counts["store_jobs"], off.counts["chunks_stored"]) == (2, 2)
    # the same prompt again: every chunk is held, none stored twice
    again = _table(pool, B, 27)
    assert [off.store(B, again, upto=e) for e in (8, 16, 24)] == [0, 0, 0]
    assert off.store(B, again) == 0 and not off.busy
    assert off.counts["chunks_stored"] == 2 and off.counts["chunks_unstored"] == 2
    with pytest.raises(InvalidArgumentError, match="upto"):
        off.store(B, again, upto=28)
    for t in (table, again):
        t.release(pool)
    pool.check_integrity()
    off.close()
    off.check_integrity()


def test_a_step_store_ends_on_a_lower_tier_chunk_boundary(tmp_path: Path) -> None:
    pool = BlockPool(32, BS)
    off = _offload(pool, host_slots=8, disk_path=tmp_path / "disk", disk_slots=8,
                   disk_blocks_per_chunk=2 * BPC, disk_direct_io=False)  # fmt: skip
    assert off.store_unit == 2 * TPC
    table = _table(pool, A, 45)  # 5 chunks; the disk's chunks: [0, 1], [2, 3], [4, 5]
    assert [off.store(A, table, upto=e) for e in (8, 16, 24, 32, 40)] == [0, 2, 0, 2, 0]
    assert off.store_reads(table)[0] is not None
    assert off.store(A, table) == 1  # the last step's: chunk 4
    assert [e.stored for e in _drain(off)] == [2, 2, 1]
    assert off.store_reads(table) == (None,)
    table.release(pool)
    # the stored prefix (4 chunks whole on disk) loads back for a prompt sharing it
    again = _table(pool, B, 45)
    started = off.begin_load(B, again)
    assert started is not None and started.chunks == 5
    while off.loading or off.busy:
        off.wait(1.0)
    again.release(pool)
    pool.check_integrity()
    off.close()
    off.check_integrity()
