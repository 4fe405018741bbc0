"""``reference``: the MLA oracle, float64, request by request, straight from the block table.

Deliberately independent of the padded-batch machinery the fast backends share: for each
request it reads exactly its first ``kv_len`` positions through its page list, computes logits
in float64 (latent space for absorbed MLA; decompressed per head through the cache's
``up_proj`` for non-absorbed MLA), applies the bottom-right causal (and sliding-window) mask,
and returns the output in the query dtype with a float32 base-e LSE. Slow by design;
``measured`` never times it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvplane.attention.backends.common import MLABackend
from kvplane.attention.base import Capabilities, Plan
from kvplane.attention.inputs import FLOAT_DTYPES, MLAKVCache, MLAQuery
from kvplane.attention.metadata import DensePageTable, PagedStructure
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    LSEBase,
    window_starts,
)

NAME = "reference"


def causal_bias(
    q_len: int, kv_len: int, causal: bool, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """``[q_len, kv_len]`` float64 additive mask: 0 where query ``i`` sees key ``j``, else -inf.
    Query ``i`` sits at position ``p = kv_len - q_len + i``; causal: ``j <= p``; a ``window``
    also needs ``j`` from :func:`~kvplane.attention.problem.window_starts` of limit ``p + 1``
    on (``j > p - window``)."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    pos = kv_len - q_len + i
    seen = (j <= pos) if causal else torch.ones_like(i * j, dtype=torch.bool)
    if window is not None:
        seen = seen & (j >= window_starts(pos + 1, window))
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


def oracle_capabilities(*kinds: AttentionKind) -> Capabilities:
    """A float64 oracle's capabilities: ``kinds`` on CPU or CUDA in any float dtype."""
    return Capabilities(
        kinds=frozenset(kinds), devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset(FLOAT_DTYPES), lse_base=LSEBase.E, sliding_window=True, oracle=True,
    )  # fmt: skip


Request = Callable[[int, slice, int], tuple[torch.Tensor, torch.Tensor]]
"""``(b, token rows, kv_len) -> (logits [t, H, kv_len], values [H, kv_len, v])``, float64,
logits not yet scaled."""


def oracle_attend(plan: Plan, v_dim: int, request: Request) -> AttentionResult:
    """Attention request by request in float64: for every request with query tokens and KV,
    ``request`` gives its logits and values; scaling, the causal mask, the softmax and the
    output are done here. Output in the query dtype, LSE float32 base e."""
    s, p = plan.structure, plan.problem
    out = torch.zeros((s.num_tokens, p.num_heads, v_dim), dtype=p.dtype, device=p.device)
    lse = torch.full((s.num_tokens, p.num_heads), float("-inf"), device=p.device)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(s.q_lens, s.kv_lens, strict=True)):
        rows = slice(start, start + q_len)
        start += q_len
        if not (q_len and kv_len):
            continue
        logits, values = request(b, rows, kv_len)
        bias = causal_bias(q_len, kv_len, p.causal, p.device, p.window)
        logits = logits * p.sm_scale + bias[:, None]
        probs, row_lse = softmax64(logits)
        out[rows] = torch.einsum("ths,hsv->thv", probs, values).to(p.dtype)
        lse[rows] = row_lse.float()
    return AttentionResult(out, lse, LSEBase.E)


class ReferenceBackend(MLABackend[DensePageTable]):
    """The float64 MLA oracle (absorbed and non-absorbed); see the module docstring."""

    def __init__(self) -> None:
        caps = oracle_capabilities(AttentionKind.MLA, AttentionKind.MLA_MHA)
        super().__init__(NAME, caps, DensePageTable)

    def prepare(self, problem: AttentionProblem, structure: PagedStructure) -> DensePageTable:
        return problem.metadata.dense()

    def attend(
        self, plan: Plan, state: DensePageTable, query: MLAQuery, cache: MLAKVCache
    ) -> AttentionResult:
        shape = plan.problem.mla_shape()
        r, up = shape.kv_lora_rank, cache.up_proj if not shape.absorbed else None

        def request(b: int, rows: slice, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
            latent = request_rows(cache.data, state.block_table[b], kv_len)
            ckv, kpe = latent[:, :r], latent[:, r:]
            q_nope, q_pe = query.nope[rows].double(), query.pe[rows].double()
            logits = torch.einsum("thp,sp->ths", q_pe, kpe)
            if up is None:  # absorbed: latent queries, the latent is the value
                logits += torch.einsum("thr,sr->ths", q_nope, ckv)
                return logits, ckv[None].expand(shape.num_heads, kv_len, r)
            k_nope = torch.einsum("sr,hrd->hsd", ckv, up.w_uk.double())
            logits += torch.einsum("thd,hsd->ths", q_nope, k_nope)
            return logits, torch.einsum("sr,hrv->hsv", ckv, up.w_uv.double())

        return oracle_attend(plan, shape.v_dim, request)
