"""``gqa_torch``: vectorised GQA/MHA paged attention for prefill and decode.

Request groups gathered into reused scratch; query heads grouped per KV head, so K/V are never
repeated per query head. See docs/attention.md.
"""

from __future__ import annotations

import torch

from kvplane.attention.backends.common import (
    GROUP_BYTES,
    GQABackend,
    GroupKV,
    attend_groups,
    compute_dtype,
    grouped_batch,
    torch_capabilities,
)
from kvplane.attention.base import Plan
from kvplane.attention.inputs import GQAKVCache, GQAQuery
from kvplane.attention.metadata import PagedStructure
from kvplane.attention.paged import GroupedBatch, pad_queries, softmax_lse, visible
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult
from kvplane.validators import require_int

NAME = "gqa_torch"


class GQATorchBackend(GQABackend[GroupedBatch]):
    """Vectorised padded batch, group by group; query heads grouped per KV head."""

    def __init__(self, group_bytes: int = GROUP_BYTES) -> None:
        super().__init__(NAME, torch_capabilities(AttentionKind.GQA), GroupedBatch)
        self.group_bytes = require_int("group_bytes", group_bytes, min=1)

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> GroupedBatch:
        shape = problem.gqa_shape()
        width = 2 * shape.num_kv_heads * shape.head_dim  # K and V
        return grouped_batch(problem, structure, width, self.group_bytes)

    def attend(
        self, plan: Plan, state: GroupedBatch, query: GQAQuery, cache: GQAKVCache
    ) -> AttentionResult:
        p, index, shape = plan.problem, state.index, plan.problem.gqa_shape()
        cdt = compute_dtype(p.dtype)
        b, t, d = index.batch, index.t_max, shape.head_dim
        hkv, group = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
        qg = pad_queries(query.q, index).to(cdt).view(b, t, hkv, group, d)

        def one_group(part: GroupKV) -> tuple[torch.Tensor, torch.Tensor]:
            rows, (keys, vals) = part.rows, part.kv
            n = keys.shape[0]
            scores = torch.einsum("btkgd,bskd->btkgs", qg[rows], keys)
            scores = scores.reshape(n, t, shape.num_heads, part.tokens).mul_(p.sm_scale)
            probs, lse = softmax_lse(
                scores, visible(index.limits[rows], part.start, part.tokens, p.window)
            )
            pg = probs.view(n, t, hkv, group, part.tokens)
            return torch.einsum("btkgs,bskd->btkgd", pg, vals).reshape(n, t, -1, d), lse

        return attend_groups(
            self.scratch, plan, state, one_group, pools=(cache.k, cache.v), dtype=cdt, v_dim=d
        )
