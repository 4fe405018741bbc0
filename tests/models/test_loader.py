"""Loading models: embedded tiny models, saved checkpoints (plain, sharded, fused experts,
tied), and checkpoints with missing, mis-shaped, unused or unsupported content."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from models_testlib import random_model, small_deepseek, small_llama

from kvplane.errors import CheckpointError, InvalidArgumentError
from kvplane.models import (
    TINY_MODELS,
    DeepSeekModel,
    LlamaModel,
    load_model,
    save_checkpoint,
    tiny_config,
)
from kvplane.models.safetensors_io import SafetensorsFile, write_safetensors

PROMPT = [5, 17, 3, 42, 8, 1, 60]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    f = SafetensorsFile(path / "model.safetensors")
    return {n: f.read(n) for n in f.names()}


def _rewrite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    write_safetensors(path / "model.safetensors", tensors)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_are_seeded_and_deterministic(name: str) -> None:
    a, b = load_model(name), load_model(name)
    assert a.config == tiny_config(name)
    assert torch.equal(a.embed.weight, b.embed.weight)
    assert not torch.equal(load_model(name, seed=1).embed.weight, a.embed.weight)
    ga, gb = a.generate(PROMPT, 6), b.generate(PROMPT, 6)
    assert ga.tokens == gb.tokens and len(ga.tokens) == 6


def test_unknown_names() -> None:
    with pytest.raises(InvalidArgumentError, match="no embedded model 'tiny-gpt'"):
        tiny_config("tiny-gpt")
    with pytest.raises(CheckpointError, match="neither an embedded model"):
        load_model("tiny-gpt")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        load_model("tiny-llama", dtype=torch.int8)


@pytest.mark.parametrize(
    "config",
    [
        small_llama(),
        small_llama(tie_word_embeddings=True),
        small_deepseek(),
        small_deepseek(v3=False),
    ],
)
def test_saved_checkpoint_loads_the_same_model(tmp_path: Path, config: Any) -> None:
    save_checkpoint(config, tmp_path, seed=7)
    loaded, built = load_model(tmp_path), random_model(config, seed=7)
    assert type(loaded) is type(built) and loaded.config == config
    assert loaded.generate(PROMPT, 8).tokens == built.generate(PROMPT, 8).tokens
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in _tensors(tmp_path)
        assert loaded.lm_head.weight is loaded.embed.weight


def test_sharded_and_fused_expert_checkpoints(tmp_path: Path) -> None:
    config = small_deepseek()
    save_checkpoint(config, tmp_path, seed=1)
    want = load_model(tmp_path).generate(PROMPT, 8).tokens
    tensors = _tensors(tmp_path)
    e = config.moe.num_experts  # type: ignore[union-attr]
    p = "model.layers.1.mlp.experts"
    gate_up = torch.stack([
        torch.cat((tensors.pop(f"{p}.{i}.gate_proj.weight"),
                   tensors.pop(f"{p}.{i}.up_proj.weight")))
        for i in range(e)
    ])  # fmt: skip
    down = torch.stack([tensors.pop(f"{p}.{i}.down_proj.weight") for i in range(e)])
    names = sorted(tensors)
    (tmp_path / "model.safetensors").unlink()
    write_safetensors(
        tmp_path / "model-00001-of-00002.safetensors", {n: tensors[n] for n in names[:9]}
    )
    write_safetensors(
        tmp_path / "model-00002-of-00002.safetensors",
        {
            **{n: tensors[n] for n in names[9:]},
            f"{p}.gate_up_proj": gate_up,
            f"{p}.down_proj": down,
        },
    )
    model = load_model(tmp_path)
    assert isinstance(model, DeepSeekModel)
    assert model.generate(PROMPT, 8).tokens == want


def test_bfloat16_load(tmp_path: Path) -> None:
    save_checkpoint(small_llama(), tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert isinstance(model, LlamaModel) and model.dtype == torch.bfloat16
    assert model.new_kv_cache(4, 4).dtype == torch.bfloat16
    assert len(model.generate(PROMPT, 4).tokens) == 4


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_checkpoint(small_llama(), tmp_path)
    tensors = _tensors(tmp_path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    _rewrite(tmp_path, tensors)
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' "
        r"\(expected shape \(16, 32\)\)",
    ):
        load_model(tmp_path)


def test_misshaped_tensor_is_named(tmp_path: Path) -> None:
    save_checkpoint(small_deepseek(), tmp_path)
    tensors = _tensors(tmp_path)
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(64, 15)
    _rewrite(tmp_path, tensors)
    with pytest.raises(
        CheckpointError,
        match=r"kv_b_proj.weight' .* has shape \(64, 15\), the config needs \(64, 16\)",
    ):
        load_model(tmp_path)


def test_tensor_the_config_does_not_use(tmp_path: Path) -> None:
    save_checkpoint(small_deepseek(q_lora_rank=None), tmp_path)
    tensors = _tensors(tmp_path)
    tensors["model.layers.0.self_attn.q_a_proj.weight"] = torch.zeros(24, 32)
    _rewrite(tmp_path, tensors)
    with pytest.raises(
        CheckpointError, match=r"does not use: 'model\.layers\.0\.self_attn\.q_a_proj\.weight'"
    ):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    save_checkpoint(small_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Gemma2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match="'Gemma2ForCausalLM' is not supported; supported: LlamaForCausalLM"
    ):
        load_model(tmp_path)


def test_a_checkpoint_with_a_nan_norm_epsilon_is_refused(tmp_path: Path) -> None:
    save_checkpoint(small_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rms_norm_eps"] = float("nan")
    (tmp_path / "config.json").write_text(json.dumps(config))  # json writes and reads NaN
    with pytest.raises(CheckpointError, match="'rms_norm_eps' must be a finite number >= 0"):
        load_model(tmp_path)
