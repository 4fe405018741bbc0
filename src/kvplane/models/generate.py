"""Greedy generation of one request in one process, over a private paged pool.

Ties go to the lowest token id, so the tokens do not depend on step sizes: the parity reference
for PD runs. Where every layer slides, the blocks out of every window are dropped after each step
(the pool keeps a null block for them). The table is released on every exit path. See
docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.blocks import BlockHasher, BlockPool, BlockTable, canonical_token_ids
from kvplane.blocks.hashing import TokenIds
from kvplane.errors import BlockStateError, InvalidArgumentError
from kvplane.ids import RequestId, TokenRange
from kvplane.layout import KVLayout
from kvplane.models.base import CausalLM
from kvplane.models.kv import PagedKVCache
from kvplane.models.step import StepBatch
from kvplane.validators import require_int


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """The new tokens (``len == max_new_tokens``), the token range each step computed, how
    many prompt tokens came from the prefix cache instead and how many blocks the request held
    after its last step (before its release)."""

    tokens: tuple[int, ...]
    prompt_len: int
    steps: tuple[TokenRange, ...]
    num_cached_tokens: int = 0
    num_held_blocks: int = 0

    @property
    def num_prefill_steps(self) -> int:
        return sum(1 for r in self.steps if r.end <= self.prompt_len)


def prefill_ranges(
    num_tokens: int, step_size: int | None = None, start: int = 0
) -> list[TokenRange]:
    """The step ranges of a chunked prefill of ``[start, num_tokens)``: one range when
    ``step_size`` is ``None``, else consecutive ranges of ``step_size`` (the last may be short)."""
    require_int("num_tokens", num_tokens, min=1)
    require_int("start", start, min=0, max=num_tokens - 1)
    step = num_tokens - start if step_size is None else require_int("step_size", step_size, min=1)
    return [TokenRange(s, min(s + step, num_tokens)) for s in range(start, num_tokens, step)]


def greedy_token(logits: torch.Tensor) -> list[int]:
    """Greedy choice per row of ``logits [B, vocab]`` (ties: lowest id)."""
    return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]


def blocks_needed(
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    layout: KVLayout | None = None,
    *,
    received: bool = False,
) -> int:
    """Blocks a request holds at its peak: those of the prompt plus every new token but the
    last. Where every layer of ``layout`` slides (the blocks before the window are dropped
    after each step), at most the ``(W - 1) // block_size + 2`` blocks the largest window
    ``W`` spans, or the whole prompt's blocks while it is computed (not when the prompt's
    window is ``received``: a PD decode side holds only that)."""
    plain = -(-(prompt_len + max(max_new_tokens - 1, 0)) // block_size)
    windows = [layout.window_of(i) for i in layout.layer_ids] if layout is not None else [None]
    if None in windows:
        return plain
    span = (max(w or 0 for w in windows) - 1) // block_size + 2
    return min(plain, span if received else max(-(-prompt_len // block_size), span))


@dataclass(frozen=True, slots=True)
class PagedContext:
    """A block pool, the KV pool it indexes and the hasher of its prefix cache.

    Owned by the caller when passed to :func:`greedy_generate` (requests release their blocks on
    return, so ``pool.check_integrity()`` and ``pool.num_free_blocks`` can be checked after);
    full blocks stay cached, so a later request with the same prefix skips that prefill. A
    windowed model's pool (:meth:`for_model`) reserves a null block for dropped blocks.
    """

    pool: BlockPool
    kv: PagedKVCache
    hasher: BlockHasher

    @classmethod
    def for_model(
        cls, model: CausalLM, num_blocks: int, block_size: int, seed: int = 0
    ) -> PagedContext:
        kv = model.new_kv_cache(num_blocks, block_size)
        pool = BlockPool(num_blocks, block_size, name="generate", null_block=kv.layout.windowed)
        return cls(pool, kv, BlockHasher(seed=seed, fingerprint=kv.layout.fingerprint()))

    def __post_init__(self) -> None:
        if (self.pool.num_blocks, self.pool.block_size) != (self.kv.num_blocks, self.kv.block_size):
            raise InvalidArgumentError(
                f"block pool ({self.pool.num_blocks} x {self.pool.block_size}) and KV pool "
                f"({self.kv.num_blocks} x {self.kv.block_size}) disagree"
            )


def greedy_generate(
    model: CausalLM,
    prompt_ids: TokenIds,
    max_new_tokens: int,
    step_size: int | None = None,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    context: PagedContext | None = None,
    request_id: str = "generate",
) -> GenerationResult:
    """Generate ``max_new_tokens`` greedy tokens after ``prompt_ids``; see the module docstring.

    Without ``context`` a private pool of ``num_blocks`` (default: exactly enough, with the null
    block of a windowed model) blocks of ``block_size`` is used; with one, its pool (and its
    block size) is used and a cached prefix is not recomputed. Raises
    :class:`InvalidArgumentError` before any work for an empty prompt, a prompt id outside the
    vocabulary, a bad count or step size, or a request longer than the pool; and, with nothing
    left allocated, when a shared pool lacks free blocks.
    """
    prompt = canonical_token_ids(prompt_ids)
    if prompt.size == 0:
        raise InvalidArgumentError("the prompt has no tokens")
    vocab = model.vocab_size
    bad = ((prompt < 0) | (prompt >= vocab)).nonzero()[0]
    if bad.size:
        raise InvalidArgumentError(
            f"prompt token id {int(prompt[bad[0]])} at position {int(bad[0])} is outside the "
            f"vocabulary [0, {vocab})"
        )
    require_int("max_new_tokens", max_new_tokens, min=0)
    n = int(prompt.size)
    prefill_ranges(n, step_size)  # validates step_size
    if context is not None:
        if num_blocks is not None:
            raise InvalidArgumentError("give num_blocks or a context, not both")
        block_size = context.pool.block_size
    require_int("block_size", block_size, min=1)
    if context is not None:
        drops = context.pool.null_block is not None
        layout = context.kv.layout
    else:
        layout = model.kv_layout(1, block_size)
        drops = layout.windowed
    need = blocks_needed(n, max_new_tokens, block_size, layout if drops else None)
    total = context.pool.num_blocks if context is not None else num_blocks or need + drops
    require_int("num_blocks", total, min=1 + drops)
    if need > total - drops:
        raise InvalidArgumentError(
            f"a prompt of {n} tokens plus {max_new_tokens} new tokens needs {need} blocks of "
            f"{block_size} tokens; the pool has {total - drops}"
        )
    if max_new_tokens == 0:
        return GenerationResult((), n, ())
    ctx = context if context is not None else PagedContext.for_model(model, total, block_size)
    table = BlockTable(RequestId(request_id), block_size, ctx.hasher)
    if table.admit(ctx.pool, prompt) is None:
        raise InvalidArgumentError(
            f"the pool has {ctx.pool.num_free_blocks} free blocks; admitting {n} tokens needs more"
        )
    steps: list[TokenRange] = []
    tokens: list[int] = []
    cached = table.num_cached_tokens
    try:
        more = need - len(table.block_ids)
        if more > ctx.pool.num_free_blocks:
            raise InvalidArgumentError(
                f"decoding {max_new_tokens} tokens needs {more} more blocks; the pool has "
                f"{ctx.pool.num_free_blocks} free"
            )
        for rng in prefill_ranges(n, step_size, table.num_computed_tokens):
            logits = _step(model, table, ctx, rng)
            steps.append(rng)
        tokens.append(greedy_token(logits)[0])
        while len(tokens) < max_new_tokens:
            if not table.append_tokens(ctx.pool, [tokens[-1]]):  # pragma: no cover - checked
                raise BlockStateError("the pool ran out of blocks while decoding")
            rng = TokenRange(table.num_tokens - 1, table.num_tokens)
            logits = _step(model, table, ctx, rng)
            steps.append(rng)
            tokens.append(greedy_token(logits)[0])
        held = table.num_held_blocks
    finally:
        table.release(ctx.pool)
    return GenerationResult(tuple(tokens), n, tuple(steps), cached, held)


def _step(model: CausalLM, table: BlockTable, ctx: PagedContext, rng: TokenRange) -> torch.Tensor:
    """Compute ``rng``, mark it computed, then drop the blocks no later step reads (the next
    one computes ``rng.end`` on), where the pool has a null block for them."""
    batch = StepBatch.from_tables([(table, rng)], model.device)
    logits = model.forward_step(batch, ctx.kv)
    table.mark_computed(ctx.pool, len(rng))
    if ctx.pool.null_block is not None:
        table.drop_before(ctx.pool, ctx.kv.layout.window_start(rng.end))
    return logits
