"""What every model config shares: the :class:`Family` enum, typed fields of an HF
``config.json`` dict (each reader returns the validated value or raises
:class:`~kvplane.errors.CheckpointError` naming the key), and the decoder keys every family
reads and writes alike (:class:`DecoderConfig`, the base of every family's config)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from kvplane.errors import CheckpointError
from kvplane.models.rope import RopeSpec
from kvplane.validators import require_bool, require_int, require_number

_MISSING = object()


class Family(enum.Enum):
    """Which model class serves a config (the loader's registry key)."""

    LLAMA = "llama"
    DEEPSEEK = "deepseek"
    BAMBA = "bamba"
    GRANITE_HYBRID = "granite_hybrid"


def int_field(d: Mapping[str, Any], key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    value = d.get(key, default)
    if value is None and default is not _MISSING:
        value = default  # JSON null means "unset"
    if value is _MISSING or value is None:
        raise CheckpointError(f"config.json has no {key!r}")
    return require_int(f"config.json {key!r}", value, min=minimum, error=CheckpointError)


def opt_int_field(d: Mapping[str, Any], key: str) -> int | None:
    return None if d.get(key) is None else int_field(d, key)


def float_field(d: Mapping[str, Any], key: str, default: float) -> float:
    """``d[key]`` (or ``default``) as a finite float >= 0; ``CheckpointError`` otherwise."""
    value = d.get(key, default)
    return require_number(f"config.json {key!r}", value, min=0, error=CheckpointError)


def bool_field(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if value is None:
        return default
    return require_bool(f"config.json {key!r}", value, error=CheckpointError)


def require_silu(d: Mapping[str, Any]) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json hidden_act {act!r} is not supported (only 'silu')")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderConfig:
    """The fields every family's config has, read from and written to the same HF keys; a
    family's config extends it (and may change a default)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = field(default_factory=RopeSpec)
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_fields(cls, d: Mapping[str, Any], *, eps: float, **family: Any) -> Self:
        """The config of HF dict ``d``: the shared fields read here (``eps``: the family's
        default ``rms_norm_eps``), the family's own given in ``family``. ``CheckpointError``
        naming the key for a missing or mistyped one."""
        return cls(
            vocab_size=int_field(d, "vocab_size"),
            hidden_size=int_field(d, "hidden_size"),
            intermediate_size=int_field(d, "intermediate_size"),
            num_layers=int_field(d, "num_hidden_layers"),
            num_heads=int_field(d, "num_attention_heads"),
            rms_norm_eps=float_field(d, "rms_norm_eps", eps),
            attention_bias=bool_field(d, "attention_bias", False),
            mlp_bias=bool_field(d, "mlp_bias", False),
            tie_word_embeddings=bool_field(d, "tie_word_embeddings", False),
            **family,
        )

    def decoder_hf(self, model_type: str) -> dict[str, Any]:
        """The HF keys of the shared fields (a family adds its own to this dict)."""
        return {
            "architectures": [self.architecture], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf(), "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
        }  # fmt: skip
