"""The Granite-4.0-H decoder (``GraniteMoeHybridForCausalLM``): a :class:`BambaModel` over
Granite's weights, so its Mamba2 mixers, recurrent state pool, step checks and serving paths are
Bamba's.

It owns Granite's layer weights (``input_layernorm``/``post_attention_layernorm``, the shared
MLP's fused ``input_linear``, the routed experts under ``block_sparse_moe``: the checkpoint names
or transformers 5's ``experts.gate_up_proj``/``down_proj``/``router.weight``) and the logits
division; the multipliers and RoPE switch are :class:`GraniteHybridConfig` properties that
:meth:`BambaModel._run_layers` reads. It must not change how Bamba computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack

import torch

from kvplane.models.bamba import BambaAttention, BambaLayer, BambaModel
from kvplane.models.config import MoEConfig
from kvplane.models.decoder import DecoderOptions
from kvplane.models.granite_hybrid_config import GraniteHybridConfig
from kvplane.models.layers import Linear, RMSNorm, SwiGLU
from kvplane.models.mamba import MambaMixer
from kvplane.models.moe import MoE
from kvplane.models.weights import TensorSource, WeightKind

EXPERT_NAMES = (
    ("router.layer.weight", "router.weight"),
    ("input_linear.weight", "experts.gate_up_proj"),
    ("output_linear.weight", "experts.down_proj"),
)
"""``(checkpoint name, transformers 5 name)`` of the router and experts under
``block_sparse_moe``; a checkpoint may use either."""


def moe_config(cfg: GraniteHybridConfig) -> MoEConfig:
    """The routed experts of ``cfg`` (``num_experts > 0``) as :class:`MoEConfig`: softmax over
    the top-k logits, as transformers' ``GraniteMoeHybridTopKRouter``."""
    return MoEConfig(
        num_experts=cfg.num_experts, experts_per_token=cfg.experts_per_token,
        intermediate_size=cfg.intermediate_size, num_shared_experts=0,
        routed_scaling_factor=1.0, scoring="topk_softmax", topk_method="greedy", num_groups=1,
        topk_groups=1, norm_topk_prob=True, first_k_dense_replace=0,
    )  # fmt: skip


def load_experts(src: TensorSource, prefix: str, cfg: MoEConfig, hidden: int) -> MoE:
    """The router and routed experts under ``prefix`` (``...block_sparse_moe``)."""
    e, inner = cfg.num_experts, cfg.intermediate_size
    router, gate_up, down = (
        f"{prefix}.{new}" if src.has(f"{prefix}.{new}") else f"{prefix}.{old}"
        for old, new in EXPERT_NAMES
    )
    return MoE(
        cfg,
        router=src.take(router, (e, hidden), WeightKind.MATRIX).float(),
        correction_bias=None,
        gate_up=src.take(gate_up, (e, 2 * inner, hidden), WeightKind.MATRIX),
        down=src.take(down, (e, hidden, inner), WeightKind.MATRIX),
        shared=None,
    )


@dataclass(frozen=True, slots=True)
class GraniteFeedForward:
    """A layer's MLP: the shared SwiGLU (``shared_mlp``; its ``input_linear`` holds gate then
    up), plus the routed experts in an MoE model."""

    shared: SwiGLU
    experts: MoE | None

    @classmethod
    def load(
        cls, src: TensorSource, cfg: GraniteHybridConfig, i: int, moe: MoEConfig | None
    ) -> GraniteFeedForward:
        p, hid, s = f"model.layers.{i}", cfg.hidden_size, cfg.shared_intermediate_size
        fused = src.take(f"{p}.shared_mlp.input_linear.weight", (2 * s, hid), WeightKind.MATRIX)
        down = Linear.load(src, f"{p}.shared_mlp.output_linear", hid, s)
        experts = load_experts(src, f"{p}.block_sparse_moe", moe, hid) if moe else None
        return cls(SwiGLU(Linear(fused[:s]), Linear(fused[s:]), down), experts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` in ``x``'s dtype."""
        out = self.shared(x)
        return out if self.experts is None else self.experts(x) + out


@dataclass(frozen=True, slots=True)
class DividedHead(Linear):
    """The LM head with its logits divided by ``divisor`` (``logits_scaling``) in the weights'
    dtype, as transformers does."""

    divisor: float = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return Linear.__call__(self, x) / self.divisor


class GraniteHybridModel(BambaModel):
    """A Granite-4.0-H decoder whose weights come from ``src``; see the module docstring."""

    FINAL_NORM = "model.norm"

    def __init__(
        self, config: GraniteHybridConfig, src: TensorSource, **options: Unpack[DecoderOptions]
    ) -> None:
        self.granite = config
        self._moe = moe_config(config) if config.num_experts else None
        super().__init__(config, src, **options)
        self.lm_head = DividedHead(self.lm_head.weight, self.lm_head.bias, config.logits_scaling)

    def _load_layer(self, src: TensorSource, i: int) -> BambaLayer:
        c = self.granite
        p, hid, eps = f"model.layers.{i}", c.hidden_size, c.rms_norm_eps
        is_attn = i in c.attn_layer_indices
        return BambaLayer(
            input_norm=RMSNorm.load(src, f"{p}.input_layernorm", hid, eps),
            attn=BambaAttention.load(src, c, i) if is_attn else None,
            mamba=None if is_attn else MambaMixer.load(src, c, i),
            pre_ff_norm=RMSNorm.load(src, f"{p}.post_attention_layernorm", hid, eps),
            mlp=GraniteFeedForward.load(src, c, i, self._moe),
        )
