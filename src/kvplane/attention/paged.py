"""Vectorised padded-batch machinery shared by the torch backends.

Page gathers, byte-budgeted request groups (:func:`batch_groups`), bottom-right visibility
limits, NaN-safe masked softmax and LSE merges (:func:`merge_states`, :func:`merge_splits`).
Plans hold index tensors only. See docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplane.attention.metadata import PagedStructure, PlanMetadata, QueryClass
from kvplane.attention.problem import AttentionResult, LSEBase, window_starts


@dataclass(frozen=True, slots=True)
class BatchIndex:
    """Plan-time index tensors of a padded batch, on the run device (see module docstring)."""

    batch: int
    t_max: int
    page_size: int
    pages: torch.Tensor  # [B, max_pages] int64, padding entries 0
    kv_lens: torch.Tensor  # [B] int64
    limits: torch.Tensor  # [B, t_max] int64
    lows: torch.Tensor  # [B] int64 first key some row sees (window; else 0): below it is unread
    q_rows: torch.Tensor | None  # [B, t_max] int64 rows of T (None: uniform, a view suffices)
    out_rows: torch.Tensor | None  # [T] int64 rows of the flattened padded batch

    @property
    def kv_tokens(self) -> int:
        """Padded KV length: ``max_pages * page_size``."""
        return int(self.pages.shape[1]) * self.page_size

    def permuted(self, order: torch.Tensor) -> BatchIndex:
        """The same batch with requests reordered by ``order`` (queries must be padded first)."""
        return BatchIndex(
            self.batch, self.t_max, self.page_size, self.pages[order], self.kv_lens[order],
            self.limits[order], self.lows[order], None, None,
        )  # fmt: skip


def build_batch_index(
    metadata: PlanMetadata,
    structure: PagedStructure,
    causal: bool,
    device: torch.device,
    window: int | None = None,
) -> BatchIndex:
    """Vectorised construction of a :class:`BatchIndex` from validated metadata; under a
    sliding ``window`` its ``lows`` are each request's first key some row sees (``kv_len``
    when no row sees any), else 0."""
    dense = metadata.dense()
    b, t_max = structure.batch_size, structure.max_q_len
    need = torch.tensor(structure.pages_needed, dtype=torch.long)
    width = max(structure.pages_needed)
    table = dense.block_table[:, :width].long().cpu()
    pages = torch.where(torch.arange(width)[None, :] < need[:, None], table, 0)
    kv = torch.tensor(structure.kv_lens, dtype=torch.long)
    ql = torch.tensor(structure.q_lens, dtype=torch.long)
    i = torch.arange(t_max)[None, :]
    real = i < ql[:, None]
    if causal:
        lim = (kv - ql)[:, None] + i + 1
        limits = torch.minimum(torch.clamp(lim, min=0), kv[:, None])
    else:
        limits = kv[:, None].expand(b, t_max)
    limits = torch.where(real, limits, 0)
    lows = torch.zeros_like(kv)
    if window is not None:
        first = window_starts(limits, window)
        lows = torch.cat([torch.where(limits > first, first, kv[:, None]), kv[:, None]], 1).amin(1)
    q_rows = out_rows = None
    if structure.query_class is QueryClass.VARLEN:
        starts = torch.cumsum(ql, 0) - ql
        q_rows = torch.where(real, starts[:, None] + i, 0).to(device)
        out_rows = real.flatten().nonzero().flatten().to(device)
    return BatchIndex(
        b, t_max, structure.page_size, pages.to(device), kv.to(device), limits.to(device),
        lows.to(device), q_rows, out_rows,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class BatchGroup:
    """Requests ``[lo, hi)`` of a padded batch, over page columns ``[first, pages)``.

    ``masked``: some real query row of the group sees other keys than all of those (a shorter
    request, causality or a sliding window), so the group needs a visibility mask. ``first``:
    the columns below it hold only keys no row of the group sees (a sliding window passed them).
    """

    lo: int
    hi: int
    pages: int
    masked: bool
    first: int = 0


@dataclass(frozen=True, slots=True)
class GroupedBatch:
    """A :class:`BatchIndex` and the groups its requests are processed in."""

    index: BatchIndex
    groups: tuple[BatchGroup, ...]


def batch_groups(
    structure: PagedStructure,
    causal: bool,
    token_bytes: int,
    budget_bytes: int,
    align: int = 1,
    *,
    window: int | None = None,
    lows: torch.Tensor | None = None,
) -> tuple[BatchGroup, ...]:
    """Consecutive groups of requests whose gathered KV (``token_bytes`` per position, padded to
    the longest request of the batch) fits ``budget_bytes``; at least one request per group, a
    multiple of ``align`` requests when more than ``align`` fit (so the groups split evenly over
    ``align`` threads). Under a sliding ``window`` a group starts at the page of its requests'
    least :attr:`BatchIndex.lows`; it is masked when a real row sees fewer keys than the group
    holds or its window starts after the group's first key."""
    ps, b = structure.page_size, structure.batch_size
    need = torch.tensor(structure.pages_needed, dtype=torch.long)
    fit = budget_bytes // max(1, int(need.max()) * ps * token_bytes)
    n = max(1, fit - fit % align if fit >= align else fit)
    kv = torch.tensor(structure.kv_lens, dtype=torch.long)
    ql = torch.tensor(structure.q_lens, dtype=torch.long)
    # the fewest keys a real row of each request sees (causal: its first row)
    least = torch.clamp(kv - ql + 1, min=0) if causal else kv
    least = torch.where(ql > 0, least, torch.iinfo(torch.long).max)
    # the last row of a request sees every key below kv_len: the latest window start of its rows
    top = window_starts(torch.where(ql > 0, kv, 0), window)
    low = torch.zeros_like(kv) if lows is None else lows.cpu()
    groups = []
    for lo in range(0, b, n):
        hi = min(b, lo + n)
        w = int(need[lo:hi].max())
        first = min(w, int(low[lo:hi].min()) // ps)
        masked = bool((least[lo:hi] < w * ps).any() or (top[lo:hi] > first * ps).any())
        groups.append(BatchGroup(lo, hi, w, masked, first))
    return tuple(groups)


def pad_queries(x: torch.Tensor, index: BatchIndex) -> torch.Tensor:
    """``[T, H, D]`` -> ``[B, t_max, H, D]``; a view for uniform batches, a gather otherwise."""
    if index.q_rows is None:
        return x.view(index.batch, index.t_max, *x.shape[1:])
    return x[index.q_rows]


def empty_state(
    index: BatchIndex, heads: int, v_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, t_max, H, v_dim] zeros, lse [B, t_max, H] -inf)``: the state of rows that have
    seen nothing yet, in ``dtype``."""
    o = torch.zeros((index.batch, index.t_max, heads, v_dim), dtype=dtype, device=device)
    return o, torch.full(o.shape[:3], float("-inf"), dtype=dtype, device=device)


def padded_result(
    o: torch.Tensor, lse: torch.Tensor, index: BatchIndex, dtype: torch.dtype
) -> AttentionResult:
    """The result of padded ``o [B, t_max, H, v]``/``lse [B, t_max, H]`` (base e): unpadded,
    ``out`` in ``dtype`` and ``lse`` float32."""
    return AttentionResult(
        unpad_rows(o, index).to(dtype), unpad_rows(lse, index).float(), LSEBase.E
    )


def unpad_rows(y: torch.Tensor, index: BatchIndex) -> torch.Tensor:
    """``[B, t_max, ...]`` -> ``[T, ...]`` in the original token order."""
    flat = y.flatten(0, 1)
    return flat if index.out_rows is None else flat[index.out_rows]


def gather_pages(
    pool: torch.Tensor, pages: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Read pages ``pages [n, k]`` of ``pool [P, page_size, ...]`` into ``[n, k * page_size, ...]``.

    ``out`` (optional) is a flat workspace of at least that many elements, reused across calls.
    """
    n, k = pages.shape
    flat = pages.reshape(-1)
    if out is None:
        got = pool.index_select(0, flat)
    else:
        got = out[: flat.numel() * pool[0].numel()].view(flat.numel(), *pool.shape[1:])
        torch.index_select(pool, 0, flat, out=got)
    return got.view(n, k * pool.shape[1], *pool.shape[2:])


def zero_invalid(
    kv: torch.Tensor, start: int, kv_lens: torch.Tensor, lows: torch.Tensor | None = None
) -> None:
    """Zero, in place, the rows of ``kv [n, S, ...]`` at positions ``>= kv_lens`` or ``< lows``
    (keys no row reads, which may hold anything: ``start`` = position of row 0). Only rows that
    need it are touched when the tail is short."""
    pos = start + torch.arange(kv.shape[1], device=kv.device)
    bad = pos[None, :] >= kv_lens[:, None]
    if lows is not None:
        bad |= pos[None, :] < lows[:, None]
    if bool(bad.any()):
        kv[bad] = 0


def gather_group(
    pool: torch.Tensor, index: BatchIndex, group: BatchGroup, out: torch.Tensor
) -> torch.Tensor:
    """The group's KV ``[n, (pages - first) * page_size, ...]`` (from position ``first *
    page_size``) gathered into the flat buffer ``out`` (at least that many elements), positions
    past each request's ``kv_len`` or below its ``lows`` zeroed."""
    rows = slice(group.lo, group.hi)
    kv = gather_pages(pool, index.pages[rows, group.first : group.pages], out=out)
    zero_invalid(kv, group.first * index.page_size, index.kv_lens[rows], index.lows[rows])
    return kv


def visible(
    limits: torch.Tensor, start: int, length: int, window: int | None = None
) -> torch.Tensor:
    """``[n, t, length]`` bool: may padded query row see key position ``start + s``. A row
    sees the keys below its limit; with a sliding ``window`` only those from its
    :func:`~kvplane.attention.problem.window_starts` on."""
    pos = (start + torch.arange(length, device=limits.device))[None, None, :]
    seen = pos < limits[:, :, None]
    if window is not None:
        seen &= pos >= window_starts(limits, window)[:, :, None]
    return seen


def softmax_lse(scores: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax over the last dim, in place on ``scores [n, t, H, S]`` (float32/64).

    ``mask [n, t, S]`` is broadcast over heads. Returns ``(p, lse)`` with ``lse [n, t, H]`` in
    base e; fully masked rows give ``p = 0`` and ``lse = -inf``.
    """
    scores.masked_fill_(~mask[:, :, None, :], float("-inf"))
    m = scores.amax(dim=-1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    scores.sub_(m[..., None]).exp_()
    denom = scores.sum(dim=-1)
    lse = m + torch.log(denom)
    scores.div_(torch.where(denom == 0, torch.ones_like(denom), denom)[..., None])
    return scores, lse


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two normalised partial attention states over disjoint key sets.

    ``o_* [..., D]`` and ``lse_* [...]`` (base e). Returns ``(o, lse)`` of attention over the union:
    ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a * e^(lse_a - lse) + o_b * e^(lse_b - lse)``.
    Two empty states merge into an empty one (``o = 0``, ``lse = -inf``).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    return o_a * w_a + o_b * w_b, lse


def merge_splits(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine per-split states ``out [n, splits, ..., v]``, ``lse [n, splits, ...]`` (base e,
    ``-inf`` where a split was empty) into ``(o [n, ..., v] float32, lse [n, ...])``; rows that
    saw nothing at all get ``0`` / ``-inf``."""
    total = torch.logsumexp(lse, dim=1)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weights = torch.exp(lse - safe[:, None])
    return (out.float() * weights[..., None]).sum(1), total
