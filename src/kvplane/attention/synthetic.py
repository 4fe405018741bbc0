"""Synthetic paged attention inputs for ``measured`` timing, benches and tests.

:func:`twin` builds a problem of the same structure over seeded data, never touching the
caller's tensors. See docs/attention.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvplane.attention.inputs import (
    GQAKVCache,
    GQAQuery,
    MLAKVCache,
    MLAQuery,
    MLAUpProjection,
)
from kvplane.attention.metadata import PlanMetadata
from kvplane.attention.problem import (
    AttentionProblem,
    GQAShape,
    MLAShape,
    QueryLayout,
    gqa_problem,
    mla_problem,
)
from kvplane.errors import InvalidArgumentError


def synthetic_metadata(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    page_size: int,
    *,
    device: torch.device | str = "cpu",
    shuffle_seed: int | None = None,
) -> tuple[PlanMetadata, int]:
    """Dense metadata for the given lengths and the pool size it needs (pages, page 0 unused)."""
    if len(q_lens) != len(kv_lens) or not q_lens:
        raise InvalidArgumentError(
            f"need equal, non-empty q_lens and kv_lens, got {len(q_lens)} and {len(kv_lens)}"
        )
    need = [-(-n // page_size) for n in kv_lens]
    total = sum(need)
    ids = torch.arange(1, total + 1)
    if shuffle_seed is not None:
        gen = torch.Generator().manual_seed(shuffle_seed)
        ids = ids[torch.randperm(total, generator=gen)]
    width = max(1, *need)
    table = torch.zeros((len(need), width), dtype=torch.int32)
    cols = torch.arange(width)[None, :] < torch.tensor(need)[:, None]
    table[cols] = ids.int()
    dev = torch.device(device)
    meta = PlanMetadata.from_dense(
        page_size,
        table.to(dev),
        torch.tensor(kv_lens, dtype=torch.int32, device=dev),
        torch.tensor(q_lens, dtype=torch.int32, device=dev),
    )
    return meta, total + 1


@dataclass(frozen=True, slots=True)
class Inputs:
    """A problem with matching query and cache."""

    problem: AttentionProblem
    query: MLAQuery | GQAQuery
    cache: MLAKVCache | GQAKVCache


def _sampler(
    dtype: torch.dtype, device: torch.device | str, seed: int
) -> Callable[[Sequence[int]], torch.Tensor]:
    """``randn(shape)``: standard normal tensors of ``dtype`` on ``device``, drawn in float32
    on the CPU from one generator seeded with ``seed`` (the same values on every device)."""
    gen, dev = torch.Generator().manual_seed(seed), torch.device(device)

    def randn(shape: Sequence[int]) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(dev, dtype)

    return randn


def make_mla_inputs(
    metadata: PlanMetadata,
    num_pages: int,
    shape: MLAShape,
    *,
    dtype: torch.dtype,
    sm_scale: float,
    causal: bool,
    layout: QueryLayout = QueryLayout.PACKED,
    device: torch.device | str = "cpu",
    seed: int = 0,
    window: int | None = None,
) -> Inputs:
    """Seeded random MLA query/cache (with ``up_proj`` for a non-absorbed ``shape``;
    ``window``: a sliding-window problem)."""
    randn = _sampler(dtype, device, seed)
    t, h = metadata.structure().num_tokens, shape.num_heads
    r, p = shape.kv_lora_rank, shape.rope_dim
    nope = shape.qk_nope_dim or r
    data = randn((num_pages, metadata.page_size, r + p))
    up = None
    if shape.qk_nope_dim is not None and shape.v_head_dim is not None:
        scale = r**-0.5
        up = MLAUpProjection(
            randn((h, r, shape.qk_nope_dim)) * scale, randn((h, r, shape.v_head_dim)) * scale
        )
    cache = MLAKVCache(data, r, up)
    if layout is QueryLayout.PACKED:
        query = MLAQuery.packed(randn((t, h, nope + p)), nope)
    else:
        query = MLAQuery.split(randn((t, h, nope)), randn((t, h, p)))
    problem = mla_problem(
        query, cache, metadata, sm_scale=sm_scale, causal=causal, absorbed=shape.absorbed,
        window=window,
    )  # fmt: skip
    return Inputs(problem, query, cache)


def make_gqa_inputs(
    metadata: PlanMetadata,
    num_pages: int,
    shape: GQAShape,
    *,
    dtype: torch.dtype,
    sm_scale: float,
    causal: bool,
    device: torch.device | str = "cpu",
    seed: int = 0,
    window: int | None = None,
) -> Inputs:
    """Seeded random GQA query and K/V pools (``window``: a sliding-window problem)."""
    randn = _sampler(dtype, device, seed)
    kv_shape = (num_pages, metadata.page_size, shape.num_kv_heads, shape.head_dim)
    cache = GQAKVCache(randn(kv_shape), randn(kv_shape))
    query = GQAQuery(randn((metadata.structure().num_tokens, shape.num_heads, shape.head_dim)))
    problem = gqa_problem(query, cache, metadata, sm_scale=sm_scale, causal=causal, window=window)
    return Inputs(problem, query, cache)


def twin(problem: AttentionProblem, *, seed: int = 0) -> Inputs:
    """Synthetic inputs with ``problem``'s structure: its lengths, on a fresh compact pool whose
    pages are shuffled (seeded), as in a pool that has served for a while."""
    s = problem.metadata.structure()
    meta, pages = synthetic_metadata(
        s.q_lens, s.kv_lens, s.page_size, device=problem.device, shuffle_seed=seed
    )
    if isinstance(problem.shape, MLAShape):
        return make_mla_inputs(
            meta, pages, problem.shape, dtype=problem.dtype, sm_scale=problem.sm_scale,
            causal=problem.causal, layout=problem.query_layout, device=problem.device, seed=seed,
            window=problem.window,
        )  # fmt: skip
    return make_gqa_inputs(
        meta, pages, problem.shape, dtype=problem.dtype, sm_scale=problem.sm_scale,
        causal=problem.causal, device=problem.device, seed=seed, window=problem.window,
    )  # fmt: skip
