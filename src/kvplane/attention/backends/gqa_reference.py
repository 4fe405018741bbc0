"""``gqa_reference``: the GQA/MHA oracle, float64, request by request, over K/V pools.

Query head ``h`` reads KV head ``h // (Hq / Hkv)``.
"""

from __future__ import annotations

import torch

from kvplane.attention.backends.common import GQABackend
from kvplane.attention.backends.reference import (
    oracle_attend,
    oracle_capabilities,
    request_rows,
)
from kvplane.attention.base import Plan
from kvplane.attention.inputs import GQAKVCache, GQAQuery
from kvplane.attention.metadata import DensePageTable, PagedStructure
from kvplane.attention.problem import AttentionKind, AttentionProblem, AttentionResult

NAME = "gqa_reference"


class GQAReferenceBackend(GQABackend[DensePageTable]):
    """Float64 oracle, request by request."""

    def __init__(self) -> None:
        super().__init__(NAME, oracle_capabilities(AttentionKind.GQA), DensePageTable)

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> DensePageTable:
        return problem.metadata.dense()

    def attend(
        self, plan: Plan, state: DensePageTable, query: GQAQuery, cache: GQAKVCache
    ) -> AttentionResult:
        shape = plan.problem.gqa_shape()
        group = shape.num_heads // shape.num_kv_heads

        def request(b: int, rows: slice, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
            table = state.block_table[b]
            keys = request_rows(cache.k, table, kv_len).repeat_interleave(group, 1)
            values = request_rows(cache.v, table, kv_len).repeat_interleave(group, 1)
            logits = torch.einsum("thd,shd->ths", query.q[rows].double(), keys)
            return logits, values.transpose(0, 1)  # [H, kv_len, d]

        return oracle_attend(plan, shape.head_dim, request)
