"""``mha``: non-absorbed MLA for prefill: decompress the latent KV per head, then plain MHA.

Its LSE equals the absorbed path's. See docs/attention.md.
"""

from __future__ import annotations

import torch

from kvplane.attention.backends.common import (
    GROUP_BYTES,
    GroupedMLABackend,
    GroupKV,
    attend_groups,
    compute_dtype,
    torch_capabilities,
)
from kvplane.attention.backends.torch_mla import padded_query
from kvplane.attention.base import Plan
from kvplane.attention.inputs import MLAKVCache, MLAQuery
from kvplane.attention.paged import GroupedBatch, softmax_lse, visible
from kvplane.attention.problem import AttentionKind, AttentionResult
from kvplane.errors import BackendError

NAME = "mha"


class MHABackend(GroupedMLABackend):
    """Non-absorbed (decompressed) MLA; see the module docstring."""

    def __init__(self, group_bytes: int = GROUP_BYTES) -> None:
        super().__init__(NAME, torch_capabilities(AttentionKind.MLA_MHA), group_bytes)

    def attend(
        self, plan: Plan, state: GroupedBatch, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        up = cache.up_proj
        if up is None:
            raise BackendError("mha needs the cache's up_proj weights")
        p, index, shape = plan.problem, state.index, plan.problem.mla_shape()
        cdt, r = compute_dtype(p.dtype), shape.kv_lora_rank
        w_uk, w_uv = up.w_uk.to(cdt), up.w_uv.to(cdt)
        _, qn, qp = padded_query(query, index, cdt)  # [B, t, H, d_nope], [B, t, H, p]

        def one_group(part: GroupKV) -> tuple[torch.Tensor, torch.Tensor]:
            rows, kv = part.rows, part.kv[0]
            ckv, kpe = kv[..., :r], kv[..., r:]
            k_nope = torch.einsum("bsr,hrd->bhsd", ckv, w_uk)
            values = torch.einsum("bsr,hrv->bhsv", ckv, w_uv)
            scores = torch.einsum("bthd,bhsd->bths", qn[rows], k_nope)
            scores += torch.einsum("bthp,bsp->bths", qp[rows], kpe)
            scores.mul_(p.sm_scale)
            probs, lse = softmax_lse(
                scores, visible(index.limits[rows], part.start, part.tokens, p.window)
            )
            return torch.einsum("bths,bhsv->bthv", probs, values), lse

        return attend_groups(
            self.scratch, plan, state, one_group, pools=(cache.data,), dtype=cdt, v_dim=shape.v_dim
        )
