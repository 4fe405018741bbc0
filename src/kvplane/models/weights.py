"""Where model weights come from: an HF checkpoint directory or a seeded random generator.

:class:`TensorSource` serves tensors by HF name and shape; :class:`CheckpointTensors` rejects
missing, mis-shaped and unused tensors. See docs/attention.md.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Protocol

import torch

from kvplane.errors import CheckpointError
from kvplane.models.safetensors_io import SafetensorsFile

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class WeightKind(enum.Enum):
    """How a random source fills a tensor: normal for matrices, ones for norms, zeros for bias."""

    MATRIX = "matrix"
    NORM = "norm"
    BIAS = "bias"


class TensorSource(Protocol):
    """Tensors by HF name. ``take`` returns ``dtype``/``device`` tensors of exactly ``shape``."""

    def has(self, name: str) -> bool: ...

    def take(self, name: str, shape: tuple[int, ...], kind: WeightKind) -> torch.Tensor: ...

    def finish(self) -> None: ...


class CheckpointTensors:
    """Tensors of the ``*.safetensors`` files of one checkpoint directory."""

    def __init__(
        self,
        files: list[SafetensorsFile],
        num_layers: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self._where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.names():
                if name in self._where:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self._where[name].path} and {f.path}"
                    )
                self._where[name] = f
        self._num_layers = num_layers
        self._dtype, self._device = dtype, torch.device(device)
        self._taken: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str, shape: tuple[int, ...], kind: WeightKind) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
        got = f.entries[name].shape
        if got != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} in {f.path} has shape {got}, the config needs {tuple(shape)}"
            )
        t = f.read(name)
        if not (t.is_floating_point()):
            raise CheckpointError(f"tensor {name!r} in {f.path} is {t.dtype}, not floating point")
        self._taken.add(name)
        return t.to(device=self._device, dtype=self._dtype)

    def _ignored(self, name: str) -> bool:
        m = _LAYER.match(name)
        return (m is not None and int(m.group(1)) >= self._num_layers) or name.endswith(
            "rotary_emb.inv_freq"
        )

    def finish(self) -> None:
        extra = sorted(n for n in self._where if n not in self._taken and not self._ignored(n))
        if extra:
            shown = ", ".join(repr(n) for n in extra[:5])
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise CheckpointError(f"checkpoint has tensors its config does not use: {shown}{more}")


class RandomTensors:
    """Seeded random weights: matrices ``N(0, std or fan_in ** -0.5)``, norms 1, biases 0."""

    def __init__(
        self,
        seed: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        std: float | None = None,
    ) -> None:
        self._seed, self._std = seed, std
        self._dtype, self._device = dtype, torch.device(device)

    def has(self, name: str) -> bool:
        return False

    def take(self, name: str, shape: tuple[int, ...], kind: WeightKind) -> torch.Tensor:
        if kind is WeightKind.NORM:
            t = torch.ones(shape)
        elif kind is WeightKind.BIAS:
            t = torch.zeros(shape)
        else:
            digest = hashlib.blake2b(f"{self._seed}:{name}".encode(), digest_size=8).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
            std = self._std if self._std is not None else shape[-1] ** -0.5
            t = torch.randn(shape, generator=gen) * std
        return t.to(device=self._device, dtype=self._dtype)

    def finish(self) -> None:
        return None


def read_checkpoint_dir(path: str | Path) -> tuple[dict[str, Any], list[SafetensorsFile]]:
    """``config.json`` (parsed) and the validated headers of every ``*.safetensors`` in ``path``."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    cfg_path = root / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(root)!r} has no config.json") from None
    except (OSError, ValueError, RecursionError) as exc:  # bad UTF-8/JSON, nesting too deep
        raise CheckpointError(f"{cfg_path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {str(root)!r} has no *.safetensors file")
    return config, [SafetensorsFile(f) for f in files]
