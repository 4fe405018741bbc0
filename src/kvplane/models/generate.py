"""Greedy generation of one request in one process, over a private paged pool.

Ties go to the lowest token id, so the tokens do not depend on step sizes: the parity reference
for PD runs. A model whose layers have different windows runs one KV pool, block pool and block
table per KV cache group; in a pool whose every layer slides, the blocks out of the window are
dropped after each step (the pool keeps a null block for them). The tables are released on
every exit path. See docs/attention.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvplane.blocks import (
    BlockHasher,
    BlockPool,
    BlockTable,
    GroupShort,
    admit_groups,
    after_step,
    canonical_token_ids,
    grow_groups,
    short_group,
)
from kvplane.blocks.hashing import TokenIds
from kvplane.errors import BlockStateError, InvalidArgumentError
from kvplane.ids import RequestId, TokenRange
from kvplane.layout import KVLayout
from kvplane.models.base import CausalLM
from kvplane.models.kv import GroupedKVCache, PagedKVCache
from kvplane.models.kv_groups import KVGroups
from kvplane.models.step import StepBatch
from kvplane.validators import require_int


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """The new tokens (``len == max_new_tokens``), the token range each step computed, how
    many prompt tokens came from the prefix cache instead and how many blocks the request held
    after its last step (before its release): in all, and per KV cache group."""

    tokens: tuple[int, ...]
    prompt_len: int
    steps: tuple[TokenRange, ...]
    num_cached_tokens: int = 0
    num_held_blocks: int = 0
    group_held_blocks: tuple[int, ...] = ()

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
    after each step), at most the ``(W - 1) // block_size + 2`` (``ceil(W / block_size) + 1``)
    blocks the largest window ``W`` spans, or the whole prompt's blocks while it is computed
    (not when the prompt's window is ``received``: a PD decode side holds only that). Per KV
    cache group: pass the group's layout."""
    plain = -(-(prompt_len + max(max_new_tokens - 1, 0)) // block_size)
    windows = [layout.window_of(i) for i in layout.layer_ids] if layout is not None else [None]
    if None in windows:
        return plain
    span = (max(w or 0 for w in windows) - 1) // block_size + 2
    return min(plain, span if received else max(-(-prompt_len // block_size), span))


def group_peaks(
    prompt_len: int,
    max_new_tokens: int,
    layouts: Sequence[KVLayout],
    pools: Sequence[BlockPool] | None = None,
    *,
    received: bool = False,
) -> tuple[int, ...]:
    """:func:`blocks_needed` per KV cache group (``layouts[g]``, its block size): a group
    drops its out-of-window blocks when its pool has a null block (``pools`` given) or, for
    pools not made yet, when every layer of its layout slides (the pool it gets has one)."""
    drops: Iterable[bool] = (
        [p.null_block is not None for p in pools] if pools is not None else map(_slides, layouts)
    )
    return tuple(
        blocks_needed(prompt_len, max_new_tokens, lay.block_size, lay if d else None,
                      received=received)
        for lay, d in zip(layouts, drops, strict=True)
    )  # fmt: skip


def _slides(layout: KVLayout) -> bool:
    """Every layer of ``layout`` has a window: its pool keeps a null block for dropped ones."""
    return None not in map(layout.window_of, layout.layer_ids)


@dataclass(frozen=True, slots=True)
class PagedContext:
    """Block pools, the KV pools they index and the hashers of their prefix caches: one of each
    per KV cache group (``pool``/``hasher`` are group 0's, ``group_pools``/``group_hashers``
    the rest; ``kv`` is a :class:`GroupedKVCache` when there are several).

    Owned by the caller when passed to :func:`greedy_generate` (requests release their blocks on
    return, so ``pool.check_integrity()`` and ``pool.num_free_blocks`` can be checked after);
    full blocks stay cached, so a later request with the same prefix skips that prefill. A
    windowed group's pool (:meth:`for_model`) reserves a null block for dropped blocks.
    """

    pool: BlockPool
    kv: PagedKVCache
    hasher: BlockHasher
    group_pools: tuple[BlockPool, ...] = ()
    group_hashers: tuple[BlockHasher, ...] = ()

    @classmethod
    def for_model(
        cls, model: CausalLM, num_blocks: int | Sequence[int], block_size: int, seed: int = 0
    ) -> PagedContext:
        """Zeroed pools for ``model``: one per KV cache group of its layers, of ``num_blocks``
        blocks each (or ``num_blocks[g]`` for group ``g``)."""
        layout = model.kv_layout(1, block_size)
        groups = KVGroups.of_layout(layout)
        sizes = (num_blocks,) * len(groups) if isinstance(num_blocks, int) else tuple(num_blocks)
        if len(sizes) != len(groups):
            raise InvalidArgumentError(f"{len(groups)} KV cache groups but {len(sizes)} sizes")
        if groups.single:
            kv = model.new_kv_cache(sizes[0], block_size)
        else:
            kv = GroupedKVCache.allocate(model.kv_layout(sizes[0], block_size), sizes, model.device)
        pools = tuple(
            BlockPool(n, block_size, name="generate" if groups.single else f"generate.{g}",
                      null_block=group.window is not None)
            for g, (n, group) in enumerate(zip(sizes, groups, strict=True))
        )  # fmt: skip
        hashers = tuple(
            BlockHasher(seed=seed, fingerprint=c.layout.fingerprint()) for c in kv.caches
        )
        return cls(pools[0], kv, hashers[0], pools[1:], hashers[1:])

    def __post_init__(self) -> None:
        caches = self.kv.caches
        if len(self.pools) != len(caches) or len(self.hashers) != len(caches):
            raise InvalidArgumentError(
                f"{len(self.pools)} block pools and {len(self.hashers)} hashers for "
                f"{len(caches)} KV pools"
            )
        for pool, kv in zip(self.pools, caches, strict=True):
            if (pool.num_blocks, pool.block_size) != (kv.num_blocks, kv.block_size):
                raise InvalidArgumentError(
                    f"block pool ({pool.num_blocks} x {pool.block_size}) and KV pool "
                    f"({kv.num_blocks} x {kv.block_size}) disagree"
                )

    @property
    def pools(self) -> tuple[BlockPool, ...]:
        """One block pool per KV cache group."""
        return (self.pool, *self.group_pools)

    @property
    def hashers(self) -> tuple[BlockHasher, ...]:
        return (self.hasher, *self.group_hashers)


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

    Without ``context`` private pools of ``num_blocks`` (default: exactly enough per KV cache
    group, with the null block of a windowed group) blocks of ``block_size`` are used; with
    one, its pools (and block size) are used and a prefix cached in every group is not
    recomputed. Raises :class:`InvalidArgumentError` before any work for an empty prompt, a
    prompt id outside the vocabulary, a bad count or step size, or a request longer than a
    pool; and, with nothing left allocated, when a shared pool lacks free blocks.
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
        layouts = tuple(c.layout for c in context.kv.caches)
        drops = tuple(p.null_block is not None for p in context.pools)
    else:
        layout = model.kv_layout(1, block_size)
        layouts = KVGroups.of_layout(layout).layouts(layout)
        drops = tuple(map(_slides, layouts))
    needs = group_peaks(n, max_new_tokens, layouts, context.pools if context else None)
    totals = (
        [p.num_blocks for p in context.pools]
        if context is not None
        else [num_blocks or need + d for need, d in zip(needs, drops, strict=True)]
    )
    for g, (need, total, d) in enumerate(zip(needs, totals, drops, strict=True)):
        require_int("num_blocks", total, min=1 + d)
        if need > total - d:
            raise InvalidArgumentError(
                f"{_where(layouts, g)}a prompt of {n} tokens plus {max_new_tokens} new tokens "
                f"needs {need} blocks of {block_size} tokens; the pool has {total - d}"
            )
    if max_new_tokens == 0:
        return GenerationResult((), n, ())
    ctx = context if context is not None else PagedContext.for_model(model, totals, block_size)
    got = admit_groups(ctx.pools, ctx.hashers, RequestId(request_id), prompt)
    if isinstance(got, GroupShort):
        g = got.group
        raise InvalidArgumentError(
            f"{_where(layouts, g)}the pool has {ctx.pools[g].num_free_blocks} free blocks; "
            f"admitting {n} tokens needs more"
        )
    tables = got
    steps: list[TokenRange] = []
    tokens: list[int] = []
    cached = tables[0].num_cached_tokens
    try:
        short = short_group(tables, ctx.pools, needs)
        if short is not None:
            g = short.group
            more = needs[g] - tables[g].num_held_blocks
            raise InvalidArgumentError(
                f"{_where(layouts, g)}decoding {max_new_tokens} tokens needs {more} more "
                f"blocks; the pool has {ctx.pools[g].num_free_blocks} free"
            )
        for rng in prefill_ranges(n, step_size, cached):
            logits = _step(model, tables, ctx, rng)
            steps.append(rng)
        tokens.append(greedy_token(logits)[0])
        while len(tokens) < max_new_tokens:
            if grow_groups(tables, ctx.pools, [tokens[-1]]) is not None:  # pragma: no cover
                raise BlockStateError("the pool ran out of blocks while decoding")  # checked
            rng = TokenRange(n + len(tokens) - 1, n + len(tokens))
            logits = _step(model, tables, ctx, rng)
            steps.append(rng)
            tokens.append(greedy_token(logits)[0])
        held = tuple(table.num_held_blocks for table in tables)
    finally:
        for table, pool in zip(tables, ctx.pools, strict=True):
            table.release(pool)
    return GenerationResult(tuple(tokens), n, tuple(steps), cached, sum(held), held)


def _where(layouts: Sequence[KVLayout], group: int) -> str:
    """An error's prefix naming KV cache group ``group`` (none for a one-group model)."""
    if len(layouts) == 1:
        return ""
    lay = layouts[group]
    return f"KV cache group {group} (window {lay.window_of(lay.layer_ids[0])}): "


def _step(
    model: CausalLM, tables: list[BlockTable], ctx: PagedContext, rng: TokenRange
) -> torch.Tensor:
    """Compute ``rng``, then the groups' upkeep (:func:`~kvplane.blocks.after_step`: marked
    computed, the blocks no later step reads dropped where a pool has a null block)."""
    batch = StepBatch.from_group_tables([(tables, rng)], model.device)
    logits = model.forward_step(batch, ctx.kv)
    after_step(tables, ctx.pools, [kv.layout for kv in ctx.kv.caches], rng)
    return logits
