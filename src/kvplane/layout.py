"""KV layouts: the physical description of one paged pool, as data.

:class:`KVLayout` owns a pool's six logical axes, memory order, byte strides, zero-copy views and
three fingerprints; the window clipping rule lives here once (:meth:`KVLayout.window_start`).
The domains of its fields (kinds, axes and orders, dtypes, layer ids, TP head ranges with
:func:`heads_cover` and :func:`shared_heads`, windows) are :mod:`kvplane.layout_fields`',
re-exported here. Pure data: no I/O, no regions, no plans. See docs/transports.md ("Layouts").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvplane.errors import LayoutError
from kvplane.layout_fields import (
    BLOCK_MAJOR,
    CANONICAL_ORDER,
    HEAD_MAJOR,
    LAYER_MAJOR,
    Axis,
    LayoutKind,
    check_head_range,
    check_layer_ids,
    check_order,
    check_windows,
    dtype_from_name,
    dtype_name,
    heads_cover,
    layer_ids_of,
    shared_heads,
)
from kvplane.state_split import StateSplit
from kvplane.validators import require_int

__all__ = [  # the field domains live in kvplane.layout_fields; callers import them from here
    "BLOCK_MAJOR", "CANONICAL_ORDER", "HEAD_MAJOR", "LAYER_MAJOR", "MAX_POOL_BYTES", "Axis",
    "KVLayout", "LayoutKind", "check_layer_ids", "dtype_from_name", "dtype_name",
    "heads_cover", "shared_heads",
]  # fmt: skip


MAX_POOL_BYTES = 1 << 62
"""No pool is larger than this (far beyond any memory): every byte offset into a pool, and
every ``offset + length`` of a descriptor, stays well inside int64."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Physical description of one paged KV pool. Build with :meth:`mha`, :meth:`gqa`,
    :meth:`mla` or :meth:`state`; every field is validated on construction (``LayoutError``)."""

    kind: LayoutKind
    num_blocks: int
    block_size: int
    layer_ids: tuple[int, ...]
    total_heads: int
    head_dim: int
    dtype: torch.dtype
    head_range: tuple[int, int] = (0, 0)
    rope_dim: int = 0
    order: tuple[Axis, ...] = BLOCK_MAJOR
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] = ()
    state_split: StateSplit | None = None
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())
    _fingerprint: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LayoutKind):
            raise LayoutError(f"KVLayout.kind must be a LayoutKind, got {self.kind!r}")
        for name in ("num_blocks", "block_size", "total_heads", "head_dim"):
            require_int(f"KVLayout.{name}", getattr(self, name), min=1, error=LayoutError)
        dtype_name(self.dtype)
        object.__setattr__(self, "layer_ids", check_layer_ids("KVLayout.layer_ids", self.layer_ids))
        head_range = check_head_range(self.head_range, self.total_heads)
        object.__setattr__(self, "head_range", head_range)
        object.__setattr__(self, "order", check_order(self.order))
        self._check_kind()
        window, windows = check_windows(self.layer_ids, self.sliding_window, self.layer_windows,
                                        whole_only=self.whole_only)  # fmt: skip
        object.__setattr__(self, "sliding_window", window)
        object.__setattr__(self, "layer_windows", windows)
        sizes = self.axis_sizes()
        strides: list[int] = [0] * len(Axis)
        step = torch.empty((), dtype=self.dtype).element_size()
        for axis in reversed(self.order):
            strides[axis] = step
            step *= sizes[axis]
        if step > MAX_POOL_BYTES:
            raise LayoutError(f"a pool of {step} bytes exceeds the {MAX_POOL_BYTES}-byte limit")
        object.__setattr__(self, "_strides", tuple(strides))

    def _check_kind(self) -> None:
        if self.kind is LayoutKind.MLA:
            if self.total_heads != 1:
                raise LayoutError(f"an MLA layout holds one latent 'head', got {self.total_heads}")
            if not 0 < self.rope_dim < self.head_dim:
                raise LayoutError(
                    f"MLA rope_dim {self.rope_dim} must be in (0, head_dim={self.head_dim}): "
                    "head_dim is latent + rope"
                )
        elif self.rope_dim != 0:
            raise LayoutError(f"rope_dim is an MLA field; {self.kind.value} got {self.rope_dim}")
        if self.kind is LayoutKind.STATE and (self.block_size != 1 or self.total_heads != 1):
            raise LayoutError("a STATE layout has block_size 1 and one head (whole-only)")
        split = self.state_split
        if split is not None and (not isinstance(split, StateSplit) or (self.kind, self.head_dim)
                                  != (LayoutKind.STATE, split.geometry.row_dim)):  # fmt: skip
            raise LayoutError(f"a state_split {split!r} needs a STATE layout of its whole row")
        if self.kind is LayoutKind.MHA and self.head_range != (0, self.total_heads):
            raise LayoutError("an MHA layout holds all heads; use GQA for a TP head range")

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def gqa(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        num_layers: int | None = None,
        layer_ids: tuple[int, ...] | None = None,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        head_range: tuple[int, int] | None = None,
        order: tuple[Axis, ...] = BLOCK_MAJOR,
        sliding_window: int | None = None,
        layer_windows: tuple[int | None, ...] = (),
    ) -> KVLayout:
        """K and V for ``kv_heads`` heads (the rank holds ``head_range``, default all); a window
        on every layer (``sliding_window``) or per global layer id (``layer_windows``)."""
        return cls(
            kind=LayoutKind.GQA,
            num_blocks=num_blocks,
            block_size=block_size,
            layer_ids=layer_ids_of(num_layers, layer_ids),
            total_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            head_range=head_range or (0, kv_heads),
            order=order,
            sliding_window=sliding_window,
            layer_windows=layer_windows,
        )

    @classmethod
    def mla(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        num_layers: int | None = None,
        layer_ids: tuple[int, ...] | None = None,
        latent_dim: int = 512,
        rope_dim: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        order: tuple[Axis, ...] = BLOCK_MAJOR,
    ) -> KVLayout:
        """DeepSeek-style packed ``c_kv ‖ k_pe``: ``[pages, page_size, latent_dim + rope_dim]``."""
        require_int("KVLayout.latent_dim", latent_dim, min=1, error=LayoutError)
        require_int("KVLayout.rope_dim", rope_dim, min=1, error=LayoutError)
        return cls(
            kind=LayoutKind.MLA,
            num_blocks=num_blocks,
            block_size=block_size,
            layer_ids=layer_ids_of(num_layers, layer_ids),
            total_heads=1,
            head_dim=latent_dim + rope_dim,
            dtype=dtype,
            rope_dim=rope_dim,
            order=order,
        )

    @classmethod
    def state(
        cls, *, num_slots: int, num_layers: int | None = None,
        layer_ids: tuple[int, ...] | None = None, state_dim: int,
        dtype: torch.dtype = torch.float32, split: StateSplit | None = None,
    ) -> KVLayout:  # fmt: skip
        """Recurrent state, a block per request: ``state_dim`` elements (a row) per layer."""
        return cls(
            kind=LayoutKind.STATE, num_blocks=num_slots, block_size=1,
            layer_ids=layer_ids_of(num_layers, layer_ids), total_heads=1, head_dim=state_dim,
            dtype=dtype, state_split=split,
        )  # fmt: skip

    # -- derived sizes ---------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def num_components(self) -> int:
        return 2 if self.kind in (LayoutKind.MHA, LayoutKind.GQA) else 1

    @property
    def local_heads(self) -> int:
        return self.head_range[1] - self.head_range[0]

    @property
    def windowed(self) -> bool:
        """True when some layer has a sliding window (the pool may lack early positions)."""
        return self.sliding_window is not None or bool(self.layer_windows)

    def window_of(self, layer_id: int) -> int | None:
        """Layer ``layer_id``'s window in the model's map (None: full; O(1), held or not)."""
        windows = self.layer_windows
        if windows and not 0 <= layer_id < len(windows):
            raise LayoutError(f"layer {layer_id} is not in the window map {windows}")
        return windows[layer_id] if windows else self.sliding_window

    def window_start(self, num_tokens: int, layers: tuple[int, ...] | None = None) -> int:
        """First position ``layers`` (default: all held) still read once a ``num_tokens``-token
        sequence is in the pool: the next step computes ``num_tokens`` on, whose first query sees
        ``(num_tokens - W, num_tokens]`` under window ``W``, so ``num_tokens + 1 - W``; a full
        layer 0, several layers the smallest. The one home of window clipping (PD sends, prefix
        loads and freed out-of-window blocks all start here)."""
        windows = map(self.window_of, self.layer_ids if layers is None else layers)
        return min(0 if w is None else max(0, num_tokens + 1 - w) for w in windows)

    @property
    def latent_dim(self) -> int:
        """MLA: the compressed ``c_kv`` width (``head_dim - rope_dim``); 0 for other kinds."""
        return self.head_dim - self.rope_dim if self.kind is LayoutKind.MLA else 0

    @property
    def whole_only(self) -> bool:
        """True when the pool cannot be sliced by token (recurrent state moves whole)."""
        return self.kind is LayoutKind.STATE

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    def axis_sizes(self) -> tuple[int, ...]:
        """Size of each axis, indexed by ``Axis`` (canonical order)."""
        return (
            self.num_blocks,
            self.num_layers,
            self.num_components,
            self.block_size,
            self.head_range[1] - self.head_range[0],
            self.row_dim,
        )

    @property
    def row_dim(self) -> int:
        """Elements of one head's row here: ``head_dim``, or a TP rank's part of a state row."""
        return self.head_dim if self.state_split is None else self.state_split.local_dim

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the pool tensor, in memory ``order``."""
        sizes = self.axis_sizes()
        return tuple(sizes[a] for a in self.order)

    def strides_bytes(self) -> tuple[int, ...]:
        """Byte stride of each axis, indexed by ``Axis``."""
        return self._strides

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K+V (or latent+rope, or state) bytes of one token of one layer on this rank."""
        return self.num_components * self.local_heads * self.row_dim * self.element_size

    @property
    def bytes_per_block_per_layer(self) -> int:
        return self.block_size * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        """One block across every layer of the pool."""
        return self.num_layers * self.bytes_per_block_per_layer

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def layer_index(self, layer_id: int) -> int:
        """Position of global layer ``layer_id`` in this pool (``LayoutError`` if absent)."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise LayoutError(
                f"layer {layer_id} is not in this pool's layers {self.layer_ids}"
            ) from None

    # -- tensors -----------------------------------------------------------------------------
    def allocate(
        self, device: torch.device | str = "cpu", pin_memory: bool = False
    ) -> torch.Tensor:
        """A zeroed contiguous pool tensor of ``shape`` and ``dtype``."""
        return torch.zeros(self.shape, dtype=self.dtype, device=device, pin_memory=pin_memory)

    def check_pool(self, pool: torch.Tensor) -> None:
        """Raise ``LayoutError`` unless ``pool`` has this layout's shape, dtype and contiguity."""
        if tuple(pool.shape) != self.shape or pool.dtype != self.dtype:
            raise LayoutError(
                f"pool tensor {tuple(pool.shape)} {pool.dtype} does not match layout "
                f"{self.shape} {self.dtype}"
            )
        if not pool.is_contiguous():
            raise LayoutError("a pool tensor must be contiguous")

    def canonical_view(self, pool: torch.Tensor) -> torch.Tensor:
        """Zero-copy view ``[blocks, layers, comps, tokens, heads, dim]`` of ``pool``."""
        self.check_pool(pool)
        where = {axis: i for i, axis in enumerate(self.order)}
        return pool.permute(*(where[a] for a in CANONICAL_ORDER))

    def layer_view(self, pool: torch.Tensor, layer_id: int) -> torch.Tensor:
        """``[blocks, comps, tokens, heads, dim]`` view of one global layer (zero-copy)."""
        return self.canonical_view(pool)[:, self.layer_index(layer_id)]

    def kv_views(self, pool: torch.Tensor, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA/GQA: K and V views ``[blocks, block_size, local_heads, head_dim]`` of one layer."""
        if self.num_components != 2:
            raise LayoutError(f"kv_views needs an MHA/GQA layout, this one is {self.kind.value}")
        view = self.layer_view(pool, layer_id)
        return view[:, 0], view[:, 1]

    def mla_view(self, pool: torch.Tensor, layer_id: int) -> torch.Tensor:
        """MLA: packed ``[pages, page_size, latent_dim + rope_dim]`` view of one layer."""
        if self.kind is not LayoutKind.MLA:
            raise LayoutError(f"mla_view needs an MLA layout, this one is {self.kind.value}")
        return self.layer_view(pool, layer_id)[:, 0, :, 0, :]

    def state_view(self, pool: torch.Tensor, layer_id: int) -> torch.Tensor:
        """STATE: ``[slots, state_dim]`` view of one layer."""
        if self.kind is not LayoutKind.STATE:
            raise LayoutError(f"state_view needs a STATE layout, this one is {self.kind.value}")
        return self.layer_view(pool, layer_id)[:, 0, 0, 0, :]

    # -- identity ----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Plain-data description (wire/JSON friendly); ``layer_windows`` and a TP rank's
        ``state_split`` only when set (so other pools' fingerprints do not change)."""
        split, windows = self.state_split, self.layer_windows
        d: dict[str, Any] = {
            "kind": self.kind.value, "num_blocks": self.num_blocks, "block_size": self.block_size,
            "layer_ids": list(self.layer_ids), "total_heads": self.total_heads,
            "head_range": list(self.head_range), "head_dim": self.head_dim,
            "rope_dim": self.rope_dim, "dtype": dtype_name(self.dtype),
            "order": [a.name for a in self.order], "sliding_window": self.sliding_window,
        }  # fmt: skip
        d |= {"layer_windows": list(windows)} if windows else {}
        return d | ({"state_split": split.describe()} if split and split.sharded else {})

    def geometry_fingerprint(self) -> bytes:
        """What PD peers must agree on whatever layers each holds (a pipeline stage holds a part
        of the receiver's): kind, heads, dims, dtype, windows (``layer_windows`` is the model's
        map, by global layer id, so every stage carries all of it). Block size, head range (and
        a TP rank's part of a state row), order, pool size and layer ids may differ."""
        d = self.describe()
        for key in ("num_blocks", "block_size", "head_range", "order", "layer_ids", "state_split"):
            d.pop(key, None)
        return _digest(b"kvplane-layout-geometry", d)

    def compat_fingerprint(self) -> bytes:
        """What PD peers holding the same layers must agree on: :meth:`geometry_fingerprint`
        and the layer ids (the one rule; the geometry's is not repeated here)."""
        geometry = {"geometry": self.geometry_fingerprint().hex(), "layer_ids": self.layer_ids}
        return _digest(b"kvplane-layout-compat", geometry)

    def fingerprint(self) -> bytes:
        """Physical identity of a block's bytes (all but pool size): for hashes and headers.
        Computed once per layout (every plan carries its two sides' fingerprints)."""
        if not self._fingerprint:
            d = self.describe()
            d.pop("num_blocks")
            object.__setattr__(self, "_fingerprint", _digest(b"kvplane-layout", d))
        return self._fingerprint


def _digest(tag: bytes, d: dict[str, Any]) -> bytes:
    text = ";".join(f"{k}={d[k]}" for k in sorted(d))
    return hashlib.blake2b(tag + b"\0" + text.encode(), digest_size=16).digest()
