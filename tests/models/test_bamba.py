"""The hybrid model's recurrent state: snapshots equal a fresh prefill's state (bit-exact),
restore resumes exactly, stale or shared slots are refused before anything is touched; the
embedded tiny models load and round-trip through HF checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvplane.attention import GQAQuery, default_registry, gqa_problem
from kvplane.errors import CheckpointError, InvalidArgumentError, LayoutError
from kvplane.models import (
    TINY_HYBRID,
    TINY_SWA,
    BambaModel,
    HybridKVCache,
    StepBatch,
    StepRequest,
    config_from_hf,
    load_model,
    save_checkpoint,
    tiny_config,
)
from kvplane.verdicts import Supported

BLOCKS = list(range(16))


def _step(model: BambaModel, kv: HybridKVCache, tokens: list[int], start: int, slot: int = 0):
    req = StepRequest(tokens[start:], start, BLOCKS, state_slot=slot)
    return model.forward_step(StepBatch.build([req], 4), kv)


def _run(model: BambaModel, tokens: list[int], sizes: list[int], slot: int = 0) -> HybridKVCache:
    kv = model.new_kv_cache(16, 4)
    assert isinstance(kv, HybridKVCache)
    start = 0
    for size in sizes:
        req = StepRequest(tokens[start : start + size], start, BLOCKS, state_slot=slot)
        model.forward_step(StepBatch.build([req], 4), kv)
        start += size
    return kv


def test_snapshot_equals_a_fresh_prefill_of_the_prefix() -> None:
    """Bit-exact for the same steps; across step sizes only float32-close: GEMMs of other
    shapes may round differently, even the first layer's (which BLAS decides, e.g. on AMD)."""
    model = load_model(TINY_HYBRID)
    assert isinstance(model, BambaModel)
    tokens = list(range(3, 27))
    one = _run(model, tokens, [24]).state.snapshot(0)
    chunked = _run(model, tokens, [8, 5, 11]).state.snapshot(0)
    again = _run(model, tokens, [8, 5, 11], slot=5).state.snapshot(5)
    assert one.num_tokens == chunked.num_tokens == again.num_tokens == 24
    assert torch.equal(chunked.rows, again.rows)
    torch.testing.assert_close(one.rows, chunked.rows, rtol=1e-4, atol=1e-5)
    n_mamba = len(model.bamba.mamba_layers)
    s = model.bamba.mamba
    assert tuple(one.rows.shape) == (n_mamba, s.conv_dim * 3 + s.inner * s.state_size)


def test_restore_resumes_and_stale_slot_is_refused() -> None:
    model = load_model(TINY_HYBRID)
    assert isinstance(model, BambaModel)
    tokens = list(range(5, 45))
    full = _run(model, tokens, [40])
    want = _step(model, _run(model, tokens, [39]), tokens, 39)
    kv = _run(model, tokens, [39])
    snap = kv.state.snapshot(0)
    kv.state.restore(3, snap)  # another row resumes from the copy
    got = _step(model, kv, tokens, 39, slot=3)
    assert torch.equal(got, want)
    assert full.state.num_tokens[0] == 40
    pool_before = kv.pool.clone()
    with pytest.raises(InvalidArgumentError, match="holds the state after 40 tokens"):
        _step(model, kv, tokens, 30, slot=3)  # a prefix without its state
    with pytest.raises(InvalidArgumentError, match="outside the 8 slots"):
        _step(model, kv, tokens, 0, slot=8)
    reqs = [StepRequest([1], 0, [0]), StepRequest([2], 0, [1])]
    with pytest.raises(InvalidArgumentError, match="share a state slot"):
        model.forward_step(StepBatch.build(reqs, 4), kv)
    plain = model.new_kv_cache(16, 4)
    plain_kv = type(plain).__mro__[1](plain.layout)  # a PagedKVCache without state
    with pytest.raises(InvalidArgumentError, match="needs a HybridKVCache"):
        model.forward_step(StepBatch.build([StepRequest([1], 0, [0])], 4), plain_kv)
    assert torch.equal(kv.pool, pool_before)
    with pytest.raises(InvalidArgumentError, match="snapshot rows"):
        kv.state.restore(0, type(snap)(snap.rows[:1], 3))


@pytest.mark.parametrize("name", [TINY_SWA, TINY_HYBRID])
def test_tiny_models_round_trip_through_checkpoints(tmp_path: Path, name: str) -> None:
    config = tiny_config(name)
    save_checkpoint(config, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == config
    embedded = load_model(name)
    prompt = list(range(1, 30))
    assert loaded.generate(prompt, 6, 9).tokens == embedded.generate(prompt, 6).tokens


def test_config_errors_name_the_key() -> None:
    hf = tiny_config(TINY_HYBRID).to_hf()
    assert config_from_hf(hf) == tiny_config(TINY_HYBRID)
    cases = [
        ({"attn_layer_indices": [9]}, "attn_layer_indices"),
        ({"time_step_limit": [0.0]}, "time_step_limit"),
        ({"mamba_d_head": 7}, "mamba_n_heads 8 x mamba_d_head 7"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}}, "0.5"),
        ({"mamba_n_groups": 3}, "mamba_n_groups"),
    ]
    for change, words in cases:
        with pytest.raises(CheckpointError, match=words):
            config_from_hf({**hf, **change})
    swa = tiny_config(TINY_SWA).to_hf()
    assert swa["model_type"] == "mistral" and swa["sliding_window"] == 16
    with pytest.raises(CheckpointError, match="sliding_window"):
        config_from_hf({**swa, "sliding_window": 0})


def test_window_is_a_capability_only_backends_that_declare_it_take() -> None:
    model = load_model(TINY_SWA)
    kv = model.new_kv_cache(4, 4)
    batch = StepBatch.build([StepRequest(list(range(10)), 0, [0, 1, 2])], 4)
    q = GQAQuery(torch.zeros(10, 4, 32))
    problem = gqa_problem(q, kv.gqa(0), batch.metadata, sm_scale=1.0, causal=True, window=16)
    verdicts = {b.name: b.check(problem) for b in default_registry()}
    assert isinstance(verdicts["gqa_torch"], Supported)
    assert isinstance(verdicts["gqa_reference"], Supported)
    triton = default_registry().get("triton").check(problem)
    assert "sliding window 16 not supported" in str(triton)  # not declared
    assert "sliding window" not in str(verdicts["mha"])  # declared: only the kind is wrong
    with pytest.raises(InvalidArgumentError, match="needs a causal problem"):
        gqa_problem(q, kv.gqa(0), batch.metadata, sm_scale=1.0, causal=False, window=16)
    with pytest.raises(InvalidArgumentError, match="window"):
        gqa_problem(q, kv.gqa(0), batch.metadata, sm_scale=1.0, causal=True, window=0)


def test_state_over_a_foreign_pool_takes_views_and_resumes() -> None:
    """A worker's state pool (another owner's tensor of :meth:`state_layout`) is used in place;
    ``resume`` declares what a slot holds, so a step continues from state written there."""
    model = load_model(TINY_HYBRID)
    assert isinstance(model, BambaModel)
    tokens = list(range(5, 45))
    ref = _run(model, tokens, [32, 8])
    layout = model.state_layout(4)
    pool = layout.allocate()
    state = model.new_state(4, pool)
    assert state.pool is pool and state.layout == layout
    src = _run(model, tokens, [32]).state
    state.restore(2, src.snapshot(0))
    state.num_tokens[2] = 0  # forgotten: only the bytes are there
    kv = _run(model, tokens, [32])
    kv.state = state
    with pytest.raises(InvalidArgumentError, match="holds the state after 0 tokens"):
        _step(model, kv, tokens[:40], 32, slot=2)
    state.resume(2, 32)
    _step(model, kv, tokens[:40], 32, slot=2)
    assert torch.equal(layout.state_view(pool, 0)[2], ref.state.snapshot(0).rows[0])
    assert torch.equal(state.snapshot(2).rows, ref.state.snapshot(0).rows)
    with pytest.raises(InvalidArgumentError, match="outside the 4 slots"):
        state.resume(4, 1)
    with pytest.raises(LayoutError, match="does not match layout"):
        model.new_state(3, pool)
