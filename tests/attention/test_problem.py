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
    QueryLayout,
    gqa_problem,
    mla_problem,
)
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
