"""The paged KV cache a model reads and writes: one pool tensor described by a ``KVLayout``,
or one per KV cache group (:class:`GroupedKVCache`).

Slot-mapped vectorised writes and zero-copy backend views; the pool may belong to someone else
(a transport), so this class only takes views. See docs/attention.md.
"""

from __future__ import annotations

import torch

from kvplane.attention import GQAKVCache, MLAKVCache, MLAUpProjection
from kvplane.errors import InvalidArgumentError
from kvplane.layout import KVLayout, LayoutKind
from kvplane.models.kv_groups import KVGroups


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

    @property
    def caches(self) -> tuple[PagedKVCache, ...]:
        """One pool per KV cache group, in group order: this one alone."""
        return (self,)

    def group_of(self, layer_id: int) -> int:
        """The KV cache group of ``layer_id``: 0, the one pool holds every layer."""
        return 0

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


class GroupedKVCache(PagedKVCache):
    """One :class:`PagedKVCache` per KV cache group (``caches[g]`` holds exactly group ``g``'s
    layers): a model whose layers have different windows. ``layout``, ``pool`` and the pool
    properties are group 0's; per-layer calls go to the layer's group. ``InvalidArgumentError``
    unless the caches hold the groups' layers, in order, with one block size and device."""

    def __init__(self, groups: KVGroups, caches: tuple[PagedKVCache, ...]) -> None:
        if not isinstance(groups, KVGroups):
            raise InvalidArgumentError(f"expected KVGroups, got {groups!r}")
        if not isinstance(caches, tuple) or any(type(c) is not PagedKVCache for c in caches):
            raise InvalidArgumentError(f"expected a tuple of PagedKVCache, got {caches!r}")
        held = tuple(c.layout.layer_ids for c in caches)
        if held != tuple(g.layer_ids for g in groups):
            raise InvalidArgumentError(f"caches hold layers {held}; the groups are {groups}")
        if len({(c.block_size, c.device, c.dtype) for c in caches}) != 1:
            raise InvalidArgumentError("the caches of one model disagree on block size or device")
        super().__init__(caches[0].layout, caches[0].pool)
        self.groups = groups
        self._caches = caches

    @classmethod
    def allocate(
        cls,
        layout: KVLayout,
        num_blocks: tuple[int, ...],
        device: torch.device | str = "cpu",
    ) -> GroupedKVCache:
        """Zeroed pools of ``num_blocks[g]`` blocks over each group of ``layout``'s layers."""
        groups = KVGroups.of_layout(layout)
        layouts = groups.layouts(layout, num_blocks)
        return cls(groups, tuple(PagedKVCache(lay, device=device) for lay in layouts))

    @property
    def caches(self) -> tuple[PagedKVCache, ...]:
        return self._caches

    def group_of(self, layer_id: int) -> int:
        return self.groups.group_of(layer_id)

    def write_kv(
        self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """GQA: store one layer's K/V at ``slots`` of its group's pool."""
        self._caches[self.group_of(layer_id)].write_kv(layer_id, slots, k, v)

    def write_latent(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        self._caches[self.group_of(layer_id)].write_latent(layer_id, slots, latent)

    def gqa(self, layer_id: int) -> GQAKVCache:
        return self._caches[self.group_of(layer_id)].gqa(layer_id)

    def mla(self, layer_id: int, up_proj: MLAUpProjection | None = None) -> MLAKVCache:
        return self._caches[self.group_of(layer_id)].mla(layer_id, up_proj)
