"""The Bamba hybrid config (``BambaForCausalLM``): Llama-style attention layers at
``attn_layer_indices`` and Mamba2 mixers everywhere else, parsed from and written to HF
``config.json`` with every field validated (``CheckpointError`` naming the key)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvplane.errors import CheckpointError
from kvplane.models.hf_fields import DecoderConfig, Family, bool_field, int_field, require_silu
from kvplane.models.rope import RopeSpec
from kvplane.state_split import MambaGeometry

BAMBA = "BambaForCausalLM"
ROTARY_FRACTION = 0.5
"""transformers hard-codes Bamba's ``partial_rotary_factor``: RoPE turns the first half of each
head (NEOX halves within it) and passes the rest through."""


@dataclass(frozen=True, slots=True)
class MambaShape(MambaGeometry):
    """One Mamba2 mixer's geometry (its state rows' :class:`MambaGeometry`, ``conv_dim``
    included): ``heads * head_dim == expand * hidden`` (the inner width)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise CheckpointError(
                f"mamba_n_heads {self.num_heads} is not a multiple of mamba_n_groups "
                f"{self.num_groups}"
            )
        if self.conv_kernel < 2:
            raise CheckpointError(f"mamba_d_conv {self.conv_kernel} must be >= 2")
        MambaGeometry.__post_init__(self)  # zero-argument super() fails in a slots dataclass

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class BambaConfig(DecoderConfig):
    """A Bamba decoder; see the module docstring. ``time_step_limit`` clamps ``dt``.

    The hybrid variants (:class:`~kvplane.models.granite_hybrid_config.GraniteHybridConfig`)
    extend it and override the properties that say how a layer scales and rotates:
    ``rotary_dim``, ``uses_rope``, ``sm_scale``, ``embedding_scale``, ``residual_scale``."""

    ARCHITECTURE: ClassVar[str] = BAMBA
    LAYERS_KEY: ClassVar[str] = "attn_layer_indices"
    """The HF key that places the attention layers."""

    num_kv_heads: int
    attn_layer_indices: tuple[int, ...]
    mamba: MambaShape
    rms_norm_eps: float = 1e-5
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    architecture: str = BAMBA

    def __post_init__(self) -> None:
        if self.architecture != self.ARCHITECTURE:
            raise CheckpointError(f"{self.architecture!r} is not {self.ARCHITECTURE}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"hidden_size {self.hidden_size}, num_attention_heads {self.num_heads} and "
                f"num_key_value_heads {self.num_kv_heads} must divide evenly"
            )
        if self.uses_rope and (self.rotary_dim % 2 or self.rotary_dim == 0):
            raise CheckpointError(f"head_dim {self.head_dim} leaves an odd rotary part")
        if not self.attn_layer_indices:
            raise CheckpointError(
                f"config.json {self.LAYERS_KEY!r} names no attention layer; kvplane serves a "
                "hybrid's attention layers from a paged KV pool, so it needs at least one"
            )
        bad = [i for i in self.attn_layer_indices if not 0 <= i < self.num_layers]
        if bad or len(set(self.attn_layer_indices)) != len(self.attn_layer_indices):
            raise CheckpointError(
                f"attn_layer_indices {list(self.attn_layer_indices)} must be distinct layers "
                f"in [0, {self.num_layers})"
            )
        lo, hi = self.time_step_limit
        if not 0 <= lo <= hi:
            raise CheckpointError(f"time_step_limit {self.time_step_limit} must be 0 <= lo <= hi")

    @property
    def family(self) -> Family:
        return Family.BAMBA

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """The leading channels of each head that RoPE turns (NEOX halves within them)."""
        return int(self.head_dim * ROTARY_FRACTION)

    @property
    def uses_rope(self) -> bool:
        """Whether attention turns ``rotary_dim`` channels with RoPE at all."""
        return True

    @property
    def sm_scale(self) -> float:
        """The attention softmax scale."""
        return float(self.head_dim**-0.5)

    @property
    def embedding_scale(self) -> float:
        """Factor on the token embeddings."""
        return 1.0

    @property
    def residual_scale(self) -> float:
        """Factor on each mixer's and MLP's output before it is added to the residual."""
        return 1.0

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.attn_layer_indices)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> BambaConfig:
        require_silu(d)
        heads = int_field(d, "num_attention_heads")
        max_pos = int_field(d, "max_position_embeddings", 262144)
        rope_raw = dict(d.get("rope_parameters") or {})
        factor = rope_raw.pop("partial_rotary_factor", ROTARY_FRACTION)
        if factor != ROTARY_FRACTION:
            raise CheckpointError(f"Bamba's partial_rotary_factor is 0.5, got {factor!r}")
        return cls.from_hf_fields(
            d,
            eps=1e-5,
            num_kv_heads=int_field(d, "num_key_value_heads", heads),
            attn_layer_indices=_indices(d.get("attn_layer_indices")),
            rope=RopeSpec.from_hf({**d, "rope_parameters": rope_raw or None}, max_pos),
            max_position_embeddings=max_pos,
            **mamba_fields(d),
        )

    def to_hf(self) -> dict[str, Any]:
        indices = {"attn_layer_indices": list(self.attn_layer_indices)}
        return self.decoder_hf("bamba") | self.mamba_hf() | indices

    def mamba_hf(self) -> dict[str, Any]:
        """The HF keys of the KV heads and the Mamba2 mixers (what :func:`mamba_fields` reads)."""
        m = self.mamba
        return {
            "num_key_value_heads": self.num_kv_heads, "mamba_n_heads": m.num_heads,
            "mamba_d_head": m.head_dim, "mamba_n_groups": m.num_groups,
            "mamba_d_state": m.state_size, "mamba_d_conv": m.conv_kernel,
            "mamba_expand": m.inner // self.hidden_size, "mamba_conv_bias": self.conv_bias,
            "mamba_proj_bias": self.proj_bias, "time_step_limit": list(self.time_step_limit),
        }  # fmt: skip


def mamba_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The Mamba2 fields of a hybrid's HF config ``d`` (transformers' Bamba and GraniteMoeHybrid
    keys and defaults): ``mamba``, ``conv_bias``, ``proj_bias``, ``time_step_limit``."""
    hidden = int_field(d, "hidden_size")
    expand = int_field(d, "mamba_expand", 2)
    m_heads = int_field(d, "mamba_n_heads", 128)
    raw_d_head = d.get("mamba_d_head", "auto")
    d_head = expand * hidden // m_heads if raw_d_head == "auto" else raw_d_head
    m_head_dim = int_field({"mamba_d_head": d_head}, "mamba_d_head")
    if m_head_dim * m_heads != expand * hidden:
        raise CheckpointError(
            f"mamba_n_heads {m_heads} x mamba_d_head {m_head_dim} != mamba_expand {expand} "
            f"x hidden_size {hidden}"
        )
    mamba = MambaShape(
        num_heads=m_heads, head_dim=m_head_dim,
        num_groups=int_field(d, "mamba_n_groups", 1),
        state_size=int_field(d, "mamba_d_state", 256),
        conv_kernel=int_field(d, "mamba_d_conv", 4),
    )  # fmt: skip
    return {
        "mamba": mamba,
        "conv_bias": bool_field(d, "mamba_conv_bias", True),
        "proj_bias": bool_field(d, "mamba_proj_bias", False),
        "time_step_limit": _limits(d.get("time_step_limit", (0.0, math.inf))),
    }


def _indices(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in raw
    ):
        raise CheckpointError(f"config.json 'attn_layer_indices' must list ints, got {raw!r:.80}")
    return tuple(raw)


def _limits(raw: Any) -> tuple[float, float]:
    """``[lo, hi]``; transformers writes a non-finite bound as ``{"__float__": "Infinity"}``."""
    if isinstance(raw, list | tuple):
        raw = [_json_float(v) for v in raw]
    ok = isinstance(raw, list | tuple) and len(raw) == 2
    if not ok or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in raw):
        raise CheckpointError(f"config.json 'time_step_limit' must be [lo, hi], got {raw!r:.80}")
    return float(raw[0]), float(raw[1])


def _json_float(v: Any) -> Any:
    if isinstance(v, Mapping) and set(v) == {"__float__"}:
        try:
            return float(v["__float__"])
        except (TypeError, ValueError):
            return v
    return v
