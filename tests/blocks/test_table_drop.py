"""Dropping blocks that slid out of every window: the pool's reserved null block, a table's
``drop_before`` and a receiver's ``admit(drop_before=...)``; ref counts, prefix-cache hashes and
pool integrity stay balanced (#33)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvplane.blocks.hashing import BlockHasher
from kvplane.blocks.pool import BlockPool
from kvplane.blocks.table import BlockTable
from kvplane.errors import BlockStateError, InvalidArgumentError
from kvplane.ids import BlockId, RequestId, TokenRange

BS = 4
HASHER = BlockHasher(seed=0, fingerprint=b"test-model")
PoolSnap = Callable[[BlockPool], tuple[Any, ...]]
TableSnap = Callable[[BlockTable], tuple[Any, ...]]


def table(rid: str = "r") -> BlockTable:
    return BlockTable(RequestId(rid), BS, HASHER)


def test_the_null_block_is_the_pools_and_never_handed_out() -> None:
    pool = BlockPool(5, BS, null_block=True)
    assert pool.null_block == 4 and pool.ref_count(BlockId(4)) == 1
    assert (pool.capacity, pool.num_free_blocks, pool.num_used_blocks) == (4, 4, 0)
    assert pool.allocate(5) is None
    assert sorted(pool.allocate(4) or []) == [0, 1, 2, 3]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.peak_used_blocks) == (0, 4, 4)
    pool.check_integrity()
    assert BlockPool(5, BS).null_block is None and BlockPool(5, BS).capacity == 5
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        BlockPool(1, BS, null_block=True)


@pytest.mark.parametrize("action", ["free", "touch", "cache"])
def test_the_null_block_cannot_be_freed_shared_or_cached(action: str, snap_pool: PoolSnap) -> None:
    pool = BlockPool(5, BS, null_block=True)
    pool.allocate(1)
    before = snap_pool(pool)
    null = BlockId(4)
    calls: dict[str, Callable[[], None]] = {
        "free": lambda: pool.free([BlockId(0), null]),
        "touch": lambda: pool.touch([null]),
        "cache": lambda: pool.cache_block(null, HASHER.hash_blocks([1, 2, 3, 4], BS)[0]),
    }
    with pytest.raises(BlockStateError, match="null block 4"):
        calls[action]()
    assert snap_pool(pool) == before
    pool.check_integrity()


def test_drop_before_frees_whole_blocks_and_points_them_at_the_null_block() -> None:
    pool = BlockPool(8, BS, null_block=True)
    t = table()
    assert t.admit(pool, list(range(14))) is not None  # 4 blocks: 0, 1, 2, 3
    t.mark_computed(pool, 14)
    assert t.drop_before(pool, 9) == 2  # blocks of [0, 8) go; 8 is in block 2
    assert t.block_ids == (7, 7, 2, 3) and t.num_dropped_blocks == 2 and t.num_held_blocks == 2
    assert (pool.num_used_blocks, pool.ref_count(BlockId(0)), pool.ref_count(BlockId(7))) == (
        2,
        0,
        1,
    )
    assert t.drop_before(pool, 11) == 0 and t.drop_before(pool, 3) == 0  # nothing new
    # the freed blocks keep their hashes: another request still matches them
    assert pool.lookup(t.block_hashes[0]) == 0 and pool.lookup(t.block_hashes[1]) == 1
    other = table("o")
    res = other.admit(pool, list(range(9)))
    assert res is not None and res.num_cached_blocks == 2 and other.block_ids[:2] == (0, 1)
    other.release(pool)
    # a slot below the held range is refused (no write can land in the null block)
    with pytest.raises(InvalidArgumentError, match=r"held tokens \[8, 14\)"):
        t.slot_mapping(TokenRange(7, 9))
    assert t.slot_mapping(TokenRange(8, 10)).tolist() == [8, 9]
    t.release(pool)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 7
    pool.check_integrity()


def test_growing_after_a_drop_reuses_freed_blocks_and_caches_only_held_ones() -> None:
    pool = BlockPool(4, BS, null_block=True)  # 3 usable blocks
    t = table()
    assert t.admit(pool, list(range(8))) is not None
    assert t.drop_before(pool, 5) == 1  # uncomputed: nothing was cached
    assert t.append_tokens(pool, list(range(8, 12)))  # needs the block just freed
    assert t.num_held_blocks == 2 and t.block_ids[0] == 3
    t.mark_computed(pool, 12)  # registers blocks 1 and 2, never the null entry
    assert pool.num_cached_blocks == 2 and pool.block_hash(BlockId(3)) is None
    t.release(pool)
    pool.check_integrity()


def test_dropping_needs_a_null_block_and_a_known_position(snap_table: TableSnap) -> None:
    pool = BlockPool(8, BS)
    t = table()
    assert t.admit(pool, list(range(10))) is not None
    assert t.drop_before(pool, 3) == 0  # no whole block before 3: no null block needed
    before = snap_table(t)
    with pytest.raises(InvalidArgumentError, match="needs a pool with a null block"):
        t.drop_before(pool, 4)
    with pytest.raises(InvalidArgumentError, match="position"):
        t.drop_before(pool, 11)
    assert snap_table(t) == before
    t.release(pool)
    with pytest.raises(BlockStateError, match="released"):
        t.drop_before(pool, 4)


def test_a_receiver_allocates_only_the_window_it_is_sent() -> None:
    """A decode side that will receive positions ``[9, 14)`` holds blocks 2 and 3 only, matches
    no prefix (the earlier blocks' KV never arrives) and never caches its partial KV."""
    pool = BlockPool(8, BS, null_block=True)
    full = table("full")
    assert full.admit(pool, list(range(14))) is not None
    full.mark_computed(pool, 14)
    full.release(pool)  # blocks 0-2 cached and free
    t = table()
    res = t.admit(pool, list(range(14)), drop_before=9)
    assert res is not None and res.num_cached_blocks == 0 and res.new_range == TokenRange(0, 14)
    assert t.block_ids[:2] == (7, 7) and t.num_held_blocks == 2 and pool.num_used_blocks == 2
    assert t.append_tokens(pool, [14, 15, 16])
    t.mark_computed(pool, 17)
    assert all(pool.block_hash(b) is None for b in t.block_ids[2:])
    t.release(pool)
    pool.check_integrity()
    assert pool.num_used_blocks == 0
    with pytest.raises(InvalidArgumentError, match="null block"):
        table("x").admit(BlockPool(8, BS), list(range(14)), drop_before=9)
    with pytest.raises(InvalidArgumentError, match="drop_before"):
        table("y").admit(pool, list(range(14)), drop_before=15)
    assert pool.num_used_blocks == 0
