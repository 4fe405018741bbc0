"""Tensor sources: checkpoint tensors (missing, mis-shaped, unused, duplicated) and seeded
random tensors; reading a checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvplane.errors import CheckpointError
from kvplane.models.safetensors_io import SafetensorsFile, write_safetensors
from kvplane.models.weights import (
    CheckpointTensors,
    RandomTensors,
    WeightKind,
    read_checkpoint_dir,
)

M = WeightKind.MATRIX


def _source(
    tmp_path: Path, tensors: dict[str, torch.Tensor], num_layers: int = 2
) -> CheckpointTensors:
    write_safetensors(tmp_path / "model.safetensors", tensors)
    return CheckpointTensors([SafetensorsFile(tmp_path / "model.safetensors")], num_layers)


def test_take_converts_and_finish_accepts_everything_used(tmp_path: Path) -> None:
    w = torch.arange(6, dtype=torch.float16).view(2, 3)
    src = _source(tmp_path, {
        "a.weight": w,
        "model.layers.2.mlp.weight": torch.ones(1),  # past num_hidden_layers: an MTP layer
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(1),
    })  # fmt: skip
    assert src.has("a.weight") and not src.has("b.weight")
    got = src.take("a.weight", (2, 3), M)
    assert got.dtype == torch.float32 and torch.equal(got, w.float())
    src.finish()


def test_missing_misshaped_and_integer_tensors(tmp_path: Path) -> None:
    src = _source(
        tmp_path, {"a.weight": torch.ones(2, 3), "i.weight": torch.ones(2, dtype=torch.int32)}
    )
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'b.weight' \(expected shape \(4,\)\)"
    ):
        src.take("b.weight", (4,), M)
    with pytest.raises(
        CheckpointError, match=r"'a.weight' .* has shape \(2, 3\), the config needs \(3, 2\)"
    ):
        src.take("a.weight", (3, 2), M)
    with pytest.raises(CheckpointError, match=r"torch\.int32, not floating point"):
        src.take("i.weight", (2,), M)


def test_unused_tensors_are_listed(tmp_path: Path) -> None:
    tensors = {f"x{i}.weight": torch.ones(1) for i in range(7)}
    src = _source(tmp_path, tensors)
    src.take("x0.weight", (1,), M)
    with pytest.raises(CheckpointError, match=r"does not use: 'x1.weight', .* and 1 more"):
        src.finish()


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "a.safetensors", {"w": torch.ones(1)})
    write_safetensors(tmp_path / "b.safetensors", {"w": torch.ones(1)})
    files = [SafetensorsFile(tmp_path / n) for n in ("a.safetensors", "b.safetensors")]
    with pytest.raises(CheckpointError, match="'w' is in both"):
        CheckpointTensors(files, 1)


def test_random_tensors_depend_on_seed_and_name_not_order() -> None:
    a, b = RandomTensors(3), RandomTensors(3)
    x1 = a.take("x", (4, 8), M)
    a.take("y", (4, 8), M)
    b.take("y", (4, 8), M)
    assert torch.equal(b.take("x", (4, 8), M), x1)
    assert not torch.equal(RandomTensors(4).take("x", (4, 8), M), x1)
    assert float(x1.std()) == pytest.approx(8**-0.5, rel=0.5)
    assert torch.equal(a.take("n", (3,), WeightKind.NORM), torch.ones(3))
    assert torch.equal(a.take("b", (3,), WeightKind.BIAS), torch.zeros(3))
    bf = RandomTensors(3, torch.bfloat16).take("x", (4, 8), M)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, x1.to(torch.bfloat16))
    assert not a.has("x")
    a.finish()


def test_read_checkpoint_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint_dir(tmp_path / "none")
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        read_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        read_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text("[" * 200000 + "]" * 200000)  # nested too deep
    with pytest.raises(CheckpointError, match="not readable JSON"):
        read_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"a": "\xff"}')  # not UTF-8
    with pytest.raises(CheckpointError, match="not readable JSON"):
        read_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"a": ' + "9" * 5000 + "}")  # int beyond the limit
    with pytest.raises(CheckpointError, match="not readable JSON"):
        read_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="JSON object"):
        read_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        read_checkpoint_dir(tmp_path)
    write_safetensors(tmp_path / "model-00001.safetensors", {"w": torch.ones(1)})
    config, files = read_checkpoint_dir(tmp_path)
    assert config == {"a": 1} and [f.path.name for f in files] == ["model-00001.safetensors"]
