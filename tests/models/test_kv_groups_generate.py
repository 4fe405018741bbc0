"""Greedy generation over KV cache groups: a Qwen2 mixing window and full layers is token-exact
against transformers while its window group holds only in-window blocks; prefix reuse takes the
prefix every group holds; refusals name the group and leave every pool as it was; uniform
models keep one pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_testlib import mixed_qwen2, random_model

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId, TokenRange
from kvplane.models import PagedContext, PagedKVCache, blocks_needed, greedy_generate, load_model
from kvplane.models.kv import GroupedKVCache
from kvplane.models.kv_groups import KVGroups
from qwen2_testlib import MixedQwen2

MIXED = random_model(mixed_qwen2(), seed=5)
PROMPT = [4, 8, 15, 16, 23, 42, 7, 1, 9, 30]


def _balanced(ctx: PagedContext) -> None:
    for pool in ctx.pools:
        pool.check_integrity()
        assert pool.num_used_blocks == 0


def test_qwen2_window_and_full_layers_match_transformers_holding_only_the_window(
    tmp_path: Path,
) -> None:
    """Layers [sliding, full, sliding, full], window 8, blocks of 4, a 20-token prompt in steps
    of 7 and 200 new tokens: the tokens of transformers' greedy search; at the end (219 tokens)
    the request holds 2 blocks of its window group (a next step would read ``(211, 219]``:
    blocks 53 and 54; at most ``ceil(8 / 4) + 1 = 3``) and ``ceil(219 / 4) = 55`` of its full
    group (one pool of every layer holds 55 blocks of 4 layers); pools balance after release."""
    hf = MixedQwen2(tmp_path, num_layers=4, seed=40)
    model = load_model(tmp_path)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(20))
    want = hf.greedy(ids[0].tolist(), 200)
    layout = model.kv_layout(1, 4)
    win, full = (blocks_needed(20, 200, 4, g) for g in KVGroups.of_layout(layout).layouts(layout))
    assert (win, full) == (5, 55)  # the window group's peak: the prompt's blocks
    ctx = PagedContext.for_model(model, (win + 1, full), 4)
    r = greedy_generate(model, ids[0].tolist(), 200, 7, context=ctx)
    assert list(r.tokens) == want
    assert r.group_held_blocks == (2, 55) and r.num_held_blocks == 57
    assert r.group_held_blocks[0] <= -(-8 // 4) + 1
    assert [p.peak_used_blocks for p in ctx.pools] == [5, 55]
    _balanced(ctx)


def test_a_mixed_model_gets_one_pool_per_group() -> None:
    ctx = PagedContext.for_model(MIXED, (4, 12), 4)
    assert isinstance(ctx.kv, GroupedKVCache)
    assert [c.layout.layer_ids for c in ctx.kv.caches] == [(0, 2), (1, 3)]
    assert [(p.num_blocks, p.null_block) for p in ctx.pools] == [(4, 3), (12, None)]
    assert ctx.hashers[0].fingerprint != ctx.hashers[1].fingerprint
    with pytest.raises(InvalidArgumentError, match="2 KV cache groups but 3 sizes"):
        PagedContext.for_model(MIXED, (4, 4, 4), 4)
    with pytest.raises(InvalidArgumentError, match="1 block pools and 1 hashers for 2 KV pools"):
        PagedContext(ctx.pool, ctx.kv, ctx.hasher)
    with pytest.raises(InvalidArgumentError, match=r"block pool \(9 x 4\) and KV pool \(12 x 4\)"):
        PagedContext(ctx.pool, ctx.kv, ctx.hasher, (BlockPool(9, 4),), ctx.group_hashers)


def test_grouped_tokens_equal_one_pools_and_the_window_group_frees() -> None:
    """The same tokens as one pool of every layer (which frees nothing: 8 blocks of 4 layers
    held at the end, 29 tokens) with 3 window blocks (positions ``(21, 29]``) and 8 full."""
    grouped = greedy_generate(MIXED, PROMPT, 20, 3, block_size=4)
    kv = MIXED.new_kv_cache(8, 4)
    one = PagedContext(BlockPool(8, 4), kv, BlockHasher(0, kv.layout.fingerprint()))
    plain = greedy_generate(MIXED, PROMPT, 20, 3, context=one)
    assert grouped.tokens == plain.tokens
    assert (plain.num_held_blocks, plain.group_held_blocks) == (8, (8,))
    assert grouped.group_held_blocks == (3, 8)
    _balanced(one)


def test_prefix_reuse_takes_the_prefix_every_group_holds() -> None:
    ctx = PagedContext.for_model(MIXED, (12, 12), 4)
    want = greedy_generate(MIXED, PROMPT, 8, context=ctx, request_id="a")
    hit = greedy_generate(MIXED, PROMPT, 8, 1, context=ctx, request_id="b")
    assert (want.num_cached_tokens, hit.num_cached_tokens, hit.steps[0]) == (0, 8, TokenRange(8, 9))
    tokens = {want.tokens, hit.tokens}
    for pool in reversed(ctx.pools):  # the full group's cache is gone, then the window group's
        _evict_all(pool)
        again = greedy_generate(MIXED, PROMPT, 8, 4, context=ctx, request_id="c")
        assert again.num_cached_tokens == 0 and again.steps[0] == TokenRange(0, 4)
        tokens.add(again.tokens)
    assert tokens == {want.tokens}
    _balanced(ctx)


def _evict_all(pool: BlockPool) -> None:
    """Reuse every free block, so none stays cached."""
    taken = pool.allocate(pool.num_free_blocks)
    assert taken is not None
    pool.free(taken)
    assert pool.num_cached_blocks == 0


def test_refusals_name_the_group_and_leave_every_pool_as_it_was() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"KV cache group 0 \(window 8\): .* needs 3 blocks .* has 1"
    ):
        greedy_generate(MIXED, PROMPT, 8, block_size=4, num_blocks=2)
    ctx = PagedContext.for_model(MIXED, (8, 12), 4)
    other = BlockTable(RequestId("other"), 4, ctx.group_hashers[0])
    assert other.admit(ctx.group_pools[0], list(range(40, 80))) is not None  # 10 of 12 blocks
    with pytest.raises(
        InvalidArgumentError, match=r"KV cache group 1 \(window None\): the pool has 2 free"
    ):
        greedy_generate(MIXED, PROMPT, 1, context=ctx)
    assert (ctx.pool.num_free_blocks, ctx.group_pools[0].num_free_blocks) == (7, 2)
    other.release(ctx.group_pools[0])
    _balanced(ctx)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-swa"])
def test_a_uniform_model_keeps_one_pool(name: str) -> None:
    model = load_model(name)
    ctx = PagedContext.for_model(model, 12, 16)
    assert type(ctx.kv) is PagedKVCache and ctx.group_pools == () and ctx.kv.caches == (ctx.kv,)
    assert ctx.pool.null_block == (11 if name == "tiny-swa" else None)
    prompt = list(range(3, 40))
    r = greedy_generate(model, prompt, 30, 16, context=ctx)
    assert r.group_held_blocks == (r.num_held_blocks,)
    assert r.num_held_blocks == (2 if name == "tiny-swa" else 5)
    _balanced(ctx)
