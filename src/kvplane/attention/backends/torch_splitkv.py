"""``torch_splitkv``: split-KV (flash-decoding) absorbed MLA for long contexts.

Theory of operation
-------------------
The KV axis is cut into splits of ``split_tokens`` positions (a multiple of the page size, sized
at plan time so one split of the whole batch is a few MiB and stays in cache). Each split is
gathered into one reused workspace, attended to on its own, giving a normalised partial state
``(o_s, lse_s)``, and folded into the running state with the LSE merge
(:func:`~kvplane.attention.paged.merge_states`). Requests are sorted by ``kv_len`` descending at
plan time, so the requests still active in split ``s`` are a prefix of the batch: a split never
gathers pages of requests that have ended. Memory is ``O(B x split)``, not ``O(B x kv_len)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.attention.backends.common import (
    MLABackend,
    compute_dtype,
    positive_int,
    torch_capabilities,
)
from kvplane.attention.backends.torch_mla import attend_latent, padded_query
from kvplane.attention.base import Plan
from kvplane.attention.inputs import MLAKVCache, MLAQuery
from kvplane.attention.metadata import PagedStructure
from kvplane.attention.paged import (
    BatchIndex,
    build_batch_index,
    empty_state,
    gather_pages,
    merge_states,
    padded_result,
    visible,
    zero_invalid,
)
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult

NAME = "torch_splitkv"
TARGET_SPLIT_BYTES = 8 << 20
"""Aim for one split of the whole batch to fill about this many bytes of gathered KV."""
MIN_SPLIT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Unsorted and sorted batch indexes, the permutations, pages per split, active requests."""

    full: BatchIndex
    index: BatchIndex
    inverse: torch.Tensor
    order: torch.Tensor
    split_pages: int
    active: tuple[int, ...]  # requests (a sorted prefix) active in each split
    ragged: tuple[bool, ...]  # does the split hold positions past some active request's end


def split_pages_for(batch: int, row_bytes: int, page_size: int, max_pages: int) -> int:
    """Pages per split: about ``TARGET_SPLIT_BYTES`` for the batch, at least one page."""
    tokens = max(MIN_SPLIT_TOKENS, TARGET_SPLIT_BYTES // max(1, batch * row_bytes))
    return max(1, min(max_pages, tokens // page_size))


class TorchSplitKVBackend(MLABackend[SplitPlan]):
    """Split-KV absorbed MLA; ``split_tokens`` fixes the split length (rounded up to pages)."""

    def __init__(self, split_tokens: int | None = None) -> None:
        if split_tokens is not None:
            positive_int("split_tokens", split_tokens)
        super().__init__(NAME, torch_capabilities(AttentionKind.MLA), SplitPlan)
        self._split_tokens = split_tokens

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> SplitPlan:
        s = structure
        shape = problem.mla_shape()
        full = build_batch_index(problem.metadata, s, problem.causal, problem.device)
        kv = torch.tensor(s.kv_lens, dtype=torch.long)
        order = torch.argsort(kv, descending=True, stable=True)
        inverse = torch.argsort(order)
        max_pages = max(1, *s.pages_needed)
        if self._split_tokens is not None:
            pages = max(1, min(max_pages, -(-self._split_tokens // s.page_size)))
        else:
            row = (shape.kv_lora_rank + shape.rope_dim) * 4
            pages = split_pages_for(s.batch_size, row, s.page_size, max_pages)
        tokens = pages * s.page_size
        sorted_kv = kv[order]
        n_splits = -(-s.max_kv_len // tokens)
        active = tuple(int((sorted_kv > i * tokens).sum()) for i in range(n_splits))
        ragged = tuple(int(sorted_kv[n - 1]) < (i + 1) * tokens for i, n in enumerate(active))
        dev = problem.device
        return SplitPlan(
            full, full.permuted(order.to(dev)), inverse.to(dev), order.to(dev), pages, active,
            ragged,
        )  # fmt: skip

    def attend(
        self, plan: Plan, state: SplitPlan, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        sp, p, pool = state, plan.problem, cache.data
        cdt, r = compute_dtype(p.dtype), p.mla_shape().kv_lora_rank
        packed, nope, pe = padded_query(query, sp.full, cdt)
        if packed is not None:  # permute one buffer and keep the halves as its views
            packed = packed[sp.order]
            nope, pe = packed[..., :r], packed[..., r:]
        else:
            nope, pe = nope[sp.order], pe[sp.order]
        idx = sp.index
        o, lse = empty_state(idx, p.num_heads, r, cdt, p.device)
        tokens = sp.split_pages * idx.page_size
        with self.scratch.use() as take:
            ws = take("kv", sp.active[0] * tokens * pool.shape[-1], pool.dtype, pool.device)
            for i, n in enumerate(sp.active):
                start = i * tokens
                pages = idx.pages[:n, i * sp.split_pages : (i + 1) * sp.split_pages]
                kv = gather_pages(pool, pages, out=ws)
                if sp.ragged[i]:
                    zero_invalid(kv, start, idx.kv_lens[:n])
                mask = visible(idx.limits[:n], start, kv.shape[1])
                qn = (None if packed is None else packed[:n], nope[:n], pe[:n])
                o_s, lse_s = attend_latent(qn, kv.to(cdt), mask, p.sm_scale, r)
                o[:n], lse[:n] = merge_states(o[:n], lse[:n], o_s, lse_s)
        return padded_result(o[sp.inverse], lse[sp.inverse], sp.full, p.dtype)
