"""The Granite-4.0-H config (``GraniteMoeHybridForCausalLM``): a Bamba-style hybrid (Mamba2 and
GQA attention layers, the same mixers and recurrent state) with muP multipliers, optional RoPE
and a shared MLP beside optional routed experts, parsed from and written to HF ``config.json``
with every field validated (``CheckpointError`` naming the key).

It owns the config only; :mod:`kvplane.models.granite_hybrid` builds the model. Field meanings:
docs/attention.md, "Sliding-window and hybrid models".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvplane.errors import CheckpointError
from kvplane.models.bamba_config import BambaConfig, mamba_fields
from kvplane.models.hf_fields import Family, int_field, require_silu
from kvplane.models.rope import RopeSpec
from kvplane.validators import require_number

GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
MAMBA, ATTENTION = ("mamba", "linear_attention"), ("attention", "full_attention")
"""``layer_types`` entries: checkpoints write the first names, transformers 5 the second."""
ROPE, NOPE = "rope", "nope"
SCALES = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
"""The muP fields: config.json keys and field names alike, each a finite number > 0."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GraniteHybridConfig(BambaConfig):
    """A Granite-4.0-H decoder; see the module docstring.

    ``attn_layer_indices`` are the ``attention`` entries of ``layer_types``. Embeddings are
    multiplied by ``embedding_multiplier``, each mixer's and MLP's output by
    ``residual_multiplier``, logits divided by ``logits_scaling``; ``attention_multiplier`` is
    the softmax scale. RoPE (whole head, NEOX) only when ``position_embedding`` is ``"rope"``.
    The MLP is a shared SwiGLU of ``shared_intermediate_size`` plus, when ``num_experts > 0``,
    ``experts_per_token`` of ``num_experts`` routed SwiGLU experts of ``intermediate_size``.
    """

    ARCHITECTURE: ClassVar[str] = GRANITE_HYBRID
    LAYERS_KEY: ClassVar[str] = "layer_types"

    architecture: str = GRANITE_HYBRID
    rms_norm_eps: float = 1e-6
    position_embedding: str = NOPE
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    num_experts: int = 0
    experts_per_token: int = 0
    shared_intermediate_size: int = 1024

    def __post_init__(self) -> None:
        BambaConfig.__post_init__(self)  # zero-argument super() fails in a slots dataclass
        if self.position_embedding not in (ROPE, NOPE):
            raise CheckpointError(
                f"config.json 'position_embedding_type' must be {ROPE!r} or {NOPE!r} (null), "
                f"got {self.position_embedding!r:.40}"
            )
        for key in SCALES:
            require_number(f"config.json {key!r}", getattr(self, key), above=0,
                           error=CheckpointError)  # fmt: skip
        if self.mlp_bias:
            raise CheckpointError(f"mlp_bias is not a field of {GRANITE_HYBRID}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise CheckpointError(
                f"config.json 'num_experts_per_tok' {self.experts_per_token} must be in "
                f"[1, num_local_experts={self.num_experts}]"
            )

    @property
    def family(self) -> Family:
        return Family.GRANITE_HYBRID

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    @property
    def uses_rope(self) -> bool:
        return self.position_embedding == ROPE

    @property
    def sm_scale(self) -> float:
        return self.attention_multiplier

    @property
    def embedding_scale(self) -> float:
        return self.embedding_multiplier

    @property
    def residual_scale(self) -> float:
        return self.residual_multiplier

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> GraniteHybridConfig:
        require_silu(d)
        hidden, heads = int_field(d, "hidden_size"), int_field(d, "num_attention_heads")
        if d.get("head_dim") is not None and int_field(d, "head_dim") != hidden // heads:
            raise CheckpointError(
                f"config.json 'head_dim' {d['head_dim']} must be hidden_size // "
                f"num_attention_heads = {hidden // heads}"
            )
        position = d.get("position_embedding_type")
        max_pos = int_field(d, "max_position_embeddings", 2048)
        experts = int_field(d, "num_local_experts", 8, minimum=0)
        return cls.from_hf_fields(
            d,
            eps=1e-6,
            num_kv_heads=int_field(d, "num_key_value_heads", heads),
            attn_layer_indices=_attention_layers(d, int_field(d, "num_hidden_layers")),
            rope=RopeSpec.from_hf(d, max_pos),
            max_position_embeddings=max_pos,
            position_embedding=NOPE if position is None else position,
            **{key: d.get(key, 1.0) for key in SCALES},  # checked by __post_init__
            num_experts=experts,
            experts_per_token=int_field(d, "num_experts_per_tok", 2, minimum=0),
            shared_intermediate_size=int_field(d, "shared_intermediate_size", 1024),
            **mamba_fields(d),
        )

    def to_hf(self) -> dict[str, Any]:
        attn = set(self.attn_layer_indices)
        types = [ATTENTION[0] if i in attn else MAMBA[0] for i in range(self.num_layers)]
        out = self.decoder_hf("granitemoehybrid") | self.mamba_hf()
        del out["mlp_bias"]
        return out | {
            "layer_types": types, "position_embedding_type": self.position_embedding,
            "embedding_multiplier": self.embedding_multiplier,
            "attention_multiplier": self.attention_multiplier,
            "residual_multiplier": self.residual_multiplier,
            "logits_scaling": self.logits_scaling, "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token,
            "shared_intermediate_size": self.shared_intermediate_size,
        }  # fmt: skip


def _attention_layers(d: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """The attention layers of ``layer_types`` (older files: ``layers_block_type``); absent,
    every layer is Mamba2 (as transformers reads it, and none is refused)."""
    key = "layer_types" if "layer_types" in d else "layers_block_type"
    raw = d.get(key)
    if raw is None:
        return ()
    known = (*MAMBA, *ATTENTION)
    if not isinstance(raw, list) or len(raw) != num_layers or not all(t in known for t in raw):
        raise CheckpointError(
            f"config.json {key!r} must give 'mamba' or 'attention' for each of the "
            f"{num_layers} layers, got {raw!r:.80}"
        )
    return tuple(i for i, t in enumerate(raw) if t in ATTENTION)
