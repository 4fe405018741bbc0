"""vLLM's paged KV tensors seen as one kvplane pool whose blocks are copied whole.

Owns :class:`VllmPool`: the check that vLLM's per-layer CPU KV tensors are equally spaced views
of one layer-major buffer, its wrapping as one pool tensor with a :class:`~kvplane.layout.KVLayout`,
:meth:`VllmPool.scatter_partial` for loads that start or end inside a chunk, and :func:`relocate`
(the buffer moved into memory a transport can export). Never
reinterprets the bytes inside a block (their order is the kernel's). Why the axis labels are
nominal: ``docs/vllm.md`` ("vLLM's KV as one pool").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvplane.errors import UnsupportedError
from kvplane.layout import Axis, KVLayout

POOL_ORDER = (Axis.LAYER, Axis.BLOCK, Axis.COMP, Axis.TOKEN, Axis.HEAD, Axis.DIM)
"""Memory order of the wrapped pool: each (layer, block) slab is contiguous, as in vLLM."""


@dataclass(frozen=True, slots=True)
class VllmPool:
    """The whole KV buffer (``tensor``, shaped as ``layout``) and the layer names in order."""

    tensor: torch.Tensor
    layout: KVLayout
    layer_names: tuple[str, ...]

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor]) -> VllmPool:
        """Wrap vLLM's per-layer KV tensors; :class:`UnsupportedError` says what does not fit
        (other ranks, dtypes, shapes, or layers that are not equally spaced views of one
        layer-major buffer)."""
        if not kv_caches:
            raise UnsupportedError("vLLM registered no KV cache tensors")
        items = sorted(kv_caches.items(), key=lambda kv: kv[1].data_ptr())
        first = items[0][1]
        shape, dtype = tuple(first.shape), first.dtype
        if len(shape) != 4 or shape[3] % 2:
            raise UnsupportedError(
                f"KV tensor of shape {shape}: the connector supports the CPU backend's "
                "[num_blocks, kv_heads, block_size, 2*head_dim] (no MLA, no GPU layouts)"
            )
        num_blocks, heads, block_size, width = shape
        block_elems = heads * block_size * width
        for name, t in items:
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise UnsupportedError(
                    f"layer {name!r}: KV tensor {tuple(t.shape)} {t.dtype} differs from "
                    f"{shape} {dtype} or is not contiguous"
                )
            if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                raise UnsupportedError(f"layer {name!r} is not a view of the shared KV buffer")
        layer_elems = num_blocks * block_elems
        for i, (name, t) in enumerate(items):
            if t.storage_offset() != first.storage_offset() + i * layer_elems:
                raise UnsupportedError(
                    f"layer {name!r} does not start {i} layer(s) after the first: the KV "
                    "buffer is not layer-major"
                )
        layout = KVLayout.gqa(
            num_blocks=num_blocks,
            block_size=block_size,
            num_layers=len(items),
            kv_heads=heads,
            head_dim=width // 2,
            dtype=dtype,
            order=POOL_ORDER,
        )
        strides = [1] * len(layout.shape)
        for i in range(len(strides) - 2, -1, -1):
            strides[i] = strides[i + 1] * layout.shape[i + 1]
        whole = torch.empty(0, dtype=dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), layout.shape, strides
        )
        return cls(whole, layout, tuple(name for name, _t in items))

    @property
    def bytes_per_block(self) -> int:
        """One block across every layer: the unit the connector copies."""
        return self.layout.bytes_per_block

    def scatter_partial(
        self, chunk: torch.Tensor, first_block: int, block_ids: Sequence[int]
    ) -> None:
        """Write blocks ``first_block .. first_block + len(block_ids) - 1`` of the host chunk
        ``chunk`` (uint8 bytes of one chunk, as the copier gathered it) into pool blocks
        ``block_ids``. Mutates only those pool blocks."""
        if not block_ids:
            return
        canon = self.layout.canonical_view(self.tensor)
        per_block = tuple(canon.shape[1:])
        blocks = chunk.view(self.layout.dtype).view(-1, *per_block)
        src = blocks[first_block : first_block + len(block_ids)]
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=canon.device)
        canon.index_copy_(0, idx, src.to(canon.device))


def relocate(
    kv_caches: Mapping[str, torch.Tensor], allocate: Callable[[int], torch.Tensor]
) -> None:
    """Move vLLM's KV buffer into memory ``allocate(nbytes)`` gives (a ``uint8`` tensor, e.g.
    a shared segment a peer can map), in place and before any forward.

    Every layer tensor keeps its identity, dtype, shape and strides (vLLM's attention layers
    hold these very objects) and now views the new memory at the same offset; the bytes are
    copied. Mutates the tensors of ``kv_caches``; the old buffer is freed once unreferenced.
    """
    items = list(kv_caches.values())
    if not items:
        raise UnsupportedError("vLLM registered no KV cache tensors")
    old = items[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != old.data_ptr() for t in items):
        raise UnsupportedError("vLLM's KV tensors are not views of one buffer")
    seg = allocate(old.nbytes())
    seg.copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),), (1,)))
    base = seg.storage_offset()  # bytes: the segment tensor is uint8
    for t in items:
        size = t.element_size()
        if base % size:
            raise UnsupportedError(f"the new KV memory is not aligned for {t.dtype}")
        t.set_(seg.untyped_storage(), base // size + t.storage_offset(), t.shape, t.stride())
