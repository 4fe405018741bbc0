"""Model configs: HF round trips, family selection and every validation error."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from models_testlib import small_deepseek, small_llama, small_moe

from kvplane.errors import CheckpointError
from kvplane.models import DeepSeekConfig, Family, LlamaConfig, RopeSpec, RopeStyle, config_from_hf
from kvplane.models.config import DEEPSEEK_V2, DEEPSEEK_V3, FULL, MISTRAL, QWEN2, SLIDING

YARN = RopeSpec(
    10000.0,
    "yarn",
    (("factor", 40.0), ("mscale_all_dim", 1.0), ("original_max_position_embeddings", 64.0)),
)


@pytest.mark.parametrize(
    "config",
    [
        small_llama(),
        small_llama(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, num_kv_heads=4),
        small_llama(architecture=MISTRAL, sliding_window=5),
        small_llama(architecture=QWEN2, sliding_window=5, layer_types=(FULL, SLIDING)),
        small_llama(architecture=QWEN2, layer_types=(FULL, FULL)),
        small_deepseek(v3=True),
        small_deepseek(v3=True, moe=False, q_lora_rank=None, rope=YARN),
        small_deepseek(v3=True, rope_interleave=False),
        small_deepseek(v3=False),
        small_deepseek(v3=False, moe=False),
    ],
)
def test_hf_round_trip_is_exact(config: Any) -> None:
    assert config_from_hf(config.to_hf()) == config


def test_family_and_derived_values() -> None:
    llama, ds = small_llama(), small_deepseek()
    assert (llama.family, ds.family) == (Family.LLAMA, Family.DEEPSEEK)
    assert ds.rope_style is RopeStyle.INTERLEAVED_SPLIT
    assert small_deepseek(rope_interleave=False).rope_style is RopeStyle.NEOX
    assert small_deepseek(v3=False).rope_style is RopeStyle.INTERLEAVED
    with pytest.raises(CheckpointError, match="V2 always interleaves"):
        small_deepseek(v3=False, rope_interleave=False)
    assert ds.sm_scale == 12**-0.5
    yarn = dataclasses.replace(ds, rope=YARN)
    assert yarn.sm_scale == pytest.approx(12**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)


def test_deepseek_v2_defaults_and_nulls() -> None:
    d = small_deepseek(v3=False).to_hf()
    d.update(num_key_value_heads=None, n_group=None, topk_group=None, norm_topk_prob=None)
    del d["topk_method"]
    cfg = config_from_hf(d)
    assert isinstance(cfg, DeepSeekConfig) and cfg.moe is not None
    assert cfg.rope_style is RopeStyle.INTERLEAVED
    assert (cfg.moe.scoring, cfg.moe.topk_method, cfg.moe.num_groups) == ("softmax", "greedy", 1)
    assert cfg.moe.norm_topk_prob is False


def test_moe_layer_selection() -> None:
    moe = small_moe(first_k_dense_replace=1, layer_freq=2)
    assert [moe.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    d = small_deepseek().to_hf()
    d["n_routed_experts"] = None
    assert config_from_hf(d).moe is None  # type: ignore[union-attr]


def _llama(**changes: Any) -> dict[str, Any]:
    d = small_llama().to_hf()
    d.update(changes)
    return d


def _qwen2(**changes: Any) -> dict[str, Any]:
    d = small_llama(architecture=QWEN2, sliding_window=6).to_hf()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (_llama(architectures=["Gemma2ForCausalLM"]), "'Gemma2ForCausalLM' is not supported"),
        (_llama(architectures=[]), "architectures"),
        ({k: v for k, v in _llama().items() if k != "hidden_size"}, "no 'hidden_size'"),
        (_llama(vocab_size="97"), "'vocab_size' must be a positive int, got '97'"),
        (_llama(num_hidden_layers=True), "'num_hidden_layers' must be a positive int, got True"),
        (_llama(num_hidden_layers=0), "'num_hidden_layers' must be a positive int, got 0"),
        (_llama(hidden_act="gelu"), "hidden_act 'gelu'"),
        (_llama(num_key_value_heads=3), "not a multiple"),
        (_llama(head_dim=7), "even"),
        (_llama(rms_norm_eps=-1.0), "rms_norm_eps"),
        (_llama(rms_norm_eps=math.nan), "'rms_norm_eps' must be a finite number >= 0, got nan"),
        (_llama(rms_norm_eps=math.inf), "'rms_norm_eps' must be a finite number >= 0, got inf"),
        (_llama(rms_norm_eps=10**400), "'rms_norm_eps' must be a finite number >= 0"),
        (_llama(rope_scaling="yarn", rope_parameters=None), "rope_scaling must be an object"),
        (_llama(attention_bias="yes"), "attention_bias"),
        (_qwen2(layer_types=[FULL]), "'layer_types' must give .* each of the 2 layers"),
        (_qwen2(layer_types=[FULL, "chunked_attention"]), "'chunked_attention'"),
        (_qwen2(layer_types="full_attention"), "'layer_types' must be a list"),
        (_qwen2(attention_bias=True), "no attention_bias field"),
    ],
)
def test_bad_llama_configs_name_the_key(config: dict[str, Any], words: str) -> None:
    with pytest.raises(CheckpointError, match=words):
        config_from_hf(config)


def test_qwen2_layer_windows_read_as_transformers_does() -> None:
    """``layer_types`` as given; without it, sliding from ``max_window_layers`` on, and only
    with ``use_sliding_window``; q/k/v biases, no o bias."""
    given = config_from_hf(_qwen2(layer_types=[SLIDING, FULL]))
    assert isinstance(given, LlamaConfig) and given.qkv_bias and not given.attention_bias
    assert [given.layer_window(i) for i in range(2)] == [6, None]
    computed = _qwen2(max_window_layers=1, layer_types=None)
    cfg = config_from_hf(computed)
    assert isinstance(cfg, LlamaConfig) and cfg.layer_types == (FULL, SLIDING)
    off = config_from_hf({**computed, "use_sliding_window": False})
    assert isinstance(off, LlamaConfig) and off.sliding_window is None
    assert [off.layer_window(i) for i in range(2)] == [None, None]
    mistral = small_llama(architecture=MISTRAL, sliding_window=5)
    assert [mistral.layer_window(i) for i in range(2)] == [5, 5] and not mistral.qkv_bias
    with pytest.raises(CheckpointError, match="sliding_window is not a field of LlamaForCausal"):
        small_llama(sliding_window=4)
    with pytest.raises(CheckpointError, match="layer_types is not a field of MistralForCausal"):
        small_llama(architecture=MISTRAL, layer_types=(FULL, FULL))


def _ds(**changes: Any) -> dict[str, Any]:
    d = small_deepseek().to_hf()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (_ds(num_experts_per_tok=5), "num_experts_per_tok 5"),
        (_ds(n_group=3), "n_group 3"),
        (_ds(n_group=2, topk_group=3), "topk_group 3"),
        (_ds(n_group=4), "fewer than 2 per group"),
        (_ds(architectures=[DEEPSEEK_V2], topk_method="random"), "topk_method 'random'"),
        (_ds(qk_rope_head_dim=5), "qk_rope_head_dim 5"),
        (_ds(kv_lora_rank=None), "no 'kv_lora_rank'"),
        (_ds(routed_scaling_factor=math.nan), "'routed_scaling_factor' must be a finite number"),
    ],
)
def test_bad_deepseek_configs_name_the_key(config: dict[str, Any], words: str) -> None:
    with pytest.raises(CheckpointError, match=words):
        config_from_hf(config)


def test_not_an_object() -> None:
    with pytest.raises(CheckpointError, match="object"):
        config_from_hf([1, 2])  # type: ignore[arg-type]


def test_architecture_names() -> None:
    assert isinstance(config_from_hf(_ds(architectures=[DEEPSEEK_V2])), DeepSeekConfig)
    assert config_from_hf(_ds()).architecture == DEEPSEEK_V3  # type: ignore[union-attr]
    assert isinstance(config_from_hf(_llama()), LlamaConfig)
