"""``sdpa``: absorbed MLA through torch's fused CPU flash-attention kernel on gathered KV.

Heads are folded into the kernel's query rows; a short batch's KV is split and merged by LSE.
Needs a packed query. See docs/attention.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvplane.attention.backends.common import (
    GROUP_BYTES,
    GroupedMLABackend,
    GroupKV,
    attend_groups,
)
from kvplane.attention.base import Capabilities, Plan
from kvplane.attention.inputs import MLAKVCache, MLAQuery
from kvplane.attention.paged import (
    GroupedBatch,
    merge_splits,
    pad_queries,
    visible,
)
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    LSEBase,
    QueryLayout,
    window_starts,
)
from kvplane.errors import BackendError
from kvplane.validators import require_int

NAME = "sdpa"
_OP = "_scaled_dot_product_flash_attention_for_cpu"
MIN_SPLIT_TOKENS = 256
"""Shortest KV split worth a kernel work item of its own."""


def kv_splits(requests: int, tokens: int, page_size: int, items: int, min_tokens: int) -> int:
    """Equal page-aligned parts to cut each request's ``tokens`` KV positions into, so that a
    group of ``requests`` gives the kernel ``items`` work items (one per thread); parts of at
    least ``min_tokens``, and ``1`` when the group has work enough."""
    want = min(-(-items // requests), tokens // min_tokens)
    pages = tokens // page_size
    return max((k for k in range(1, want + 1) if pages % k == 0), default=1)


def split_attention(
    problem: AttentionProblem,
    q: torch.Tensor,
    kv: torch.Tensor,
    limits: torch.Tensor,
    *,
    masked: bool,
    splits: int,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on ``q [n, t, H, D]`` over ``kv [n, S, D]`` (key positions from ``start``)
    cut into ``splits`` equal parts, ``limits [n, t]`` keys visible per row (from its window
    start under the problem's sliding window): ``(out [n, splits, t, H, D], lse [n, splits, t,
    H])``, ``lse = -inf`` where a row sees nothing of a split."""
    n, t, h, d = q.shape
    s_len = kv.shape[1]
    part = s_len // splits
    k = kv.view(n * splits, 1, part, d).expand(n * splits, t, part, d)
    qs = q[:, None].expand(n, splits, t, h, d).reshape(n * splits, t, h, d)
    bias = None
    if masked:
        seen = visible(limits, start, s_len, problem.window)
        seen = seen.view(n, t, splits, part).transpose(1, 2)
        bias = torch.zeros(seen.shape, dtype=problem.dtype, device=problem.device)
        bias.masked_fill_(~seen, float("-inf"))
        bias = bias.reshape(n * splits, t, 1, part)
    op = getattr(torch.ops.aten, _OP)
    out, lse = op(qs, k, k, 0.0, False, attn_mask=bias, scale=problem.sm_scale)
    starts = start + torch.arange(splits, device=problem.device) * part
    first = window_starts(limits, problem.window)[:, None, :]
    empty = (limits[:, None, :] <= starts[None, :, None]) | (first >= starts[None, :, None] + part)
    lse = lse.view(n, splits, t, h).masked_fill(empty[..., None], float("-inf"))
    return out.view(n, splits, t, h, d), lse


class SDPABackend(GroupedMLABackend):
    """Absorbed MLA via the fused CPU flash kernel, heads folded; see the module docstring.

    ``work_items`` (default: torch's intra-op threads at run time) is how many kernel work
    items a group should offer; ``min_split_tokens`` the shortest KV split.
    """

    def __init__(
        self,
        group_bytes: int = GROUP_BYTES,
        *,
        min_split_tokens: int = MIN_SPLIT_TOKENS,
        work_items: int | None = None,
    ) -> None:
        caps = Capabilities(
            kinds=frozenset({AttentionKind.MLA}),
            devices=frozenset({"cpu"}),
            dtypes=frozenset({torch.float32, torch.bfloat16}),
            lse_base=LSEBase.E,
            query_layouts=frozenset({QueryLayout.PACKED}),
            sliding_window=True,
        )
        super().__init__(NAME, caps, group_bytes)
        self.min_split_tokens = require_int("min_split_tokens", min_split_tokens, min=1)
        self.work_items = (
            None if work_items is None else require_int("work_items", work_items, min=1)
        )

    def environment_reasons(self, problem: AttentionProblem) -> Sequence[str]:
        if hasattr(torch.ops.aten, _OP):
            return ()
        return (f"this torch build has no aten::{_OP} kernel",)

    def attend(
        self, plan: Plan, state: GroupedBatch, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        if query.packed_data is None:
            raise BackendError("sdpa needs a packed query")
        p, index = plan.problem, state.index
        qp = pad_queries(query.packed_data, index)  # [B, t, H, D]: t "heads" of H rows
        r = p.mla_shape().kv_lora_rank
        items = self.work_items if self.work_items is not None else torch.get_num_threads()

        def one_group(part: GroupKV) -> tuple[torch.Tensor, torch.Tensor]:
            rows = part.rows
            n = rows.stop - rows.start
            splits = kv_splits(n, part.tokens, index.page_size, items, self.min_split_tokens)
            out, split_lse = split_attention(
                p, qp[rows], part.kv[0], index.limits[rows], masked=part.masked, splits=splits,
                start=part.start,
            )  # fmt: skip
            return merge_splits(out[..., :r], split_lse)

        return attend_groups(
            self.scratch, plan, state, one_group, pools=(cache.data,), dtype=p.dtype, v_dim=r,
            state_dtype=torch.float32,
        )  # fmt: skip
