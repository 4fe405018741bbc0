"""Rotary position embeddings: the scaling variants of HF configs and the three pair layouts.

:class:`RopeSpec` (default, linear, llama3, yarn) and :class:`RopeStyle` (NEOX, INTERLEAVED,
INTERLEAVED_SPLIT); the style is part of a model's identity. See docs/attention.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvplane.errors import CheckpointError
from kvplane.validators import finite_number, is_number


class RopeStyle(enum.Enum):
    """Which channels form a rotated pair, and where the rotated values are written."""

    NEOX = "neox"
    INTERLEAVED = "interleaved"
    INTERLEAVED_SPLIT = "interleaved_split"


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _num(params: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """``params[key]`` (or ``default``) as a finite float; ``CheckpointError`` otherwise."""
    value = params.get(key, default)
    number = finite_number(value)
    if number is None:
        what = "finite" if is_number(value) else "a number"
        raise CheckpointError(f"rope parameter {key!r} must be {what}, got {value!r}")
    return number


_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow")
"""Parameters the frequency formulas divide by or take the log of: must be > 0."""


def _check_params(params: Mapping[str, float]) -> None:
    """Every parameter finite, the divisors > 0, ``original_max_position_embeddings >= 1``."""
    for key, value in params.items():
        if not is_number(value):
            raise CheckpointError(f"rope parameter {key!r} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise CheckpointError(f"rope parameter {key!r} must be finite, got {value!r}")
        if key in _POSITIVE and value <= 0:
            raise CheckpointError(f"rope {key} must be > 0, got {value}")
    old = params.get("original_max_position_embeddings")
    if old is not None and old < 1:
        raise CheckpointError(f"rope original_max_position_embeddings must be >= 1, got {old}")


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Frequencies of one model's RoPE. ``params`` keeps the type-specific numbers by name:
    all finite, ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``beta_fast`` and
    ``beta_slow`` > 0 and ``original_max_position_embeddings >= 1`` (else ``CheckpointError``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    params: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.theta) or self.theta <= 1.0:
            raise CheckpointError(f"rope_theta must be a finite number > 1, got {self.theta!r}")
        if self.rope_type not in ROPE_TYPES:
            raise CheckpointError(
                f"rope type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        needed = {
            "default": (),
            "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings"),
        }[self.rope_type]  # fmt: skip
        have = dict(self.params)
        _check_params(have)  # first: a bad value explains a missing derived one (yarn factor)
        missing = [k for k in needed if k not in have]
        if missing:
            raise CheckpointError(f"rope type {self.rope_type!r} needs parameters {missing}")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], max_position_embeddings: int) -> RopeSpec:
        """From an HF config: ``rope_parameters`` (transformers 5) or ``rope_theta`` +
        ``rope_scaling`` (older files). A yarn ``factor`` of ``None`` means
        ``max_position_embeddings / original_max_position_embeddings`` (DeepSeek-V3).
        ``rope_parameters`` / ``rope_scaling`` must be JSON objects (or absent/null); any
        malformed value is a ``CheckpointError``."""
        raw = config.get("rope_parameters")
        if raw is None:
            scaling = config.get("rope_scaling")
            if scaling is not None and not isinstance(scaling, Mapping):
                raise CheckpointError(f"rope_scaling must be an object, got {scaling!r:.80}")
            raw = dict(scaling or {})
            raw.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        if not isinstance(raw, Mapping):
            raise CheckpointError(f"rope_parameters must be an object, got {raw!r:.80}")
        rope_type = str(raw.get("rope_type", raw.get("type", "default")))
        theta = _num(raw, "rope_theta", 10000.0)
        if _num(raw, "partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError("partial_rotary_factor != 1 is not supported")
        params: dict[str, float] = {}
        for key in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
            "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
        ):  # fmt: skip
            if raw.get(key) is not None:
                params[key] = _num(raw, key)
        if "truncate" in raw:
            params["truncate"] = float(bool(raw["truncate"]))
        old = params.get("original_max_position_embeddings")
        if rope_type == "yarn" and "factor" not in params and old is not None and old >= 1:
            params["factor"] = max_position_embeddings / old  # (old < 1: __post_init__ refuses)
        return cls(theta, rope_type, tuple(sorted(params.items())))  # checks params once

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_parameters`` object of an HF ``config.json``."""
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_type": self.rope_type}
        for key, value in self.params:
            out[key] = bool(value) if key == "truncate" else value
        return out

    def param(self, key: str, default: float) -> float:
        return dict(self.params).get(key, default)

    def inv_freq(self, dim: int) -> torch.Tensor:
        """``[dim // 2]`` float32 inverse frequencies for a rotary dim of ``dim`` channels."""
        base = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv = 1.0 / (self.theta**base)
        if self.rope_type == "linear":
            return inv / self.param("factor", 1.0)
        if self.rope_type == "llama3":
            return self._llama3(inv)
        if self.rope_type == "yarn":
            return self._yarn(dim)
        return inv

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        factor, old = self.param("factor", 1.0), self.param("original_max_position_embeddings", 1)
        low, high = self.param("low_freq_factor", 1.0), self.param("high_freq_factor", 4.0)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)

    def _yarn(self, dim: int) -> torch.Tensor:
        factor, old = self.param("factor", 1.0), self.param("original_max_position_embeddings", 1)
        beta_fast, beta_slow = self.param("beta_fast", 32.0), self.param("beta_slow", 1.0)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.param("truncate", 1.0):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1 - ramp
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
            1.0 / pos_freqs
        ) * extrapolation

    @property
    def attention_scaling(self) -> float:
        """Factor on cos/sin (yarn's attention factor; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        have = dict(self.params)
        if "attention_factor" in have:
            return have["attention_factor"]
        factor = self.param("factor", 1.0)
        mscale, mscale_all = have.get("mscale"), have.get("mscale_all_dim")
        if mscale and mscale_all:
            return _get_mscale(factor, mscale) / _get_mscale(factor, mscale_all)
        return _get_mscale(factor)

    @property
    def softmax_scale_factor(self) -> float:
        """Factor on an MLA softmax scale: ``mscale(factor, mscale_all_dim) ** 2`` under yarn."""
        mscale_all = self.param("mscale_all_dim", 0.0)
        if self.rope_type == "default" or not mscale_all:
            return 1.0
        return _get_mscale(self.param("factor", 1.0), mscale_all) ** 2


def rope_tables(
    spec: RopeSpec, dim: int, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` float32 ``[T, dim // 2]`` for int64 ``positions [T]`` (scaled per spec)."""
    inv = spec.inv_freq(dim).to(positions.device)
    angles = positions.float()[:, None] * inv[None, :]
    scale = spec.attention_scaling
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle
) -> torch.Tensor:
    """Rotate ``x [T, H, dim]`` by tables ``[T, dim // 2]``; returns a new tensor of x's dtype."""
    c, s = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    if style is RopeStyle.NEOX:
        half = x.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        c2, s2 = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        rotated = torch.cat((-b, a), dim=-1)
        return (xf * c2 + rotated * s2).to(x.dtype)
    a, b = xf[..., 0::2], xf[..., 1::2]
    even, odd = a * c - b * s, a * s + b * c
    if style is RopeStyle.INTERLEAVED:
        return torch.stack((even, odd), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((even, odd), dim=-1).to(x.dtype)
