"""Non-absorbed (MHA) MLA against the oracle, fp32 and bf16, and its kind routing."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention import AttentionKind, Selector


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mha_matches_reference(dtype, mla_inputs, run_backend, assert_close) -> None:
    inputs = mla_inputs([3, 1, 4], [3, 10, 9], nope=24, v_dim=20, dtype=dtype)
    assert inputs.problem.kind is AttentionKind.MLA_MHA
    res = run_backend("mha", inputs)
    assert res.out.shape == (8, 4, 20) and res.out.dtype == dtype
    assert_close(res, run_backend("reference", inputs), dtype)


def test_auto_routes_non_absorbed_to_mha(registry, mla_inputs) -> None:
    plan = Selector(registry).plan(mla_inputs([2], [2], nope=24, v_dim=20).problem)
    assert plan.backend == "mha" and [e.candidate for e in plan.trace] == ["mha", "reference"]
