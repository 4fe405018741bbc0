"""``torch``: absorbed MLA in latent space on any torch device (gather pages, matmul, softmax).

Request groups bounded by :data:`GROUP_BYTES`; float32 arithmetic, base-e LSE. See
docs/attention.md.
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
from kvplane.attention.base import Plan
from kvplane.attention.inputs import MLAKVCache, MLAQuery
from kvplane.attention.paged import BatchIndex, GroupedBatch, pad_queries, softmax_lse, visible
from kvplane.attention.problem import AttentionKind, AttentionResult

NAME = "torch"


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


class TorchMLABackend(GroupedMLABackend):
    """Absorbed MLA, group by group; see the module docstring."""

    def __init__(self, group_bytes: int = GROUP_BYTES) -> None:
        super().__init__(NAME, torch_capabilities(AttentionKind.MLA), group_bytes)

    def attend(
        self, plan: Plan, state: GroupedBatch, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        p, index = plan.problem, state.index
        r, cdt = p.mla_shape().kv_lora_rank, compute_dtype(p.dtype)
        packed, nope, pe = padded_query(query, index, cdt)

        def one_group(part: GroupKV) -> tuple[torch.Tensor, torch.Tensor]:
            rows = part.rows
            q = (None if packed is None else packed[rows], nope[rows], pe[rows])
            mask = visible(index.limits[rows], part.start, part.tokens, p.window)
            return attend_latent(q, part.kv[0], mask, p.sm_scale, r)

        return attend_groups(
            self.scratch, plan, state, one_group, pools=(cache.data,), dtype=cdt, v_dim=r
        )
