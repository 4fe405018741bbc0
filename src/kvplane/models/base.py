"""The model contract: a causal LM that runs forward steps over a paged KV cache.

Implementations: :class:`~kvplane.models.llama.LlamaModel` (GQA KV) and
:class:`~kvplane.models.deepseek.DeepSeekModel` (MLA latent KV); ``kvplane.models.loader``
maps HF architecture names to them. Everything a serving loop needs goes through this protocol:
size a pool with :meth:`CausalLM.kv_layout`, then call :meth:`CausalLM.forward_step` once per
prefill chunk or decode step (see :mod:`kvplane.models.step` for what the caller promises).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvplane.layout import BLOCK_MAJOR, Axis, KVLayout
from kvplane.models.config import ModelConfig
from kvplane.models.kv import PagedKVCache
from kvplane.models.step import StepBatch


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only LM over paged KV. Weights are immutable; only the KV pool is written."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype:
        """Weights, activations and KV dtype."""
        ...

    @property
    def device(self) -> torch.device: ...

    def kv_layout(
        self, num_blocks: int, block_size: int, order: tuple[Axis, ...] = BLOCK_MAJOR
    ) -> KVLayout:
        """The layout of a pool of ``num_blocks`` blocks for every layer of this model."""
        ...

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A zeroed pool of :meth:`kv_layout` on the model's device."""
        ...

    def forward_step(
        self, batch: StepBatch, kv: PagedKVCache, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Compute ``batch``'s tokens: write their KV into ``kv`` at ``batch.slot_mapping`` and
        return float32 logits ``[B, vocab]`` of each request's last token (``[T, vocab]`` of
        every token with ``all_logits``). KV for each request's ``[0, start)`` must already be in
        ``kv``. Bad input raises before ``kv`` is touched."""
        ...
