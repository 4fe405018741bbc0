"""TP ranks' parts of recurrent-state rows in a plan: which elements one rank sends another.

:func:`row_pieces` is the one rule of which TP rank sends which elements of each state row to
which TP rank of the other side: per part of the row (:data:`~kvplane.state_split.PARTS`), the
senders are grouped by the units they hold; a group sharing units with the destination sends
them once, from its member ``destination rank % group size`` (how
:func:`~kvplane.transfer.resharding.reshard` picks among replicated KV heads), so the senders'
pieces tile the destination's row exactly once. :func:`row_splits` says when a plan needs it;
:func:`row_elements` and :func:`row_coverage` are the planner's elements and analytic coverage
for it. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvplane.errors import LayoutError
from kvplane.layout import Axis, KVLayout
from kvplane.state_split import PARTS, StateSplit, units_held
from kvplane.transfer.coverage import MOD, Coverage, coverage_of_product
from kvplane.transfer.request import OpGrouping, PlanRequest
from kvplane.transports.base import Int64Array

Elements = tuple[Int64Array, Int64Array, Int64Array, Int64Array]
"""Parallel arrays: source offset, destination offset, length and op index of each element."""


@dataclass(frozen=True, slots=True)
class RowPiece:
    """Elements ``[start, start + length)`` of a whole row, at ``src`` in the sender's row and
    at ``dst`` in the receiver's."""

    start: int
    src: int
    dst: int
    length: int


def row_pieces(src: StateSplit, dst: StateSplit) -> tuple[RowPiece, ...]:
    """What TP rank ``src`` sends TP rank ``dst`` of every state row, in row order (module
    docstring; none when another rank sends all it shares). ``LayoutError`` unless both split
    the same geometry."""
    if src.geometry != dst.geometry:
        raise LayoutError(f"state rows of {src.geometry} and {dst.geometry} do not match")
    out = []
    parts = src.geometry.parts()
    for i, ((start, units, unit), here, there) in enumerate(zip(parts, src.spans, dst.spans,
                                                                strict=True)):  # fmt: skip
        held, needed = src.held(i), dst.held(i)
        lo, hi = max(held[0], needed[0]), min(held[1], needed[1])
        group = [r for r in range(src.tp_size)
                 if units_held(units, PARTS[i], src.tp_size, r) == held]  # fmt: skip
        if lo >= hi or group[dst.tp_rank % len(group)] != src.tp_rank:
            continue
        s, d = (lo - held[0]) * unit + here.local, (lo - needed[0]) * unit + there.local
        out.append(RowPiece(start + lo * unit, s, d, (hi - lo) * unit))
    return tuple(out)


def row_splits(src: KVLayout, dst: KVLayout) -> tuple[StateSplit, StateSplit] | None:
    """Both sides' splits when either holds a TP rank's part of each state row (a side with no
    split holds whole rows of the other's geometry); None when neither does."""
    a, b = src.state_split, dst.state_split
    sharded = [split for split in (a, b) if split is not None and split.sharded]
    if not sharded:
        return None
    geometry = sharded[0].geometry
    return a or StateSplit(geometry), b or StateSplit(geometry)


def _axes(req: PlanRequest) -> tuple[tuple[Int64Array, Int64Array], tuple[Int64Array, Int64Array]]:
    """The block (slot) and layer contributions of the request on both sides."""
    s_str, d_str = req.src.layout.strides_bytes(), req.dst.layout.strides_bytes()
    a, b = req.tokens.start, req.tokens.end
    blocks = (req.src.offset + req.src.block_ids[a:b] * s_str[Axis.BLOCK],
              req.dst.offset + req.dst.block_ids[a:b] * d_str[Axis.BLOCK])  # fmt: skip
    layers = (req.src_layers * s_str[Axis.LAYER], req.dst_layers * d_str[Axis.LAYER])
    return blocks, layers


def _piece_axis(pieces: tuple[RowPiece, ...], size: int) -> tuple[Int64Array, Int64Array]:
    return (np.array([p.src * size for p in pieces], dtype=np.int64),
            np.array([p.dst * size for p in pieces], dtype=np.int64))  # fmt: skip


def row_elements(req: PlanRequest, pieces: tuple[RowPiece, ...]) -> Elements:
    """One element per (slot, layer, piece) of a whole-only request, the op index the layer's
    position under LAYER grouping (else 0). ``pieces`` must be non-empty."""
    (sb, db), (sl, dl) = _axes(req)
    size = req.src.layout.element_size
    ps, pd = _piece_axis(pieces, size)
    n = np.array([p.length * size for p in pieces], dtype=np.int64)
    shape = (len(sb), len(sl), len(pieces))
    s = (sb[:, None, None] + sl[None, :, None] + ps[None, None, :]).ravel()
    d = (db[:, None, None] + dl[None, :, None] + pd[None, None, :]).ravel()
    by_layer = req.options.grouping is OpGrouping.LAYER
    op = np.arange(len(sl), dtype=np.int64) if by_layer else np.zeros(len(sl), dtype=np.int64)
    return (
        s,
        d,
        np.broadcast_to(n, shape).ravel(),
        np.broadcast_to(op[None, :, None], shape).ravel(),
    )


def row_coverage(req: PlanRequest, pieces: tuple[RowPiece, ...]) -> Coverage:
    """Analytic moments of the request's pieces: per distinct piece length, the product of the
    slot, layer and piece-start axes and the bytes of a piece, summed (independent of
    :func:`row_elements`)."""
    blocks, layers = _axes(req)
    size = req.src.layout.element_size
    parts = []
    for length in sorted({p.length for p in pieces}):
        same = tuple(p for p in pieces if p.length == length)
        parts.append(coverage_of_product([blocks, layers, _piece_axis(same, size), length * size]))
    total = sum(c.num_bytes for c in parts)
    moments = zip(*(c.moments for c in parts), strict=True)
    return Coverage(total, tuple(sum(m) % MOD for m in moments)) if parts else Coverage.zero()
