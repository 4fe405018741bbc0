"""``mha``: non-absorbed MLA for prefill: decompress the latent KV per head, then plain MHA.

For prefill, queries are many and the context is mostly the new tokens, so decompressing
``k_nope = c_kv @ w_uk`` and ``v = c_kv @ w_uv`` per head (``d_nope``/``d_v`` wide instead of
``r``) is cheaper than absorbing every query into the latent space. The gathered latent
``[B, S, r + p]`` is decompressed in the compute dtype; logits are
``q_nope . k_nope + q_pe . k_pe`` (``k_pe`` shared by all heads). Output ``[T, H, d_v]``; its LSE
equals the absorbed path's because the logits are mathematically identical.
"""

from __future__ import annotations

import torch

from kvplane.attention.backends.torch_mla import (
    CPU_DTYPES,
    check_inputs,
    compute_dtype,
    empty_result,
)
from kvplane.attention.base import Capabilities, Plan, Verdict, plan_state, verdict
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
from kvplane.errors import BackendError

NAME = "mha"


class MHABackend:
    """Non-absorbed (decompressed) MLA; see the module docstring."""

    def __init__(self) -> None:
        self._caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA_MHA}),
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
        index = build_batch_index(problem.metadata, s, problem.causal, problem.device)
        return Plan(NAME, problem, s, index)

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult:
        index = plan_state(plan, NAME, BatchIndex)
        q, c = check_inputs(plan, query, cache)
        shape = plan.problem.mla_shape()
        done = empty_result(plan, shape.v_dim)
        if done is not None:
            return done
        if c.up_proj is None:
            raise BackendError("mha needs the cache's up_proj weights")
        cdt = compute_dtype(plan.problem.dtype)
        r = shape.kv_lora_rank
        kv = gather_pages(c.data, index.pages)
        zero_invalid(kv, 0, index.kv_lens)
        kv = kv.to(cdt)
        ckv, kpe = kv[..., :r], kv[..., r:]
        k_nope = torch.einsum("bsr,hrd->bhsd", ckv, c.up_proj.w_uk.to(cdt))
        values = torch.einsum("bsr,hrv->bhsv", ckv, c.up_proj.w_uv.to(cdt))
        qn = pad_queries(q.nope, index).to(cdt)  # [B, t, H, d_nope]
        qp = pad_queries(q.pe, index).to(cdt)  # [B, t, H, p]
        scores = torch.einsum("bthd,bhsd->bths", qn, k_nope)
        scores += torch.einsum("bthp,bsp->bths", qp, kpe)
        scores.mul_(plan.problem.sm_scale)
        probs, lse = softmax_lse(scores, visible(index.limits, 0, kv.shape[1]))
        o = torch.einsum("bths,bhsv->bthv", probs, values)
        out = unpad_rows(o, index).to(plan.problem.dtype)
        return AttentionResult(out, unpad_rows(lse, index).float(), LSEBase.E)
