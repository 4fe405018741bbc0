"""The value domains of a KV layout's fields, and the rules between their values.

Owns the kinds (:class:`LayoutKind`), the six axes and the memory orders (:class:`Axis`,
``*_MAJOR``), the KV dtype names (the wire's and the fingerprints'), layer ids
(:func:`check_layer_ids`), TP head ranges (:func:`check_head_range`; :func:`heads_cover`, the
one coverage rule, and :func:`shared_heads`) and per-layer windows (:func:`check_windows`).
Pure functions and values; knows no :class:`~kvplane.layout.KVLayout` (which composes them and
re-exports the names its callers use, so they import them from ``kvplane.layout``). See
docs/transports.md ("Layouts").
"""

from __future__ import annotations

import enum

import torch

from kvplane.errors import LayoutError
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


def check_order(order: object) -> tuple[Axis, ...]:
    """``order`` as a memory order: a permutation of the six :class:`Axis` with ``DIM`` last
    (the innermost, contiguous axis); ``LayoutError`` naming it otherwise."""
    if not isinstance(order, tuple | list) or any(not isinstance(a, Axis) for a in order):
        raise LayoutError(f"KVLayout.order must be a sequence of Axis, got {order!r}")
    if sorted(order) != list(CANONICAL_ORDER) or order[-1] != Axis.DIM:
        raise LayoutError(f"KVLayout.order must permute all six axes with DIM last: {tuple(order)}")
    return tuple(order)


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


def check_head_range(value: object, total_heads: int) -> tuple[int, int]:
    """``value`` as the TP head range a pool of ``total_heads`` holds: a non-empty half-open
    ``(start, end)`` inside them, ``(0, 0)`` standing for all; ``LayoutError`` otherwise."""
    lo, hi = _int_tuple("KVLayout.head_range", value, size=2, error=LayoutError)
    if (lo, hi) == (0, 0):
        return 0, total_heads
    if not 0 <= lo < hi <= total_heads:
        raise LayoutError(
            f"KVLayout.head_range {(lo, hi)} must satisfy 0 <= start < end <= "
            f"total_heads={total_heads}"
        )
    return lo, hi


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


def check_windows(
    layer_ids: tuple[int, ...],
    sliding_window: int | None,
    layer_windows: object,
    *,
    whole_only: bool,
) -> tuple[int | None, tuple[int | None, ...]]:
    """``(sliding_window, layer_windows)`` of a pool holding ``layer_ids``, validated: one
    window for every layer, or the model's map by global layer id (the window or None of every
    id up to the largest held, and no ``sliding_window``); a map of one value becomes
    ``sliding_window``. A whole-only pool has none. ``LayoutError`` naming the field."""
    name, raw, top = "KVLayout.layer_windows", layer_windows, max(layer_ids)
    if not isinstance(raw, tuple | list):
        raise LayoutError(f"{name} must be a sequence, got {raw!r}")
    if sliding_window is not None:
        require_int("KVLayout.sliding_window", sliding_window, min=1, error=LayoutError)
    windows = tuple(
        w if w is None else require_int(f"{name}[{i}]", w, min=1, error=LayoutError)
        for i, w in enumerate(raw)
    )
    if whole_only and (windows or sliding_window is not None):
        raise LayoutError("a STATE layout has no sliding window")
    if windows and (sliding_window is not None or top >= len(windows)):
        why = f"the window or None of every layer id up to {top}, and no sliding_window"
        raise LayoutError(f"{name} {windows} must give {why}")
    if len(set(windows)) == 1:
        return windows[0], ()
    return sliding_window, windows


def layer_ids_of(num_layers: int | None, layer_ids: tuple[int, ...] | None) -> tuple[int, ...]:
    """The layer ids a constructor is given: ``layer_ids``, else ``range(num_layers)``
    (``LayoutError`` for neither, or for both disagreeing)."""
    if layer_ids is not None:
        if num_layers is not None and num_layers != len(layer_ids):
            raise LayoutError(f"num_layers={num_layers} disagrees with layer_ids={layer_ids}")
        return tuple(layer_ids)
    if num_layers is None:
        raise LayoutError("give num_layers or layer_ids")
    require_int("KVLayout.num_layers", num_layers, min=1, error=LayoutError)
    return tuple(range(num_layers))
