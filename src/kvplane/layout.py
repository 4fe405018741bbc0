"""KV layouts: the physical description of one paged pool, as data.

:class:`KVLayout` owns a pool's six logical axes, memory order, byte strides, zero-copy views and
three fingerprints; the window and TP head rules live here once (:meth:`KVLayout.window_start`,
:func:`heads_cover`, :func:`shared_heads`). Pure data: no I/O, no regions, no plans. See
docs/transports.md ("Layouts").
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvplane.errors import LayoutError
from kvplane.state_split import StateSplit
from kvplane.validators import Error, require_int


class LayoutKind(enum.Enum):
    """What a pool holds: K and V per head (MHA/GQA), a packed MLA latent, or whole-only state."""

    MHA = "mha"
    GQA = "gqa"
    MLA = "mla"
    STATE = "state"


class Axis(enum.IntEnum):
    """The six logical axes; the int value is the axis position in the canonical order."""

    BLOCK = 0
    LAYER = 1
    COMP = 2
    TOKEN = 3
    HEAD = 4
    DIM = 5


CANONICAL_ORDER: tuple[Axis, ...] = tuple(Axis)
BLOCK_MAJOR = CANONICAL_ORDER
"""``[blocks, layers, comps, tokens, heads, dim]``: a block of every layer is one contiguous run."""
LAYER_MAJOR = (Axis.LAYER, Axis.COMP, Axis.BLOCK, Axis.TOKEN, Axis.HEAD, Axis.DIM)
"""``[layers, comps, blocks, tokens, heads, dim]``: vLLM's per-layer ``[2, N, B, H, D]`` stacked."""
HEAD_MAJOR = (Axis.BLOCK, Axis.LAYER, Axis.COMP, Axis.HEAD, Axis.TOKEN, Axis.DIM)
"""``[blocks, layers, comps, heads, tokens, dim]``: a TP head range is contiguous per block."""

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.uint8: "uint8",
    torch.int8: "int8",
}


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of a supported KV dtype (goes into fingerprints and the wire)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        known = list(_DTYPE_NAMES.values())
        raise LayoutError(f"unsupported KV dtype {dtype}; use one of {known}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    for dtype, known in _DTYPE_NAMES.items():
        if known == name:
            return dtype
    raise LayoutError(f"unknown KV dtype name {name!r}; use one of {list(_DTYPE_NAMES.values())}")


MAX_POOL_BYTES = 1 << 62
"""No pool is larger than this (far beyond any memory): every byte offset into a pool, and
every ``offset + length`` of a descriptor, stays well inside int64."""


def heads_cover(held: tuple[int, int], needed: tuple[int, int]) -> bool:
    """True when the half-open TP head range ``held`` (a sender's) contains every head of the
    non-empty range ``needed`` (a receiver's). The one coverage predicate of the data plane
    (the PD handshake, the router and the slice planner use it). Pools without a head split
    (MLA's latent head, state pools: ``(0, 1)`` on both sides) are always covered."""
    return held[0] <= needed[0] < needed[1] <= held[1]


def shared_heads(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The global heads both half-open TP head ranges hold, or None when they are disjoint: what
    a transfer between two ranks can move (the planner's head range)."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _int_tuple(
    what: str, value: object, *, size: int | None = None, min: int | None = None, error: Error
) -> tuple[int, ...]:
    """``value`` as a tuple of ints (not bools), each ``>= min`` where given, of ``size`` items
    where given; ``error`` naming ``what`` (and the bad item) otherwise."""
    if not isinstance(value, tuple | list):
        raise error(f"{what} must be a sequence of ints, got {value!r}")
    if size is not None and len(value) != size:
        raise error(f"{what} must hold {size} ints, got {value!r}")
    return tuple(
        require_int(f"{what}[{i}]", item, min=min, error=error) for i, item in enumerate(value)
    )


def check_layer_ids(what: str, value: object, *, error: Error = LayoutError) -> tuple[int, ...]:
    """``value`` as a pool's layer ids: a non-empty sequence of distinct ints >= 0; else
    ``error`` naming ``what``. The one rule for :class:`KVLayout` and its wire form."""
    ids = _int_tuple(what, value, min=0, error=error)
    if not ids:
        raise error(f"{what} must name at least one layer")
    if len(set(ids)) != len(ids):
        raise error(f"{what} has duplicates: {ids}")
    return ids


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
        head_range = _int_tuple("KVLayout.head_range", self.head_range, size=2, error=LayoutError)
        object.__setattr__(self, "head_range", head_range)
        if not isinstance(self.order, tuple | list) or any(
            not isinstance(a, Axis) for a in self.order
        ):
            raise LayoutError(f"KVLayout.order must be a sequence of Axis, got {self.order!r}")
        object.__setattr__(self, "order", tuple(self.order))
        if self.head_range == (0, 0):
            object.__setattr__(self, "head_range", (0, self.total_heads))
        lo, hi = self.head_range
        if not 0 <= lo < hi <= self.total_heads:
            raise LayoutError(
                f"KVLayout.head_range {self.head_range} must satisfy 0 <= start < end <= "
                f"total_heads={self.total_heads}"
            )
        self._check_kind()
        if sorted(self.order) != list(CANONICAL_ORDER) or self.order[-1] != Axis.DIM:
            raise LayoutError(
                f"KVLayout.order must permute all six axes with DIM last: {self.order}"
            )
        self._check_windows()
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

    def _check_windows(self) -> None:
        """Validate the windows; ``layer_windows`` all equal become ``sliding_window``."""
        name, raw, top = "KVLayout.layer_windows", self.layer_windows, max(self.layer_ids)
        if not isinstance(raw, tuple | list):
            raise LayoutError(f"{name} must be a sequence, got {raw!r}")
        if self.sliding_window is not None:
            require_int("KVLayout.sliding_window", self.sliding_window, min=1, error=LayoutError)
        windows = tuple(
            w if w is None else require_int(f"{name}[{i}]", w, min=1, error=LayoutError)
            for i, w in enumerate(raw)
        )
        if self.whole_only and (windows or self.sliding_window is not None):
            raise LayoutError("a STATE layout has no sliding window")
        if windows and (self.sliding_window is not None or top >= len(windows)):
            why = f"the window or None of every layer id up to {top}, and no sliding_window"
            raise LayoutError(f"{name} {windows} must give {why}")
        if len(set(windows)) == 1:
            object.__setattr__(self, "sliding_window", windows[0])
            windows = ()
        object.__setattr__(self, "layer_windows", windows)

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
            layer_ids=_layers(num_layers, layer_ids),
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
            layer_ids=_layers(num_layers, layer_ids),
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
            layer_ids=_layers(num_layers, layer_ids), total_heads=1, head_dim=state_dim,
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


def _layers(num_layers: int | None, layer_ids: tuple[int, ...] | None) -> tuple[int, ...]:
    if layer_ids is not None:
        if num_layers is not None and num_layers != len(layer_ids):
            raise LayoutError(f"num_layers={num_layers} disagrees with layer_ids={layer_ids}")
        return tuple(layer_ids)
    if num_layers is None:
        raise LayoutError("give num_layers or layer_ids")
    require_int("KVLayout.num_layers", num_layers, min=1, error=LayoutError)
    return tuple(range(num_layers))
