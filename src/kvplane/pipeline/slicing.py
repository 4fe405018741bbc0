"""Pipelined slices: step ranges, where each slice is cut, and the plans that move one slice.

:func:`step_ranges` splits a chunked prefill into steps; :class:`SliceCutter` cuts each step's
slice at both sides' block boundaries (a partial block deferred, the final slice always cut);
the pure :func:`plan_slice` builds one slice's plans with
:func:`~kvplane.transfer.planner.plan_transfer` (or, for one sender of several, its
:class:`~kvplane.pipeline.shares.Share` through :func:`~kvplane.transfer.resharding.plan_piece`).
It moves no byte and holds no session state.
See docs/pipeline.md ("Slicing").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvplane.errors import InvalidArgumentError, PlanError
from kvplane.ids import RegionId, SliceId, TokenRange
from kvplane.layout import KVLayout, heads_cover
from kvplane.pd.events import TransferRequest
from kvplane.pipeline.advert import RemotePool, num_paged, split_destination
from kvplane.pipeline.shares import Share
from kvplane.transfer import OpGrouping, PlanOptions, PlanSide, TransferPlan, plan_transfer
from kvplane.transfer.resharding import (
    KVBox,
    Piece,
    moves_whole_only,
    plan_piece,
    window_boxes,
)
from kvplane.transports.base import Int64Array
from kvplane.validators import require_int


def step_ranges(num_tokens: int, step_size: int) -> list[TokenRange]:
    """``[0, N)`` in consecutive steps of ``step_size`` tokens (the last may be shorter)."""
    require_int("num_tokens", num_tokens, min=1)
    require_int("step_size", step_size, min=1)
    return [TokenRange(s, min(s + step_size, num_tokens)) for s in range(0, num_tokens, step_size)]


class SliceCutter:
    """Slices of one request (see the module docstring); ``align`` is the block alignment.
    ``pipelined=False`` sends everything in the final slice, after the prefill ends (the
    baseline the pipelined mode is measured against); ``every`` > 1 cuts only after every
    ``every``-th step (fewer, larger slices)."""

    def __init__(
        self, num_tokens: int, align: int, *, pipelined: bool = True, every: int = 1
    ) -> None:
        self.num_tokens = num_tokens
        self.align = require_int("align", align, min=1)
        self.every = require_int("every", every, min=1)
        self.pipelined = pipelined
        self.steps = 0
        self.sent = 0
        self.next_id = 0
        self.done = False

    @staticmethod
    def alignment(*block_sizes: int) -> int:
        """Alignment that keeps a slice boundary on a block boundary of every side."""
        return math.lcm(*block_sizes)

    def after_step(self, step_end: int, is_last: bool) -> tuple[SliceId, TokenRange] | None:
        """The slice a step ending at ``step_end`` emits, or None (all of it deferred)."""
        if self.done:
            raise InvalidArgumentError("the final slice was already cut")
        if not self.sent <= step_end <= self.num_tokens:
            raise InvalidArgumentError(
                f"step end {step_end} outside [{self.sent}, {self.num_tokens}]"
            )
        self.steps += 1
        if is_last:
            if step_end != self.num_tokens:
                raise InvalidArgumentError(
                    f"the last step ends at {step_end}, not {self.num_tokens}"
                )
            cut = self.num_tokens
            self.done = True
        else:
            due = self.pipelined and self.steps % self.every == 0
            cut = (step_end // self.align) * self.align if due else 0
            if cut <= self.sent:
                return None
        out = (SliceId(self.next_id), TokenRange(self.sent, cut))
        self.sent = cut
        self.next_id += 1
        return out


def _ids(block_ids: tuple[int, ...]) -> Int64Array:
    return np.asarray(block_ids, dtype=np.int64)


def slice_schedule(
    num_tokens: int,
    steps: list[TokenRange],
    align: int,
    *,
    pipelined: bool = True,
    every: int = 1,
) -> tuple[tuple[TokenRange, bool], ...]:
    """The ``(range, is_last)`` of every slice the steps will produce, in slice-id order."""
    cutter = SliceCutter(num_tokens, align, pipelined=pipelined, every=every)
    out = []
    for i, step in enumerate(steps):
        cut = cutter.after_step(step.end, i == len(steps) - 1)
        if cut is not None:
            out.append((cut[1], cutter.done))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class LocalPool:
    """One of our pools as a plan source: layout, region, and the request's block ids in it."""

    layout: KVLayout
    region: RegionId
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PlannedSlice:
    """The plans of one slice, each with its destination pool's block size (1: whole-only)."""

    plans: tuple[TransferPlan, ...]
    dst_block_sizes: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.plans)

    @property
    def empty(self) -> bool:
        return not self.plans


def plan_slice(
    src: list[LocalPool],
    dst: list[RemotePool],
    request: TransferRequest,
    tokens: TokenRange,
    *,
    slice_id: SliceId,
    is_last: bool,
    grouping: OpGrouping = OpGrouping.WHOLE,
    share: Share | None = None,
) -> PlannedSlice:
    """The plans that move one slice (none: nothing to move). Raises ``PlanError`` /
    ``LayoutError`` / ``ProtocolError`` for a request the pools cannot serve. Without a
    ``share`` we are the session's one sender, so a destination whose TP heads our KV pool
    does not all hold is refused (the heads we lack would never arrive). With one, we are one
    sender of several: the KV plan moves exactly the share's heads × layers (``PlanError``
    unless our pools share exactly those heads) and the whole-only pools move as
    :func:`~kvplane.transfer.resharding.moves_whole_only` says (the lead's all; a stage's
    share of a state pool from every stage). The KV moves as one plan per window group of the layers
    (:func:`~kvplane.transfer.resharding.window_boxes`): window layers only the positions
    inside the window of the request's whole sequence, full layers all. Either side may hold
    one paged pool per KV cache group (the leading pools): each of our paged pools' window
    boxes goes, layer by layer, to the destination pool that holds each layer (a box may feed
    several; ``PlanError`` for a layer none holds)."""
    ns, nd = num_paged([p.layout for p in src]), num_paged([p.layout for p in dst])
    if len(src) - ns != len(dst) - nd:
        raise InvalidArgumentError(f"{len(src)} local pools but the peer advertises {len(dst)}")
    held, needed = src[0].layout.head_range, dst[0].layout.head_range
    if share is None and not heads_cover(held, needed):  # refused at the handshake already
        raise PlanError(
            f"destination heads {needed} are not all in our heads {held}: "
            "one sender cannot fill them"
        )
    dst_ids = split_destination(request.dst_block_ids, dst, request.num_tokens)
    n = request.num_tokens
    lo = max(tokens.start, request.prefix_tokens)
    plans: list[tuple[TransferPlan, int]] = []
    if lo < tokens.end:
        options = PlanOptions(
            prefix_tokens=request.prefix_tokens, grouping=grouping, slice_id=slice_id
        )
        targets = [
            PlanSide(p.layout, _ids(ids), p.region)
            for p, ids in zip(dst[:nd], dst_ids[:nd], strict=True)
        ]
        part = TokenRange(lo, tokens.end)
        for kv_src in src[:ns]:
            src_side = PlanSide(kv_src.layout, _ids(kv_src.block_ids), kv_src.region)
            mine = kv_src.layout.layer_ids
            whole = share.piece.box if share is not None else KVBox(needed, mine, part)
            layers = tuple(i for i in whole.layers if i in mine)  # a share's, in this pool
            if not layers:
                continue
            for window_box in window_boxes(kv_src.layout, KVBox(whole.heads, layers, part), n):
                for dst_side, box in _targets(targets, window_box):
                    if share is None:
                        plan = plan_transfer(src_side, dst_side, box.tokens, layers=box.layers,
                                             options=options)  # fmt: skip
                    else:
                        piece = Piece(share.sender, box)
                        plan = plan_piece(piece, src_side, dst_side, options).plan
                    plans.append((plan, dst_side.layout.block_size))
    if is_last:
        for local, remote, ids in zip(src[ns:], dst[nd:], dst_ids[nd:], strict=True):
            if share is not None and not moves_whole_only(
                local.layout, remote.layout, lead=share.lead
            ):
                continue
            plan = plan_transfer(
                PlanSide(local.layout, _ids(local.block_ids), local.region),
                PlanSide(remote.layout, _ids(ids), remote.region),
                None,
                options=PlanOptions(slice_id=slice_id),
            )
            plans.append((plan, remote.layout.block_size))
    kept = [(p, bs) for p, bs in plans if not p.empty]
    return PlannedSlice(tuple(p for p, _ in kept), tuple(bs for _, bs in kept))


def _targets(targets: list[PlanSide], box: KVBox) -> list[tuple[PlanSide, KVBox]]:
    """``box`` cut by destination paged pool: each pool holding some of its layers with the
    box over those layers, in pool order (``PlanError`` for a layer no pool holds)."""
    out: list[tuple[PlanSide, KVBox]] = []
    placed: set[int] = set()
    for side in targets:
        held = set(side.layout.layer_ids)
        layers = tuple(i for i in box.layers if i in held)
        if layers:
            out.append((side, KVBox(box.heads, layers, box.tokens)))
            placed.update(layers)
    missing = tuple(i for i in box.layers if i not in placed)
    if missing:
        held_by = [side.layout.layer_ids for side in targets]
        raise PlanError(f"no destination pool holds layers {missing}: the peer's pools hold "
                        f"{held_by}")  # fmt: skip
    return out
