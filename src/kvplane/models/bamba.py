"""The Bamba hybrid decoder (``BambaForCausalLM``): GQA attention layers over paged KV and
Mamba2 layers over a per-request :class:`~kvplane.models.recurrent.RecurrentState`.

Attention turns the first half of each head with NEOX RoPE; every layer is
``x + mixer(norm(x))`` then ``x + SwiGLU(norm(x))``. A hybrid variant (Granite-4.0-H,
:mod:`kvplane.models.granite_hybrid`) subclasses :class:`BambaModel`: it loads its own layers
(``_load_layer``) and its config's properties scale and rotate. ``forward_step`` takes a
:class:`~kvplane.models.recurrent.HybridKVCache` (``new_kv_cache``); each request names its
state row (``StepRequest.state_slot``); a request starting at 0 restarts its row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Unpack

import torch

from kvplane.attention import GQAQuery, gqa_problem
from kvplane.errors import InvalidArgumentError
from kvplane.layout import BLOCK_MAJOR, Axis, KVLayout
from kvplane.models.bamba_config import BambaConfig
from kvplane.models.decoder import DecoderOptions, PagedDecoder, StepAttention
from kvplane.models.kv import PagedKVCache
from kvplane.models.layers import Linear, RMSNorm, SwiGLU, load_trunk
from kvplane.models.mamba import MambaMixer
from kvplane.models.recurrent import HybridKVCache, RecurrentState, state_layout
from kvplane.models.rope import RopeStyle, apply_rope, rope_tables
from kvplane.models.step import StepBatch
from kvplane.models.weights import TensorSource

DEFAULT_STATE_SLOTS = 8
"""State rows of a pool made by :meth:`BambaModel.new_kv_cache` (concurrent requests)."""

FeedForward = Callable[[torch.Tensor], torch.Tensor]
"""A layer's MLP: ``[T, hidden]`` -> ``[T, hidden]`` in the input's dtype."""


@dataclass(frozen=True, slots=True)
class BambaAttention:
    q: Linear
    k: Linear
    v: Linear
    o: Linear

    @classmethod
    def load(cls, src: TensorSource, cfg: BambaConfig, i: int) -> BambaAttention:
        p, hid, d, b = (
            f"model.layers.{i}.self_attn",
            cfg.hidden_size,
            cfg.head_dim,
            cfg.attention_bias,
        )
        return cls(
            q=Linear.load(src, f"{p}.q_proj", cfg.num_heads * d, hid, b),
            k=Linear.load(src, f"{p}.k_proj", cfg.num_kv_heads * d, hid, b),
            v=Linear.load(src, f"{p}.v_proj", cfg.num_kv_heads * d, hid, b),
            o=Linear.load(src, f"{p}.o_proj", hid, cfg.num_heads * d, b),
        )


@dataclass(frozen=True, slots=True)
class BambaLayer:
    """One layer: exactly one of ``attn`` / ``mamba`` is set."""

    input_norm: RMSNorm
    attn: BambaAttention | None
    mamba: MambaMixer | None
    pre_ff_norm: RMSNorm
    mlp: FeedForward

    @classmethod
    def load(cls, src: TensorSource, cfg: BambaConfig, i: int) -> BambaLayer:
        p, hid, eps = f"model.layers.{i}", cfg.hidden_size, cfg.rms_norm_eps
        is_attn = i in cfg.attn_layer_indices
        return cls(
            input_norm=RMSNorm.load(src, f"{p}.input_layernorm", hid, eps),
            attn=BambaAttention.load(src, cfg, i) if is_attn else None,
            mamba=None if is_attn else MambaMixer.load(src, cfg, i),
            pre_ff_norm=RMSNorm.load(src, f"{p}.pre_ff_layernorm", hid, eps),
            mlp=SwiGLU.load(src, f"{p}.feed_forward", hid, cfg.intermediate_size, cfg.mlp_bias),
        )


class BambaModel(PagedDecoder):
    """A Bamba decoder whose weights come from ``src``; see the module docstring."""

    FINAL_NORM: ClassVar[str] = "model.final_layernorm"

    def __init__(
        self, config: BambaConfig, src: TensorSource, **options: Unpack[DecoderOptions]
    ) -> None:
        self.bamba = config
        trunk = load_trunk(src, config, lambda i: self._load_layer(src, i), self.FINAL_NORM)
        super().__init__(config, trunk, **options)
        self.layers = trunk.layers

    def _load_layer(self, src: TensorSource, i: int) -> BambaLayer:
        """Layer ``i``'s weights (``self.bamba`` is set)."""
        return BambaLayer.load(src, self.bamba, i)

    def kv_layout(
        self, num_blocks: int, block_size: int, order: tuple[Axis, ...] = BLOCK_MAJOR
    ) -> KVLayout:
        """The paged KV of the attention layers only (the Mamba layers keep no KV)."""
        c = self.bamba
        return KVLayout.gqa(
            num_blocks=num_blocks, block_size=block_size, layer_ids=c.attn_layer_indices,
            kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=self.dtype, order=order,
        )  # fmt: skip

    def state_layout(self, num_slots: int) -> KVLayout:
        """The STATE layout of ``num_slots`` request rows (one row per Mamba layer)."""
        return state_layout(self.bamba.mamba, self.bamba.mamba_layers, num_slots)

    def new_state(
        self, num_slots: int = DEFAULT_STATE_SLOTS, pool: torch.Tensor | None = None
    ) -> RecurrentState:
        """The recurrent state of ``num_slots`` request rows: zeroed on the model's device, or
        views of ``pool`` (a tensor of :meth:`state_layout`, e.g. a worker's state pool)."""
        c = self.bamba
        return RecurrentState(c.mamba, c.mamba_layers, num_slots, self.device, pool)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        layout = self.kv_layout(num_blocks, block_size)
        return HybridKVCache(layout, self.new_state(), device=self.device)

    def check_step(self, batch: StepBatch, kv: PagedKVCache) -> None:
        """The decoder's checks, then the state: a :class:`HybridKVCache`, distinct state
        slots, each request starting at 0 or where its slot stopped."""
        super().check_step(batch, kv)
        if not isinstance(kv, HybridKVCache):
            raise InvalidArgumentError(
                f"a Bamba step needs a HybridKVCache (new_kv_cache), got {type(kv).__name__}"
            )
        if len(batch.state_slots) != batch.batch_size:
            raise InvalidArgumentError(
                f"{batch.batch_size} requests but {len(batch.state_slots)} state slots"
            )
        if len(set(batch.state_slots)) != len(batch.state_slots):
            raise InvalidArgumentError(f"two requests share a state slot: {batch.state_slots}")
        for slot, rng in zip(batch.state_slots, batch.ranges, strict=True):
            kv.state.check_advance(slot, rng.start)

    def _run_layers(
        self, x: torch.Tensor, batch: StepBatch, kv: PagedKVCache, attention: StepAttention
    ) -> torch.Tensor:
        assert isinstance(kv, HybridKVCache)  # check_step
        c, state = self.bamba, kv.state
        t, d, res = x.shape[0], c.head_dim, c.residual_scale
        x = x * c.embedding_scale
        tables = rope_tables(c.rope, c.rotary_dim, batch.positions) if c.uses_rope else None
        rows, first = [], 0
        for slot, rng in zip(batch.state_slots, batch.ranges, strict=True):
            if rng.start == 0:
                state.reset(slot)
            rows.append(slice(first, first + len(rng)))
            first += len(rng)
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            if layer.attn is not None:
                a = layer.attn
                q, k = a.q(h).view(t, c.num_heads, d), a.k(h).view(t, c.num_kv_heads, d)
                if tables is not None:
                    q, k = self._rope(q, *tables), self._rope(k, *tables)
                kv.write_kv(i, batch.slot_mapping, k, a.v(h).view(t, c.num_kv_heads, d))
                query, cache = GQAQuery(q), kv.gqa(i)
                problem = gqa_problem(
                    query, cache, batch.metadata, sm_scale=c.sm_scale, causal=True
                )
                out = attention.run(problem, query, cache).out.reshape(t, c.num_heads * d)
                x = x + a.o(out) * res
            else:
                assert layer.mamba is not None
                mixed = [
                    layer.mamba(h[r], state.conv(i, slot), state.ssm(i, slot))
                    for slot, r in zip(batch.state_slots, rows, strict=True)
                ]
                x = x + torch.cat(mixed) * res
            x = x + layer.mlp(layer.pre_ff_norm(x)) * res
        for slot, rng in zip(batch.state_slots, batch.ranges, strict=True):
            state.num_tokens[slot] = rng.end
        return x

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.bamba.rotary_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin, RopeStyle.NEOX), x[..., r:]], dim=-1)
