"""BlockPool: exact free-queue (LRU) order, caching and eviction, metrics, bad input unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvplane.blocks.pool import BlockPool
from kvplane.config import PoolConfig
from kvplane.errors import (
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    UnknownBlockError,
)
from kvplane.ids import BlockHash, BlockId
from kvplane.metrics import MetricsRegistry

Snap = Callable[[BlockPool], tuple[Any, ...]]


def H(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def ids(*xs: int) -> list[BlockId]:
    return [BlockId(x) for x in xs]


def test_fresh_pool() -> None:
    pool = BlockPool(4, 16)
    assert (pool.num_blocks, pool.block_size) == (4, 16)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (4, 0, 0)
    assert pool.free_queue_order() == [0, 1, 2, 3]
    pool.check_integrity()
    cfg = BlockPool.from_config(PoolConfig(num_blocks=3, block_size=8))
    assert (cfg.num_blocks, cfg.block_size) == (3, 8)


def test_allocate_pops_head_and_free_appends_tail_in_given_order() -> None:
    pool = BlockPool(6, 4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(0) == []
    assert pool.free_queue_order() == [3, 4, 5]
    pool.free(ids(2, 0))  # 2 is freed first, so it is evicted before 0
    assert pool.free_queue_order() == [3, 4, 5, 2, 0]
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert pool.free_queue_order() == [0]
    assert [pool.ref_count(b) for b in ids(0, 1, 2, 3, 4, 5)] == [0, 1, 1, 1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 5)
    pool.check_integrity()


def test_shared_block_returns_to_queue_only_at_ref_zero() -> None:
    pool = BlockPool(3, 4)
    a, _b, _c = pool.allocate(3) or []
    pool.touch([a])  # shared by a second request: ref 2
    pool.free([a])
    assert pool.ref_count(a) == 1
    assert pool.free_queue_order() == []
    pool.free([a])
    assert pool.free_queue_order() == [a]
    pool.check_integrity()


def test_duplicates_in_one_free_call_enqueue_at_last_reference() -> None:
    pool = BlockPool(4, 4)
    b0, b1, _, _ = pool.allocate(4) or []
    pool.touch([b0])  # b0 ref 2
    pool.free([b0, b1, b0])  # b0 reaches 0 only at its second mention, after b1
    assert pool.free_queue_order() == [b1, b0]
    pool.check_integrity()


def test_cached_free_blocks_stay_matchable_until_evicted_lru_first() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(4) or []
    for i, b in enumerate(blocks):
        pool.cache_block(b, H(i))
    assert pool.num_cached_blocks == 4
    pool.free(blocks[::-1])  # release in reverse: tail block 3 is evicted first
    assert pool.free_queue_order() == [3, 2, 1, 0]
    assert [pool.lookup(H(i)) for i in range(4)] == [0, 1, 2, 3]
    # a prefix hit on blocks 0 and 1 takes them out of the queue
    pool.touch(ids(0, 1))
    assert pool.free_queue_order() == [3, 2]
    assert (pool.ref_count(BlockId(0)), pool.ref_count(BlockId(1))) == (1, 1)
    # allocating evicts from the head: 3 loses its hash, 2 stays cached
    assert pool.allocate(1) == [3]
    assert pool.lookup(H(3)) is None
    assert pool.block_hash(BlockId(3)) is None
    assert pool.lookup(H(2)) == 2
    assert pool.num_cached_blocks == 3
    pool.check_integrity()


def test_cache_block_rules() -> None:
    pool = BlockPool(3, 4)
    a, b, _c = pool.allocate(3) or []
    pool.cache_block(a, H(1))
    pool.cache_block(a, H(1))  # idempotent
    assert pool.block_hash(a) == H(1)
    pool.cache_block(b, H(1))  # first writer wins: b stands by behind a
    pool.cache_block(b, H(1))  # idempotent for the standby too
    assert pool.lookup(H(1)) == a
    assert pool.block_hash(b) == H(1)
    assert pool.num_cached_blocks == 2
    # a freed: lookup prefers b, in use (sharing it costs no free block); a stays cached
    pool.free([a])
    assert (pool.lookup(H(1)), pool.block_hash(a)) == (b, H(1))
    assert pool.allocate(1) == [a]
    assert pool.block_hash(a) is None
    assert pool.lookup(H(1)) == b
    assert pool.num_cached_blocks == 1
    pool.free([b])
    assert (pool.free_queue_order(), pool.lookup(H(1))) == ([b], b)  # free, still matchable
    pool.check_integrity()


def test_standby_eviction_keeps_first_block() -> None:
    pool = BlockPool(3, 4)
    a, b, c = pool.allocate(3) or []
    pool.cache_block(a, H(1))
    pool.cache_block(b, H(1))
    pool.cache_block(c, H(1))
    pool.free([b, a, c])  # queue b, a, c: the standby b is evicted first
    assert pool.allocate(1) == [b]
    assert (pool.lookup(H(1)), pool.num_cached_blocks) == (a, 2)
    assert pool.allocate(1) == [a]
    assert (pool.lookup(H(1)), pool.num_cached_blocks) == (c, 1)
    assert pool.allocate(1) == [c]
    assert (pool.lookup(H(1)), pool.num_cached_blocks) == (None, 0)
    pool.check_integrity()


def test_touch_of_used_uncached_block_shares_it() -> None:
    pool = BlockPool(2, 4)
    (a,) = pool.allocate(1) or []
    pool.touch([a, a])
    assert pool.ref_count(a) == 3
    pool.free([a, a, a])
    assert pool.free_queue_order() == [1, a]
    pool.check_integrity()


def test_allocate_shortage_returns_none_and_changes_nothing(snap_pool: Snap) -> None:
    pool = BlockPool(3, 4)
    blocks = pool.allocate(2) or []
    pool.cache_block(blocks[0], H(9))
    pool.free(blocks)
    pool.allocate(1)
    before = snap_pool(pool)
    assert pool.allocate(4) is None
    assert snap_pool(pool) == before
    pool.check_integrity()


def test_accepts_numpy_ids() -> None:
    pool = BlockPool(3, 4)
    blocks = np.asarray(pool.allocate(2), dtype=np.int64)
    pool.free(blocks)
    assert pool.free_queue_order() == [2, 0, 1]
    assert pool.ref_count(np.int32(0)) == 0  # type: ignore[arg-type]


BAD_CALLS: list[tuple[str, Callable[[BlockPool], object], type[Exception], str]] = [
    ("negative n", lambda p: p.allocate(-1), InvalidArgumentError, "-1"),
    ("float n", lambda p: p.allocate(1.0), InvalidArgumentError, "1.0"),  # type: ignore[arg-type]
    ("bool n", lambda p: p.allocate(True), InvalidArgumentError, "True"),
    ("double free", lambda p: p.free(ids(1)), DoubleFreeError, "block 1 .* ref count 0"),
    ("dup in call", lambda p: p.free(ids(0, 2, 0)), DoubleFreeError, "block 0 .*2 time"),
    ("unknown free", lambda p: p.free(ids(0, 7)), UnknownBlockError, "block 7"),
    ("negative id", lambda p: p.free(ids(-1)), UnknownBlockError, "block -1"),
    ("bool id", lambda p: p.free([True]), UnknownBlockError, "True"),  # type: ignore[list-item]
    ("str ids", lambda p: p.free("01"), InvalidArgumentError, "'01'"),  # type: ignore[arg-type]
    ("non-seq ids", lambda p: p.free(3), InvalidArgumentError, "3"),  # type: ignore[arg-type]
    ("unknown touch", lambda p: p.touch(ids(0, 4)), UnknownBlockError, "block 4"),
    ("touch free", lambda p: p.touch(ids(0, 1)), BlockStateError, "block 1 .*free and not"),
    ("cache free", lambda p: p.cache_block(BlockId(1), H(5)), BlockStateError, "block 1.*free"),
    ("cache unknown", lambda p: p.cache_block(BlockId(9), H(5)), UnknownBlockError, "block 9"),
    ("recache", lambda p: p.cache_block(BlockId(0), H(5)), BlockStateError, "already cached"),
    ("short hash", lambda p: p.cache_block(BlockId(2), b"x"), InvalidArgumentError, "b'x'"),  # type: ignore[arg-type]
    ("lookup str", lambda p: p.lookup("x" * 32), InvalidArgumentError, "'xxx"),  # type: ignore[arg-type]
    ("ref unknown", lambda p: p.ref_count(BlockId(4)), UnknownBlockError, "block 4"),
    ("hash unknown", lambda p: p.block_hash(BlockId(-2)), UnknownBlockError, "block -2"),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_typed_error_and_changes_nothing(
    case: tuple[str, Callable[[BlockPool], object], type[Exception], str], snap_pool: Snap
) -> None:
    _, call, exc, match = case
    pool = BlockPool(4, 4)
    pool.allocate(3)  # 0, 1, 2 used; 3 free
    pool.cache_block(BlockId(0), H(1))
    pool.free(ids(1))  # 1 is free and uncached
    before = snap_pool(pool)
    with pytest.raises(exc, match=match):
        call(pool)
    assert snap_pool(pool) == before
    pool.check_integrity()


@pytest.mark.parametrize("kw", [dict(num_blocks=0), dict(block_size=-1), dict(num_blocks=2.0)])
def test_bad_construction(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"num_blocks": 4, "block_size": 4, **kw}
    with pytest.raises(InvalidArgumentError, match=str(next(iter(kw.values())))):
        BlockPool(**args)


def test_integrity_check_detects_inconsistency() -> None:
    pool = BlockPool(3, 4)
    pool.allocate(1)
    pool._ref[0] = 0  # ref 0 but not in the free queue
    with pytest.raises(BlockStateError, match="free 2 \\+ used 0 != total 3"):
        pool.check_integrity()
    pool = BlockPool(3, 4)
    pool.allocate(1)
    pool._ref[0] = -1
    with pytest.raises(BlockStateError, match="negative ref count -1"):
        pool.check_integrity()
    pool = BlockPool(3, 4)
    pool.allocate(1)
    pool._hash[0] = H(1)  # hash on the block but not in the map
    with pytest.raises(BlockStateError, match="block 0 carries hash"):
        pool.check_integrity()
    pool = BlockPool(3, 4)
    pool.allocate(1)
    pool._hash_map[H(2)] = {BlockId(0): None}  # map entry the block does not carry
    with pytest.raises(BlockStateError, match="block 0, block disagrees"):
        pool.check_integrity()


def test_metrics_exact_values() -> None:
    reg = MetricsRegistry()
    pool = BlockPool(4, 4, reg, name="prefill")
    lbl = {"pool": "prefill"}

    def val(name: str, suffix: str = "_total") -> float:
        return reg.value(f"block_pool_{name}", lbl, suffix)

    blocks = pool.allocate(3) or []
    assert pool.allocate(2) is None
    pool.cache_block(blocks[0], H(1))
    pool.cache_block(blocks[1], H(2))
    assert val("usage", "") == 0.75
    pool.free(blocks)
    assert (val("usage", ""), val("peak_used_blocks", "")) == (0.0, 3)  # the peak stays
    pool.touch([blocks[0]])
    assert pool.allocate(3) == [3, 1, 2]  # 1 was cached under H(2): evicted
    assert val("allocated_blocks") == 6
    assert val("allocation_failures") == 1
    assert val("cache_hits") == 1
    assert val("cache_evictions") == 1
    assert val("usage", "") == 1.0
    assert val("cached_blocks", "") == 1
    assert val("peak_used_blocks", "") == 4
    # a second pool on the same registry keeps its own series
    other = BlockPool(2, 4, reg, name="decode")
    other.allocate(1)
    assert reg.value("block_pool_usage", {"pool": "decode"}) == 0.5
    assert val("allocated_blocks") == 6
    pool.check_integrity()
    other.check_integrity()


def test_lookup_prefers_a_holder_in_use() -> None:
    pool = BlockPool(3, 4)
    a, b, c = pool.allocate(3) or []
    pool.cache_block(a, H(1))
    pool.cache_block(b, H(1))  # b stands by behind a
    assert pool.lookup(H(1)) == a  # both in use: the first registered
    pool.free([a])
    assert pool.lookup(H(1)) == b  # a is free: sharing b costs no free block
    pool.free([b])
    assert pool.lookup(H(1)) == a  # both free: the first registered again
    pool.touch([b])
    assert pool.lookup(H(1)) == b
    pool.free([b, c])
    pool.check_integrity()


def test_check_touch_raises_what_touch_would_and_changes_nothing(snap_pool: Snap) -> None:
    pool = BlockPool(3, 4)
    a, _b, _c = pool.allocate(3) or []
    pool.cache_block(a, H(1))
    pool.free(ids(0, 2))  # a: free and cached; c: free, uncached
    before = snap_pool(pool)
    assert pool.check_touch(np.array([0, 1])) == [0, 1]  # type: ignore[arg-type]
    with pytest.raises(BlockStateError, match="block 2"):
        pool.check_touch(ids(0, 2))
    with pytest.raises(UnknownBlockError):
        pool.check_touch(ids(5))
    assert snap_pool(pool) == before


def test_plain_int_and_array_ids_are_checked_with_no_python_step_per_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fence touches and frees every block of every store: plain ints and integer arrays
    are validated in C; only a batch holding something else is walked id by id."""
    pool = BlockPool(64, 4)
    held = pool.allocate(64) or []
    calls = []
    real = BlockPool._block_id

    def counted(self: BlockPool, value: object) -> BlockId:
        calls.append(value)
        return real(self, value)

    monkeypatch.setattr(BlockPool, "_block_id", counted)
    arr = np.array(held, dtype=np.int64)
    pool.check_touch(arr)
    pool.touch(held)
    pool.free(arr[::-1])
    assert calls == []
    with pytest.raises(UnknownBlockError, match="block 64"):
        pool.touch(np.array([3, 64]))
    with pytest.raises(UnknownBlockError, match="True"):
        pool.touch([3, True])  # type: ignore[list-item]
    with pytest.raises(UnknownBlockError):
        pool.touch(np.array([[3]]))
    with pytest.raises(UnknownBlockError):
        pool.touch(np.array([3.0]))
    assert [pool.ref_count(b) for b in held[:4]] == [1, 1, 1, 1]
    pool.free(held)
    pool.check_integrity()
