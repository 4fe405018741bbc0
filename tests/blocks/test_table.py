"""BlockTable: prefix match, shortage rollback, range accounting, slot mapping, bad input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.blocks.hashing import BlockHasher
from kvplane.blocks.pool import BlockPool
from kvplane.blocks.table import BlockTable, TableState, consecutive_runs
from kvplane.errors import BlockStateError, InvalidArgumentError
from kvplane.ids import BlockId, RequestId, TokenRange

BS = 4
HASHER = BlockHasher(seed=0, fingerprint=b"test-model")
PoolSnap = Callable[[BlockPool], tuple[Any, ...]]
TableSnap = Callable[[BlockTable], tuple[Any, ...]]


def table(rid: str = "r", extra: tuple[str | int | bytes, ...] = ()) -> BlockTable:
    return BlockTable(RequestId(rid), BS, HASHER, extra)


def computed(pool: BlockPool, tokens: list[int], rid: str = "a") -> BlockTable:
    """Admit ``tokens`` and mark all of them computed."""
    t = table(rid)
    assert t.admit(pool, tokens) is not None
    t.mark_computed(pool, len(t.new_range))
    return t


def test_cold_admit_allocates_everything() -> None:
    pool = BlockPool(8, BS)
    t = table()
    res = t.admit(pool, list(range(10)))
    assert res is not None
    assert res.block_ids == (0, 1, 2)
    assert (res.num_cached_blocks, res.num_new_blocks) == (0, 3)
    assert (res.cached_range, res.new_range) == (TokenRange(0, 0), TokenRange(0, 10))
    assert t.state is TableState.ADMITTED
    assert (t.num_tokens, t.num_cached_tokens, t.num_computed_tokens) == (10, 0, 0)
    assert t.block_hashes == tuple(HASHER.hash_blocks(list(range(10)), BS))
    assert pool.num_cached_blocks == 0  # nothing is cached before it is computed
    t.mark_computed(pool, 5)
    assert t.computed_range == TokenRange(0, 5)
    assert t.new_range == TokenRange(5, 10)
    assert pool.lookup(t.block_hashes[0]) == 0
    assert pool.lookup(t.block_hashes[1]) is None
    t.mark_computed(pool, 5)
    assert pool.lookup(t.block_hashes[1]) == 1
    assert pool.num_cached_blocks == 2  # the partial tail block is never cached
    t.release(pool)
    assert t.state is TableState.RELEASED
    assert pool.free_queue_order() == [3, 4, 5, 6, 7, 2, 1, 0]  # reverse: tail evicted first
    pool.check_integrity()


def test_prefix_hit_shares_blocks_and_accounts_ranges() -> None:
    pool = BlockPool(8, BS)
    a = computed(pool, list(range(10)))
    b = table("b")
    res = b.admit(pool, [*range(8), 50, 51, 52, 53, 54])
    assert res is not None
    assert res.block_ids == (0, 1, 3, 4)
    assert res.num_cached_blocks == 2
    assert (b.cached_range, b.computed_range, b.new_range) == (
        TokenRange(0, 8),
        TokenRange(8, 8),
        TokenRange(8, 13),
    )
    assert [pool.ref_count(BlockId(i)) for i in range(5)] == [2, 2, 1, 1, 1]
    b.mark_computed(pool, 3)
    assert (b.computed_range, b.new_range) == (TokenRange(8, 11), TokenRange(11, 13))
    a.release(pool)
    b.release(pool)
    assert [pool.ref_count(BlockId(i)) for i in range(8)] == [0] * 8
    assert pool.free_queue_order() == [5, 6, 7, 2, 4, 3, 1, 0]
    pool.check_integrity()


def test_hit_on_freed_cached_blocks_and_divergent_prefix() -> None:
    pool = BlockPool(8, BS)
    computed(pool, list(range(12))).release(pool)
    c = table("c")
    res = c.admit(pool, [0, 1, 2, 3, 9, 9, 9, 9, 8, 9])  # block 1 differs: only block 0 hits
    assert res is not None
    assert res.num_cached_blocks == 1
    assert res.block_ids[0] == 0
    assert pool.ref_count(BlockId(0)) == 1
    c.release(pool)
    pool.check_integrity()


def test_hit_is_capped_so_the_last_token_is_computed() -> None:
    pool = BlockPool(8, BS)
    computed(pool, list(range(8))).release(pool)
    d = table("d")
    res = d.admit(pool, list(range(8)))  # both blocks cached, but only one may be a hit
    assert res is not None
    assert res.num_cached_blocks == 1
    assert (d.cached_range, d.new_range) == (TokenRange(0, 4), TokenRange(4, 8))
    assert res.block_ids[0] == 0
    assert res.block_ids[1] != 1
    d.mark_computed(pool, 4)
    # block 1 (free, cached) and our duplicate (in use) both hold the hash: lookup prefers ours
    assert pool.lookup(d.block_hashes[1]) == res.block_ids[1]
    assert pool.block_hash(res.block_ids[1]) == d.block_hashes[1]
    d.release(pool)
    pool.check_integrity()


def test_extra_keys_separate_caches() -> None:
    pool = BlockPool(8, BS)
    computed(pool, list(range(9))).release(pool)
    e = table("e", extra=("lora-x",))
    res = e.admit(pool, list(range(9)))
    assert res is not None
    assert res.num_cached_blocks == 0
    e.release(pool)
    pool.check_integrity()


def test_admit_shortage_changes_nothing(snap_pool: PoolSnap, snap_table: TableSnap) -> None:
    pool = BlockPool(3, BS)
    computed(pool, list(range(8))).release(pool)  # blocks 0, 1 cached and free; 2 free
    before_pool = snap_pool(pool)
    t = table("t")
    before_table = snap_table(t)
    # two hits would be taken from the free queue, leaving 1 block for the 2 fresh ones needed
    assert t.admit(pool, list(range(13))) is None
    assert snap_pool(pool) == before_pool
    assert snap_table(t) == before_table
    assert t.state is TableState.NEW
    # 9 tokens need only 1 fresh block: fits exactly
    res = t.admit(pool, list(range(9)))
    assert res is not None
    assert res.block_ids == (0, 1, 2)
    assert pool.num_free_blocks == 0
    t.release(pool)
    pool.check_integrity()


def test_append_tokens_grows_at_block_boundaries(
    snap_pool: PoolSnap, snap_table: TableSnap
) -> None:
    pool = BlockPool(4, BS)
    t = table()
    assert t.admit(pool, [1, 2, 3]) is not None
    assert t.append_tokens(pool, [4]) is True
    assert (t.num_tokens, t.block_ids) == (4, (0,))
    assert t.block_hashes == tuple(HASHER.hash_blocks([1, 2, 3, 4], BS))
    assert t.append_tokens(pool, np.array([5])) is True
    assert t.block_ids == (0, 1)
    assert t.append_tokens(pool, []) is True
    for tok in range(6, 13):
        assert t.append_tokens(pool, torch.tensor([tok]))
    assert t.block_ids == (0, 1, 2)
    assert t.token_ids.tolist() == list(range(1, 13))
    assert t.block_hashes == tuple(HASHER.hash_blocks(list(range(1, 13)), BS))
    assert t.new_range == TokenRange(0, 12)
    other = BlockTable(RequestId("o"), BS, HASHER)
    assert other.admit(pool, [7]) is not None  # takes the last block
    before_pool, before_table = snap_pool(pool), snap_table(t)
    assert t.append_tokens(pool, [13, 14]) is False
    assert snap_pool(pool) == before_pool
    assert snap_table(t) == before_table
    t.mark_computed(pool, 12)
    assert pool.num_cached_blocks == 3
    t.release(pool)
    other.release(pool)
    pool.check_integrity()


def test_token_ids_view_is_read_only() -> None:
    pool = BlockPool(2, BS)
    t = table()
    t.admit(pool, [1, 2])
    with pytest.raises(ValueError, match="read-only"):
        t.token_ids[0] = 5
    t.release(pool)


def test_slot_mapping_exact_values() -> None:
    pool = BlockPool(8, BS)
    hog = pool.allocate(2) or []  # blocks 0, 1 held elsewhere
    t = table()
    t.admit(pool, list(range(5)))  # blocks 2, 3
    pool.free([hog[0]])
    t.append_tokens(pool, list(range(5, 10)))  # block 4: the queue head is now 4, 5, 6, 7, 0
    assert t.block_ids == (2, 3, 4)
    got = t.slot_mapping(TokenRange(0, 10))
    assert got.dtype == torch.int64
    assert got.tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    assert t.slot_mapping(TokenRange(3, 6)).tolist() == [11, 12, 13]
    assert t.slot_mapping(TokenRange(9, 10)).tolist() == [17]
    empty = t.slot_mapping(TokenRange(4, 4))
    assert (empty.shape, empty.dtype) == (torch.Size([0]), torch.int64)
    with pytest.raises(InvalidArgumentError, match=r"\[8, 11\)"):
        t.slot_mapping(TokenRange(8, 11))
    with pytest.raises(InvalidArgumentError, match="TokenRange"):
        t.slot_mapping((0, 2))  # type: ignore[arg-type]
    t.release(pool)
    pool.free([hog[1]])
    pool.check_integrity()


def test_release_is_idempotent_and_ends_the_table() -> None:
    pool = BlockPool(2, BS)
    t = table()
    t.release(pool)  # never admitted
    assert t.state is TableState.RELEASED
    with pytest.raises(BlockStateError, match="released"):
        t.admit(pool, [1])
    u = table("u")
    u.admit(pool, [1, 2, 3, 4, 5])
    u.release(pool)
    u.release(pool)
    assert (u.num_tokens, u.block_ids, u.new_range) == (0, (), TokenRange(0, 0))
    with pytest.raises(BlockStateError, match="released"):
        u.slot_mapping(TokenRange(0, 0))
    with pytest.raises(BlockStateError, match="released"):
        u.append_tokens(pool, [1])
    assert pool.free_queue_order() == [1, 0]
    pool.check_integrity()


def _admitted(pool: BlockPool) -> BlockTable:
    t = table("bad")
    t.admit(pool, [1, 2, 3, 4, 5, 6])
    return t


BAD: list[tuple[str, Callable[[BlockTable, BlockPool], object], type[Exception], str]] = [
    ("admit twice", lambda t, p: t.admit(p, [1]), BlockStateError, "admitted"),
    (
        "other pool",
        lambda t, p: t.append_tokens(BlockPool(9, BS), [1]),
        InvalidArgumentError,
        "another pool",
    ),
    (
        "pool block size",
        lambda t, p: t.mark_computed(BlockPool(9, 8), 1),
        InvalidArgumentError,
        "block_size 4, the pool has 8",
    ),
    ("not a pool", lambda t, p: t.release("pool"), InvalidArgumentError, "'pool'"),  # type: ignore[arg-type]
    ("negative token", lambda t, p: t.append_tokens(p, [1, -5]), InvalidArgumentError, "-5"),
    ("float token", lambda t, p: t.append_tokens(p, [0.5]), InvalidArgumentError, "0.5"),
    ("mark too many", lambda t, p: t.mark_computed(p, 7), InvalidArgumentError, r"7 .*\[0, 6\)"),
    ("mark negative", lambda t, p: t.mark_computed(p, -1), InvalidArgumentError, "-1"),
    ("mark float", lambda t, p: t.mark_computed(p, 1.0), InvalidArgumentError, "1.0"),  # type: ignore[arg-type]
    (
        "slot range",
        lambda t, p: t.slot_mapping(TokenRange(2, 7)),
        InvalidArgumentError,
        r"\[2, 7\)",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_changes_nothing(
    case: tuple[str, Callable[[BlockTable, BlockPool], object], type[Exception], str],
    snap_pool: PoolSnap,
    snap_table: TableSnap,
) -> None:
    _, call, exc, match = case
    pool = BlockPool(4, BS)
    t = _admitted(pool)
    before = (snap_pool(pool), snap_table(t))
    with pytest.raises(exc, match=match):
        call(t, pool)
    assert (snap_pool(pool), snap_table(t)) == before
    t.release(pool)
    pool.check_integrity()


def test_bad_admit_and_construction(snap_pool: PoolSnap) -> None:
    pool = BlockPool(4, BS)
    before = snap_pool(pool)
    for tokens, match in (([], "no tokens"), ([1, 2**63], str(2**63)), (["a"], "'a'")):
        t = table()
        with pytest.raises(InvalidArgumentError, match=match):
            t.admit(pool, tokens)
        assert t.state is TableState.NEW
    with pytest.raises(InvalidArgumentError, match="block_size 4, the pool has 8"):
        table().admit(BlockPool(4, 8), [1])
    assert snap_pool(pool) == before
    with pytest.raises(InvalidArgumentError, match="request_id"):
        BlockTable(RequestId(""), BS, HASHER)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        BlockTable(RequestId("r"), 0, HASHER)
    with pytest.raises(InvalidArgumentError, match="hasher"):
        BlockTable(RequestId("r"), BS, "h")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"1\.5"):
        BlockTable(RequestId("r"), BS, HASHER, (1.5,))  # type: ignore[arg-type]
    pool.check_integrity()


def test_concurrent_duplicates_keep_the_prefix_findable() -> None:
    """Two requests compute one prompt at once; the first finishes and its blocks are reused.
    The prompt stays matchable through the second request's standby blocks."""
    pool = BlockPool(6, BS)
    prompt = list(range(9))
    a, b = table("a"), table("b")
    assert a.admit(pool, prompt) is not None  # blocks 0, 1, 2
    assert b.admit(pool, prompt) is not None  # blocks 3, 4, 5 (nothing computed yet: no hit)
    a.mark_computed(pool, 9)
    b.mark_computed(pool, 9)
    assert [pool.lookup(h) for h in a.block_hashes] == [0, 1]
    a.release(pool)
    assert pool.allocate(3) == [2, 1, 0]  # a's blocks are reused: evicted
    assert [pool.lookup(h) for h in b.block_hashes] == [3, 4]
    c = table("c")
    res = c.admit(pool, [*prompt[:8], 99])
    assert res is None  # 2 hits, 1 fresh block needed, none free
    pool.free([BlockId(0)])
    res = c.admit(pool, [*prompt[:8], 99])
    assert res is not None
    assert (res.block_ids, res.cached_range) == ((3, 4, 0), TokenRange(0, 8))
    for t in (b, c):
        t.release(pool)
    pool.free([BlockId(1), BlockId(2)])
    assert pool.num_free_blocks == 6
    pool.check_integrity()


def test_consecutive_runs() -> None:
    assert consecutive_runs(np.array([], dtype=np.int64)) == []
    # runs (start id, length): 4..6, 2..3, 9
    assert consecutive_runs(np.array([4, 5, 6, 2, 3, 9], dtype=np.int64)) == [
        (0, 3),
        (3, 5),
        (5, 6),
    ]


def test_admit_shares_an_in_use_standby_copy() -> None:
    """The first holder of a hash is free (cached) while a duplicate is in use: admission
    shares the in-use copy, so the free one is not counted against the free blocks."""
    pool = BlockPool(4, BS)
    prompt = list(range(BS))
    a = table("a")
    assert a.admit(pool, prompt) is not None  # block 0
    b = table("b")
    assert b.admit(pool, [*prompt, 7]) is not None  # blocks 1, 2 (no hit yet)
    a.mark_computed(pool, BS)
    b.mark_computed(pool, BS + 1)  # block 1 stands by behind block 0
    other = pool.allocate(1)  # block 3: busy
    a.release(pool)  # block 0: free and cached; the only free block
    assert (pool.num_free_blocks, pool.lookup(b.block_hashes[0])) == (1, 1)
    c = table("c")
    res = c.admit(pool, [*prompt, 9])
    assert res is not None
    assert (res.block_ids, res.num_cached_blocks) == ((1, 0), 1)
    assert (pool.ref_count(BlockId(1)), pool.num_free_blocks) == (2, 0)
    for t in (b, c):
        t.release(pool)
    pool.free(other or [])
    pool.check_integrity()


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        (5, r"^token ids must be a sequence of ints, got 5$"),
        (None, r"^token ids must be a sequence of ints, got None$"),
        ([7, True], r"^token_ids\[1\] must be an int in \[0, 2\*\*63\), got True$"),
    ],
)
def test_admit_refuses_non_sequences_and_bools(
    tokens: object, match: str, snap_pool: PoolSnap
) -> None:
    pool = BlockPool(4, BS)
    before = snap_pool(pool)
    t = table()
    with pytest.raises(InvalidArgumentError, match=match):
        t.admit(pool, tokens)  # type: ignore[arg-type]
    assert t.state is TableState.NEW and snap_pool(pool) == before
