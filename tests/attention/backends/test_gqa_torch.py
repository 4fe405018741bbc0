"""GQA paged attention: prefill with prefix KV, decode, mixed batches, NaN poison, dtypes."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention import Selector
from kvplane.attention.backends import GQATorchBackend


def _poison(inputs):
    s = inputs.problem.metadata.structure()
    table = inputs.problem.metadata.dense().block_table
    for pool in (inputs.cache.k, inputs.cache.v):
        pool[0] = float("nan")
        for b, n in enumerate(s.kv_lens):
            for pos in range(n, table.shape[1] * s.page_size):
                pool[int(table[b, pos // s.page_size]), pos % s.page_size] = float("nan")
    return inputs


CASES = {
    "prefill_no_prefix": ([5, 3], [5, 3]),
    "prefill_with_prefix": ([4, 2], [11, 9]),
    "decode": ([1, 1, 1], [1, 8, 0]),
    "mixed": ([1, 6, 1], [13, 6, 2]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (6, 1)])
def test_gqa_matches_reference(  # noqa: PLR0917
    case, causal, heads, kv_heads, gqa_inputs, run_backend, assert_close
) -> None:
    q, kv = CASES[case]
    inputs = _poison(gqa_inputs(q, kv, heads=heads, kv_heads=kv_heads, causal=causal))
    want = run_backend("gqa_reference", inputs)
    assert_close(run_backend("gqa_torch", inputs), want, torch.float32)
    one_per_group = GQATorchBackend(group_bytes=1)  # every request its own group
    plan = one_per_group.plan(inputs.problem)
    assert len(plan.state.groups) == len(q)
    assert_close(one_per_group.run(plan, inputs.query, inputs.cache), want, torch.float32)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [1, 3, 8])
def test_a_sliding_window_matches_reference(
    case, window, gqa_inputs, run_backend, assert_close
) -> None:
    """Rows see only their last ``window`` causal keys; keys before every row's window are set
    huge (finite: the reference masks by bias), so any leak moves the output."""
    q, kv = CASES[case]
    inputs = _poison(gqa_inputs(q, kv, window=window))
    s = inputs.problem.metadata.structure()
    table = inputs.problem.metadata.dense().block_table
    for b, (ql, n) in enumerate(zip(s.q_lens, s.kv_lens, strict=True)):
        for pos in range(max(0, n - ql + 1 - window)):  # below every row's window
            for pool in (inputs.cache.k, inputs.cache.v):
                pool[int(table[b, pos // s.page_size]), pos % s.page_size] = 1e4
    want = run_backend("gqa_reference", inputs)
    assert torch.isfinite(want.out).all()
    assert_close(run_backend("gqa_torch", inputs), want, torch.float32)


def test_gqa_bf16(gqa_inputs, run_backend, assert_close) -> None:
    inputs = gqa_inputs([3, 1], [7, 12], dtype=torch.bfloat16)
    assert_close(
        run_backend("gqa_torch", inputs), run_backend("gqa_reference", inputs), torch.bfloat16
    )


def test_prefill_then_decode_equals_one_pass(gqa_inputs, run_backend) -> None:
    """Causal prefill of 6 tokens: its last row equals a decode of token 6 over the same KV."""
    full = gqa_inputs([6], [6])
    prefill = run_backend("gqa_torch", full)
    from kvplane.attention import GQAQuery, PlanMetadata, gqa_problem
    from kvplane.attention.synthetic import Inputs

    table = full.problem.metadata.dense().block_table
    meta = PlanMetadata.from_dense(
        4, table, torch.tensor([6], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    )
    q = GQAQuery(full.query.q[5:6])
    p = gqa_problem(q, full.cache, meta, sm_scale=full.problem.sm_scale, causal=True)
    decode = run_backend("gqa_torch", Inputs(p, q, full.cache))
    torch.testing.assert_close(prefill.out[5:6], decode.out, atol=1e-6, rtol=1e-6)


def test_auto_picks_gqa_torch(registry, gqa_inputs) -> None:
    assert Selector(registry).plan(gqa_inputs([1], [3]).problem).backend == "gqa_torch"
