"""``sdpa``: absorbed MLA through torch's fused CPU flash-attention kernel on gathered KV.

The public ``scaled_dot_product_attention`` returns no LSE, so this backend calls the CPU
flash kernel behind it (``aten::_scaled_dot_product_flash_attention_for_cpu``), which returns
``(out, logsumexp)``. That kernel needs one head dim for Q, K and V, so the gathered latent KV
``[B, S, r + p]`` is passed as both K and V (one head, expanded to ``H`` without a copy) and the
output's first ``r`` columns are the latent output. Bottom-right causality and ``kv_len`` are an
additive ``-inf`` mask. Needs a packed query (split inputs fall through to another backend). A
torch build without the kernel makes ``check`` report Unsupported.
"""

from __future__ import annotations

import torch

from kvplane.attention.backends.torch_mla import check_inputs, empty_result
from kvplane.attention.base import Capabilities, Plan, Verdict, plan_state, verdict
from kvplane.attention.paged import (
    BatchIndex,
    build_batch_index,
    gather_pages,
    pad_queries,
    unpad_rows,
    visible,
    zero_invalid,
)
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    LSEBase,
    QueryLayout,
)
from kvplane.errors import BackendError

NAME = "sdpa"
_OP = "_scaled_dot_product_flash_attention_for_cpu"


class SDPABackend:
    """Absorbed MLA via the fused CPU flash kernel; see the module docstring."""

    def __init__(self) -> None:
        self._caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA}),
            devices=frozenset({"cpu"}),
            dtypes=frozenset({torch.float32, torch.bfloat16}),
            lse_base=LSEBase.E,
            query_layouts=frozenset({QueryLayout.PACKED}),
        )

    @property
    def name(self) -> str:
        return NAME

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def check(self, problem: AttentionProblem) -> Verdict:
        reasons = list(self._caps.reasons(problem))
        if not hasattr(torch.ops.aten, _OP):
            reasons.append(f"this torch build has no aten::{_OP} kernel")
        return verdict(reasons)

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
        if q.packed_data is None:
            raise BackendError("sdpa needs a packed query")
        dtype = plan.problem.dtype
        kv = gather_pages(c.data, index.pages)
        zero_invalid(kv, 0, index.kv_lens)
        b, s_len, d = kv.shape
        h = shape.num_heads
        qp = pad_queries(q.packed_data, index).transpose(1, 2)  # [B, H, t, D]
        k = kv[:, None].expand(b, h, s_len, d)
        seen = visible(index.limits, 0, s_len)
        bias = torch.zeros(seen.shape, dtype=dtype, device=kv.device)
        bias.masked_fill_(~seen, float("-inf"))
        op = getattr(torch.ops.aten, _OP)
        out, lse = op(qp, k, k, 0.0, False, attn_mask=bias[:, None], scale=plan.problem.sm_scale)
        out = out[..., : shape.kv_lora_rank].transpose(1, 2)  # [B, t, H, r]
        lse = lse.transpose(1, 2).float()  # [B, t, H]
        empty = (index.limits == 0)[:, :, None]  # rows that see nothing: 0 / -inf
        out = out.masked_fill(empty[..., None], 0)
        lse = lse.masked_fill(empty, float("-inf"))
        return AttentionResult(unpad_rows(out, index).to(dtype), unpad_rows(lse, index), LSEBase.E)
