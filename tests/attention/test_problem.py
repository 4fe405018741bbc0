"""AttentionProblem: required sm_scale, kinds, cross-checks at build and at run."""

from __future__ import annotations

import math

import pytest
import torch

from kvplane.attention import (
    AttentionKind,
    AttentionResult,
    GQAKVCache,
    GQAQuery,
    LSEBase,
    MLAKVCache,
    MLAQuery,
    MLAShape,
    MLAUpProjection,
    QueryLayout,
    gqa_problem,
    mla_problem,
)
from kvplane.attention.problem import window_starts
from kvplane.attention.synthetic import synthetic_metadata
from kvplane.errors import BackendError, InvalidArgumentError


def _meta(q=(1, 2), kv=(3, 6)):
    return synthetic_metadata(list(q), list(kv), 4)


def test_mla_problem_describes_inputs() -> None:
    meta, pages = _meta()
    q = MLAQuery.packed(torch.randn(3, 2, 10), 8)
    p = mla_problem(q, MLAKVCache(torch.randn(pages, 4, 10), 8), meta, sm_scale=0.5, causal=True)
    assert p.shape == MLAShape(2, 8, 2)
    assert (p.kind, p.num_heads, p.dtype, p.query_layout) == (
        AttentionKind.MLA,
        2,
        torch.float32,
        QueryLayout.PACKED,
    )
    split = MLAQuery.split(torch.randn(3, 2, 8), torch.randn(3, 2, 2))
    p2 = mla_problem(
        split, MLAKVCache(torch.randn(pages, 4, 10), 8), meta, sm_scale=0.5, causal=False
    )
    assert p2.query_layout is QueryLayout.SPLIT


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan, True, "0.1"])
def test_sm_scale_is_required_and_checked(scale) -> None:
    meta, pages = _meta()
    q = MLAQuery.packed(torch.randn(3, 2, 10), 8)
    with pytest.raises(InvalidArgumentError, match="sm_scale"):
        mla_problem(q, MLAKVCache(torch.randn(pages, 4, 10), 8), meta, sm_scale=scale, causal=True)


def test_mismatches_are_named() -> None:
    meta, pages = _meta()
    cache = MLAKVCache(torch.randn(pages, 4, 10), 8)
    with pytest.raises(InvalidArgumentError, match="query has 2 tokens, metadata sums to 3"):
        mla_problem(
            MLAQuery.packed(torch.randn(2, 2, 10), 8), cache, meta, sm_scale=1.0, causal=True
        )
    with pytest.raises(InvalidArgumentError, match="neither the latent rank 8"):
        mla_problem(
            MLAQuery.packed(torch.randn(3, 2, 9), 7),
            MLAKVCache(torch.randn(pages, 4, 10), 8),
            meta,
            sm_scale=1.0,
            causal=True,
        )
    with pytest.raises(InvalidArgumentError, match="page_size 4 != cache page_size 2"):
        mla_problem(
            MLAQuery.packed(torch.randn(3, 2, 10), 8),
            MLAKVCache(torch.randn(pages, 2, 10), 8),
            meta,
            sm_scale=1.0,
            causal=True,
        )
    with pytest.raises(InvalidArgumentError, match="does not fit K/V"):
        gqa_problem(
            GQAQuery(torch.randn(3, 3, 8)),
            GQAKVCache(torch.randn(pages, 4, 2, 8), torch.randn(pages, 4, 2, 8)),
            meta,
            sm_scale=1.0,
            causal=True,
        )


def test_validate_inputs_at_run() -> None:
    meta, pages = _meta()
    cache = MLAKVCache(torch.randn(pages, 4, 10), 8)
    p = mla_problem(
        MLAQuery.packed(torch.randn(3, 2, 10), 8), cache, meta, sm_scale=1.0, causal=True
    )
    with pytest.raises(BackendError, match="planned dims"):
        p.validate_inputs(MLAQuery.packed(torch.randn(3, 4, 10), 8), cache)
    with pytest.raises(BackendError, match="float64"):
        p.validate_inputs(MLAQuery.packed(torch.randn(3, 2, 10).double(), 8), cache)
    with pytest.raises(BackendError, match="cannot serve"):
        p.validate_inputs(
            MLAQuery.packed(torch.randn(3, 2, 10), 8), MLAKVCache(torch.randn(2, 4, 10), 8)
        )
    with pytest.raises(BackendError, match="expects a packed query"):
        p.validate_inputs(MLAQuery.split(torch.randn(3, 2, 8), torch.randn(3, 2, 2)), cache)
    with pytest.raises(BackendError, match="needs MLAQuery"):
        p.validate_inputs(GQAQuery(torch.randn(3, 2, 8)), cache)
    with pytest.raises(BackendError, match="GQA backend was given a mla"):
        p.gqa_shape()


def test_lse_natural_converts_base_two() -> None:
    r = AttentionResult(torch.zeros(1, 1, 1), torch.tensor([[3.0]]), LSEBase.TWO)
    assert r.lse_natural().item() == pytest.approx(3.0 * math.log(2.0))
    e = AttentionResult(torch.zeros(1, 1, 1), torch.tensor([[3.0]]), LSEBase.E)
    assert e.lse_natural() is e.lse


def _ambiguous(pages: int, *, up: bool = True) -> tuple[MLAQuery, MLAKVCache]:
    """d_nope == r == 8: a latent and a per-head query are both [T, H, 8 + 2]."""
    w = MLAUpProjection(torch.randn(2, 8, 8), torch.randn(2, 8, 6)) if up else None
    return MLAQuery.packed(torch.randn(3, 2, 10), 8), MLAKVCache(torch.randn(pages, 4, 10), 8, w)


def test_absorbed_is_required_where_shapes_cannot_tell() -> None:
    meta, pages = _meta()
    q, cache = _ambiguous(pages)
    with pytest.raises(InvalidArgumentError, match=r"pass absorbed=True .* or absorbed=False"):
        mla_problem(q, cache, meta, sm_scale=0.5, causal=True)
    latent = mla_problem(q, cache, meta, sm_scale=0.5, causal=True, absorbed=True)
    assert latent.shape == MLAShape(2, 8, 2) and latent.kind is AttentionKind.MLA
    per_head = mla_problem(q, cache, meta, sm_scale=0.5, causal=True, absorbed=False)
    assert per_head.shape == MLAShape(2, 8, 2, 8, 6) and per_head.kind is AttentionKind.MLA_MHA
    assert per_head.shape.v_dim == 6 and not per_head.shape.absorbed and latent.shape.absorbed


def test_absorbed_must_fit_the_shapes() -> None:
    meta, pages = _meta()
    q, no_up = _ambiguous(pages, up=False)
    assert mla_problem(q, no_up, meta, sm_scale=0.5, causal=True).kind is AttentionKind.MLA
    with pytest.raises(InvalidArgumentError, match=r"needs the cache's up_proj .* has no up_proj"):
        mla_problem(q, no_up, meta, sm_scale=0.5, causal=True, absorbed=False)
    per_head_q = MLAQuery.packed(torch.randn(3, 2, 14), 12)  # d_nope 12 != r 8
    cache = MLAKVCache(no_up.data, 8, MLAUpProjection(torch.randn(2, 8, 12), torch.randn(2, 8, 6)))
    assert mla_problem(per_head_q, cache, meta, sm_scale=0.5, causal=True).shape == MLAShape(
        2, 8, 2, 12, 6
    )
    with pytest.raises(InvalidArgumentError, match="absorbed query needs nope dim == latent rank"):
        mla_problem(per_head_q, cache, meta, sm_scale=0.5, causal=True, absorbed=True)
    with pytest.raises(InvalidArgumentError, match="has up_proj d_nope 12"):
        mla_problem(q, cache, meta, sm_scale=0.5, causal=True, absorbed=False)
    with pytest.raises(InvalidArgumentError, match="absorbed must be a bool or None, got 1"):
        mla_problem(q, cache, meta, sm_scale=0.5, causal=True, absorbed=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"both set .* or both None"):
        MLAShape(2, 8, 2, 8, None)


def _up(heads: int = 2, nope: int = 8, v: int = 8, dtype: torch.dtype = torch.float32):
    return MLAUpProjection(
        torch.randn(heads, 16, nope, dtype=dtype), torch.randn(heads, 16, v, dtype=dtype)
    )


@pytest.mark.parametrize(
    ("up", "match"),
    [
        (
            _up(v=12),
            r"up_proj \(heads, d_nope, d_v\) \(2, 8, 12\) do not match the planned \(2, 8, 8\)",
        ),
        (
            _up(heads=3),
            r"up_proj \(heads, d_nope, d_v\) \(3, 8, 8\) do not match the planned \(2, 8, 8\)",
        ),
        (
            _up(nope=6),
            r"up_proj \(heads, d_nope, d_v\) \(2, 6, 8\) do not match the planned \(2, 8, 8\)",
        ),
        (_up(dtype=torch.float64), "up_proj is torch.float64@cpu, planned for torch.float32@cpu"),
        (None, "non-absorbed MLA needs the cache's up_proj weights"),
    ],
)
def test_validate_inputs_checks_the_up_projection_of_non_absorbed_mla(up, match) -> None:
    meta, pages = synthetic_metadata([3], [5], 4)
    data = torch.randn(pages, 4, 24)
    q = MLAQuery.packed(torch.randn(3, 2, 16), 8)
    p = mla_problem(q, MLAKVCache(data, 16, _up()), meta, sm_scale=0.2, causal=True)
    assert p.shape == MLAShape(2, 16, 8, 8, 8)
    p.validate_inputs(q, MLAKVCache(data, 16, _up()))  # a matching up_proj passes
    with pytest.raises(BackendError, match=match):
        p.validate_inputs(q, MLAKVCache(data, 16, up))


def test_up_projection_dtype_must_match_the_query_at_build() -> None:
    meta, pages = synthetic_metadata([3], [5], 4)
    cache = MLAKVCache(torch.randn(pages, 4, 24), 16, _up(dtype=torch.float64))
    with pytest.raises(
        InvalidArgumentError, match=r"up_proj is torch\.float64@cpu, query is torch\.float32@cpu"
    ):
        mla_problem(
            MLAQuery.packed(torch.randn(3, 2, 16), 8), cache, meta, sm_scale=0.2, causal=True
        )


def test_window_starts_are_transformers_sliding_window() -> None:
    """Row limits ``[5, 1, 0, 9]`` (positions 4, 0, padding, 8) under window 3 see from keys
    2, 0, 0 and 6 on; without a window from 0. Equal, key by key, to transformers' mask."""
    limits = torch.tensor([[5, 1, 0, 9]])
    assert window_starts(limits, 3).tolist() == [[2, 0, 0, 6]]
    assert window_starts(limits, None).tolist() == [[0, 0, 0, 0]]
    masking = pytest.importorskip("transformers.masking_utils")
    for window in (1, 3, 4):
        hf = masking.sliding_window_causal_mask_function(window)
        zero, keys = torch.tensor(0), range(10)
        for q in range(10):
            first = int(window_starts(torch.tensor([q + 1]), window))
            sees = [bool(hf(zero, zero, torch.tensor(q), torch.tensor(k))) for k in keys]
            assert sees == [first <= k <= q for k in keys]
