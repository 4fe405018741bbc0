"""The planner: a pure function from a transfer request to a :class:`TransferPlan`.

Owns :func:`plan_transfer`: token segments cut at both sides' block boundaries, stride folding,
broadcast enumeration and coalescing into maximal runs (descriptors == ``stats().
contiguous_runs`` for a single-op plan), with the request's analytic :class:`Coverage` computed
apart so ``validate()`` checks the plan. Vectorised: a Python loop only over distinct segment
lengths. Theory of operation: docs/transports.md ("The planner").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.ids import ChunkKey, TokenRange
from kvplane.layout import Axis
from kvplane.transfer.coverage import Coverage, coverage_of_product
from kvplane.transfer.plan import TransferOp, TransferPlan
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanRequest, PlanSide, resolve
from kvplane.transfer.state_rows import row_coverage, row_elements, row_pieces, row_splits
from kvplane.transports.base import DescriptorList, Int64Array

_Elements = tuple[Int64Array, Int64Array, Int64Array, Int64Array]
"""Parallel arrays: source offset, destination offset, length and op index of each element."""


@dataclass(frozen=True, slots=True)
class _Axis:
    """A regular logical axis: the byte contribution of each index on each side."""

    src: Int64Array
    dst: Int64Array
    selects_op: bool = False
    steps: tuple[int, int] | None = None
    """``(src, dst)`` byte step between consecutive indices when the axis is an arithmetic
    progression on both sides (known from the layout), so folding needs no array scan."""

    def folds_into(self, run: int) -> bool:
        if len(self.src) == 1:
            return True
        if self.selects_op:
            return False
        if self.steps is not None:
            return self.steps == (run, run)
        return bool(np.all(np.diff(self.src) == run) and np.all(np.diff(self.dst) == run))


@dataclass(frozen=True, slots=True)
class _OpSpec:
    tokens: TokenRange
    layers: tuple[int, ...]
    chunk_keys: tuple[ChunkKey, ...]


def plan_transfer(
    src: PlanSide,
    dst: PlanSide,
    tokens: TokenRange | None,
    *,
    layers: Sequence[int] | None = None,
    options: PlanOptions | None = None,
) -> TransferPlan:
    """Plan moving the KV of ``tokens`` × ``layers`` from ``src`` to ``dst``.

    ``tokens`` are sequence positions (``None`` only for whole-only STATE pools); ``layers`` are
    global layer ids (default: every layer of the source pool), which both pools must hold. Heads
    moved are the intersection of both sides' TP head ranges. Prefix reuse drops tokens below
    ``options.prefix_tokens``; windows keep only what :meth:`KVLayout.window_start` of
    ``layers`` keeps of a sequence ending at ``tokens.end`` (so plan such pools with the range
    ending at the sequence end, one window group at a time: a group mixing a full layer keeps
    every position; :func:`~kvplane.transfer.resharding.window_boxes` splits a request).
    A state pool holding a TP rank's part of each row (``KVLayout.state_split``) moves the
    elements :func:`~kvplane.transfer.state_rows.row_pieces` assigns this pair of ranks.
    The result is ``TransferPlan.tokens``; an empty one gives a plan with no ops. Pure: reads
    its arguments, returns frozen data. Raises ``LayoutError`` for incompatible layouts and
    ``PlanError`` for a bad request (see :mod:`kvplane.transfer.request`).
    """
    req = resolve(src, dst, tokens, layers, options or PlanOptions())
    splits = row_splits(src.layout, dst.layout)
    pieces = () if splits is None else row_pieces(*splits)
    specs = _op_specs(req)
    fixed = _fixed_axes(req)
    coverage = _coverage(req, fixed) if splits is None else row_coverage(req, pieces)
    ops: tuple[TransferOp, ...] = ()
    if not req.tokens.empty and (splits is None or pieces):
        found = _elements(req, fixed) if splits is None else row_elements(req, pieces)
        ops = _split(req, specs, _coalesce(found, single_op=len(specs) == 1))
    return TransferPlan(
        ops=ops,
        tokens=req.tokens,
        layers=req.layers,
        coverage=coverage,
        src_region=src.region,
        dst_region=dst.region,
        src_fingerprint=src.layout.fingerprint(),
        dst_fingerprint=dst.layout.fingerprint(),
    )


def _chunk_keys(req: PlanRequest, tokens: TokenRange) -> tuple[ChunkKey, ...]:
    spec, keys = req.options.chunk_spec, req.options.chunk_keys
    if spec is None or tokens.empty:
        return ()
    step = spec.tokens_per_chunk
    return keys[tokens.start // step : -(-tokens.end // step)]


def _op_specs(req: PlanRequest) -> list[_OpSpec]:
    """What each op serves; empty when there is nothing to move."""
    a, b = req.tokens.start, req.tokens.end
    if a == b:
        return []
    opts = req.options
    if opts.grouping is OpGrouping.LAYER:
        keys = _chunk_keys(req, req.tokens)
        return [_OpSpec(req.tokens, (layer,), keys) for layer in req.layers]
    if opts.grouping is OpGrouping.CHUNK and opts.chunk_spec is not None:
        step = opts.chunk_spec.tokens_per_chunk
        specs = []
        for chunk in range(a // step, -(-b // step)):
            part = TokenRange(max(a, chunk * step), min(b, (chunk + 1) * step))
            specs.append(_OpSpec(part, req.layers, _chunk_keys(req, part)))
        return specs
    return [_OpSpec(req.tokens, req.layers, _chunk_keys(req, req.tokens))]


def _token_offsets(side: PlanSide, positions: Int64Array) -> Int64Array:
    """Byte offset of token ``positions`` (head 0, layer 0, comp 0) on one side."""
    layout = side.layout
    strides = layout.strides_bytes()
    bs = layout.block_size
    blocks = side.block_ids[positions // bs]
    out: Int64Array = (
        side.offset + blocks * strides[Axis.BLOCK] + (positions % bs) * strides[Axis.TOKEN]
    )
    return out


def _fixed_axes(req: PlanRequest) -> list[_Axis]:
    """LAYER, COMP and HEAD contributions on both sides."""
    s_str, d_str = req.src.layout.strides_bytes(), req.dst.layout.strides_bytes()
    comps = np.arange(req.src.layout.num_components, dtype=np.int64)
    heads = np.arange(req.heads[0], req.heads[1], dtype=np.int64)
    s_head0, d_head0 = req.src.layout.head_range[0], req.dst.layout.head_range[0]
    by_layer = req.options.grouping is OpGrouping.LAYER
    sl, dl = req.src_layers, req.dst_layers
    layer_steps = None  # both sides hold the chosen layers at consecutive indices
    if _consecutive(sl) and _consecutive(dl):
        layer_steps = (s_str[Axis.LAYER], d_str[Axis.LAYER])
    return [
        _Axis(sl * s_str[Axis.LAYER], dl * d_str[Axis.LAYER], by_layer, layer_steps),
        _Axis(comps * s_str[Axis.COMP], comps * d_str[Axis.COMP], False,
              (s_str[Axis.COMP], d_str[Axis.COMP])),
        _Axis((heads - s_head0) * s_str[Axis.HEAD], (heads - d_head0) * d_str[Axis.HEAD], False,
              (s_str[Axis.HEAD], d_str[Axis.HEAD])),
    ]  # fmt: skip


def _consecutive(indices: Int64Array) -> bool:
    n = len(indices)
    return n < 2 or (
        int(indices[-1]) - int(indices[0]) == n - 1 and bool(np.all(np.diff(indices) == 1))
    )


def _row_bytes(req: PlanRequest) -> int:
    return req.src.layout.head_dim * req.src.layout.element_size


def _coverage(req: PlanRequest, fixed: list[_Axis]) -> Coverage:
    """Analytic moments of the request, per token from the block tables (independent of the
    segment/fold/coalesce path). When both sides share one block size and the range is whole
    blocks, the token axis is the product of a block axis and a token-in-block axis (the same
    byte set, so the same moments, from ``block_size`` times fewer offsets)."""
    if req.tokens.empty:
        return Coverage.zero()
    a, b = req.tokens.start, req.tokens.end
    bs = req.src.layout.block_size
    axes: list[tuple[Int64Array, Int64Array] | int]
    if bs == req.dst.layout.block_size and a % bs == 0 and b % bs == 0:
        starts = np.arange(a, b, bs, dtype=np.int64)
        tok = np.arange(bs, dtype=np.int64)
        s_tok = req.src.layout.strides_bytes()[Axis.TOKEN]
        d_tok = req.dst.layout.strides_bytes()[Axis.TOKEN]
        axes = [
            (_token_offsets(req.src, starts), _token_offsets(req.dst, starts)),
            (tok * s_tok, tok * d_tok),
        ]
    else:
        positions = np.arange(a, b, dtype=np.int64)
        axes = [(_token_offsets(req.src, positions), _token_offsets(req.dst, positions))]
    axes += [(ax.src, ax.dst) for ax in fixed]
    axes.append(_row_bytes(req))  # the byte-in-row axis (k, k), k < row: closed form
    return coverage_of_product(axes)


def _segments(req: PlanRequest) -> tuple[Int64Array, Int64Array]:
    """Start and length of every token segment (no block or chunk boundary inside)."""
    a, b = req.tokens.start, req.tokens.end
    steps = [req.src.layout.block_size, req.dst.layout.block_size]
    spec = req.options.chunk_spec
    if req.options.grouping is OpGrouping.CHUNK and spec is not None:
        steps.append(spec.tokens_per_chunk)
    cuts = [np.array([a], dtype=np.int64)]
    cuts += [np.arange(-(-a // s) * s, b, s, dtype=np.int64) for s in steps]
    starts = np.unique(np.concatenate(cuts))
    lengths = np.diff(np.append(starts, b))
    return starts, lengths


def _elements(req: PlanRequest, fixed: list[_Axis]) -> _Elements:
    """Every unfoldable element as parallel arrays (src offset, dst offset, length, op)."""
    starts, lengths = _segments(req)
    seg_src = _token_offsets(req.src, starts)
    seg_dst = _token_offsets(req.dst, starts)
    spec = req.options.chunk_spec
    if req.options.grouping is OpGrouping.CHUNK and spec is not None:
        step = spec.tokens_per_chunk
        seg_op = starts // step - req.tokens.start // step
    else:
        seg_op = np.zeros(len(starts), dtype=np.int64)
    s_tok = req.src.layout.strides_bytes()[Axis.TOKEN]
    d_tok = req.dst.layout.strides_bytes()[Axis.TOKEN]
    parts: list[_Elements] = []
    for n in np.unique(lengths).tolist():  # distinct segment lengths: one or a few
        tok = np.arange(n, dtype=np.int64)
        run, comb_s, comb_d, comb_op = _fold_and_enumerate(
            _row_bytes(req), [_Axis(tok * s_tok, tok * d_tok, False, (s_tok, d_tok)), *fixed]
        )
        pick = np.flatnonzero(lengths == n)
        s = (seg_src[pick, None] + comb_s[None, :]).ravel()
        d = (seg_dst[pick, None] + comb_d[None, :]).ravel()
        op = (seg_op[pick, None] + comb_op[None, :]).ravel()
        parts.append((s, d, np.full(len(s), run, dtype=np.int64), op))
    if len(parts) == 1:
        return parts[0]
    cols = list(zip(*parts, strict=True))
    return (
        np.concatenate(cols[0]),
        np.concatenate(cols[1]),
        np.concatenate(cols[2]),
        np.concatenate(cols[3]),
    )


def _fold_and_enumerate(
    row: int, axes: list[_Axis]
) -> tuple[int, Int64Array, Int64Array, Int64Array]:
    """Fold every axis that continues the run on both sides; enumerate the rest.

    Returns the run length and, per enumerated combination, its src/dst offset and op index.
    """
    run, base_s, base_d = row, 0, 0
    rest = list(axes)
    folded = True
    while folded:
        folded = False
        for i, ax in enumerate(rest):
            if ax.folds_into(run):
                base_s += int(ax.src[0])
                base_d += int(ax.dst[0])
                run *= len(ax.src)
                del rest[i]
                folded = True
                break
    comb_s = np.array([base_s], dtype=np.int64)
    comb_d = np.array([base_d], dtype=np.int64)
    comb_op = np.zeros(1, dtype=np.int64)
    for ax in rest:
        index = np.arange(len(ax.src), dtype=np.int64)
        comb_s = (comb_s[:, None] + ax.src[None, :]).ravel()
        comb_d = (comb_d[:, None] + ax.dst[None, :]).ravel()
        comb_op = (comb_op[:, None] + (index if ax.selects_op else 0 * index)[None, :]).ravel()
    return run, comb_s, comb_d, comb_op


def _coalesce(elements: _Elements, *, single_op: bool) -> _Elements:
    """Sort by (op, src offset) and merge neighbours contiguous on both sides (same op)."""
    s, d, n, op = elements
    order = np.argsort(s, kind="stable") if single_op else np.lexsort((s, op))
    s, d, n, op = s[order], d[order], n[order], op[order]
    joins = (op[1:] == op[:-1]) & (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:])
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    return s[heads], d[heads], np.add.reduceat(n, heads), op[heads]


def _split(req: PlanRequest, specs: list[_OpSpec], elements: _Elements) -> tuple[TransferOp, ...]:
    """One op per spec from the op-sorted elements."""
    s, d, n, op = elements
    bounds = np.searchsorted(op, np.arange(len(specs) + 1, dtype=np.int64)).tolist()
    s_reg = np.full(len(s), req.src.region, dtype=np.int64)
    d_reg = s_reg if req.dst.region == req.src.region else np.full_like(s_reg, req.dst.region)
    # both sides checked once, whole; each op gets views (one lengths array for both sides:
    # the pairing check sees it at once)
    whole_src = DescriptorList(s_reg, s, n)
    whole_dst = DescriptorList(d_reg, d, whole_src.lengths)
    src_parts = whole_src.parts(bounds)
    dst_parts = whole_dst.parts(bounds, lengths_of=src_parts)
    slice_id = req.options.slice_id
    return tuple(
        TransferOp.planned(
            src, dst, spec.tokens, layers=spec.layers, chunk_keys=spec.chunk_keys, slice_id=slice_id
        )
        for spec, src, dst in zip(specs, src_parts, dst_parts, strict=True)
    )
