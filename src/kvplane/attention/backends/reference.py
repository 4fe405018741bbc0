"""``reference``: the MLA oracle, float64, request by request, straight from the block table.

Deliberately independent of the padded-batch machinery the fast backends share: for each
request it reads exactly its first ``kv_len`` positions through its page list, computes logits
in float64 (latent space for absorbed MLA; decompressed per head through the cache's
``up_proj`` for non-absorbed MLA), applies the bottom-right causal mask, and returns the output
in the query dtype with a float32 base-e LSE. Slow by design; ``measured`` never times it.
"""

from __future__ import annotations

import torch

from kvplane.attention.backends.torch_mla import check_inputs, empty_result
from kvplane.attention.base import Capabilities, Plan, Verdict, plan_state, verdict
from kvplane.attention.inputs import FLOAT_DTYPES
from kvplane.attention.metadata import DensePageTable
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult, LSEBase

NAME = "reference"


def causal_bias(q_len: int, kv_len: int, causal: bool, device: torch.device) -> torch.Tensor:
    """``[q_len, kv_len]`` float64 additive mask: 0 where query ``i`` sees key ``j``, else -inf."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    seen = (j <= kv_len - q_len + i) if causal else torch.ones_like(i * j, dtype=torch.bool)
    bias = torch.zeros((q_len, kv_len), dtype=torch.float64, device=device)
    return bias.masked_fill(~seen, float("-inf"))


def softmax64(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim of float64 ``logits [t, H, S]``; empty rows give 0 / -inf."""
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(logits - safe[..., None])
    return p, lse


def request_rows(pool: torch.Tensor, table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` token rows of one request, ``[kv_len, ...]`` float64."""
    page_size = pool.shape[1]
    need = -(-kv_len // page_size)
    pages = table[:need].long()
    return pool[pages].reshape(need * page_size, *pool.shape[2:])[:kv_len].double()


class ReferenceBackend:
    """The float64 MLA oracle (absorbed and non-absorbed); see the module docstring."""

    def __init__(self) -> None:
        self._caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA, AttentionKind.MLA_MHA}),
            devices=frozenset({"cpu", "cuda"}),
            dtypes=frozenset(FLOAT_DTYPES),
            lse_base=LSEBase.E,
            oracle=True,
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
        return Plan(NAME, problem, s, problem.metadata.dense())

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult:
        dense = plan_state(plan, NAME, DensePageTable)
        q, c = check_inputs(plan, query, cache)
        shape = plan.problem.mla_shape()
        done = empty_result(plan, shape.v_dim)
        if done is not None:
            return done
        s, p = plan.structure, plan.problem
        r = shape.kv_lora_rank
        out = torch.zeros((s.num_tokens, p.num_heads, shape.v_dim), dtype=p.dtype, device=p.device)
        lse = torch.full((s.num_tokens, p.num_heads), float("-inf"), device=p.device)
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(s.q_lens, s.kv_lens, strict=True)):
            end = start + q_len
            if q_len and kv_len:
                rows = request_rows(c.data, dense.block_table[b], kv_len)
                ckv, kpe = rows[:, :r], rows[:, r:]
                qn, qp = q.nope[start:end].double(), q.pe[start:end].double()
                logits = torch.einsum("thp,sp->ths", qp, kpe)
                if c.up_proj is not None and shape.qk_nope_dim is not None:
                    k_nope = torch.einsum("sr,hrd->hsd", ckv, c.up_proj.w_uk.double())
                    values = torch.einsum("sr,hrv->hsv", ckv, c.up_proj.w_uv.double())
                    logits += torch.einsum("thd,hsd->ths", qn, k_nope)
                else:
                    values = ckv[None].expand(p.num_heads, kv_len, r)
                    logits += torch.einsum("thr,sr->ths", qn, ckv)
                logits = (
                    logits * p.sm_scale + causal_bias(q_len, kv_len, p.causal, p.device)[:, None]
                )
                probs, row_lse = softmax64(logits)
                out[start:end] = torch.einsum("ths,hsv->thv", probs, values).to(p.dtype)
                lse[start:end] = row_lse.float()
            start = end
        return AttentionResult(out, lse, LSEBase.E)
