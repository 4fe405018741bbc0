"""vLLM's paged KV tensors seen as one kvplane pool whose blocks are copied whole.

Owns :class:`VllmPool`: the check that vLLM's per-layer KV tensors (any backend's shape and
stride order, :mod:`.kv_shapes`) are equally spaced views of one buffer, its wrapping as one
dense pool tensor with a :class:`~kvplane.layout.KVLayout`,
:meth:`VllmPool.scatter_partial` for loads that start or end inside a chunk, and :func:`relocate`
(the buffer moved into memory a transport can export). Never
reinterprets the bytes inside a block (their order is the kernel's). Why the axis labels are
nominal on the CPU backend: ``docs/vllm.md`` ("vLLM's KV as one pool").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvplane.errors import UnsupportedError
from kvplane.integrations.vllm.kv_shapes import LayerShape, infer_layout
from kvplane.layout import KVLayout


@dataclass(frozen=True, slots=True)
class VllmPool:
    """The whole KV buffer (``tensor``, shaped as ``layout``) and the layer names in order."""

    tensor: torch.Tensor
    layout: KVLayout
    layer_names: tuple[str, ...]

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        shape: LayerShape = LayerShape.BHNC,
        *,
        mla_rope_dim: int | None = None,
        stride_order: Sequence[int] | None = None,
    ) -> VllmPool:
        """Wrap vLLM's per-layer KV tensors, each indexed as ``shape`` (an MLA pool when
        ``mla_rope_dim`` is given; ``stride_order``: the memory order the backend reports,
        checked). Layers are taken in address order. :class:`UnsupportedError` says what does
        not fit (layers not views of one buffer, other shapes or dtypes, padded pages,
        layers not equally spaced: see :func:`~.kv_shapes.infer_layout`)."""
        if not kv_caches:
            raise UnsupportedError("vLLM registered no KV cache tensors")
        items = sorted(kv_caches.items(), key=lambda kv: kv[1].data_ptr())
        first = items[0][1]
        for name, t in items:
            if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                raise UnsupportedError(f"layer {name!r} is not a view of the shared KV buffer")
        got = infer_layout(
            shape,
            [t for _n, t in items],
            mla_rope_dim=mla_rope_dim,
            stride_order=stride_order,
        )
        layout = got.layout
        strides = [1] * len(layout.shape)
        for i in range(len(strides) - 2, -1, -1):
            strides[i] = strides[i + 1] * layout.shape[i + 1]
        whole = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), got.storage_offset, layout.shape, strides
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
