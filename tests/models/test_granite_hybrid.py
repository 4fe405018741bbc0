"""Granite-4.0-H (``GraniteMoeHybridForCausalLM``): tiny random-init transformers models (dense
and MoE, RoPE and NoPE) load through kvplane's loader as a :class:`BambaModel` and give
transformers' logits (float32 tolerance) and greedy tokens with chunked prefill; a recurrent
state snapshot at a step boundary equals a fresh prefill of that prefix (bit-exact) and resumes
bit-exactly; the config round-trips and every bad field is a ``CheckpointError`` naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from kvplane.errors import CheckpointError
from kvplane.models import (
    BambaModel,
    GraniteHybridConfig,
    GraniteHybridModel,
    HybridKVCache,
    MambaShape,
    PagedDecoder,
    StepBatch,
    StepRequest,
    build_model,
    config_from_hf,
    load_model,
    save_checkpoint,
)
from kvplane.models.safetensors_io import SafetensorsFile, write_safetensors
from kvplane.models.weights import RandomTensors

NEW_TOKENS = 24
PROMPT_LENS = (20, 70)
BLOCKS = list(range(24))


def save_granite(path: Path, seed: int, **changes: Any) -> Any:
    """A random-init transformers ``GraniteMoeHybridForCausalLM`` (4 layers, attention at 1,
    4 experts top-2 beside the shared MLP, RoPE, Granite-like multipliers; ``changes`` override
    config fields) made under torch seed ``seed`` and saved to ``path``; returns it (eval)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, shared_intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, layer_types=["mamba", "attention", "mamba", "mamba"],
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
        mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2,
        position_embedding_type="rope", embedding_multiplier=12.0, attention_multiplier=1 / 64,
        residual_multiplier=0.22, logits_scaling=8.0,
    )  # fmt: skip
    cfg = transformers.GraniteMoeHybridConfig(**{**base, **changes})
    hf = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return hf


CASES: dict[str, dict[str, Any]] = {
    "moe-rope": {},
    "dense-nope-tied": dict(
        num_local_experts=0, position_embedding_type="nope", tie_word_embeddings=True,
        initializer_range=0.1, embedding_multiplier=2.0,
    ),
    "moe-top1-null-position-2attn-bias": dict(
        num_experts_per_tok=1, position_embedding_type=None, attention_bias=True,
        layer_types=["attention", "mamba", "mamba", "attention"], mamba_n_groups=1,
        mamba_conv_bias=False, initializer_range=0.1, embedding_multiplier=2.0,
    ),
}  # fmt: skip


def _config(**changes: Any) -> GraniteHybridConfig:
    base = GraniteHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_layers=4, num_heads=4,
        num_kv_heads=2, attn_layer_indices=(1,), max_position_embeddings=512,
        mamba=MambaShape(num_heads=8, head_dim=16, num_groups=2, state_size=16, conv_kernel=4),
        position_embedding="rope", embedding_multiplier=12.0, attention_multiplier=1 / 64,
        residual_multiplier=0.22, logits_scaling=8.0, num_experts=4, experts_per_token=2,
        shared_intermediate_size=96,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def _hf_greedy(hf: Any, ids: torch.Tensor, new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return [int(t) for t in out[0, ids.shape[1] :]]


def _prefill(model: PagedDecoder, prompt: list[int], steps: list[int]) -> torch.Tensor:
    """Every position's logits through a chunked prefill over out-of-order pages."""
    kv = model.new_kv_cache(32, 4)
    out, start = [], 0
    for size in steps:
        req = StepRequest(prompt[start : start + size], start, list(range(31, -1, -1)))
        out.append(model.forward_step(StepBatch.build([req], 4), kv, all_logits=True))
        start += size
    return torch.cat(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    hf = save_granite(tmp_path, sum(map(ord, name)), **CASES[name])
    model = load_model(tmp_path)
    assert isinstance(model, GraniteHybridModel) and isinstance(model, BambaModel)
    c = model.granite
    assert c.num_experts == hf.config.num_local_experts
    assert c.uses_rope is (hf.config.position_embedding_type == "rope")
    assert model.kv_layout(4, 4).layer_ids == c.attn_layer_indices
    for n in PROMPT_LENS:
        ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            want_logits = hf(ids).logits[0]
        want = _hf_greedy(hf, ids, NEW_TOKENS)
        assert len(set(want)) > 2  # the tokens discriminate (not one token repeated)
        prompt = ids[0].tolist()
        got_logits = _prefill(model, prompt, [n // 3, n // 3, n - 2 * (n // 3)])
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=2e-5)
        for step in (None, 7):
            assert list(model.generate(prompt, NEW_TOKENS, step, block_size=4).tokens) == want


def test_transformers5_weight_names_and_kvplane_checkpoints_load_alike(tmp_path: Path) -> None:
    """The routed experts under transformers 5's names give the checkpoint names' logits
    bit-exactly; a checkpoint kvplane saves loads in transformers with kvplane's logits."""
    save_granite(tmp_path / "ckpt", 3)
    legacy = load_model(tmp_path / "ckpt")
    renames = {
        "router.layer.weight": "router.weight", "input_linear.weight": "experts.gate_up_proj",
        "output_linear.weight": "experts.down_proj",
    }  # fmt: skip
    f = SafetensorsFile(tmp_path / "ckpt" / "model.safetensors")
    tensors, moved = {}, 0
    for name in f.names():
        new = name
        for old, to in renames.items():
            if ".block_sparse_moe." in name and name.endswith(old):
                new, moved = name.removesuffix(old) + to, moved + 1
        tensors[new] = f.read(name)
    assert moved == 3 * 4  # router, gate_up and down of 4 layers
    (tmp_path / "v5").mkdir()
    (tmp_path / "v5" / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
    write_safetensors(tmp_path / "v5" / "model.safetensors", tensors, {"format": "pt"})
    prompt = list(range(5, 40))
    want = _prefill(legacy, prompt, [35])
    assert torch.equal(_prefill(load_model(tmp_path / "v5"), prompt, [35]), want)

    transformers = pytest.importorskip("transformers")
    config = _config(tie_word_embeddings=True)
    save_checkpoint(config, tmp_path / "ours", seed=4)
    ours = load_model(tmp_path / "ours")
    assert ours.config == config
    hf = transformers.GraniteMoeHybridForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prefill(ours, prompt, [20, 15]), hf_logits, rtol=1e-4, atol=2e-5)


def _steps(
    model: GraniteHybridModel, kv: HybridKVCache, tokens: list[int], sizes: list[int], *,
    slot: int = 0, start: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Prefill ``sizes`` tokens at a time from ``start`` on state ``slot``; the last logits."""
    logits = torch.empty(0)
    for size in sizes:
        req = StepRequest(tokens[start : start + size], start, BLOCKS, state_slot=slot)
        logits = model.forward_step(StepBatch.build([req], 4), kv)
        start += size
    return logits


def _cache(model: GraniteHybridModel) -> HybridKVCache:
    kv = model.new_kv_cache(24, 4)
    assert isinstance(kv, HybridKVCache)
    return kv


@pytest.mark.parametrize("changes", [{}, {"num_experts": 0, "position_embedding": "nope"}])
def test_state_at_a_step_boundary_equals_a_fresh_prefill_and_resumes(changes: Any) -> None:
    """The state after each step of a long prompt's chunked prefill equals a fresh prefill of
    that prefix in the same steps (bit-exact, float32: the snapshot prefix offload keeps and PD
    sends); restored into another slot it resumes to the continuous run's logits bit-exactly.
    Across other step sizes it is float32-close only (GEMMs of other shapes round apart)."""
    model = build_model(_config(**changes), RandomTensors(1))
    assert isinstance(model, GraniteHybridModel)
    tokens = [(7 * i + 3) % 128 for i in range(60)]
    sizes = [8, 5, 11, 16]
    kv, snaps, start = _cache(model), {}, 0
    for size in sizes:
        _steps(model, kv, tokens, [size], start=start)
        start += size
        snaps[start] = kv.state.snapshot(0)
    for k, end in enumerate((8, 13, 24, 40)):
        fresh = _cache(model)
        _steps(model, fresh, tokens[:end], sizes[: k + 1], slot=3)
        assert fresh.state.num_tokens[3] == snaps[end].num_tokens == end
        assert torch.equal(fresh.state.snapshot(3).rows, snaps[end].rows), end
    assert not torch.equal(snaps[24].rows, snaps[40].rows)
    one_step = _cache(model)
    _steps(model, one_step, tokens, [40])
    torch.testing.assert_close(one_step.state.snapshot(0).rows, snaps[40].rows, rtol=1e-4,
                               atol=1e-5)  # fmt: skip

    want = _steps(model, kv, tokens, [20], start=40)
    resumed = _cache(model)
    _steps(model, resumed, tokens, sizes[:3], slot=1)  # the KV of [0, 24); slot 1's state
    resumed.state.restore(6, snaps[24])
    got = _steps(model, resumed, tokens, [16, 20], slot=6, start=24)
    assert torch.equal(got, want)
    assert resumed.state.num_tokens[6] == kv.state.num_tokens[0] == 60
    s, n_mamba = model.granite.mamba, len(model.granite.mamba_layers)
    assert tuple(snaps[40].rows.shape) == (n_mamba, s.conv_dim * 3 + s.inner * s.state_size)


def test_config_round_trips_and_every_bad_field_names_its_key() -> None:
    config = _config()
    hf = config.to_hf()
    assert config_from_hf(hf) == config
    v5 = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    assert config_from_hf({**hf, "layer_types": v5}) == config
    old = {k: v for k, v in hf.items() if k != "layer_types"}
    assert config_from_hf({**old, "layers_block_type": hf["layer_types"]}) == config
    nope = config_from_hf({**hf, "position_embedding_type": None})
    assert isinstance(nope, GraniteHybridConfig) and not nope.uses_rope
    dense = config_from_hf({**hf, "num_local_experts": 0, "num_experts_per_tok": 0})
    assert isinstance(dense, GraniteHybridConfig) and dense.num_experts == 0
    cases: list[tuple[dict[str, Any], str]] = [
        ({"layer_types": ["mamba"] * 3}, "'layer_types' must give"),
        ({"layer_types": ["mamba", "attention", "moe", "mamba"]}, "'layer_types' must give"),
        ({"layer_types": ["mamba"] * 4}, "'layer_types' names no attention layer"),
        ({"position_embedding_type": "alibi"}, "'position_embedding_type' must be"),
        ({"logits_scaling": 0}, "'logits_scaling' must be a finite number > 0"),
        ({"residual_multiplier": "x"}, "'residual_multiplier' must be"),
        ({"embedding_multiplier": float("nan")}, "'embedding_multiplier' must be"),
        ({"attention_multiplier": -1.0}, "'attention_multiplier' must be"),
        ({"num_experts_per_tok": 5}, "'num_experts_per_tok' 5 must be in"),
        ({"num_local_experts": -1}, "'num_local_experts'"),
        ({"shared_intermediate_size": 0}, "'shared_intermediate_size'"),
        ({"head_dim": 8}, "'head_dim' 8 must be"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"mamba_d_head": 7}, "mamba_n_heads 8 x mamba_d_head 7"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"time_step_limit": [0.0]}, "'time_step_limit'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ]  # fmt: skip
    for change, words in cases:
        with pytest.raises(CheckpointError, match=words):
            config_from_hf({**hf, **change})
    with pytest.raises(CheckpointError, match="is not GraniteMoeHybridForCausalLM"):
        _config(architecture="BambaForCausalLM")
