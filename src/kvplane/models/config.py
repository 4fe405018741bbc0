"""Model configs: the Llama (with Mistral and Qwen2) and DeepSeek-V2/V3 families (the hybrids'
live in ``bamba_config`` and ``granite_hybrid_config``), parsed from (and written to) HF
``config.json`` dicts with every field validated.

A config is a frozen value; :func:`config_from_hf` picks the family from ``architectures`` and
raises :class:`~kvplane.errors.CheckpointError` naming the key for anything missing, mistyped or
unsupported (an unknown architecture lists the supported ones). ``to_hf()`` writes the keys that
``config_from_hf`` and transformers read, so a saved tiny model loads in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.errors import CheckpointError
from kvplane.models.bamba_config import BAMBA, BambaConfig
from kvplane.models.granite_hybrid_config import GRANITE_HYBRID, GraniteHybridConfig
from kvplane.models.hf_fields import DecoderConfig, Family
from kvplane.models.hf_fields import bool_field as _bool
from kvplane.models.hf_fields import float_field as _float
from kvplane.models.hf_fields import int_field as _int
from kvplane.models.hf_fields import opt_int_field as _opt_int
from kvplane.models.hf_fields import require_silu as _silu
from kvplane.models.rope import RopeSpec, RopeStyle

MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
LLAMA_ARCHITECTURES = ("LlamaForCausalLM", MISTRAL, QWEN2)
WINDOWED = (MISTRAL, QWEN2)
"""The Llama-family architectures with a ``sliding_window`` field."""
SLIDING, FULL = "sliding_attention", "full_attention"
"""transformers' ``layer_types`` entries."""
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
SUPPORTED_ARCHITECTURES = (*LLAMA_ARCHITECTURES, DEEPSEEK_V2, DEEPSEEK_V3, BAMBA, GRANITE_HYBRID)


def _qwen2_windows(d: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2's window fields as transformers reads them: ``sliding_window`` only with
    ``use_sliding_window``; ``layer_types`` as given, else sliding from layer
    ``max_window_layers`` on where there is a window."""
    window = _opt_int(d, "sliding_window") if _bool(d, "use_sliding_window", False) else None
    types = d.get("layer_types")
    if types is None:
        n, first = _int(d, "num_hidden_layers"), _int(d, "max_window_layers", 28, minimum=0)
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    if not isinstance(types, list):
        raise CheckpointError(f"config.json 'layer_types' must be a list, got {types!r}")
    return {"sliding_window": window, "layer_types": tuple(types)}


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """A Llama-family decoder: RMSNorm, NEOX RoPE, GQA attention, SwiGLU MLP.

    ``MistralForCausalLM`` is the same decoder with an optional ``sliding_window``: every layer
    attends to at most that many most recent keys (itself included). ``Qwen2ForCausalLM`` adds
    q/k/v biases (never an o bias) and per-layer ``layer_types``: only its ``sliding_attention``
    layers have the window (:meth:`layer_window`).
    """

    num_kv_heads: int
    head_dim: int
    architecture: str = "LlamaForCausalLM"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        arch = self.architecture
        if self.sliding_window is not None and arch not in WINDOWED:
            raise CheckpointError(f"sliding_window is not a field of {arch}")
        if arch == QWEN2 and self.attention_bias:
            raise CheckpointError(f"{QWEN2} has q/k/v biases and no attention_bias field")
        types = self.layer_types
        if types is not None:
            if arch != QWEN2:
                raise CheckpointError(f"layer_types is not a field of {arch}")
            if len(types) != self.num_layers or not set(types) <= {SLIDING, FULL}:
                raise CheckpointError(
                    f"config.json 'layer_types' must give {SLIDING!r} or {FULL!r} for each of "
                    f"the {self.num_layers} layers, got {list(types)!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def family(self) -> Family:
        return Family.LLAMA

    @property
    def qkv_bias(self) -> bool:
        """Whether the q/k/v projections have a bias (Qwen2's always do)."""
        return self.attention_bias or self.architecture == QWEN2

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window: ``sliding_window`` where ``layer_types`` is unset
        (Mistral) or says ``sliding_attention``; ``None`` (full attention) otherwise."""
        types = self.layer_types
        return self.sliding_window if types is None or types[i] == SLIDING else None

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> LlamaConfig:
        _silu(d)
        arch = str(d["architectures"][0])
        heads = _int(d, "num_attention_heads")
        head_dim = d.get("head_dim") or _int(d, "hidden_size") // heads
        max_pos = _int(d, "max_position_embeddings", 2048)
        windows: dict[str, Any] = (
            _qwen2_windows(d) if arch == QWEN2
            else {"sliding_window": _opt_int(d, "sliding_window") if arch == MISTRAL else None}
        )  # fmt: skip
        return cls.from_hf_fields(
            d,
            eps=1e-6,
            num_kv_heads=_int(d, "num_key_value_heads", heads),
            head_dim=_int({"head_dim": head_dim}, "head_dim"),
            rope=RopeSpec.from_hf(d, max_pos),
            max_position_embeddings=max_pos,
            architecture=arch,
            **windows,
        )

    def to_hf(self) -> dict[str, Any]:
        arch = self.architecture
        extra: dict[str, Any] = {"sliding_window": self.sliding_window} if arch == MISTRAL else {}
        if arch == QWEN2:
            extra = {
                "use_sliding_window": self.sliding_window is not None,
                "sliding_window": self.sliding_window,
                "layer_types": [
                    FULL if self.layer_window(i) is None else SLIDING
                    for i in range(self.num_layers)
                ],
            }
        model_type = {MISTRAL: "mistral", QWEN2: "qwen2"}.get(arch, "llama")
        return extra | self.decoder_hf(model_type) | {
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """DeepSeek mixture of experts: routed experts (top-k of ``num_experts``) plus shared ones.

    ``scoring`` is ``softmax`` (V2), ``sigmoid`` (V3, with a score-correction bias and group
    selection by the sum of each group's top-2 scores) or ``topk_softmax`` (Granite: the top-k
    logits, then a softmax over them; greedy, one group, no scaling); ``topk_method`` for V2 is
    ``greedy`` or ``group_limited_greedy`` (groups ranked by their best score).
    """

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    scoring: str
    topk_method: str
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    first_k_dense_replace: int
    layer_freq: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise CheckpointError(
                f"num_experts_per_tok {self.experts_per_token} must be in [1, "
                f"n_routed_experts={self.num_experts}]"
            )
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise CheckpointError(
                f"n_group {self.num_groups} must divide {self.num_experts} experts and "
                f"topk_group {self.topk_groups} must be in [1, n_group]"
            )
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise CheckpointError(f"topk_method {self.topk_method!r} is not supported")
        if self.scoring not in ("softmax", "sigmoid", "topk_softmax"):
            raise CheckpointError(
                f"MoE scoring {self.scoring!r} is not softmax, sigmoid or topk_softmax"
            )
        if self.scoring == "topk_softmax" and (
            self.topk_method != "greedy" or self.num_groups != 1 or self.num_shared_experts
            or self.routed_scaling_factor != 1.0
        ):  # fmt: skip
            raise CheckpointError(
                "topk_softmax routing is greedy over one group of experts, none shared, unscaled"
            )
        if self.scoring == "sigmoid" and self.num_experts // self.num_groups < 2:
            raise CheckpointError(
                f"sigmoid routing ranks groups by their top-2 experts: {self.num_experts} "
                f"experts in {self.num_groups} groups leaves fewer than 2 per group"
            )

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.layer_freq == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepSeekConfig(DecoderConfig):
    """A DeepSeek-V2/V3 decoder: MLA (optional q LoRA, latent KV, decoupled RoPE) + dense/MoE."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in (DEEPSEEK_V2, DEEPSEEK_V3):
            raise CheckpointError(f"{self.architecture!r} is not a DeepSeek architecture")
        if self.qk_rope_head_dim % 2:
            raise CheckpointError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.architecture == DEEPSEEK_V2 and not self.rope_interleave:
            raise CheckpointError("DeepSeek-V2 always interleaves its rope channels")

    @property
    def family(self) -> Family:
        return Family.DEEPSEEK

    @property
    def rope_style(self) -> RopeStyle:
        """V2: interleaved pairs in place; V3: interleaved pairs written split (``rope_interleave``)
        or NEOX halves."""
        if self.architecture == DEEPSEEK_V2:
            return RopeStyle.INTERLEAVED
        return RopeStyle.INTERLEAVED_SPLIT if self.rope_interleave else RopeStyle.NEOX

    @property
    def sm_scale(self) -> float:
        """``(qk_nope + qk_rope) ** -0.5`` times yarn's ``mscale ** 2``."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        return float(scale * self.rope.softmax_scale_factor)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> DeepSeekConfig:
        _silu(d)
        arch = str(d["architectures"][0])
        max_pos = _int(d, "max_position_embeddings", 2048)
        v3 = arch == DEEPSEEK_V3
        moe = None
        experts = d.get("n_routed_experts")
        if experts:
            moe = MoEConfig(
                num_experts=_int(d, "n_routed_experts"),
                experts_per_token=_int(d, "num_experts_per_tok"),
                intermediate_size=_int(d, "moe_intermediate_size"),
                num_shared_experts=_int(d, "n_shared_experts", 0, minimum=0),
                routed_scaling_factor=_float(d, "routed_scaling_factor", 1.0),
                scoring="sigmoid" if v3 else "softmax",
                topk_method="noaux_tc" if v3 else str(d.get("topk_method") or "greedy"),
                num_groups=_opt_int(d, "n_group") or 1,
                topk_groups=_opt_int(d, "topk_group") or 1,
                norm_topk_prob=_bool(d, "norm_topk_prob", v3),
                first_k_dense_replace=_int(d, "first_k_dense_replace", 0, minimum=0),
                layer_freq=_int(d, "moe_layer_freq", 1),
            )
        return cls.from_hf_fields(
            d,
            eps=1e-6,
            architecture=arch,
            q_lora_rank=_opt_int(d, "q_lora_rank"),
            kv_lora_rank=_int(d, "kv_lora_rank"),
            qk_nope_head_dim=_int(d, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(d, "qk_rope_head_dim"),
            v_head_dim=_int(d, "v_head_dim"),
            rope=RopeSpec.from_hf(d, max_pos),
            rope_interleave=_bool(d, "rope_interleave", True) if v3 else True,
            max_position_embeddings=max_pos,
            moe=moe,
        )

    def to_hf(self) -> dict[str, Any]:
        v3 = self.architecture == DEEPSEEK_V3
        out = self.decoder_hf("deepseek_v3" if v3 else "deepseek_v2") | {
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "n_routed_experts": None,
            "first_k_dense_replace": self.num_layers,
        }  # fmt: skip
        if v3:
            out["rope_interleave"] = self.rope_interleave
            out["num_nextn_predict_layers"] = 0
        m = self.moe
        if m is not None:
            out.update({
                "n_routed_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
                "moe_intermediate_size": m.intermediate_size,
                "n_shared_experts": m.num_shared_experts,
                "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.num_groups,
                "topk_group": m.topk_groups, "norm_topk_prob": m.norm_topk_prob,
                "first_k_dense_replace": m.first_k_dense_replace, "moe_layer_freq": m.layer_freq,
            })  # fmt: skip
            if not v3:
                out["topk_method"] = m.topk_method
        return out


ModelConfig = LlamaConfig | DeepSeekConfig | BambaConfig
"""A :class:`GraniteHybridConfig` is a :class:`BambaConfig`."""


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """Parse an HF ``config.json`` dict; ``CheckpointError`` for an unsupported architecture."""
    if not isinstance(d, Mapping):
        raise CheckpointError(f"config.json must hold an object, got {type(d).__name__}")
    archs = d.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise CheckpointError(f"config.json 'architectures' must name one class, got {archs!r}")
    if archs[0] in LLAMA_ARCHITECTURES:
        return LlamaConfig.from_hf(d)
    if archs[0] in (DEEPSEEK_V2, DEEPSEEK_V3):
        return DeepSeekConfig.from_hf(d)
    if archs[0] == BAMBA:
        return BambaConfig.from_hf(d)
    if archs[0] == GRANITE_HYBRID:
        return GraniteHybridConfig.from_hf(d)
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise CheckpointError(f"architecture {archs[0]!r} is not supported; supported: {supported}")
