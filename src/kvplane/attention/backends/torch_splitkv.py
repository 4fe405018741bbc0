"""``torch_splitkv``: split-KV (flash-decoding) absorbed MLA for long contexts.

An in-place online softmax over cache-sized splits, masked only where a split needs it; memory
``O(B x split)``. See docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.attention.backends.common import (
    MLABackend,
    compute_dtype,
    torch_capabilities,
)
from kvplane.attention.backends.torch_mla import padded_query
from kvplane.attention.base import Plan
from kvplane.attention.inputs import MLAKVCache, MLAQuery
from kvplane.attention.metadata import PagedStructure
from kvplane.attention.paged import (
    BatchIndex,
    build_batch_index,
    gather_pages,
    padded_result,
    visible,
    zero_invalid,
)
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    window_starts,
)
from kvplane.validators import require_int

NAME = "torch_splitkv"
TARGET_SPLIT_BYTES = 8 << 20
"""Aim for one split of the whole batch to fill about this many bytes of gathered KV."""
MIN_SPLIT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Unsorted and sorted batch indexes, the permutations, pages per split and, per split, the
    active requests (a sorted prefix), whether it holds positions past some active request's end
    or below its ``lows`` (``ragged``: zero them), whether some active real row sees fewer keys
    than it holds (``masked``: apply the visibility mask; padding rows may see anything, they
    are dropped) and whether some real row sees any of its keys (``live``: else a sliding
    window has passed it by and it is skipped)."""

    full: BatchIndex
    index: BatchIndex
    inverse: torch.Tensor
    order: torch.Tensor
    split_pages: int
    active: tuple[int, ...]
    ragged: tuple[bool, ...]
    masked: tuple[bool, ...]
    live: tuple[bool, ...]


def split_pages_for(batch: int, row_bytes: int, page_size: int, max_pages: int) -> int:
    """Pages per split: about ``TARGET_SPLIT_BYTES`` for the batch, at least one page."""
    tokens = max(MIN_SPLIT_TOKENS, TARGET_SPLIT_BYTES // max(1, batch * row_bytes))
    return max(1, min(max_pages, tokens // page_size))


class _OnlineState:
    """The running ``(m, l, acc)`` (``l`` is ``total``) of the sorted batch, rows ``[n, t*H]``."""

    def __init__(self, batch: int, rows: int, v_dim: int, dtype: torch.dtype, dev: torch.device):
        self.m = torch.full((batch, rows), float("-inf"), dtype=dtype, device=dev)
        self.total = torch.zeros((batch, rows), dtype=dtype, device=dev)
        self.acc = torch.zeros((batch, rows, v_dim), dtype=dtype, device=dev)

    def fold(self, n: int, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Fold masked scores ``[n, rows, S]`` (consumed in place) and ``values [n, S, v]``."""
        m, total, acc = self.m[:n], self.total[:n], self.acc[:n]
        new = torch.maximum(m, scores.amax(dim=-1))
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        alpha = torch.exp(m - safe)
        scores.sub_(safe[..., None]).exp_()
        total.mul_(alpha).add_(scores.sum(dim=-1))
        acc.mul_(alpha[..., None]).baddbmm_(scores, values)
        m.copy_(new)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o [n, rows, v], lse [n, rows])``; rows that saw no key give ``0`` and ``-inf``."""
        empty = self.total == 0
        o = self.acc / torch.where(empty, torch.ones_like(self.total), self.total)[..., None]
        lse = torch.where(empty, torch.full_like(self.m, float("-inf")), self.m + self.total.log())
        return o, lse


class TorchSplitKVBackend(MLABackend[SplitPlan]):
    """Split-KV absorbed MLA; ``split_tokens`` fixes the split length (rounded up to pages)."""

    def __init__(self, split_tokens: int | None = None) -> None:
        if split_tokens is not None:
            require_int("split_tokens", split_tokens, min=1)
        super().__init__(NAME, torch_capabilities(AttentionKind.MLA), SplitPlan)
        self._split_tokens = split_tokens

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> SplitPlan:
        s = structure
        shape = problem.mla_shape()
        full = build_batch_index(
            problem.metadata, s, problem.causal, problem.device, problem.window
        )
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
        # padding rows (past a request's q_len) are discarded: they never call for a mask
        real = torch.arange(full.t_max)[None, :] < torch.tensor(s.q_lens, dtype=torch.long)[:, None]
        lim = full.limits.cpu()
        first = torch.where(real, window_starts(lim, problem.window), 0)[order]
        seen = (real & (lim > 0))[order]
        limits = torch.where(real, lim, s.max_kv_len)[order]
        n_splits = -(-s.max_kv_len // tokens)
        active = tuple(int((sorted_kv > i * tokens).sum()) for i in range(n_splits))
        lows = full.lows.cpu()[order]
        ragged = tuple(
            int(sorted_kv[n - 1]) < (i + 1) * tokens or bool((lows[:n] > i * tokens).any())
            for i, n in enumerate(active)
        )
        masked = tuple(
            bool((limits[:n] < (i + 1) * tokens).any() or (first[:n] > i * tokens).any())
            for i, n in enumerate(active)
        )
        live = tuple(
            bool((seen[:n] & (first[:n] < (i + 1) * tokens) & (limits[:n] > i * tokens)).any())
            for i, n in enumerate(active)
        )
        dev = problem.device
        return SplitPlan(
            full, full.permuted(order.to(dev)), inverse.to(dev), order.to(dev), pages, active,
            ragged, masked, live,
        )  # fmt: skip

    def attend(
        self, plan: Plan, state: SplitPlan, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        sp, p, pool = state, plan.problem, cache.data
        cdt, r = compute_dtype(p.dtype), p.mla_shape().kv_lora_rank
        idx, heads = sp.index, p.num_heads
        b, t = idx.batch, idx.t_max
        packed, nope, pe = padded_query(query, sp.full, cdt)
        if packed is not None:  # one scaled, sorted buffer: the scores are one matmul
            packed = (packed[sp.order] * p.sm_scale).view(b, t * heads, -1)
        else:
            nope = (nope[sp.order] * p.sm_scale).view(b, t * heads, r)
            pe = (pe[sp.order] * p.sm_scale).view(b, t * heads, -1)
        run = _OnlineState(b, t * heads, r, cdt, p.device)
        tokens = sp.split_pages * idx.page_size
        with self.scratch.use() as take:
            ws = take("kv", sp.active[0] * tokens * pool.shape[-1], pool.dtype, pool.device)
            sws = take("scores", sp.active[0] * t * heads * tokens, cdt, p.device)
            for i, n in enumerate(sp.active):
                if not sp.live[i]:
                    continue
                start = i * tokens
                pages = idx.pages[:n, i * sp.split_pages : (i + 1) * sp.split_pages]
                kv = gather_pages(pool, pages, out=ws)
                if sp.ragged[i]:
                    zero_invalid(kv, start, idx.kv_lens[:n], idx.lows[:n])
                kv = kv.to(cdt)
                width = kv.shape[1]
                scores = sws[: n * t * heads * width].view(n, t * heads, width)
                kt = kv.transpose(1, 2)
                if packed is not None:
                    torch.bmm(packed[:n], kt, out=scores)
                else:
                    torch.bmm(nope[:n], kt[:, :r], out=scores)
                    scores.baddbmm_(pe[:n], kt[:, r:])
                if sp.masked[i]:
                    mask = visible(idx.limits[:n], start, width, p.window)
                    scores.view(n, t, heads, width).masked_fill_(
                        ~mask[:, :, None, :], float("-inf")
                    )
                run.fold(n, scores, kv[..., :r])
        o, lse = run.result()
        o, lse = o.view(b, t, heads, r)[sp.inverse], lse.view(b, t, heads)[sp.inverse]
        return padded_result(o, lse, sp.full, p.dtype)
