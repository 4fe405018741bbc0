"""Helpers of the codec parity tests: a model's prompt KV round-tripped through a codec in
chunks, as a cold tier would store and load it, and greedy agreement with raw KV, measured
both ways (docs/offload.md, "Codecs").

*Teacher-forced*: one step over the raw greedy continuation given the prompt's cached KV; the
share of positions whose greedy token equals the one the same step picks over raw KV.
*Free-running*: the share of whole continuations identical to raw's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvplane.blocks import BlockTable
from kvplane.ids import RequestId, TokenRange
from kvplane.models import PagedContext, greedy_generate
from kvplane.models.base import CausalLM
from kvplane.models.step import StepBatch
from kvplane.offload.codecs import ChunkCoder, ChunkFormat, make_codec

NEW_TOKENS = 32
BLOCK = 16
BLOCKS_PER_CHUNK = 2
POOL_BLOCKS = 16


def prompt_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    """``count`` seeded lengths in ``[low, high]``, none a multiple of :data:`BLOCK`: a prompt
    of whole blocks would be all cached, leaving no step to predict its first new token."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [n + 1 if n % BLOCK == 0 else n for n in lens]


def prefilled(model: CausalLM, prompt: Sequence[int], codec: str) -> PagedContext:
    """A context whose prefix cache holds ``prompt``'s full blocks, every chunk of its pool
    encoded with ``codec`` and decoded back in place (block-major, as stored)."""
    ctx = PagedContext.for_model(model, num_blocks=POOL_BLOCKS, block_size=BLOCK)
    greedy_generate(model, prompt, 1, context=ctx)
    layout = ctx.kv.layout
    fmt = ChunkFormat.of(layout, BLOCKS_PER_CHUNK * layout.bytes_per_block)
    coder = ChunkCoder(make_codec(codec), fmt)
    view = layout.canonical_view(ctx.kv.pool)
    for b in range(0, layout.num_blocks, BLOCKS_PER_CHUNK):
        blocks = view[b : b + BLOCKS_PER_CHUNK]
        chunk = blocks.contiguous().view(-1).view(torch.uint8)
        enc = coder.encode(chunk)
        out = torch.empty_like(chunk)
        assert coder.decode(enc.tag, enc.data, out)
        blocks.copy_(out.view(layout.dtype).view(blocks.shape))
    return ctx


def teacher_forced(
    model: CausalLM, ctx: PagedContext, prompt: Sequence[int], continuation: Sequence[int]
) -> torch.Tensor:
    """The logits ``[len(continuation), vocab]`` predicting each continuation token, given the
    prompt's cached KV in ``ctx`` and the continuation tokens before it (one step over the
    uncached rest)."""
    seq = [*prompt, *continuation]
    table = BlockTable(RequestId("teacher"), BLOCK, ctx.hasher)
    assert table.admit(ctx.pool, seq) is not None
    try:
        c = table.num_cached_tokens
        assert 0 < c < len(prompt)
        batch = StepBatch.from_tables([(table, TokenRange(c, len(seq)))])
        logits = model.forward_step(batch, ctx.kv, all_logits=True)
    finally:
        table.release(ctx.pool)
    first = len(prompt) - 1 - c
    return logits[first : first + len(continuation)]


@dataclass(frozen=True, slots=True)
class RawRun:
    """A prompt's raw greedy continuation, the teacher-forced greedy tokens over raw KV (the
    reference a codec is held to) and their top-1 minus top-2 logit margins."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    greedy: torch.Tensor
    margins: torch.Tensor


def raw_runs(model: CausalLM, prompts: Sequence[Sequence[int]]) -> list[RawRun]:
    """The :class:`RawRun` of each prompt (:data:`NEW_TOKENS` new tokens)."""
    out = []
    for prompt in prompts:
        tokens = greedy_generate(model, prompt, NEW_TOKENS).tokens
        logits = teacher_forced(model, prefilled(model, prompt, "raw"), prompt, tokens)
        top = logits.topk(2).values
        out.append(RawRun(tuple(prompt), tokens, logits.argmax(-1), top[:, 0] - top[:, 1]))
    return out


@dataclass(frozen=True, slots=True)
class Agreement:
    """Of ``tokens`` teacher-forced positions, ``same_tokens`` agree with raw; of
    ``continuations`` free-running ones, ``same_continuations`` are identical to raw's."""

    same_tokens: int
    tokens: int
    same_continuations: int
    continuations: int

    @property
    def token_share(self) -> float:
        return self.same_tokens / self.tokens

    @property
    def continuation_share(self) -> float:
        return self.same_continuations / self.continuations


def agreement(model: CausalLM, runs: Sequence[RawRun], codec: str, free: bool = True) -> Agreement:
    """Greedy agreement with raw KV of ``model`` with its prompt KV round-tripped through
    ``codec``: teacher-forced over every run, and free-running too when ``free``."""
    same_tokens = same_runs = 0
    for r in runs:
        got = teacher_forced(model, prefilled(model, r.prompt, codec), r.prompt, r.tokens)
        same_tokens += int((got.argmax(-1) == r.greedy).sum())
        if free:
            ctx = prefilled(model, r.prompt, codec)
            run = greedy_generate(model, r.prompt, NEW_TOKENS, context=ctx)
            assert run.num_cached_tokens > 0
            same_runs += run.tokens == r.tokens
    return Agreement(same_tokens, len(runs) * NEW_TOKENS, same_runs, len(runs) if free else 0)
