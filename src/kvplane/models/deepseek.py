"""The DeepSeek-V2/V3 decoder over a paged MLA latent cache.

Absorbed attention for decode, decompressed (``mha``) for prefill, chosen by :class:`MLAPath`
and passed to ``mla_problem`` explicitly; dense or MoE MLP. The MLA math: docs/attention.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Unpack

import torch

from kvplane.attention import MLAQuery, MLAUpProjection, mla_problem
from kvplane.layout import BLOCK_MAJOR, Axis, KVLayout
from kvplane.models.config import DEEPSEEK_V3, DeepSeekConfig
from kvplane.models.decoder import DecoderOptions, PagedDecoder, StepAttention
from kvplane.models.kv import PagedKVCache
from kvplane.models.layers import Linear, RMSNorm, SwiGLU, load_trunk
from kvplane.models.moe import MoE
from kvplane.models.rope import apply_rope, rope_tables
from kvplane.models.step import StepBatch
from kvplane.models.weights import TensorSource, WeightKind


class MLAPath(enum.Enum):
    """Which MLA computation a step uses; see the module docstring."""

    AUTO = "auto"
    ABSORBED = "absorbed"
    DECOMPRESSED = "decompressed"


@dataclass(frozen=True, slots=True)
class QLoRA:
    """The low-rank query path ``q_b(norm(q_a(x)))``."""

    a: Linear
    norm: RMSNorm
    b: Linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


@dataclass(frozen=True, slots=True)
class MLAWeights:
    """One layer's attention weights. ``query`` is ``q_proj`` or the q LoRA; ``up`` holds
    ``kv_b_proj`` split per head into ``w_uk [H, r, d_nope]`` and ``w_uv [H, r, d_v]``."""

    query: Linear | QLoRA
    kv_a: Linear
    kv_norm: RMSNorm
    up: MLAUpProjection
    o: Linear

    @classmethod
    def load(cls, src: TensorSource, cfg: DeepSeekConfig, prefix: str) -> MLAWeights:
        hid, h, r, bias = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.attention_bias
        dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        query: Linear | QLoRA
        if cfg.q_lora_rank is None:
            query = Linear.load(src, f"{prefix}.q_proj", h * (dn + dr), hid)
        else:
            rank = cfg.q_lora_rank
            query = QLoRA(
                Linear.load(src, f"{prefix}.q_a_proj", rank, hid, bias),
                RMSNorm.load(src, f"{prefix}.q_a_layernorm", rank, 1e-6),
                Linear.load(src, f"{prefix}.q_b_proj", h * (dn + dr), rank),
            )
        kv_b = src.take(f"{prefix}.kv_b_proj.weight", (h * (dn + dv), r), WeightKind.MATRIX)
        per_head = kv_b.view(h, dn + dv, r)
        up = MLAUpProjection(
            w_uk=per_head[:, :dn].transpose(1, 2).contiguous(),
            w_uv=per_head[:, dn:].transpose(1, 2).contiguous(),
        )
        return cls(
            query=query,
            kv_a=Linear.load(src, f"{prefix}.kv_a_proj_with_mqa", r + dr, hid, bias),
            kv_norm=RMSNorm.load(src, f"{prefix}.kv_a_layernorm", r, 1e-6),
            up=up,
            o=Linear.load(src, f"{prefix}.o_proj", hid, h * dv, bias),
        )


@dataclass(frozen=True, slots=True)
class DeepSeekLayer:
    input_norm: RMSNorm
    attn: MLAWeights
    post_norm: RMSNorm
    mlp: SwiGLU | MoE


class DeepSeekModel(PagedDecoder):
    """A DeepSeek-V2/V3 decoder whose weights come from ``src``; ``mla_path`` picks the MLA
    computation (see :class:`MLAPath`). Every tensor is checked before the model exists."""

    def __init__(
        self,
        config: DeepSeekConfig,
        src: TensorSource,
        *,
        mla_path: MLAPath = MLAPath.AUTO,
        **options: Unpack[DecoderOptions],
    ) -> None:
        hid, eps = config.hidden_size, config.rms_norm_eps

        def layer(i: int) -> DeepSeekLayer:
            p = f"model.layers.{i}"
            mlp: SwiGLU | MoE
            if config.moe is not None and config.moe.is_moe_layer(i):
                v3 = config.architecture == DEEPSEEK_V3
                mlp = MoE.load(src, f"{p}.mlp", config.moe, hid, v3)
            else:
                mlp = SwiGLU.load(src, f"{p}.mlp", hid, config.intermediate_size, config.mlp_bias)
            return DeepSeekLayer(
                input_norm=RMSNorm.load(src, f"{p}.input_layernorm", hid, eps),
                attn=MLAWeights.load(src, config, f"{p}.self_attn"),
                post_norm=RMSNorm.load(src, f"{p}.post_attention_layernorm", hid, eps),
                mlp=mlp,
            )

        trunk = load_trunk(src, config, layer, "model.norm")
        super().__init__(config, trunk, **options)
        self.layers = trunk.layers
        self.deepseek = config
        self.mla_path = mla_path

    def kv_layout(
        self, num_blocks: int, block_size: int, order: tuple[Axis, ...] = BLOCK_MAJOR
    ) -> KVLayout:
        c = self.deepseek
        return KVLayout.mla(
            num_blocks=num_blocks, block_size=block_size, num_layers=c.num_layers,
            latent_dim=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim, dtype=self.dtype, order=order,
        )  # fmt: skip

    def absorbed(self, batch: StepBatch) -> bool:
        """Whether ``batch`` runs the absorbed MLA path."""
        if self.mla_path is MLAPath.ABSORBED:
            return True
        return self.mla_path is MLAPath.AUTO and batch.is_decode

    def _run_layers(
        self, x: torch.Tensor, batch: StepBatch, kv: PagedKVCache, attention: StepAttention
    ) -> torch.Tensor:
        c = self.deepseek
        t, h, r = x.shape[0], c.num_heads, c.kv_lora_rank
        dn, dr = c.qk_nope_head_dim, c.qk_rope_head_dim
        cos, sin = rope_tables(c.rope, dr, batch.positions)
        absorbed = self.absorbed(batch)
        for i, layer in enumerate(self.layers):
            a = layer.attn
            hs = layer.input_norm(x)
            q = a.query(hs).view(t, h, dn + dr)
            q_nope, q_pe = q[..., :dn], apply_rope(q[..., dn:], cos, sin, c.rope_style)
            ckv = a.kv_a(hs)
            k_pe = apply_rope(ckv[:, None, r:], cos, sin, c.rope_style)[:, 0]
            kv.write_latent(i, batch.slot_mapping, torch.cat((a.kv_norm(ckv[:, :r]), k_pe), -1))
            if absorbed:
                query = MLAQuery.packed(torch.cat((a.up.absorb_query(q_nope), q_pe), -1), r)
                cache = kv.mla(i)
            else:
                query = MLAQuery.packed(torch.cat((q_nope, q_pe), -1), dn)
                cache = kv.mla(i, a.up)
            problem = mla_problem(
                query, cache, batch.metadata, sm_scale=c.sm_scale, causal=True, absorbed=absorbed
            )
            out = attention.run(problem, query, cache).out
            if absorbed:
                out = a.up.project_output(out)
            x = x + a.o(out.reshape(t, h * c.v_head_dim))
            x = x + layer.mlp(layer.post_norm(x))
        return x
