"""The cluster file: the shipped examples parse; every bad key is one typed line; geometry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvplane.errors import ConfigError
from kvplane.simulate.geometry import gqa_geometry, mla_geometry
from kvplane.simulate.parse import load_cluster, parse_cluster

ROOT = Path(__file__).resolve().parents[2]

MINIMAL: dict[str, Any] = {
    "model": {"kind": "gqa", "layers": 2, "kv_heads": 2, "head_dim": 32},
    "cluster": {"prefill_workers": 1, "decode_workers": 1},
    "prefill": {"token_s": 1e-4},
    "decode": {"token_s": 1e-3},
    "transport": {"bandwidth_bytes_s": 1e9},
}


def with_(section: str, **keys: Any) -> dict[str, Any]:
    doc = {k: dict(v) for k, v in MINIMAL.items()}
    doc.setdefault(section, {}).update(keys)
    return doc


def test_examples_parse() -> None:
    h200 = load_cluster(ROOT / "examples" / "h200x8.toml")
    assert h200.geometry.logical_bytes_per_token == 2 * 80 * 8 * 128 * 2  # 320 KiB
    assert [t.name for t in h200.tiers] == ["device", "host", "disk", "remote"]
    assert [t.shared for t in h200.tiers] == [False, False, False, True]
    assert (h200.prefill_workers, h200.decode_workers, h200.router) == (4, 4, "prefix-aware")
    cpu = load_cluster(ROOT / "examples" / "cpu2.toml")
    assert cpu.geometry.logical_bytes_per_token == 2 * 2 * 2 * 32 * 4


def test_minimal_defaults() -> None:
    spec = parse_cluster(MINIMAL, ROOT)
    assert spec.prefill.pipelined and spec.prefill.slice_tokens == 512
    assert (spec.router, spec.tiers, spec.failures) == ("round-robin", (), ())


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({**MINIMAL, "extra": {}}, r"unknown section \[extra\]"),
        (with_("prefill", speed=1), r"\[prefill\] has unknown key 'speed'"),
        ({k: v for k, v in MINIMAL.items() if k != "decode"}, r"no \[decode\] section"),
        (with_("transport", bandwidth_bytes_s=0), r"\[transport\] bandwidth_bytes_s must be"),
        (with_("prefill", token_s=-1), r"\[prefill\] token_s must be a finite number >= 0"),
        (with_("decode", accept_s=-1e-3), r"\[decode\] accept_s must be a finite number >= 0"),
        (with_("prefill", pipelined="yes"), r"\[prefill\] pipelined must be a bool"),
        (with_("cluster", router="random"), r"\[cluster\] router must be one of"),
        (with_("cluster", prefill_workers=0), r"\[cluster\] prefill_workers must be a positive"),
        (with_("cluster", tp=3), r"kv_heads 2 and \[cluster\] tp 3"),
        (with_("tiers", l4={}), r"\[tiers.l4\] is not a tier"),
        (
            with_("tiers", host={"capacity_bytes": 1, "bandwidth_bytes_s": 1, "chunk_tokens": 100}),
            r"\[tiers.host\] chunk_tokens must be a multiple of 512",
        ),
        (
            with_("tiers", host={"bandwidth_bytes_s": 1}),
            r"\[tiers.host\] capacity_bytes is missing",
        ),
        (with_("model", kind="mamba"), r"\[model\] kind must be gqa or mla"),
        (with_("model", latent_dim=4), r"kind gqa does not take the keys \['latent_dim'\]"),
        (with_("model", dtype="int3"), r"\[model\] dtype"),
        ({**MINIMAL, "failures": [{"role": "prefill", "index": 0, "at_s": 1}]}, "leave one alive"),
        ({**MINIMAL, "failures": [{"role": "decode", "index": 5, "at_s": 1}]}, "past the 1"),
        ({**MINIMAL, "failures": [{"role": "router", "index": 0, "at_s": 1}]}, "role must be"),
        ({**MINIMAL, "poisson": {"input_tokens": 0}}, r"\[poisson\] input_tokens"),
    ],
)
def test_bad_files_are_one_config_error(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cluster(doc, ROOT)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_cluster(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_cluster(tmp_path / "bad.toml")


def test_tensor_parallel_geometry() -> None:
    # 8 KV heads on 4 ranks: split, nothing replicated
    split = gqa_geometry(80, 8, 128, "bfloat16", 4)
    assert split.held_bytes_per_token == split.logical_bytes_per_token == 327_680
    # 2 KV heads on 8 ranks: each rank holds one head, 4 copies of each
    rep = gqa_geometry(1, 2, 64, "float32", 8)
    assert (rep.logical_bytes_per_token, rep.held_bytes_per_token) == (1024, 4096)
    # MLA: the latent is whole on every rank (DeepSeek-V3: 61 x (512 + 64) x 2 B)
    mla = mla_geometry(61, 512, 64, "bfloat16", 2)
    assert (mla.logical_bytes_per_token, mla.held_bytes_per_token) == (70_272, 140_544)


def test_hf_config_geometry(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    doc = {**MINIMAL, "model": {"hf_config": "config.json", "dtype": "float16"}}
    spec = parse_cluster(doc, tmp_path)
    assert spec.geometry.logical_bytes_per_token == 2 * 3 * 2 * 64 * 2
    doc["model"] = {"hf_config": "missing.json"}
    with pytest.raises(ConfigError, match="hf_config"):
        parse_cluster(doc, tmp_path)
