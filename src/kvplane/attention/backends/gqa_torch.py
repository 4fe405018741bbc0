"""``gqa_torch``: vectorised GQA/MHA paged attention for prefill and decode.

Serves varlen queries, bottom-right causality and prefix KV alike (the model writes the new
tokens' K/V into their pages first, then attends with ``q_len`` new tokens over
``kv_len = prefix + new`` positions). The padded batch's pages are gathered once and query heads
are grouped per KV head (head ``h`` reads KV head ``h // (Hq / Hkv)``), so K/V are never
repeated per query head.
"""

from __future__ import annotations

import torch

from kvplane.attention.backends.gqa_reference import GQABackendBase, gqa_empty, gqa_inputs
from kvplane.attention.backends.torch_mla import CPU_DTYPES, compute_dtype
from kvplane.attention.base import Capabilities, Plan, plan_state
from kvplane.attention.paged import (
    BatchIndex,
    build_batch_index,
    gather_pages,
    pad_queries,
    softmax_lse,
    unpad_rows,
    visible,
    zero_invalid,
)
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult, LSEBase


class GQATorchBackend(GQABackendBase):
    """Vectorised padded batch; query heads grouped per KV head."""

    def __init__(self) -> None:
        self._name = "gqa_torch"
        self._caps = Capabilities(
            kinds=frozenset({AttentionKind.GQA}),
            devices=frozenset({"cpu", "cuda"}),
            dtypes=CPU_DTYPES,
            lse_base=LSEBase.E,
        )

    def plan(self, problem: AttentionProblem) -> Plan:
        s = problem.metadata.structure()
        index = build_batch_index(problem.metadata, s, problem.causal, problem.device)
        return Plan(self._name, problem, s, index)

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult:
        index = plan_state(plan, self._name, BatchIndex)
        q, c = gqa_inputs(plan, query, cache)
        done = gqa_empty(plan)
        if done is not None:
            return done
        shape = plan.problem.gqa_shape()
        cdt = compute_dtype(plan.problem.dtype)
        keys = gather_pages(c.k, index.pages)  # [B, S, Hkv, D]
        vals = gather_pages(c.v, index.pages)
        zero_invalid(keys, 0, index.kv_lens)
        zero_invalid(vals, 0, index.kv_lens)
        keys, vals = keys.to(cdt), vals.to(cdt)
        b, t = index.batch, index.t_max
        hkv, group = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
        qg = pad_queries(q.q, index).to(cdt).view(b, t, hkv, group, shape.head_dim)
        scores = torch.einsum("btkgd,bskd->btkgs", qg, keys).reshape(b, t, shape.num_heads, -1)
        scores.mul_(plan.problem.sm_scale)
        probs, lse = softmax_lse(scores, visible(index.limits, 0, keys.shape[1]))
        pg = probs.view(b, t, hkv, group, -1)
        o = torch.einsum("btkgs,bskd->btkgd", pg, vals).reshape(b, t, shape.num_heads, -1)
        out = unpad_rows(o, index).to(plan.problem.dtype)
        return AttentionResult(out, unpad_rows(lse, index).float(), LSEBase.E)
