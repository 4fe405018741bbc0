"""Resharding: which prefill rank sends which KV to which decode rank when the two sides are
parallelised differently (prefill TP × PP stages, decode TP, different block sizes).

:func:`reshard` maps a producer :class:`Parallelism` to a consumer one for one model: per decode
rank, the :class:`Piece` s (sender, global heads, layers, tokens) that tile its destination
:class:`KVBox` exactly once. :func:`tp_head_range` is the one rule of which heads a TP rank holds,
:func:`stage_layers` of which stage holds a layer (KV or state), :func:`moves_whole_only` of who
moves a whole-only pool (a TP rank's part of each state row: :mod:`~kvplane.transfer.state_rows`);
:func:`window_boxes` splits a box by the layers' windows; where several ranks hold the same heads
(GQA with TP > KV heads, MLA's latent) exactly one sender is chosen, the others skip.
:func:`plan_pieces` turns pieces into plans through the one planner. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from kvplane.chunks import ChunkSpec
from kvplane.errors import LayoutError, PlanError
from kvplane.ids import TokenRange
from kvplane.layout import KVLayout, check_layer_ids, shared_heads
from kvplane.transfer.plan import TransferPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import PlanOptions, PlanSide
from kvplane.validators import require_int


def tp_head_range(total_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The half-open global KV heads TP rank ``tp_rank`` of ``tp_size`` holds. ``tp_size``
    dividing ``total_heads``: an even contiguous split. Fewer heads than ranks (GQA with TP > KV
    heads; MLA's one latent "head", ``total_heads=1``): head ``h`` is replicated on the
    ``tp_size // total_heads`` consecutive ranks from ``h · tp_size // total_heads`` (how
    engines shard KV heads). ``LayoutError`` unless one of the two divides the other."""
    require_int("total_heads", total_heads, min=1, error=LayoutError)
    require_int("tp_size", tp_size, min=1, error=LayoutError)
    require_int("tp_rank", tp_rank, min=0, max=tp_size - 1, error=LayoutError)
    if total_heads % tp_size == 0:
        per_rank = total_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % total_heads == 0:
        head = tp_rank // (tp_size // total_heads)
        return head, head + 1
    raise LayoutError(f"{total_heads} KV heads and TP {tp_size}: one must divide the other")


@dataclass(frozen=True, slots=True, order=True)
class SenderId:
    """A prefill rank: TP rank ``tp_rank`` of pipeline stage ``stage``."""

    stage: int
    tp_rank: int

    def __post_init__(self) -> None:
        require_int("SenderId.stage", self.stage, min=0, error=PlanError)
        require_int("SenderId.tp_rank", self.tp_rank, min=0, error=PlanError)

    def __str__(self) -> str:
        return f"stage {self.stage} tp {self.tp_rank}"


@dataclass(frozen=True, slots=True)
class KVBox:
    """A set of KV cells: global ``heads`` (half-open) × ``layers`` (global ids) × ``tokens``."""

    heads: tuple[int, int]
    layers: tuple[int, ...]
    tokens: TokenRange

    def __post_init__(self) -> None:
        if not isinstance(self.heads, tuple | list) or len(self.heads) != 2:
            raise PlanError(f"KVBox.heads must be a (start, end) pair, got {self.heads!r}")
        lo = require_int("KVBox.heads[0]", self.heads[0], min=0, error=PlanError)
        hi = require_int("KVBox.heads[1]", self.heads[1], min=lo + 1, error=PlanError)
        object.__setattr__(self, "heads", (lo, hi))
        object.__setattr__(self, "layers", check_layer_ids("KVBox.layers", self.layers,
                                                           error=PlanError))  # fmt: skip
        if not isinstance(self.tokens, TokenRange):
            raise PlanError(f"KVBox.tokens must be a TokenRange, got {self.tokens!r}")

    @property
    def cells(self) -> int:
        """Head × layer × token cells in the box."""
        return (self.heads[1] - self.heads[0]) * len(self.layers) * len(self.tokens)

    def overlaps(self, other: KVBox) -> bool:
        """True when the boxes share a cell."""
        return (
            shared_heads(self.heads, other.heads) is not None
            and not self.tokens.intersect(other.tokens).empty
            and not set(self.layers).isdisjoint(other.layers)
        )

    def contains(self, other: KVBox) -> bool:
        """True when every cell of ``other`` is in this box."""
        return (
            self.heads[0] <= other.heads[0]
            and other.heads[1] <= self.heads[1]
            and set(other.layers) <= set(self.layers)
            and self.tokens.contains(other.tokens)
        )

    def __str__(self) -> str:
        return f"heads [{self.heads[0]}, {self.heads[1]}) × layers {self.layers} × {self.tokens}"


@dataclass(frozen=True, slots=True)
class Piece:
    """What one sender moves to one decode rank: the cells of ``box``."""

    sender: SenderId
    box: KVBox

    def __str__(self) -> str:
        return f"{self.box} from {self.sender}"


@dataclass(frozen=True, slots=True)
class Parallelism:
    """How one side is parallelised: ``tp_size`` TP ranks per pipeline stage, ``stages`` the
    global layer ids each stage holds (in stage order; a decode side has one stage) and the
    pools' ``block_size``. Stages must be non-empty and disjoint (``PlanError``)."""

    tp_size: int
    stages: tuple[tuple[int, ...], ...]
    block_size: int

    def __post_init__(self) -> None:
        require_int("Parallelism.tp_size", self.tp_size, min=1, error=PlanError)
        require_int("Parallelism.block_size", self.block_size, min=1, error=PlanError)
        if not isinstance(self.stages, tuple | list) or not self.stages:
            raise PlanError(f"Parallelism.stages must name one or more stages: {self.stages!r}")
        stages = tuple(
            check_layer_ids(f"Parallelism.stages[{i}]", s, error=PlanError)
            for i, s in enumerate(self.stages)
        )
        every = [layer for s in stages for layer in s]
        if len(set(every)) != len(every):
            raise PlanError(f"Parallelism.stages share layers: {stages}")
        object.__setattr__(self, "stages", stages)

    @classmethod
    def pipeline(
        cls, *, tp_size: int, num_layers: int, pp_size: int = 1, block_size: int
    ) -> Parallelism:
        """``pp_size`` stages of consecutive layers of ``range(num_layers)``, as even as can be
        (the first ``num_layers % pp_size`` stages hold one layer more)."""
        require_int("num_layers", num_layers, min=1, error=PlanError)
        require_int("pp_size", pp_size, min=1, max=num_layers, error=PlanError)
        base, extra = divmod(num_layers, pp_size)
        bounds = [0]
        for stage in range(pp_size):
            bounds.append(bounds[-1] + base + (stage < extra))
        stages = tuple(tuple(range(a, b)) for a, b in pairwise(bounds))
        return cls(tp_size, stages, block_size)

    @property
    def layers(self) -> tuple[int, ...]:
        """Every layer the side holds, stage by stage."""
        return tuple(layer for stage in self.stages for layer in stage)

    def blocks_of(self, tokens: TokenRange) -> range:
        """Sequence block indices this side's pools hold ``tokens`` in."""
        return ChunkSpec(self.block_size).blocks_of(tokens)

    def rank_layout(self, model: KVLayout, stage: int, tp_rank: int, num_blocks: int) -> KVLayout:
        """The pool layout of rank (``stage``, ``tp_rank``) for ``model`` (the one-process
        layout): its TP heads, its stage's layers, this side's block size, ``num_blocks``."""
        require_int("stage", stage, min=0, max=len(self.stages) - 1, error=PlanError)
        return KVLayout(
            kind=model.kind, num_blocks=num_blocks, block_size=self.block_size,
            layer_ids=self.stages[stage], total_heads=model.total_heads,
            head_dim=model.head_dim, dtype=model.dtype,
            head_range=tp_head_range(model.total_heads, self.tp_size, tp_rank),
            rope_dim=model.rope_dim, order=model.order, sliding_window=model.sliding_window,
            layer_windows=model.layer_windows,
        )  # fmt: skip


def stage_layers(
    layer_ids: Sequence[int], num_layers: int, pp_size: int
) -> tuple[tuple[int, ...], ...]:
    """Per pipeline stage, those of ``layer_ids`` (one pool's global layer ids: a hybrid's
    attention layers for its KV pool, its Mamba layers for its state pool) in the stage's
    consecutive range of the model's ``num_layers`` layers (:meth:`Parallelism.pipeline`): the
    one rule of which stage holds a layer, for every pool. A stage may hold none of a pool's
    layers (an empty tuple). ``PlanError`` as :meth:`Parallelism.pipeline`."""
    ranges = Parallelism.pipeline(tp_size=1, num_layers=num_layers, pp_size=pp_size,
                                  block_size=1).stages  # fmt: skip
    return tuple(tuple(i for i in layer_ids if r[0] <= i <= r[-1]) for r in ranges)


def moves_whole_only(local: KVLayout, remote: KVLayout, *, lead: bool) -> bool:
    """Whether one sender of several moves its whole-only pool ``local`` into the destination's
    ``remote`` in the final slice (planned with ``local``'s layers): the lead moves every
    whole-only pool (the tail, a state pool); any other sender moves a pool it holds a stage's
    share of (fewer layers than ``remote``: a hybrid's state pool of its stage's Mamba layers,
    :func:`stage_layers`), so the stages' pools tile the destination's layers once, or a TP
    rank's part of each row (``state_split``: the planner moves the elements
    :func:`~kvplane.transfer.state_rows.row_pieces` assigns it), so the ranks tile each row once."""
    split = local.state_split
    return lead or set(local.layer_ids) < set(remote.layer_ids) or bool(split and split.sharded)


def window_boxes(layout: KVLayout, box: KVBox, num_tokens: int) -> tuple[KVBox, ...]:
    """``box`` split by sliding window: per group of its layers that share a window in
    ``layout`` (in order of each group's first layer), those layers × the box's tokens from
    the group's :meth:`KVLayout.window_start` of a ``num_tokens``-token sequence on — the
    cells the decode side's attention reads; a group left with no token is dropped. The boxes
    are disjoint and their union is every read cell of ``box``. Pure; ``LayoutError`` for a
    layer ``layout`` does not hold."""
    groups: dict[int | None, list[int]] = {}
    for layer in box.layers:
        groups.setdefault(layout.window_of(layer), []).append(layer)
    out = []
    for layers in map(tuple, groups.values()):
        start = max(box.tokens.start, layout.window_start(num_tokens, layers))
        if start == box.tokens.start and len(layers) == len(box.layers):  # nothing to split
            return (box,) if start < box.tokens.end else ()
        if start < box.tokens.end:
            out.append(KVBox(box.heads, layers, TokenRange(start, box.tokens.end)))
    return tuple(out)


def destination(model: KVLayout, decode: Parallelism, tp_rank: int, tokens: TokenRange) -> KVBox:
    """The cells decode rank ``tp_rank`` must receive: its TP heads × every layer × ``tokens``."""
    return KVBox(tp_head_range(model.total_heads, decode.tp_size, tp_rank), decode.layers, tokens)


def reshard(
    model: KVLayout, prefill: Parallelism, decode: Parallelism, tokens: TokenRange
) -> tuple[tuple[Piece, ...], ...]:
    """Per decode TP rank, the pieces (in stage, then head order) that move ``tokens`` of every
    layer of its heads from the prefill ranks of ``model`` (the one-process layout, whose
    ``total_heads`` and ``layer_ids`` are split). Per stage, the prefill ranks are grouped by
    the heads they hold; each group sharing heads with the decode rank sends them once, from
    its member ``decode_rank % group size`` (replicas take turns across decode ranks). Every
    piece is the shared heads × the stage's layers × ``tokens``, so the pieces tile
    :func:`destination` exactly once. ``PlanError`` unless both sides hold exactly the model's
    layers and the decode side has one stage; ``LayoutError`` for a TP size that splits the
    heads unevenly."""
    if len(decode.stages) != 1 or decode.stages[0] != model.layer_ids:
        raise PlanError(
            f"the decode side must be one stage of the model's layers {model.layer_ids}, "
            f"got {decode.stages}"
        )
    if sorted(prefill.layers) != sorted(model.layer_ids):
        raise PlanError(
            f"prefill stages {prefill.stages} must hold the model's layers {model.layer_ids}"
        )
    heads = model.total_heads
    groups: dict[tuple[int, int], list[int]] = {}
    for rank in range(prefill.tp_size):
        groups.setdefault(tp_head_range(heads, prefill.tp_size, rank), []).append(rank)
    out = []
    for d_rank in range(decode.tp_size):
        needed = tp_head_range(heads, decode.tp_size, d_rank)
        pieces = []
        for stage, layers in enumerate(prefill.stages):
            for held, ranks in sorted(groups.items()):
                shared = shared_heads(held, needed)
                if shared is not None:
                    sender = SenderId(stage, ranks[d_rank % len(ranks)])
                    pieces.append(Piece(sender, KVBox(shared, layers, tokens)))
        out.append(tuple(pieces))
    return tuple(out)


# -- plans ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class PiecePlan:
    """The plan that moves ``piece`` from its sender's pool into the decode rank's pool."""

    piece: Piece
    plan: TransferPlan

    @property
    def sender(self) -> SenderId:
        return self.piece.sender


def plan_piece(piece: Piece, src: PlanSide, dst: PlanSide, options: PlanOptions) -> PiecePlan:
    """Plan one piece from ``src`` (its sender's pool) into ``dst``. The planner moves the heads
    both pools share, so those must be exactly the piece's heads (``PlanError`` otherwise:
    planning the piece would move other heads than it claims); the planner refuses a layer
    either pool lacks (``PlanError``)."""
    shared = shared_heads(src.layout.head_range, dst.layout.head_range)
    if shared != piece.box.heads:
        raise PlanError(
            f"piece {piece}: the sender's heads {src.layout.head_range} and the destination's "
            f"{dst.layout.head_range} share {shared}, not the piece's heads"
        )
    plan = plan_transfer(src, dst, piece.box.tokens, layers=piece.box.layers, options=options)
    return PiecePlan(piece, plan)


def plan_pieces(
    pieces: Sequence[Piece],
    sources: Mapping[SenderId, PlanSide],
    dst: PlanSide,
    *,
    options: PlanOptions | None = None,
) -> tuple[PiecePlan, ...]:
    """One plan per piece, in piece order, from ``sources[piece.sender]`` into ``dst`` (one
    decode rank's pool), all with ``options``. Pure. ``PlanError`` when a sender has no source
    pool, and as :func:`plan_piece`; nothing is planned before every sender is found."""
    missing = sorted({p.sender for p in pieces} - set(sources))
    if missing:
        raise PlanError(f"no source pool for sender(s) {', '.join(map(str, missing))}")
    chosen = options or PlanOptions()
    return tuple(plan_piece(p, sources[p.sender], dst, chosen) for p in pieces)
