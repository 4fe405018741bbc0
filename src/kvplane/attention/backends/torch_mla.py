"""``torch``: absorbed MLA in latent space on any torch device (gather pages, matmul, softmax).

The whole padded batch is gathered at once (``[B, pages * page_size, r + p]``), so memory grows
with ``B x max kv_len``; ``torch_splitkv`` bounds it for long contexts. Low-precision inputs are
computed in float32; the output is cast back to the query dtype, the LSE is float32 base e.
"""

from __future__ import annotations

import torch

from kvplane.attention.base import Capabilities, Plan, Verdict, plan_state, verdict
from kvplane.attention.inputs import MLAKVCache, MLAQuery
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
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    LSEBase,
)
from kvplane.errors import BackendError

NAME = "torch"
CPU_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Low-precision inputs are computed in float32; float32/64 stay as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def padded_query(
    query: MLAQuery, index: BatchIndex, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(packed or None, nope, pe)`` padded to ``[B, t_max, H, *]`` in ``dtype``.

    A packed query is padded once and split by views, so both halves stay one buffer.
    """
    if query.packed_data is not None:
        packed = pad_queries(query.packed_data, index).to(dtype)
        r = query.nope_dim
        return packed, packed[..., :r], packed[..., r:]
    nope = pad_queries(query.nope, index).to(dtype)
    return None, nope, pad_queries(query.pe, index).to(dtype)


def attend_latent(
    q: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    mask: torch.Tensor,
    sm_scale: float,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention of padded queries over gathered KV.

    ``q`` = ``(packed [n, t, H, r+p] | None, nope [n, t, H, r], pe [n, t, H, p])``, ``kv [n, S,
    r+p]`` (same dtype, positions past ``kv_len`` already zeroed), ``mask [n, t, S]``. Returns
    ``(o [n, t, H, r], lse [n, t, H])`` in the compute dtype, LSE base e.
    """
    packed, nope, pe = q
    n, t, h = nope.shape[:3]
    s_len = kv.shape[1]
    kt = kv.transpose(1, 2)
    if packed is not None:
        scores = torch.matmul(packed.reshape(n, t * h, -1), kt)
    else:
        scores = torch.matmul(nope.reshape(n, t * h, rank), kt[:, :rank])
        scores.add_(torch.matmul(pe.reshape(n, t * h, -1), kt[:, rank:]))
    scores = scores.view(n, t, h, s_len).mul_(sm_scale)
    p, lse = softmax_lse(scores, mask)
    o = torch.matmul(p.view(n, t * h, s_len), kv[..., :rank]).view(n, t, h, rank)
    return o, lse


def check_inputs(plan: Plan, query: object, cache: object) -> tuple[MLAQuery, MLAKVCache]:
    plan.problem.validate_inputs(query, cache)
    if not isinstance(query, MLAQuery) or not isinstance(cache, MLAKVCache):
        raise BackendError(
            "MLA backends need MLAQuery and MLAKVCache"
        )  # unreachable after validate
    return query, cache


def empty_result(plan: Plan, v_dim: int) -> AttentionResult | None:
    """The result when there is nothing to attend to (no query token or no KV at all): zeros
    and ``lse = -inf``; ``None`` otherwise."""
    s = plan.structure
    if s.num_tokens and s.max_kv_len:
        return None
    p = plan.problem
    out = torch.zeros((s.num_tokens, p.num_heads, v_dim), dtype=p.dtype, device=p.device)
    lse = torch.full((s.num_tokens, p.num_heads), float("-inf"), device=p.device)
    return AttentionResult(out, lse, LSEBase.E)


class TorchMLABackend:
    """Absorbed MLA, whole batch at once; see the module docstring."""

    def __init__(self) -> None:
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
        index = build_batch_index(problem.metadata, s, problem.causal, problem.device)
        return Plan(NAME, problem, s, index)

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult:
        index = plan_state(plan, NAME, BatchIndex)
        q, c = check_inputs(plan, query, cache)
        shape = plan.problem.mla_shape()
        done = empty_result(plan, shape.v_dim)
        if done is not None:
            return done
        cdt = compute_dtype(plan.problem.dtype)
        kv = gather_pages(c.data, index.pages)
        zero_invalid(kv, 0, index.kv_lens)
        kv = kv.to(cdt)
        mask = visible(index.limits, 0, kv.shape[1])
        qp = padded_query(q, index, cdt)
        o, lse = attend_latent(qp, kv, mask, plan.problem.sm_scale, shape.kv_lora_rank)
        out = unpad_rows(o, index).to(plan.problem.dtype)
        return AttentionResult(out, unpad_rows(lse, index).float(), LSEBase.E)
