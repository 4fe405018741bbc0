"""The engine fingerprint that roots chunk keys: every field matters, weights by stamp."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.fingerprint import EngineFingerprint, weights_stamp

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
        {"tp_rank": 1, "tp_size": 2},
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
