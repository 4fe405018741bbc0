"""The Llama-family decoder (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``) over a paged GQA KV cache.

RMSNorm, NEOX RoPE, GQA over the ``gqa_*`` backends (each layer's sliding window, if any, is
its problem's ``window``), SwiGLU; HF weight names. See docs/attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack

import torch

from kvplane.attention import GQAQuery, gqa_problem
from kvplane.layout import BLOCK_MAJOR, Axis, KVLayout
from kvplane.models.config import LlamaConfig
from kvplane.models.decoder import DecoderOptions, PagedDecoder, StepAttention
from kvplane.models.kv import PagedKVCache
from kvplane.models.layers import Linear, RMSNorm, SwiGLU, load_trunk
from kvplane.models.rope import RopeStyle, apply_rope, rope_tables
from kvplane.models.step import StepBatch
from kvplane.models.weights import TensorSource


@dataclass(frozen=True, slots=True)
class LlamaLayer:
    """One decoder layer's weights."""

    input_norm: RMSNorm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    post_norm: RMSNorm
    mlp: SwiGLU

    @classmethod
    def load(cls, src: TensorSource, cfg: LlamaConfig, i: int) -> LlamaLayer:
        p = f"model.layers.{i}"
        hid, d, b, qkv = cfg.hidden_size, cfg.head_dim, cfg.attention_bias, cfg.qkv_bias
        return cls(
            input_norm=RMSNorm.load(src, f"{p}.input_layernorm", hid, cfg.rms_norm_eps),
            q=Linear.load(src, f"{p}.self_attn.q_proj", cfg.num_heads * d, hid, qkv),
            k=Linear.load(src, f"{p}.self_attn.k_proj", cfg.num_kv_heads * d, hid, qkv),
            v=Linear.load(src, f"{p}.self_attn.v_proj", cfg.num_kv_heads * d, hid, qkv),
            o=Linear.load(src, f"{p}.self_attn.o_proj", hid, cfg.num_heads * d, b),
            post_norm=RMSNorm.load(src, f"{p}.post_attention_layernorm", hid, cfg.rms_norm_eps),
            mlp=SwiGLU.load(src, f"{p}.mlp", hid, cfg.intermediate_size, cfg.mlp_bias),
        )


class LlamaModel(PagedDecoder):
    """A Llama decoder whose weights come from ``src`` (a checkpoint or a seeded generator).

    Every tensor is read and checked (``CheckpointError`` for a missing, mis-shaped or unused
    one) before the model exists.
    """

    def __init__(
        self, config: LlamaConfig, src: TensorSource, **options: Unpack[DecoderOptions]
    ) -> None:
        trunk = load_trunk(src, config, lambda i: LlamaLayer.load(src, config, i), "model.norm")
        super().__init__(config, trunk, **options)
        self.layers = trunk.layers
        self.llama = config

    def kv_layout(
        self, num_blocks: int, block_size: int, order: tuple[Axis, ...] = BLOCK_MAJOR
    ) -> KVLayout:
        """The GQA pool of every layer with each layer's window (``layer_windows``; one window
        on every layer, as Mistral's or Qwen2's all sliding, is the pool's ``sliding_window``),
        so PD moves, per window group, only the positions its attention reads
        (:meth:`KVLayout.window_start`), and the blocks out of a window are freed
        (:meth:`~kvplane.blocks.BlockTable.drop_before`) where every layer of a pool slides:
        one pool, or one per KV cache group (:class:`~kvplane.models.kv.GroupedKVCache`)."""
        c = self.llama
        return KVLayout.gqa(
            num_blocks=num_blocks, block_size=block_size, num_layers=c.num_layers,
            kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype, order=order,
            layer_windows=tuple(c.layer_window(i) for i in range(c.num_layers)),
        )  # fmt: skip

    def _run_layers(
        self, x: torch.Tensor, batch: StepBatch, kv: PagedKVCache, attention: StepAttention
    ) -> torch.Tensor:
        c = self.llama
        t, d = x.shape[0], c.head_dim
        cos, sin = rope_tables(c.rope, d, batch.positions)
        for i, layer in enumerate(self.layers):
            pages = batch.pages(kv.group_of(i))  # its KV cache group's pool and page table
            h = layer.input_norm(x)
            q = apply_rope(layer.q(h).view(t, c.num_heads, d), cos, sin, RopeStyle.NEOX)
            k = apply_rope(layer.k(h).view(t, c.num_kv_heads, d), cos, sin, RopeStyle.NEOX)
            kv.write_kv(i, pages.slot_mapping, k, layer.v(h).view(t, c.num_kv_heads, d))
            query, cache = GQAQuery(q), kv.gqa(i)
            problem = gqa_problem(
                query, cache, pages.metadata, sm_scale=d**-0.5, causal=True,
                window=c.layer_window(i),
            )  # fmt: skip
            out = attention.run(problem, query, cache).out
            x = x + layer.o(out.reshape(t, c.num_heads * d))
            x = x + layer.mlp(layer.post_norm(x))
        return x
