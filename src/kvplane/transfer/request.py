"""What a caller asks the planner for, checked and normalised before any arithmetic.

:class:`PlanSide` and :class:`PlanOptions` name a request; :func:`resolve` turns it into a
:class:`PlanRequest` (effective token range, layer indices, shared TP heads, op boundaries) or
raises ``LayoutError``/``PlanError`` naming the bad value. It builds no descriptors and touches
no region. See docs/transports.md ("Transfer requests").
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.chunks import ChunkSpec
from kvplane.errors import LayoutError, PlanError
from kvplane.ids import ChunkKey, RegionId, SliceId, TokenRange
from kvplane.layout import KVLayout, shared_heads
from kvplane.transports.base import Int64Array
from kvplane.transports.descriptors import MAX_END
from kvplane.validators import is_int, require_int


@dataclass(frozen=True, slots=True, eq=False)
class PlanSide:
    """One end of a transfer: a pool's layout, the sequence's block table in it, and where the
    pool's bytes are — ``offset`` bytes into region ``region``.

    ``block_ids[i]`` is the pool block holding sequence tokens ``[i*bs, (i+1)*bs)``. Stored as a
    read-only int64 array; every id must lie in ``[0, layout.num_blocks)`` (``PlanError``).
    """

    layout: KVLayout
    block_ids: Int64Array
    region: RegionId
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise PlanError(f"PlanSide.layout must be a KVLayout, got {self.layout!r}")
        raw = np.asarray(self.block_ids)
        if raw.size and (raw.dtype.kind not in "iu" or raw.dtype == np.bool_):
            raise PlanError(f"PlanSide.block_ids must be integers, got dtype {raw.dtype}")
        ids = np.ascontiguousarray(raw, dtype=np.int64)
        if ids.ndim != 1:
            raise PlanError(f"PlanSide.block_ids must be one-dimensional, got shape {ids.shape}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.layout.num_blocks))
        if len(bad):
            raise PlanError(
                f"block id {int(ids[bad[0]])} (table position {int(bad[0])}) is outside the "
                f"pool's [0, {self.layout.num_blocks})"
            )
        ids.setflags(write=False)
        object.__setattr__(self, "block_ids", ids)
        require_int("PlanSide.region", self.region, min=0, error=PlanError)
        require_int("PlanSide.offset", self.offset, min=0, error=PlanError)
        if self.offset > MAX_END - self.layout.pool_bytes:
            raise PlanError(
                f"PlanSide: a pool of {self.layout.pool_bytes} bytes at offset {self.offset} "
                f"ends past the {MAX_END}-byte limit"
            )

    @property
    def pool_end(self) -> int:
        """First region byte after the pool (the region must be at least this long)."""
        return self.offset + self.layout.pool_bytes


class OpGrouping(enum.Enum):
    """How a plan's descriptors are split into ops (one transport batch each)."""

    WHOLE = "whole"
    """One op for the whole plan (fewest descriptors)."""
    CHUNK = "chunk"
    """One op per chunk of ``chunk_spec.tokens_per_chunk`` sequence positions."""
    LAYER = "layer"
    """One op per layer (layer-wise pipelining)."""


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """``prefix_tokens``: the receiver already holds tokens ``[0, prefix_tokens)``, skip them.
    ``grouping``: op split. ``chunk_spec``/``chunk_keys``: chunk geometry and the sequence's
    chunk keys (chunk ``i`` → ``chunk_keys[i]``) for annotation; ``slice_id``: annotation."""

    prefix_tokens: int = 0
    grouping: OpGrouping = OpGrouping.WHOLE
    chunk_spec: ChunkSpec | None = None
    chunk_keys: tuple[ChunkKey, ...] = ()
    slice_id: SliceId | None = None

    def __post_init__(self) -> None:
        require_int("PlanOptions.prefix_tokens", self.prefix_tokens, min=0, error=PlanError)
        if not isinstance(self.grouping, OpGrouping):
            raise PlanError(f"PlanOptions.grouping must be an OpGrouping, got {self.grouping!r}")
        if self.chunk_spec is not None and not isinstance(self.chunk_spec, ChunkSpec):
            raise PlanError(f"PlanOptions.chunk_spec must be a ChunkSpec, got {self.chunk_spec!r}")
        if not isinstance(self.chunk_keys, tuple | list):
            raise PlanError(f"PlanOptions.chunk_keys must be a sequence, got {self.chunk_keys!r}")
        object.__setattr__(self, "chunk_keys", tuple(self.chunk_keys))
        if any(not isinstance(k, bytes) for k in self.chunk_keys):
            raise PlanError("PlanOptions.chunk_keys must be bytes")
        if self.chunk_spec is None and (self.chunk_keys or self.grouping is OpGrouping.CHUNK):
            raise PlanError("chunk keys and CHUNK grouping need PlanOptions.chunk_spec")
        if self.slice_id is not None:
            require_int("PlanOptions.slice_id", self.slice_id, min=0, error=PlanError)


@dataclass(frozen=True, slots=True, eq=False)
class PlanRequest:
    """A resolved request: effective ``tokens``, ``layers`` and their pool indices on each
    side, and the global head range ``heads`` both sides hold."""

    src: PlanSide
    dst: PlanSide
    tokens: TokenRange
    layers: tuple[int, ...]
    src_layers: Int64Array
    dst_layers: Int64Array
    heads: tuple[int, int]
    options: PlanOptions


_MUST_MATCH = (
    "kind", "dtype", "head_dim", "rope_dim", "total_heads", "sliding_window", "layer_windows",
)  # fmt: skip


def _check_compatible(a: KVLayout, b: KVLayout) -> None:
    for name in _MUST_MATCH:
        if getattr(a, name) != getattr(b, name):
            raise LayoutError(
                f"source and destination layouts differ in {name}: {getattr(a, name)!r} vs "
                f"{getattr(b, name)!r}"
            )


def _layer_indices(layout: KVLayout, layers: tuple[int, ...], side: str) -> Int64Array:
    if layers == layout.layer_ids:  # every layer in pool order (the usual request)
        return np.arange(len(layers), dtype=np.int64)
    known = {layer: i for i, layer in enumerate(layout.layer_ids)}
    missing = [layer for layer in layers if layer not in known]
    if missing:
        raise PlanError(
            f"{side} pool does not hold layer(s) {missing}; it holds {layout.layer_ids}"
        )
    return np.array([known[layer] for layer in layers], dtype=np.int64)


def _resolve_layers(src: KVLayout, layers: Sequence[int] | None) -> tuple[int, ...]:
    if layers is None:  # the layout validated its own layer ids
        return src.layer_ids
    try:
        chosen = tuple(layers)
    except TypeError:
        raise PlanError(f"layers must be a sequence of ints, got {layers!r}") from None
    if not chosen:
        raise PlanError("a plan needs at least one layer")
    if not all(is_int(i) for i in chosen):
        raise PlanError(f"layers must be ints, got {chosen!r}")
    if len(set(chosen)) != len(chosen):
        raise PlanError(f"layers has duplicates: {chosen}")
    return chosen


def _effective_tokens(
    src: PlanSide,
    dst: PlanSide,
    tokens: TokenRange | None,
    layers: tuple[int, ...],
    options: PlanOptions,
) -> TokenRange:
    if src.layout.whole_only:
        whole = TokenRange(0, len(src.block_ids))
        if len(dst.block_ids) != len(src.block_ids):
            raise PlanError(
                f"whole-only state: {len(src.block_ids)} source blocks but "
                f"{len(dst.block_ids)} destination blocks"
            )
        if tokens is not None and tokens != whole:
            raise PlanError(
                f"a {src.layout.kind.value} layout moves whole blocks only; token range {tokens} "
                f"would slice it (omit it or pass {whole})"
            )
        if options.prefix_tokens or options.grouping is OpGrouping.CHUNK:
            raise PlanError(
                f"a {src.layout.kind.value} layout moves whole blocks only; prefix_tokens="
                f"{options.prefix_tokens} and grouping={options.grouping.value} would slice it"
            )
        return whole
    if not isinstance(tokens, TokenRange):
        raise PlanError(f"a KV plan needs a TokenRange, got {tokens!r}")
    start = max(tokens.start, options.prefix_tokens, src.layout.window_start(tokens.end, layers))
    return TokenRange(min(start, tokens.end), tokens.end)


SMALL_TABLE = 256
"""Block tables up to this long are checked for repeats with a set, longer ones by sorting."""


def _check_blocks(side: PlanSide, tokens: TokenRange, name: str) -> None:
    if tokens.empty:
        return
    bs = side.layout.block_size
    first, last = tokens.start // bs, -(-tokens.end // bs)
    if last > len(side.block_ids):
        raise PlanError(
            f"{name} block table holds {len(side.block_ids)} blocks ({len(side.block_ids) * bs} "
            f"tokens) but tokens {tokens} need {last}"
        )
    used = side.block_ids[first:last]
    if len(used) <= SMALL_TABLE and len(set(used.tolist())) == len(used):
        return  # the usual slice: a few blocks, all distinct (a set beats a sort here)
    uniq, counts = np.unique(used, return_counts=True)
    if len(uniq) != len(used):
        raise PlanError(f"{name} block table repeats block id {int(uniq[counts > 1][0])}")


def resolve(
    src: PlanSide,
    dst: PlanSide,
    tokens: TokenRange | None,
    layers: Sequence[int] | None,
    options: PlanOptions,
) -> PlanRequest:
    """Check and normalise a request (see the module docstring); raises before any arithmetic."""
    if not isinstance(src, PlanSide) or not isinstance(dst, PlanSide):
        raise PlanError("plan_transfer needs PlanSide source and destination")
    if not isinstance(options, PlanOptions):
        raise PlanError(f"options must be PlanOptions, got {options!r}")
    _check_compatible(src.layout, dst.layout)
    chosen = _resolve_layers(src.layout, layers)
    src_layers = _layer_indices(src.layout, chosen, "source")
    dst_layers = _layer_indices(dst.layout, chosen, "destination")
    heads = shared_heads(src.layout.head_range, dst.layout.head_range)
    if heads is None:
        raise PlanError(
            f"source heads {src.layout.head_range} and destination heads "
            f"{dst.layout.head_range} do not intersect: nothing to move"
        )
    effective = _effective_tokens(src, dst, tokens, chosen, options)
    _check_blocks(src, effective, "source")
    _check_blocks(dst, effective, "destination")
    return PlanRequest(src, dst, effective, chosen, src_layers, dst_layers, heads, options)
