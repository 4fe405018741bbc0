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

from kvplane.attention.backends.torch_mla import (
    CPU_DTYPES,
    attend_latent,
    check_inputs,
    compute_dtype,
    empty_result,
    padded_query,
)
from kvplane.attention.base import Capabilities, Plan, Verdict, plan_state, verdict
from kvplane.attention.paged import (
    BatchIndex,
    build_batch_index,
    gather_pages,
    merge_states,
    unpad_rows,
    visible,
    zero_invalid,
)
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult, LSEBase
from kvplane.errors import InvalidArgumentError

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


class TorchSplitKVBackend:
    """Split-KV absorbed MLA; ``split_tokens`` fixes the split length (rounded up to pages)."""

    def __init__(self, split_tokens: int | None = None) -> None:
        if split_tokens is not None and (
            isinstance(split_tokens, bool) or not isinstance(split_tokens, int) or split_tokens < 1
        ):
            raise InvalidArgumentError(f"split_tokens must be a positive int, got {split_tokens!r}")
        self._split_tokens = split_tokens
        self._caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA}),
            devices=frozenset({"cpu", "cuda"}),
            dtypes=CPU_DTYPES,
            lse_base=LSEBase.E,
        )

    @property
    def name(self) -> str:
        return NAME

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def check(self, problem: AttentionProblem) -> Verdict:
        return verdict(self._caps.reasons(problem))

    def plan(self, problem: AttentionProblem) -> Plan:
        s = problem.metadata.structure()
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
        state = SplitPlan(
            full,
            full.permuted(order.to(dev)),
            inverse.to(dev),
            order.to(dev),
            pages,
            active,
            ragged,
        )
        return Plan(NAME, problem, s, state)

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult:
        sp = plan_state(plan, NAME, SplitPlan)
        q, c = check_inputs(plan, query, cache)
        shape = plan.problem.mla_shape()
        done = empty_result(plan, shape.v_dim)
        if done is not None:
            return done
        cdt = compute_dtype(plan.problem.dtype)
        r = shape.kv_lora_rank
        packed, nope, pe = padded_query(q, sp.full, cdt)
        if packed is not None:  # permute one buffer and keep the halves as its views
            packed = packed[sp.order]
            nope, pe = packed[..., :r], packed[..., r:]
        else:
            nope, pe = nope[sp.order], pe[sp.order]
        idx = sp.index
        b, t, h = idx.batch, idx.t_max, shape.num_heads
        o = torch.zeros((b, t, h, r), dtype=cdt, device=plan.problem.device)
        lse = torch.full((b, t, h), float("-inf"), dtype=cdt, device=plan.problem.device)
        tokens = sp.split_pages * idx.page_size
        ws = torch.empty(
            sp.active[0] * tokens * c.data.shape[-1], dtype=c.data.dtype, device=c.data.device
        ) if sp.active else None  # fmt: skip
        for i, n in enumerate(sp.active):
            start = i * tokens
            pages = idx.pages[:n, i * sp.split_pages : (i + 1) * sp.split_pages]
            kv = gather_pages(c.data, pages, out=ws)
            if sp.ragged[i]:
                zero_invalid(kv, start, idx.kv_lens[:n])
            mask = visible(idx.limits[:n], start, kv.shape[1])
            qn = (None if packed is None else packed[:n], nope[:n], pe[:n])
            o_s, lse_s = attend_latent(qn, kv.to(cdt), mask, plan.problem.sm_scale, r)
            o[:n], lse[:n] = merge_states(o[:n], lse[:n], o_s, lse_s)
        o, lse = o[sp.inverse], lse[sp.inverse]
        out = unpad_rows(o, sp.full).to(plan.problem.dtype)
        return AttentionResult(out, unpad_rows(lse, sp.full).float(), LSEBase.E)
