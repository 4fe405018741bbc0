"""``gqa_reference``: the GQA/MHA oracle, float64, request by request, over K/V pools.

Query head ``h`` reads KV head ``h // (Hq / Hkv)``. Also home of the helpers the GQA backends
share (input checks, the empty-batch result, the common capability plumbing).
"""

from __future__ import annotations

import torch

from kvplane.attention.backends.reference import causal_bias, request_rows, softmax64
from kvplane.attention.base import Capabilities, Plan, Verdict, plan_state, verdict
from kvplane.attention.inputs import FLOAT_DTYPES, GQAKVCache, GQAQuery
from kvplane.attention.metadata import DensePageTable
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult, LSEBase
from kvplane.errors import BackendError


def gqa_inputs(plan: Plan, query: object, cache: object) -> tuple[GQAQuery, GQAKVCache]:
    plan.problem.validate_inputs(query, cache)
    if not isinstance(query, GQAQuery) or not isinstance(cache, GQAKVCache):
        raise BackendError("GQA backends need GQAQuery and GQAKVCache")  # unreachable
    return query, cache


def gqa_empty(plan: Plan) -> AttentionResult | None:
    s, p = plan.structure, plan.problem
    if s.num_tokens and s.max_kv_len:
        return None
    d = p.gqa_shape().head_dim
    out = torch.zeros((s.num_tokens, p.num_heads, d), dtype=p.dtype, device=p.device)
    lse = torch.full((s.num_tokens, p.num_heads), float("-inf"), device=p.device)
    return AttentionResult(out, lse, LSEBase.E)


class GQABackendBase:
    _name: str
    _caps: Capabilities

    @property
    def name(self) -> str:
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def check(self, problem: AttentionProblem) -> Verdict:
        return verdict(self._caps.reasons(problem))


class GQAReferenceBackend(GQABackendBase):
    """Float64 oracle, request by request."""

    def __init__(self) -> None:
        self._name = "gqa_reference"
        self._caps = Capabilities(
            kinds=frozenset({AttentionKind.GQA}),
            devices=frozenset({"cpu", "cuda"}),
            dtypes=frozenset(FLOAT_DTYPES),
            lse_base=LSEBase.E,
            oracle=True,
        )

    def plan(self, problem: AttentionProblem) -> Plan:
        return Plan(self._name, problem, problem.metadata.structure(), problem.metadata.dense())

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult:
        dense = plan_state(plan, self._name, DensePageTable)
        q, c = gqa_inputs(plan, query, cache)
        done = gqa_empty(plan)
        if done is not None:
            return done
        s, p, shape = plan.structure, plan.problem, plan.problem.gqa_shape()
        group = shape.num_heads // shape.num_kv_heads
        out = torch.zeros(
            (s.num_tokens, p.num_heads, shape.head_dim), dtype=p.dtype, device=p.device
        )
        lse = torch.full((s.num_tokens, p.num_heads), float("-inf"), device=p.device)
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(s.q_lens, s.kv_lens, strict=True)):
            end = start + q_len
            if q_len and kv_len:
                keys = request_rows(c.k, dense.block_table[b], kv_len).repeat_interleave(group, 1)
                vals = request_rows(c.v, dense.block_table[b], kv_len).repeat_interleave(group, 1)
                logits = torch.einsum("thd,shd->ths", q.q[start:end].double(), keys) * p.sm_scale
                logits = logits + causal_bias(q_len, kv_len, p.causal, p.device)[:, None]
                probs, row_lse = softmax64(logits)
                out[start:end] = torch.einsum("ths,shd->thd", probs, vals).to(p.dtype)
                lse[start:end] = row_lse.float()
            start = end
        return AttentionResult(out, lse, LSEBase.E)
