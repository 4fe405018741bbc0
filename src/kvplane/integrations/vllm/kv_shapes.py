"""How vLLM's attention backends shape one layer's KV tensor, read as a :class:`KVLayout`.

Owns :class:`LayerShape` (which kvplane axis each dim of a backend's per-layer tensor is) and
:func:`infer_layout`: per-layer tensors that are equally spaced views of one buffer, with any
stride order, become one dense pool layout whose memory order is read from the strides. Owns
the reading of a reported stride order (vLLM's ``KVCacheLayout`` names such as ``"LBHNC"``,
or an older backend's ``get_kv_cache_stride_order()``) as that memory order. Pure: reads only
shapes, strides and offsets, never bytes; imports no vLLM. Why: ``docs/vllm.md`` ("GPU layouts").
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvplane.errors import UnsupportedError
from kvplane.layout import CANONICAL_ORDER, Axis, KVLayout

_A = Axis
_C = (Axis.COMP, Axis.DIM)  # a K‖V (or latent‖rope) content dim: component-major, then dim


class LayerShape(enum.Enum):
    """The dims of one layer's KV tensor as a backend indexes it (its logical shape; the
    memory order may be any permutation). Each dim names the kvplane axes it holds."""

    BHNC = ((_A.BLOCK,), (_A.HEAD,), (_A.TOKEN,), _C)
    """``[num_blocks, kv_heads, block_size, 2*head_dim]`` (K‖V on the last dim): every backend
    of the installed vLLM (RFC #42082: CPU, FlashAttention, FlashInfer, Triton), and MLA with
    one head and ``latent + rope`` content."""
    FLASH_ATTN = ((_A.COMP,), (_A.BLOCK,), (_A.TOKEN,), (_A.HEAD,), (_A.DIM,))
    """``(2, num_blocks, block_size, kv_heads, head_dim)``: FlashAttention / Triton before it."""
    FLASHINFER = ((_A.BLOCK,), (_A.COMP,), (_A.TOKEN,), (_A.HEAD,), (_A.DIM,))
    """``(num_blocks, 2, block_size, kv_heads, head_dim)``: FlashInfer (NHD; HND by stride)."""
    MLA = ((_A.BLOCK,), (_A.TOKEN,), (_A.DIM,))
    """``(num_blocks, block_size, latent + rope)``: MLA backends before RFC #42082."""

    @property
    def ndim(self) -> int:
        return len(self.value)


LAYOUT_LETTERS = "LBHNC"
"""The logical dims of vLLM's ``KVCacheLayout`` names, in logical order."""


def stride_order_from_name(name: str) -> tuple[int, ...]:
    """vLLM's ``KVCacheLayout[name].stride_order`` without importing vLLM: the physical order
    of the logical ``[L, B, H, N, C]`` dims, e.g. ``"LBNHC"`` -> ``(0, 1, 3, 2, 4)``.
    :class:`UnsupportedError` for a name that is not a permutation of ``LBHNC``."""
    if sorted(name) != sorted(LAYOUT_LETTERS):
        raise UnsupportedError(
            f"unknown vLLM KV cache layout {name!r} (not a permutation of LBHNC)"
        )
    return tuple(LAYOUT_LETTERS.index(ch) for ch in name)


def _normalised(order: Sequence[Axis], sizes: Sequence[int]) -> tuple[Axis, ...]:
    """``order`` with its size-1 axes moved just before DIM, in canonical order: they hold no
    bytes of their own, so where they sit must not change a layout's identity."""
    sized = [a for a in order if sizes[a] > 1 and a is not Axis.DIM]
    ones = [a for a in CANONICAL_ORDER if sizes[a] == 1 and a is not Axis.DIM]
    return (*sized, *ones, Axis.DIM)


def reported_order(
    shape: LayerShape, stride_order: Sequence[int], sizes: Sequence[int]
) -> tuple[Axis, ...]:
    """The memory order a backend reports, as kvplane axes (normalised like
    :func:`infer_layout`'s). ``stride_order`` permutes the per-layer dims, optionally preceded
    by a layer dim (then one entry longer); without one, LAYER is taken as outermost."""
    dims: list[tuple[Axis, ...]] = list(shape.value)
    if len(stride_order) == shape.ndim + 1:
        dims = [(Axis.LAYER,), *dims]
    elif len(stride_order) != shape.ndim:
        raise UnsupportedError(
            f"stride order {tuple(stride_order)} does not fit the {shape.name} shape"
        )
    if sorted(stride_order) != list(range(len(dims))):
        raise UnsupportedError(f"stride order {tuple(stride_order)} is not a permutation")
    order = [a for i in stride_order for a in dims[i]]
    if Axis.LAYER not in order:
        order.insert(0, Axis.LAYER)
    order += [a for a in CANONICAL_ORDER if a not in order]
    return _normalised(order, sizes)


@dataclass(frozen=True, slots=True)
class InferredPool:
    """A dense pool over one buffer: its layout and where element 0 sits in the storage."""

    layout: KVLayout
    storage_offset: int


def _axis_strides(shape: LayerShape, t: torch.Tensor, comps: int) -> tuple[list[int], list[int]]:
    """Per-axis size and element stride of one layer tensor (absent axes: size 1, stride 0)."""
    if t.dim() != shape.ndim:
        raise UnsupportedError(
            f"KV tensor of shape {tuple(t.shape)}: the {shape.name} layout has {shape.ndim} dims"
        )
    sizes, strides = [1] * len(Axis), [0] * len(Axis)
    for axes, size, stride in zip(shape.value, t.shape, t.stride(), strict=True):
        if len(axes) == 2:  # content: comps x dim
            if size % comps:
                raise UnsupportedError(
                    f"KV tensor of shape {tuple(t.shape)}: content dim {size} is not {comps} parts"
                )
            sizes[Axis.COMP], strides[Axis.COMP] = comps, stride * (size // comps)
            sizes[Axis.DIM], strides[Axis.DIM] = size // comps, stride
        else:
            sizes[axes[0]], strides[axes[0]] = size, stride
    return sizes, strides


def infer_layout(
    shape: LayerShape,
    layers: Sequence[torch.Tensor],
    *,
    mla_rope_dim: int | None = None,
    stride_order: Sequence[int] | None = None,
) -> InferredPool:
    """The one dense pool that ``layers`` (per-layer views in layer order, sharing one storage,
    equal shape, dtype and strides, equally spaced) are slices of.

    ``mla_rope_dim`` makes it an MLA pool (one head; content ``latent + rope``); else K and V.
    The memory order is the order of the strides (size-1 axes normalised); a ``stride_order``
    the backend reports must agree with it. :class:`UnsupportedError` naming the misfit for
    anything else: other dims, padded or overlapping pages, gaps between layers, DIM not
    innermost."""
    first = layers[0]
    comps = 1 if mla_rope_dim is not None else 2
    sizes, strides = _axis_strides(shape, first, comps)
    sizes[Axis.LAYER] = len(layers)
    for i, t in enumerate(layers):
        if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
            raise UnsupportedError(
                f"layer {i}: KV tensor {tuple(t.shape)} {t.dtype} differs from "
                f"{tuple(first.shape)} {first.dtype}"
            )
        if t.stride() != first.stride():
            raise UnsupportedError(f"layer {i}: KV tensor strides {t.stride()} differ")
    base = int(first.storage_offset())
    step = int(layers[1].storage_offset()) - base if len(layers) > 1 else 0
    for i, t in enumerate(layers):
        if t.storage_offset() != base + i * step:
            raise UnsupportedError(
                f"layer {i} does not start {i} layer stride(s) after the first: the layers "
                "are not equally spaced in the KV buffer"
            )
    strides[Axis.LAYER] = step
    sized = sorted((a for a in Axis if sizes[a] > 1), key=lambda a: -strides[a])
    expect = 1
    for axis in reversed(sized):
        if strides[axis] != expect:
            raise UnsupportedError(
                f"KV tensors {tuple(first.shape)} strides {first.stride()} (layer stride "
                f"{step}) are not one dense buffer: padded, interleaved or overlapping pages"
            )
        expect *= sizes[axis]
    if sized and sized[-1] is not Axis.DIM:
        raise UnsupportedError(f"the head dim is not innermost in strides {first.stride()}")
    order = _normalised([*sized, Axis.DIM], sizes)
    if stride_order is not None:
        told = reported_order(shape, stride_order, sizes)
        if told != order:
            raise UnsupportedError(
                f"the backend reports memory order {[a.name for a in told]} but the KV "
                f"tensors are laid out as {[a.name for a in order]}"
            )
    if mla_rope_dim is None:
        return InferredPool(
            KVLayout.gqa(
                num_blocks=sizes[Axis.BLOCK],
                block_size=sizes[Axis.TOKEN],
                num_layers=len(layers),
                kv_heads=sizes[Axis.HEAD],
                head_dim=sizes[Axis.DIM],
                dtype=first.dtype,
                order=order,
            ),
            base,
        )
    if sizes[Axis.HEAD] != 1 or not 0 < mla_rope_dim < sizes[Axis.DIM]:
        raise UnsupportedError(
            f"an MLA KV tensor holds one head of latent + rope {mla_rope_dim}: got "
            f"{sizes[Axis.HEAD]} head(s) of {sizes[Axis.DIM]}"
        )
    layout = KVLayout.mla(
        num_blocks=sizes[Axis.BLOCK],
        block_size=sizes[Axis.TOKEN],
        num_layers=len(layers),
        latent_dim=sizes[Axis.DIM] - mla_rope_dim,
        rope_dim=mla_rope_dim,
        dtype=first.dtype,
        order=order,
    )
    return InferredPool(layout, base)
