"""The engine fingerprint that roots chunk keys: every field matters, weights by stamp."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.fingerprint import (
    EngineFingerprint,
    adapter_stamp,
    config_stamp,
    engine_fingerprint,
    weights_stamp,
)
from kvplane.layout import Axis, KVLayout

BASE = EngineFingerprint(
    vllm_version="0.32.0",
    isa="x86_64:vec",
    kv_layout="LBHNC",
    dtype="bfloat16/auto",
    block_size=32,
    block_shape=(2, 32, 64),
    num_layers=2,
    model="/m",
    weights="abc",
)


def test_digest_is_stable_and_16_bytes() -> None:
    assert BASE.digest() == dataclasses.replace(BASE).digest()
    assert len(BASE.digest()) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"vllm_version": "0.32.1"},
        {"isa": "x86_64:amx"},
        {"kv_layout": "BLHNC"},
        {"dtype": "float16/auto"},
        {"block_size": 64},
        {"block_shape": (2, 32, 128)},
        {"num_layers": 3},
        {"model": "/n"},
        {"weights": "abd"},
        {"config": "0123"},
        {"model_dtype": "torch.float16"},
        {"tp_rank": 1, "tp_size": 2},
        {"pool_layout": "00ff"},
    ],
)
def test_every_field_changes_the_digest(change: dict[str, object]) -> None:
    assert dataclasses.replace(BASE, **change).digest() != BASE.digest()  # type: ignore[arg-type]


def test_rejects_bad_fields() -> None:
    with pytest.raises(InvalidArgumentError, match="block_size"):
        dataclasses.replace(BASE, block_size=0)
    with pytest.raises(InvalidArgumentError, match="tp_rank"):
        dataclasses.replace(BASE, tp_rank=2, tp_size=2)


def test_weights_stamp_follows_the_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    (tmp_path / "README.md").write_text("not part of the stamp")
    first = weights_stamp(tmp_path)
    assert weights_stamp(tmp_path) == first
    (tmp_path / "README.md").write_text("still not part of it")
    assert weights_stamp(tmp_path) == first
    os.utime(weights, ns=(1, 2))
    assert weights_stamp(tmp_path) != first
    assert weights_stamp("org/model") == "name:org/model"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidArgumentError, match="no weight files"):
        weights_stamp(empty)


def test_a_model_given_as_a_file_stamps_by_its_size_and_mtime(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"Q4 weights" * 100)
    first = weights_stamp(gguf)
    assert not first.startswith("name:") and weights_stamp(gguf) == first
    gguf.write_bytes(b"Q8 other weights" * 999)
    assert weights_stamp(gguf) != first
    size = weights_stamp(gguf)
    os.utime(gguf, ns=(1, 2))
    assert weights_stamp(gguf) != size


def test_weights_in_a_subdirectory_enter_the_stamp(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    weights = tmp_path / "sub" / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    first = weights_stamp(tmp_path)
    weights.write_bytes(b"y" * 20)
    assert weights_stamp(tmp_path) != first


def test_adapter_stamp_follows_every_file_of_the_adapter(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    weights = tmp_path / "adapter_model.safetensors"
    weights.write_bytes(b"x" * 10)
    first = adapter_stamp(tmp_path)
    assert adapter_stamp(tmp_path) == first
    os.utime(weights, ns=(1, 2))
    assert adapter_stamp(tmp_path) != first
    assert adapter_stamp(weights) not in (first, adapter_stamp(tmp_path))
    assert adapter_stamp("org/adapter") == "name:org/adapter"


class _HFConfig:
    """A stand-in for a transformers config: ``to_json_string`` with sorted keys."""

    def __init__(self, **values: object) -> None:
        self.values = values

    def to_json_string(self, use_diff: bool = True) -> str:
        assert use_diff is False  # the full config, not its diff from the defaults
        return json.dumps(self.values, sort_keys=True)


class _ModelConfig:
    def __init__(self, hf: _HFConfig, **extra: object) -> None:
        self.hf_config = hf
        self.revision = extra.get("revision")
        self.quantization = extra.get("quantization")
        self.hf_overrides = extra.get("hf_overrides", {})


def test_the_config_stamp_follows_what_changes_the_kv_bytes() -> None:
    """An ``hf_overrides`` RoPE scaling leaves the model name and weights alone but changes
    every KV byte: its stamp, so the chunk keys, must differ."""
    base = {"rope_theta": 10000.0, "num_key_value_heads": 2}
    stamp = config_stamp(_ModelConfig(_HFConfig(**base)))
    assert stamp == config_stamp(_ModelConfig(_HFConfig(**dict(reversed(base.items())))))
    scaled = {**base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    overrides = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    changed = [
        _ModelConfig(_HFConfig(**scaled), hf_overrides=overrides),
        _ModelConfig(_HFConfig(**{**base, "rope_theta": 500000.0})),
        _ModelConfig(_HFConfig(**base), revision="v2"),
        _ModelConfig(_HFConfig(**base), quantization="fp8"),
    ]
    assert len({stamp, *(config_stamp(c) for c in changed)}) == 5
    assert config_stamp(object()) == config_stamp(object())  # nothing known: one stamp


def _identity_override() -> object:
    return lambda cfg: cfg  # a fresh function object (a new address) per call


def test_the_config_stamp_holds_no_address_of_a_callable_override() -> None:
    """vLLM accepts a callable ``hf_overrides``; its effect is in the resolved ``hf_config``.
    Two engines (or one restarted) with the same function must stamp alike, or every restart
    derives new chunk keys and never hits what the disk and remote tiers hold."""
    hf = _HFConfig(rope_theta=10000.0)
    one, two = _identity_override(), _identity_override()
    assert one is not two
    stamp = config_stamp(_ModelConfig(hf, hf_overrides=one))
    assert stamp == config_stamp(_ModelConfig(hf, hf_overrides=two))
    assert stamp != config_stamp(_ModelConfig(hf, hf_overrides=json.loads))  # another function
    nested = _ModelConfig(hf, hf_overrides={"fix": one})
    assert config_stamp(nested) == config_stamp(_ModelConfig(hf, hf_overrides={"fix": two}))


class _Opaque:
    """A value with the default ``object.__repr__`` (an address in every process)."""


def test_the_config_stamp_refuses_a_value_without_a_stable_form() -> None:
    hf = _HFConfig(rope_theta=10000.0)
    with pytest.raises(InvalidArgumentError, match="memory address"):
        config_stamp(_ModelConfig(hf, hf_overrides={"x": _Opaque()}))
    with pytest.raises(InvalidArgumentError, match="memory address"):
        config_stamp(_ModelConfig(_Opaque()))  # type: ignore[arg-type]
    assert config_stamp(_ModelConfig(hf, hf_overrides={1: "a", "b": 2})) == config_stamp(
        _ModelConfig(hf, hf_overrides={"b": 2, 1: "a"})
    )


@pytest.mark.parametrize(
    ("change", "want"),
    [
        ({"block_size": 0}, "EngineFingerprint.block_size must be a positive int, got 0"),
        ({"num_layers": True}, "EngineFingerprint.num_layers must be a positive int, got True"),
        ({"tp_size": 2.0}, "EngineFingerprint.tp_size must be a positive int, got 2.0"),
        ({"tp_rank": 2, "tp_size": 2}, "EngineFingerprint.tp_rank must be an int in [0, 1], got 2"),
        (
            {"tp_rank": True, "tp_size": 2},
            "EngineFingerprint.tp_rank must be an int in [0, 1], got True",
        ),
        ({"block_shape": (2, True, 64)}, "EngineFingerprint.block_shape (2, True, 64)"),
        ({"block_shape": ()}, "EngineFingerprint.block_shape ()"),
    ],
)
def test_bad_fields_are_worded_exactly(change: dict[str, object], want: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        dataclasses.replace(BASE, **change)  # type: ignore[arg-type]
    assert str(err.value) == want
    assert dataclasses.replace(BASE, tp_rank=1, tp_size=2).tp_rank == 1


def test_a_gpu_engine_keys_on_its_pool_layout_not_an_isa() -> None:
    """Two GPU engines alike but for the memory order inside a block (FlashInfer NHD vs HND)
    hold different bytes: their fingerprints differ though neither has an ISA."""
    engine = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout="LBNHC"),
        model_config=SimpleNamespace(
            model="org/model", dtype="torch.bfloat16", **vars(_ModelConfig(_HFConfig(a=1)))
        ),
    )
    a = Axis
    nhd, hnd = (
        KVLayout.gqa(num_blocks=8, block_size=16, num_layers=2, kv_heads=2, head_dim=64,
                     order=(a.LAYER, a.BLOCK, *inner, a.COMP, a.DIM))
        for inner in ((a.TOKEN, a.HEAD), (a.HEAD, a.TOKEN))
    )  # fmt: skip
    one = engine_fingerprint(engine, nhd, (2, 16, 128), "0.32.0")
    assert one.isa == "" and one.pool_layout == nhd.fingerprint().hex()
    assert one.dtype == "bfloat16/auto" and one.kv_layout == "LBNHC" and one.num_layers == 2
    assert one.weights == "name:org/model" and one.block_size == 16
    assert engine_fingerprint(engine, nhd, (2, 16, 128), "0.32.0").digest() == one.digest()
    assert engine_fingerprint(engine, hnd, (2, 16, 128), "0.32.0").digest() != one.digest()
