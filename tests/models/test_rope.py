"""RoPE: parsing HF rope configs, the frequency variants, and the three pair layouts."""

from __future__ import annotations

import math

import pytest
import torch

import kvplane.models.rope as rope_module
from kvplane.errors import CheckpointError
from kvplane.models.rope import RopeSpec, RopeStyle, apply_rope, rope_tables

STYLES = list(RopeStyle)


def test_new_and_legacy_config_forms_parse_to_the_same_spec() -> None:
    new = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    legacy = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}}
    a, b = RopeSpec.from_hf(new, 2048), RopeSpec.from_hf(legacy, 2048)
    assert a == b == RopeSpec(5e5, "linear", (("factor", 2.0),))
    assert RopeSpec.from_hf({}, 2048) == RopeSpec(10000.0, "default", ())
    assert RopeSpec.from_hf({"rope_parameters": a.to_hf()}, 2048) == a


def test_yarn_without_factor_uses_the_context_ratio() -> None:
    d = {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}}
    spec = RopeSpec.from_hf(d, 163840)
    assert spec.param("factor", 0.0) == 40.0
    assert spec.softmax_scale_factor == 1.0  # no mscale_all_dim
    d["rope_scaling"]["mscale_all_dim"] = 1.0
    spec = RopeSpec.from_hf(d, 163840)
    assert spec.softmax_scale_factor == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2, rel=1e-12)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "'dynamic'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_parameters": {"rope_theta": 1.0}}, "rope_theta"),
        ({"rope_parameters": {"rope_theta": "big"}}, "'rope_theta'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "factor"),
        ({"rope_parameters": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"rope_parameters": [1, 2]}, "object"),
        ({"rope_scaling": "yarn"}, "rope_scaling must be an object, got 'yarn'"),
        ({"rope_scaling": [["type", "linear"]]}, "rope_scaling must be an object"),
        (
            {"rope_parameters": {"partial_rotary_factor": None}},
            "'partial_rotary_factor' must be a number, got None",
        ),
        (
            {"rope_parameters": {"partial_rotary_factor": "1"}},
            "'partial_rotary_factor' must be a number",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 0}},
            "original_max_position_embeddings must be >= 1, got 0",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 0.5,
                }
            },
            "original_max_position_embeddings must be >= 1, got 0.5",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": math.nan}},
            "'factor' must be finite",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": math.inf}},
            "'factor' must be finite",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 10**400}},
            "'factor' must be finite",
        ),
        ({"rope_parameters": {"rope_theta": math.nan}}, "'rope_theta' must be finite"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            },
            "low_freq_factor must be > 0, got 0",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "beta_fast": -1,
                    "original_max_position_embeddings": 64,
                }
            },
            "beta_fast must be > 0, got -1",
        ),
    ],
)
def test_bad_rope_configs_name_the_problem(config: dict[str, object], words: str) -> None:
    with pytest.raises(CheckpointError, match=words):
        RopeSpec.from_hf(config, 2048)


def test_rope_spec_checks_its_params_when_built_directly() -> None:
    with pytest.raises(CheckpointError, match="rope parameter 'factor' must be finite, got nan"):
        RopeSpec(1e4, "linear", (("factor", math.nan),))
    with pytest.raises(CheckpointError, match="original_max_position_embeddings must be >= 1"):
        RopeSpec(1e4, "yarn", (("factor", 2.0), ("original_max_position_embeddings", 0.0)))


def test_default_and_linear_frequencies_are_exact() -> None:
    inv = RopeSpec(10000.0).inv_freq(8)
    torch.testing.assert_close(inv, torch.tensor([1.0, 0.1, 0.01, 0.001]), rtol=1e-6, atol=0)
    lin = RopeSpec(10000.0, "linear", (("factor", 4.0),)).inv_freq(8)
    torch.testing.assert_close(lin, inv / 4, rtol=0, atol=0)


def test_llama3_divides_low_frequencies_and_smooths_the_band() -> None:
    params = (
        ("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 1024.0),
    )  # fmt: skip
    base = RopeSpec(10000.0).inv_freq(16)
    got = RopeSpec(10000.0, "llama3", params).inv_freq(16)
    wavelen = 2 * math.pi / base
    # wavelengths 6.3 .. 19869: below 256 unchanged, above 1024 divided by 8, 628 smoothed
    torch.testing.assert_close(got[:4], base[:4], rtol=0, atol=0)
    torch.testing.assert_close(got[5:], base[5:] / 8, rtol=0, atol=0)
    s = (1024 / float(wavelen[4]) - 1.0) / 3.0
    assert float(got[4]) == pytest.approx(
        (1 - s) * float(base[4]) / 8 + s * float(base[4]), rel=1e-6
    )


def test_frequencies_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0},
        {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 128},
    ]  # fmt: skip
    for params in cases:
        cfg = transformers.LlamaConfig(
            hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters=dict(params)
        )
        want, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
        spec = RopeSpec.from_hf({"rope_parameters": params}, 2048)
        torch.testing.assert_close(spec.inv_freq(32), want.float(), rtol=1e-6, atol=0)
        assert spec.attention_scaling == pytest.approx(scaling, rel=1e-12)


@pytest.mark.parametrize("style", STYLES)
def test_position_zero_only_moves_channels(style: RopeStyle) -> None:
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(RopeSpec(), 8, torch.zeros(3, dtype=torch.int64))
    want = x
    if style is RopeStyle.INTERLEAVED_SPLIT:  # the rotated evens, then the rotated odds
        want = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    assert torch.equal(apply_rope(x, cos, sin, style), want)


@pytest.mark.parametrize("style", STYLES)
def test_scores_depend_only_on_relative_position(style: RopeStyle) -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)
    spec = RopeSpec(500.0)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_tables(spec, 16, torch.tensor([pq]))
        ck, sk = rope_tables(spec, 16, torch.tensor([pk]))
        return float((apply_rope(q, cq, sq, style) * apply_rope(k, ck, sk, style)).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(0, 0) == pytest.approx(float((q * k).sum()), abs=1e-5)
    norm = apply_rope(q, *rope_tables(spec, 16, torch.tensor([37])), style).norm()
    assert float(norm) == pytest.approx(float(q.norm()), rel=1e-6)


def test_the_three_layouts_are_permutations_of_one_rotation() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 8, generator=g)
    cos, sin = rope_tables(RopeSpec(), 8, torch.arange(5) * 11)
    inter = apply_rope(x, cos, sin, RopeStyle.INTERLEAVED)
    split = apply_rope(x, cos, sin, RopeStyle.INTERLEAVED_SPLIT)
    assert torch.equal(split, torch.cat((inter[..., 0::2], inter[..., 1::2]), dim=-1))
    # NEOX pairs channel i with i + d/2: interleave x that way and the rotations coincide
    woven = torch.stack((x[..., :4], x[..., 4:]), dim=-1).flatten(-2)
    neox = apply_rope(x, cos, sin, RopeStyle.NEOX)
    woven_out = apply_rope(woven, cos, sin, RopeStyle.INTERLEAVED)
    assert torch.equal(neox, torch.cat((woven_out[..., 0::2], woven_out[..., 1::2]), dim=-1))


def test_yarn_scales_the_tables_and_keeps_the_input_dtype() -> None:
    params = (("factor", 4.0), ("original_max_position_embeddings", 64.0))
    spec = RopeSpec(10000.0, "yarn", params)
    assert spec.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-12)
    cos, sin = rope_tables(spec, 8, torch.tensor([0]))
    torch.testing.assert_close(cos, torch.full((1, 4), spec.attention_scaling))
    assert torch.equal(sin, torch.zeros(1, 4))
    x = torch.ones(1, 1, 8, dtype=torch.bfloat16)
    assert apply_rope(x, cos, sin, RopeStyle.NEOX).dtype == torch.bfloat16


def test_from_hf_checks_the_parameters_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, float]] = []
    real = rope_module._check_params

    def counted(params: dict[str, float]) -> None:
        calls.append(dict(params))
        real(params)

    monkeypatch.setattr(rope_module, "_check_params", counted)
    cfg = {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 64}}
    spec = RopeSpec.from_hf(cfg, 256)
    assert spec.param("factor", 0.0) == 4.0 and len(calls) == 1
