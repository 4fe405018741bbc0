"""One request's block tables across KV cache groups (``blocks/groups``): admission with the
prefix every group holds (a Hypothesis property over random pools, prompts and cached
prefixes), all-or-none growth, the peak check and the upkeep after a step (marked computed,
out-of-window blocks dropped, a reader's hold respected); pools balance after each."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.blocks import (
    BlockHasher,
    BlockPool,
    BlockTable,
    GroupShort,
    admit_groups,
    after_step,
    drop_windows,
    grow_groups,
    short_group,
)
from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId, TokenRange

BS = 2
RID = RequestId("r")


@dataclass(frozen=True)
class _Window:
    """A group's layout as the upkeep reads it: window ``w`` (None: full attention)."""

    w: int | None

    def window_start(self, num_tokens: int) -> int:
        return 0 if self.w is None else max(0, num_tokens + 1 - self.w)


def _hashers(n: int) -> list[BlockHasher]:
    return [BlockHasher(seed=3, fingerprint=f"group{g}".encode()) for g in range(n)]


def _warm(pool: BlockPool, hasher: BlockHasher, tokens: list[int], rid: str) -> None:
    """Leave ``tokens``' full blocks cached (and free) in ``pool``."""
    t = BlockTable(RequestId(rid), BS, hasher)
    assert t.admit(pool, tokens) is not None
    t.mark_computed(pool, t.num_tokens - t.num_computed_tokens)
    t.release(pool)


def _matched(pool: BlockPool, hasher: BlockHasher, tokens: list[int], first: int) -> int:
    """Leading blocks of ``tokens`` ``pool`` holds cached, as ``BlockTable.admit`` may share
    them (never the last token's block; none for a receiver)."""
    if first:
        return 0
    run = 0
    for h in hasher.hash_blocks(tokens, BS)[: (len(tokens) - 1) // BS]:
        if pool.lookup(h) is None:
            break
        run += 1
    return run


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[BlockPool], list[int], list[int] | None, int]:
    groups = draw(st.integers(1, 3))
    prompt = draw(st.lists(st.integers(0, 1), min_size=1, max_size=12))
    hashers = _hashers(groups)
    pools = []
    for g in range(groups):
        null = draw(st.booleans())
        warms = draw(st.integers(0, 2)) if draw(st.integers(0, 3)) == 0 else 1
        pool = BlockPool(draw(st.integers(2, 12)), BS, name=f"g{g}", null_block=null)
        for i in range(warms):  # cached prefixes: mostly the prompt's
            other = st.lists(st.integers(0, 1), max_size=12)
            warm = prompt if draw(st.integers(0, 3)) else draw(other)
            cut = draw(st.sampled_from([len(warm), *range(1, len(warm))]) if warm else st.just(1))
            if warm and -(-cut // BS) <= pool.num_free_blocks:
                _warm(pool, hashers[g], warm[:cut], f"w{i}")
        busy = draw(st.integers(0, min(2, pool.num_free_blocks)))  # another request's blocks
        if busy:
            pool.allocate(busy)
        pools.append(pool)
    drop = None
    if draw(st.booleans()):
        drop = [draw(st.integers(0, len(prompt))) if p.null_block is not None else 0 for p in pools]
    return pools, prompt, drop, groups


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_admit_groups_shares_the_common_prefix_or_changes_nothing(
    case: tuple[list[BlockPool], list[int], list[int] | None, int],
) -> None:
    pools, prompt, drop, groups = case
    hashers = _hashers(groups)
    firsts = drop or [0] * groups
    common = min(_matched(p, h, prompt, f) for p, h, f in zip(pools, hashers, firsts, strict=True))
    free = [p.num_free_blocks for p in pools]
    used = [p.num_used_blocks for p in pools]
    got = admit_groups(pools, hashers, RID, prompt, drop_before=drop)
    if isinstance(got, GroupShort):
        assert 0 <= got.group < groups
        assert [p.num_free_blocks for p in pools] == free
        assert [p.num_used_blocks for p in pools] == used
    else:
        assert [t.num_cached_tokens for t in got] == [common * BS] * groups
        for table, pool, f, before in zip(got, pools, firsts, free, strict=True):
            assert table.num_tokens == len(prompt) and table.num_dropped_blocks == f // BS
            assert table.num_held_blocks == -(-len(prompt) // BS) - f // BS
            assert pool.num_free_blocks >= before - table.num_held_blocks
            table.release(pool)
        assert [p.num_free_blocks for p in pools] == free
    for pool in pools:
        pool.check_integrity()


def test_admit_groups_re_admits_a_group_that_matched_more_at_the_common_prefix() -> None:
    hashers = _hashers(2)
    pools = [BlockPool(6, BS), BlockPool(6, BS, null_block=True)]
    prompt = [1, 2, 3, 4, 5, 6, 7]
    _warm(pools[0], hashers[0], prompt[:6], "w0")  # group 0 holds 3 blocks, group 1 one
    _warm(pools[1], hashers[1], prompt[:2], "w1")
    got = admit_groups(pools, hashers, RID, prompt)
    assert not isinstance(got, GroupShort)
    assert [t.num_cached_tokens for t in got] == [2, 2]
    assert [p.num_used_blocks for p in pools] == [4, 4]  # 1 shared + 3 fresh each
    for t, p in zip(got, pools, strict=True):
        t.release(p)
        p.check_integrity()


def test_admit_groups_names_the_short_group_and_holds_nothing() -> None:
    hashers = _hashers(2)
    pools = [BlockPool(8, BS), BlockPool(3, BS)]
    assert admit_groups(pools, hashers, RID, [1] * 7) == GroupShort(1)
    assert [p.num_free_blocks for p in pools] == [8, 3]
    with pytest.raises(InvalidArgumentError, match="2 KV cache groups but 1 hashers"):
        admit_groups(pools, hashers[:1], RID, [1])
    with pytest.raises(InvalidArgumentError, match="no tokens"):
        admit_groups(pools, hashers, RID, [])
    with pytest.raises(InvalidArgumentError, match="at least one"):
        admit_groups([], [], RID, [1])
    for p in pools:
        p.check_integrity()


def test_grow_groups_is_all_or_none_and_short_group_finds_the_first_short_pool() -> None:
    hashers = _hashers(2)
    pools = [BlockPool(4, BS), BlockPool(2, BS)]
    got = admit_groups(pools, hashers, RID, [1, 2, 3, 4])
    assert isinstance(got, list)
    assert short_group(got, pools, [3, 2]) is None
    assert short_group(got, pools, [3, 3]) == GroupShort(1)
    assert grow_groups(got, pools, [5]) == GroupShort(1)  # group 1 has no free block
    assert [t.num_tokens for t in got] == [4, 4] and [p.num_free_blocks for p in pools] == [2, 0]
    assert grow_groups(got, pools, []) is None
    for t, p in zip(got, pools, strict=True):
        t.release(p)
    got = admit_groups(pools, hashers, RID, [1, 2, 3])
    assert isinstance(got, list) and grow_groups(got, pools, [4]) is None
    assert [t.num_tokens for t in got] == [4, 4]
    for t, p in zip(got, pools, strict=True):
        t.release(p)
        p.check_integrity()
        assert p.num_used_blocks == 0


def test_grow_groups_counts_only_blocks_no_one_reserved() -> None:
    """A free block another request reserved is not this table's: the growth is refused in
    every group, none changed (append_tokens' own rule)."""
    hashers = _hashers(2)
    pools = [BlockPool(4, BS), BlockPool(4, BS)]
    got = admit_groups(pools, hashers, RID, [1, 2, 3, 4])  # 2 blocks of 2 tokens each
    assert isinstance(got, list)
    assert pools[1].reserve(2)  # its 2 free blocks are promised elsewhere
    assert short_group(got, pools, [3, 3]) == GroupShort(1)
    assert grow_groups(got, pools, [5]) == GroupShort(1)
    assert [t.num_tokens for t in got] == [4, 4] and [p.num_free_blocks for p in pools] == [2, 2]
    pools[1].unreserve(2)
    assert grow_groups(got, pools, [5]) is None
    for t, p in zip(got, pools, strict=True):
        t.release(p)
        p.check_integrity()
        assert (p.num_used_blocks, p.num_reserved_blocks) == (0, 0)


def test_after_step_marks_computed_and_drops_only_window_blocks() -> None:
    hashers = _hashers(2)
    pools = [BlockPool(8, BS), BlockPool(8, BS, null_block=True)]
    layouts = [_Window(None), _Window(3)]
    got = admit_groups(pools, hashers, RID, list(range(12)))
    assert isinstance(got, list)
    assert after_step(got, pools, layouts, TokenRange(0, 8)) == 3  # window_start(8) = 6
    assert [t.num_computed_tokens for t in got] == [8, 8]
    assert [t.num_held_blocks for t in got] == [6, 3] and got[1].num_dropped_blocks == 3
    assert pools[0].num_cached_blocks == 4  # group 0's full computed blocks are cached
    with pytest.raises(InvalidArgumentError, match="cannot mark 5 tokens computed, 4 remain"):
        after_step(got, pools, layouts, TokenRange(8, 13))
    assert [t.num_computed_tokens for t in got] == [8, 8]  # nothing changed
    for t, p in zip(got, pools, strict=True):
        t.release(p)
        p.check_integrity()
        assert p.num_used_blocks == 0


def test_drop_windows_keeps_what_a_reader_holds_until_it_lets_go() -> None:
    hashers = _hashers(1)
    pools = [BlockPool(8, BS, null_block=True)]
    got = admit_groups(pools, hashers, RID, list(range(10)))
    assert isinstance(got, list)
    layouts = [_Window(2)]  # window_start(10) = 9: blocks 0..3 are out of the window
    assert drop_windows(got, pools, layouts, 10, hold=[4]) == 2  # a store reads from 4 on
    assert got[0].num_held_blocks == 3
    assert drop_windows(got, pools, layouts, 10, hold=[None]) == 2  # the store ended
    assert got[0].num_held_blocks == 1 and pools[0].num_free_blocks == 6
    with pytest.raises(InvalidArgumentError, match="1 KV cache groups but 2 hold"):
        drop_windows(got, pools, layouts, 10, hold=[None, None])
    got[0].release(pools[0])
    pools[0].check_integrity()
