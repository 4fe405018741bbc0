"""The paged KV cache a model reads and writes: one pool tensor described by a ``KVLayout``.

Slot-mapped vectorised writes and zero-copy backend views; the pool may belong to someone else
(a transport), so this class only takes views. See docs/attention.md.
"""

from __future__ import annotations

import torch

from kvplane.attention import GQAKVCache, MLAKVCache, MLAUpProjection
from kvplane.errors import InvalidArgumentError
from kvplane.layout import KVLayout, LayoutKind


class PagedKVCache:
    """A pool tensor plus its layout. ``pool`` defaults to ``layout.allocate(device)`` (zeros).

    Holds every head (a TP head range is not served by the models). Mutated only through
    :meth:`write_kv` / :meth:`write_latent`; the caller keeps block ownership (a ``BlockPool``).
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"expected a KVLayout, got {layout!r}")
        if layout.kind not in (LayoutKind.GQA, LayoutKind.MHA, LayoutKind.MLA):
            raise InvalidArgumentError(f"a model KV cache cannot use a {layout.kind.value} layout")
        if layout.local_heads != layout.total_heads:
            raise InvalidArgumentError(
                f"the models hold every KV head; layout has head range {layout.head_range}"
            )
        if pool is None:
            pool = layout.allocate(device)
        layout.check_pool(pool)
        self.layout = layout
        self.pool = pool

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def num_slots(self) -> int:
        return self.layout.num_blocks * self.layout.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def check_slots(self, slots: torch.Tensor) -> None:
        """``InvalidArgumentError`` unless every slot of int64 ``slots [T]`` is in the pool."""
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise InvalidArgumentError(
                f"slots [{int(slots.min())}, {int(slots.max())}] fall outside the pool's "
                f"{self.num_slots} slots ({self.num_blocks} blocks of {self.block_size})"
            )

    def write_kv(
        self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """GQA: store ``k``/``v [T, kv_heads, head_dim]`` of one layer at ``slots [T]``."""
        kp, vp = self.layout.kv_views(self.pool, layer_id)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        kp[blocks, offsets] = k.to(self.dtype)
        vp[blocks, offsets] = v.to(self.dtype)

    def write_latent(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """MLA: store the packed ``latent [T, kv_lora_rank + rope]`` of one layer at ``slots``."""
        view = self.layout.mla_view(self.pool, layer_id)
        view[slots // self.block_size, slots % self.block_size] = latent.to(self.dtype)

    def gqa(self, layer_id: int) -> GQAKVCache:
        """The K/V pools of one layer as the attention backends' input (views, no copy)."""
        k, v = self.layout.kv_views(self.pool, layer_id)
        return GQAKVCache(k, v)

    def mla(self, layer_id: int, up_proj: MLAUpProjection | None = None) -> MLAKVCache:
        """The latent pool of one layer (views); ``up_proj`` enables the non-absorbed path."""
        view = self.layout.mla_view(self.pool, layer_id)
        return MLAKVCache(view, self.layout.latent_dim, up_proj)
