"""Non-absorbed (MHA) MLA against the oracle, fp32 and bf16, and its kind routing."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention import AttentionKind, MLAQuery, Selector, mla_problem
from kvplane.attention.backends import MHABackend
from kvplane.attention.synthetic import Inputs
from kvplane.errors import InvalidArgumentError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mha_matches_reference(dtype, mla_inputs, run_backend, assert_close) -> None:
    inputs = mla_inputs([3, 1, 4], [3, 10, 9], nope=24, v_dim=20, dtype=dtype)
    assert inputs.problem.kind is AttentionKind.MLA_MHA
    res = run_backend("mha", inputs)
    assert res.out.shape == (8, 4, 20) and res.out.dtype == dtype
    assert_close(res, run_backend("reference", inputs), dtype)
    one_per_group = MHABackend(group_bytes=1)
    grouped = one_per_group.run(one_per_group.plan(inputs.problem), inputs.query, inputs.cache)
    assert len(one_per_group.plan(inputs.problem).state.groups) == 3
    assert_close(grouped, res, dtype)


def test_auto_routes_non_absorbed_to_mha(registry, mla_inputs) -> None:
    plan = Selector(registry).plan(mla_inputs([2], [2], nope=24, v_dim=20).problem)
    assert plan.backend == "mha" and [e.candidate for e in plan.trace] == ["mha", "reference"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nope_equal_to_rank_both_ways(dtype, mla_inputs, run_backend, assert_close) -> None:
    """d_nope == r: one [T, H, r + p] query tensor read per head (absorbed=False) and as a
    latent query (absorbed=True) are two different problems; each matches ``reference``."""
    per_head = mla_inputs([1, 4, 2], [9, 4, 17], nope=64, v_dim=20, dtype=dtype)
    q, cache, meta = per_head.query, per_head.cache, per_head.problem.metadata
    scale = per_head.problem.sm_scale
    assert per_head.problem.kind is AttentionKind.MLA_MHA and q.nope_dim == cache.kv_lora_rank
    with pytest.raises(InvalidArgumentError, match="pass absorbed=True"):
        mla_problem(q, cache, meta, sm_scale=scale, causal=True)
    mha = run_backend("mha", per_head)
    assert mha.out.shape == (7, 4, 20)
    assert_close(mha, run_backend("reference", per_head), dtype)
    p = mla_problem(q, cache, meta, sm_scale=scale, causal=True, absorbed=True)
    latent = Inputs(p, q, cache)
    assert p.kind is AttentionKind.MLA
    want = run_backend("reference", latent)
    assert want.out.shape == (7, 4, 64)
    for name in ("torch", "torch_splitkv", "sdpa"):
        assert_close(run_backend(name, latent), want, dtype)
    up = cache.up_proj
    assert up is not None  # the two readings really differ
    assert not torch.allclose(up.project_output(want.out).float(), mha.out.float(), atol=0.1)
    # the per-head query absorbed for real gives the per-head result back
    q_lat = MLAQuery.packed(torch.cat([up.absorb_query(q.nope), q.pe], -1), 64)
    real = Inputs(
        mla_problem(q_lat, cache, meta, sm_scale=scale, causal=True, absorbed=True), q_lat, cache
    )
    absorbed = run_backend("torch", real)
    tol = 2e-5 if dtype == torch.float32 else 5e-2  # bf16: the absorbed query is rounded
    got = up.project_output(absorbed.out).float()
    torch.testing.assert_close(got, mha.out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(absorbed.lse, mha.lse, atol=tol, rtol=tol)
