"""The model ``kvplane bench windows`` serves and the byte and block arithmetic over its pools:
a tiny random Qwen2 whose layers alternate sliding-window and full attention, written as a
checkpoint by kvplane's own config path (:func:`save_checkpoint`, no transformers), and its
pools' layouts with KV cache groups on or off (:class:`MixedModel`).

Owns the model's shape and the bench's minimum: what the decode side must receive, each layer
from :meth:`~kvplane.layout.KVLayout.window_start` (the one home of window clipping) on. Starts
no process and measures nothing. See docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kvplane.layout import KVLayout
from kvplane.models import load_model
from kvplane.models.config import FULL, QWEN2, SLIDING, LlamaConfig
from kvplane.models.kv_groups import KVGroups
from kvplane.models.loader import save_checkpoint
from kvplane.serving.pools import TAIL_BYTES

WINDOW = 128
"""The sliding layers' window, tokens."""
BLOCK_SIZE = 16
"""Tokens per block on both workers."""
BLOCKS_PER_CHUNK = 2
"""Blocks per prefix-store chunk (32 tokens)."""
NUM_LAYERS = 4
DTYPE = "float32"
VOCAB = 1024
MAX_POSITIONS = 4096


def mixed_config(window: int = WINDOW) -> LlamaConfig:
    """A Qwen2 of :data:`NUM_LAYERS` layers alternating sliding (window ``window``) and full
    attention from a sliding one; 2 KV heads of 16: 256 bytes per token per layer in float32."""
    types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(NUM_LAYERS))
    return LlamaConfig(
        architecture=QWEN2, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_layers=NUM_LAYERS, num_heads=4, num_kv_heads=2, head_dim=16,
        max_position_embeddings=MAX_POSITIONS, sliding_window=window, layer_types=types,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class MixedModel:
    """The checkpoint at ``path`` and its paged KV layout (one block; the geometry is all that
    is read): the pools a worker serves it with, per ``--kv-groups``."""

    path: Path
    layout: KVLayout

    @classmethod
    def write(cls, path: Path, window: int = WINDOW) -> MixedModel:
        """Write the checkpoint (seeded weights, :data:`DTYPE`) under ``path`` and read back its
        layout through :func:`~kvplane.models.load_model`, as the workers will."""
        save_checkpoint(mixed_config(window), path, seed=0, dtype=torch.float32)
        model = load_model(path, dtype=torch.float32)
        return cls(path, model.kv_layout(1, BLOCK_SIZE))

    def pools(self, groups: bool) -> tuple[KVLayout, ...]:
        """The paged pools' layouts of a worker: one per KV cache group (ordered by first layer,
        as ``WorkerPools`` makes them) with ``groups``, else the one pool of every layer."""
        if not groups:
            return (self.layout,)
        return KVGroups.of_layout(self.layout).layouts(self.layout)

    def minimum_bytes(self, num_tokens: int) -> int:
        """The bytes a decode side must receive for a ``num_tokens`` prompt: every layer's
        positions from its :meth:`~kvplane.layout.KVLayout.window_start` (full layers: the whole
        prompt; window layers: the last ``W - 1``, the ones the next token's query reads) plus
        the tail (first token and per-request state, ``TAIL_BYTES``)."""
        lay = self.layout
        kept = sum(num_tokens - lay.window_start(num_tokens, (i,)) for i in lay.layer_ids)
        return kept * lay.bytes_per_token_per_layer + TAIL_BYTES

    def block_layers(self, groups: bool, blocks: Mapping[int, int]) -> int:
        """Block-layers of ``blocks[g]`` blocks of each pool ``g`` of :meth:`pools`."""
        return sum(blocks.get(g, 0) * lay.num_layers for g, lay in enumerate(self.pools(groups)))

    def chunk_bytes(self, groups: bool, chunks: Mapping[int, int]) -> int:
        """Bytes of ``chunks[g]`` prefix-store chunks of each pool ``g`` of :meth:`pools`."""
        return sum(
            chunks.get(g, 0) * BLOCKS_PER_CHUNK * lay.bytes_per_block
            for g, lay in enumerate(self.pools(groups))
        )
