"""Greedy generation: step plans, prefix reuse through a shared context, exact step ranges,
token invariance under step and block sizes, and refused requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models_testlib import random_model, small_deepseek, small_llama

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId, TokenRange
from kvplane.models import (
    PagedContext,
    blocks_needed,
    greedy_generate,
    greedy_token,
    load_model,
    prefill_ranges,
)

PROMPT = [4, 8, 15, 16, 23, 42, 7, 1, 9, 30]
LLAMA = random_model(small_llama(), seed=11)
WANT = LLAMA.generate(PROMPT, 8).tokens


def test_prefill_ranges_and_block_counts() -> None:
    assert prefill_ranges(10) == [TokenRange(0, 10)]
    assert prefill_ranges(10, 4) == [TokenRange(0, 4), TokenRange(4, 8), TokenRange(8, 10)]
    assert prefill_ranges(10, 4, start=8) == [TokenRange(8, 10)]
    assert prefill_ranges(3, 5) == [TokenRange(0, 3)]
    for bad in ((0, None, 0), (5, 0, 0), (5, None, 5), (5, True, 0)):
        with pytest.raises(InvalidArgumentError):
            prefill_ranges(*bad)  # type: ignore[arg-type]
    assert [blocks_needed(10, n, 4) for n in (0, 1, 2, 3, 6, 7)] == [3, 3, 3, 3, 4, 4]


def test_greedy_ties_go_to_the_lowest_id() -> None:
    assert greedy_token(torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 5.0]])) == [1, 0]


def test_exact_steps_and_result() -> None:
    r = LLAMA.generate(PROMPT, 3, step_size=4)
    assert r.steps == (TokenRange(0, 4), TokenRange(4, 8), TokenRange(8, 10), TokenRange(10, 11),
                       TokenRange(11, 12))  # fmt: skip
    assert (r.prompt_len, r.num_prefill_steps, r.num_cached_tokens) == (10, 3, 0)
    assert r.tokens == WANT[:3]
    empty = LLAMA.generate(PROMPT, 0)
    assert (empty.tokens, empty.steps) == ((), ())


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 10), st.sampled_from([1, 2, 3, 5, 16]))
def test_tokens_do_not_depend_on_step_or_block_size(step: int, block_size: int) -> None:
    assert LLAMA.generate(PROMPT, 8, step, block_size=block_size).tokens == WANT


def test_a_shared_context_reuses_the_cached_prefix() -> None:
    ctx = PagedContext.for_model(LLAMA, num_blocks=12, block_size=4)
    first = greedy_generate(LLAMA, PROMPT, 8, context=ctx, request_id="a")
    again = greedy_generate(LLAMA, PROMPT, 8, step_size=1, context=ctx, request_id="b")
    assert first.tokens == again.tokens == WANT
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 8)
    assert again.steps[0] == TokenRange(8, 9)
    ctx.pool.check_integrity()
    assert ctx.pool.num_free_blocks == 12 and ctx.pool.num_cached_blocks > 0


def test_a_busy_shared_pool_is_refused_and_left_as_it_was() -> None:
    ctx = PagedContext.for_model(LLAMA, num_blocks=5, block_size=4)
    other = BlockTable(RequestId("other"), 4, ctx.hasher)
    assert other.admit(ctx.pool, list(range(50, 58))) is not None  # holds 2 blocks
    with pytest.raises(InvalidArgumentError, match="needs 2 more blocks; the pool has 0 free"):
        greedy_generate(LLAMA, PROMPT, 8, context=ctx)  # admits 3 blocks, decode needs 2 more
    assert ctx.pool.num_free_blocks == 3  # the failed request released its blocks
    other2 = BlockTable(RequestId("o2"), 4, ctx.hasher)
    assert other2.admit(ctx.pool, list(range(60, 68))) is not None
    with pytest.raises(InvalidArgumentError, match="the pool has 1 free blocks"):
        greedy_generate(LLAMA, PROMPT, 1, context=ctx)
    other2.release(ctx.pool)
    other.release(ctx.pool)
    ctx.pool.check_integrity()
    assert ctx.pool.num_free_blocks == 5


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"prompt_ids": []}, "no tokens"),
        (
            {"prompt_ids": [1, 97]},
            r"prompt token id 97 at position 1 is outside the vocabulary \[0, 97\)",
        ),
        ({"prompt_ids": [1, -3]}, "-3"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0"),
        ({"step_size": 0}, "step_size must be a positive int"),
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"num_blocks": 2}, "needs 4 blocks of 4 tokens; the pool has 2"),
    ],
)
def test_bad_requests(kwargs: dict[str, object], words: str) -> None:
    args: dict[str, object] = {"prompt_ids": PROMPT, "max_new_tokens": 5, "block_size": 4}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=words):
        greedy_generate(LLAMA, **args)  # type: ignore[arg-type]


def test_prompt_longer_than_a_given_pool() -> None:
    ctx = PagedContext.for_model(LLAMA, num_blocks=2, block_size=4)
    with pytest.raises(
        InvalidArgumentError, match="a prompt of 10 tokens plus 1 new tokens needs 3 blocks"
    ):
        greedy_generate(LLAMA, PROMPT, 1, context=ctx)
    with pytest.raises(InvalidArgumentError, match="num_blocks or a context"):
        greedy_generate(LLAMA, PROMPT, 1, context=ctx, num_blocks=3)
    ctx.pool.check_integrity()
    assert ctx.pool.num_free_blocks == 2


def test_context_parts_must_agree() -> None:
    kv = LLAMA.new_kv_cache(4, 4)
    with pytest.raises(InvalidArgumentError, match=r"block pool \(4 x 8\) and KV pool \(4 x 4\)"):
        PagedContext(BlockPool(4, 8), kv, BlockHasher(0, b"f"))


def test_deepseek_generates_too() -> None:
    model = random_model(small_deepseek(), seed=3)
    r = model.generate(PROMPT[:5], 40, step_size=2, block_size=4)
    assert len(r.tokens) == 40 and all(0 <= t < 89 for t in r.tokens)
    assert r.tokens == model.generate(PROMPT[:5], 40).tokens


def test_a_window_model_holds_only_the_blocks_its_window_reads() -> None:
    """tiny-swa (window 16 on every layer) over a 200-token sequence (150 prompt + 51 new tokens,
    blocks of 16): dropping the blocks out of the window, the request ends holding 2 blocks
    (the step after 200 reads ``(184, 200]``: blocks 11 and 12), at its peak the 10 of its
    prompt; a pool without a null block drops nothing and ends holding all 13. Same tokens."""
    swa = load_model("tiny-swa")
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 1024, 150)]
    layout = swa.kv_layout(1, 16)
    assert blocks_needed(150, 51, 16, layout) == 10 and blocks_needed(150, 51, 16) == 13
    assert blocks_needed(150, 51, 16, layout, received=True) == 2
    ctx = PagedContext.for_model(swa, num_blocks=11, block_size=16)
    assert ctx.pool.null_block == 10
    after = greedy_generate(swa, prompt, 51, 16, context=ctx)
    kv = swa.new_kv_cache(13, 16)
    plain = PagedContext(BlockPool(13, 16), kv, BlockHasher(0, kv.layout.fingerprint()))
    before = greedy_generate(swa, prompt, 51, 16, context=plain)
    assert after.tokens == before.tokens
    assert (after.num_held_blocks, ctx.pool.peak_used_blocks) == (2, 10)
    assert (before.num_held_blocks, plain.pool.peak_used_blocks) == (13, 13)
    for pool in (ctx.pool, plain.pool):
        pool.check_integrity()
        assert pool.num_used_blocks == 0
    with pytest.raises(InvalidArgumentError, match="needs 10 blocks of 16 tokens; the pool has 9"):
        greedy_generate(swa, prompt, 51, 16, num_blocks=10)  # one of them is the null block
    assert greedy_generate(swa, prompt, 51, 16, block_size=16).tokens == after.tokens
