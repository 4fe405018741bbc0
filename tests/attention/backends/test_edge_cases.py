"""The issue's edge cases, every CPU MLA backend against the float64 ``reference`` oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplane import native as native_build
from kvplane.attention import MLAKVCache, MLAQuery, PlanMetadata, QueryLayout, mla_problem
from kvplane.attention.backends import (
    CPUFusedBackend,
    SDPABackend,
    TorchMLABackend,
    TorchSplitKVBackend,
)
from kvplane.attention.synthetic import Inputs

FUSED = ["cpu_fused", "fused_ranges"] if native_build.compiler() is not None else []
"""The C kernel's variants, where this machine can build it."""
MLA_BACKENDS = [
    "torch", "torch_splitkv", "sdpa", "splitkv_tiny", "torch_1req", "sdpa_1req", "sdpa_split",
    *FUSED,
]  # fmt: skip


@pytest.fixture
def runner(run_backend, registry):
    """Like ``run_backend`` plus ``splitkv_tiny``: split-KV with 4-token splits (many merges),
    ``*_1req``: a one-byte group budget, so every request is its own group, and ``sdpa_split``:
    one request per group cut into up to 4 kernel work items of >= 4 tokens (LSE-merged) and
    ``fused_ranges``: the C kernel with every request cut into key ranges of >= 4 tokens."""
    variants = {
        "splitkv_tiny": TorchSplitKVBackend(split_tokens=4),
        "torch_1req": TorchMLABackend(group_bytes=1),
        "sdpa_1req": SDPABackend(group_bytes=1),
        "sdpa_split": SDPABackend(group_bytes=1, min_split_tokens=4, work_items=4),
        "fused_ranges": CPUFusedBackend(threads=8, min_split_tokens=4),
    }

    def run(name: str, inputs: Inputs):
        b = variants.get(name)
        if b is not None:
            return b.run(b.plan(inputs.problem), inputs.query, inputs.cache)
        return run_backend(name, inputs)

    return run


def _poison(inputs: Inputs) -> Inputs:
    """NaN in page 0 (never written) and in every slot past each request's kv_len."""
    data = inputs.cache.data
    data[0] = float("nan")
    s = inputs.problem.metadata.structure()
    table = inputs.problem.metadata.dense().block_table
    for b, n in enumerate(s.kv_lens):
        pages = table[b].long()
        for pos in range(n, table.shape[1] * s.page_size):
            data[pages[pos // s.page_size], pos % s.page_size] = float("nan")
    return inputs


CASES = {
    "kv_len_0": ([1, 1, 1], [7, 0, 5]),
    "one_token": ([1, 1], [1, 1]),
    "decode_ragged": ([1, 1, 1, 1], [3, 17, 9, 30]),
    "spec_verify": ([4, 4, 4], [4, 11, 23]),
    "mixed_decode_prefill": ([1, 6, 1, 3, 0], [10, 6, 33, 20, 4]),
}


@pytest.mark.parametrize("backend", MLA_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_fp32(backend, case, causal, mla_inputs, runner, assert_close):  # noqa: PLR0917
    q_lens, kv_lens = CASES[case]
    inputs = _poison(mla_inputs(q_lens, kv_lens, causal=causal))
    want = runner("reference", inputs)
    got = runner(backend, inputs)
    assert_close(got, want, torch.float32)
    # rows that see nothing: zero output, -inf LSE
    s = inputs.problem.metadata.structure()
    start = 0
    for q_len, kv_len in zip(s.q_lens, s.kv_lens, strict=True):
        if kv_len == 0:
            assert torch.equal(
                got.out[start : start + q_len], torch.zeros_like(got.out[start : start + q_len])
            )
            assert bool(torch.isneginf(got.lse[start : start + q_len]).all())
        start += q_len


@pytest.mark.parametrize("backend", MLA_BACKENDS)
def test_bf16_within_tolerance(backend, mla_inputs, runner, assert_close):
    inputs = _poison(mla_inputs([1, 3, 1], [9, 12, 30], dtype=torch.bfloat16))
    assert_close(runner(backend, inputs), runner("reference", inputs), torch.bfloat16)


def test_bottom_right_causal_alignment(mla_inputs, runner):
    """Row i of a q_len=4 causal block equals a decode over the first kv_len-3+i positions."""
    inputs = mla_inputs([4], [10], causal=True)
    verify = runner("torch", inputs)
    table = inputs.problem.metadata.dense().block_table
    packed = inputs.query.packed_data
    assert packed is not None
    for i in range(4):
        meta = PlanMetadata.from_dense(
            4,
            table,
            torch.tensor([10 - 3 + i], dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
        )
        q = MLAQuery.packed(packed[i : i + 1], 64)
        p = mla_problem(q, inputs.cache, meta, sm_scale=inputs.problem.sm_scale, causal=True)
        single = runner("reference", Inputs(p, q, inputs.cache))
        torch.testing.assert_close(verify.out[i], single.out[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(verify.lse[i], single.lse[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "torch_splitkv", "sdpa", *FUSED[:1]])
def test_packed_and_split_identical_without_copies(backend, mla_inputs, runner):
    inputs = mla_inputs([1, 2, 1], [5, 9, 14])
    packed = inputs.query.packed_data
    assert packed is not None
    split = MLAQuery.split(packed[..., :64], packed[..., 64:])
    # the split halves are views of the packed buffer and give it back without a copy
    assert split.nope.data_ptr() == packed.data_ptr()
    assert split.packed_data is not None and split.packed_data.data_ptr() == packed.data_ptr()
    cache = inputs.cache
    assert cache.ckv.data_ptr() == cache.data.data_ptr()
    assert cache.kpe.untyped_storage().data_ptr() == cache.data.untyped_storage().data_ptr()
    p_split = mla_problem(
        split, cache, inputs.problem.metadata, sm_scale=inputs.problem.sm_scale, causal=True
    )
    assert p_split.query_layout is QueryLayout.PACKED
    a = runner(backend, inputs)
    b = runner(backend, Inputs(p_split, split, cache))
    assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)
    assert cache.data.data_ptr() == inputs.cache.data.data_ptr()  # the pool was never replaced


def test_separate_split_tensors_match_packed(mla_inputs, runner, assert_close):
    inputs = mla_inputs([2, 1], [6, 13], layout=QueryLayout.SPLIT)
    assert inputs.problem.query_layout is QueryLayout.SPLIT
    packed_q = MLAQuery.packed(torch.cat([inputs.query.nope, inputs.query.pe], -1), 64)
    p2 = mla_problem(
        packed_q,
        inputs.cache,
        inputs.problem.metadata,
        sm_scale=inputs.problem.sm_scale,
        causal=True,
    )
    for name in ("torch", "torch_splitkv", *FUSED[:1]):
        assert_close(
            runner(name, inputs), runner(name, Inputs(p2, packed_q, inputs.cache)), torch.float32
        )


def test_absorbed_equals_non_absorbed(mla_inputs, runner, assert_close):
    """mha over decompressed KV == torch in latent space, after absorbing and projecting."""
    mha_in = _poison(mla_inputs([1, 5, 2], [8, 5, 19], nope=24, v_dim=20))
    up = mha_in.cache.up_proj
    assert up is not None
    mha = runner("mha", mha_in)
    assert_close(mha, runner("reference", mha_in), torch.float32)
    q_lat = torch.cat([up.absorb_query(mha_in.query.nope), mha_in.query.pe], -1)
    q = MLAQuery.packed(q_lat, 64)
    latent_cache = MLAKVCache(mha_in.cache.data, 64)
    p = mla_problem(
        q, latent_cache, mha_in.problem.metadata, sm_scale=mha_in.problem.sm_scale, causal=True
    )
    absorbed = runner("torch", Inputs(p, q, latent_cache))
    torch.testing.assert_close(up.project_output(absorbed.out), mha.out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(absorbed.lse, mha.lse, atol=2e-5, rtol=2e-5)


def test_deepseek_dims_tiny_batch(mla_inputs, runner, assert_close):
    inputs = _poison(mla_inputs([1, 2], [20, 7], heads=2, rank=512, rope=64, page_size=8))
    want = runner("reference", inputs)
    for name in ("torch", "torch_splitkv", "sdpa", *FUSED):
        assert_close(runner(name, inputs), want, torch.float32)


def test_run_never_mutates_the_cache(mla_inputs, runner):
    inputs = _poison(mla_inputs([1, 3], [9, 14]))
    before = inputs.cache.data.clone()
    for name in ("torch", "torch_splitkv", "sdpa", *FUSED[:1], "reference"):
        runner(name, inputs)
    assert torch.equal(before.nan_to_num(7.0), inputs.cache.data.nan_to_num(7.0))


@st.composite
def batches(draw):
    b = draw(st.integers(1, 4))
    kv = draw(st.lists(st.integers(0, 30), min_size=b, max_size=b))
    q = [draw(st.integers(0, max(1, n))) for n in kv]
    return q, kv, draw(st.booleans()), draw(st.sampled_from([1, 4, 8]))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=batches())
def test_random_batches_match_reference(batch, mla_inputs, runner, assert_close):
    q_lens, kv_lens, causal, page_size = batch
    inputs = _poison(mla_inputs(q_lens, kv_lens, causal=causal, page_size=page_size, heads=2))
    want = runner("reference", inputs)
    for name in MLA_BACKENDS:
        assert_close(runner(name, inputs), want, torch.float32)
