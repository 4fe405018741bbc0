"""A prefill rank's share of a decode rank's request when several prefill ranks feed it.

:class:`Share` is what one sender of a gather session moves in every slice: the heads ×
layers of its :class:`~kvplane.transfer.resharding.Piece`; the request's *lead* moves the
whole-only pools (the tail, a state pool), and every stage its own layers of a state pool.
:func:`shares` derives every sender's share for one decode rank from
:func:`~kvplane.transfer.resharding.reshard` (the one rule of who sends what), so both sides
compute the same answer from the two layouts. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.errors import PlanError
from kvplane.ids import TokenRange
from kvplane.layout import KVLayout
from kvplane.transfer.resharding import Parallelism, Piece, SenderId, reshard
from kvplane.validators import require_int

ANY_TOKENS = TokenRange(0, 1)
"""The tokens of a share's piece: a share names heads and layers; each slice names tokens."""


@dataclass(frozen=True, slots=True)
class Share:
    """Sender ``piece.sender`` moves ``piece``'s heads × layers of each slice's tokens; in the
    final slice the ``lead`` moves the whole-only pools (exactly one per request: the
    destination's tail is written once) and any other sender the layers it holds of a state
    pool (:func:`~kvplane.transfer.resharding.moves_whole_only`)."""

    piece: Piece
    lead: bool

    def __post_init__(self) -> None:
        if not isinstance(self.piece, Piece):
            raise PlanError(f"Share.piece must be a Piece, got {self.piece!r}")
        if not isinstance(self.lead, bool):
            raise PlanError(f"Share.lead must be a bool, got {self.lead!r}")

    @property
    def sender(self) -> SenderId:
        return self.piece.sender


def shares(
    model: KVLayout, prefill: Parallelism, decode: Parallelism, decode_rank: int
) -> dict[SenderId, Share]:
    """Every sender's share of decode rank ``decode_rank``'s requests, in :func:`reshard`
    order (stage, then heads; one piece per sender). The lead is the first sender of the last
    stage: the one that computes the first token, which the tail carries. ``PlanError`` /
    ``LayoutError`` as :func:`reshard`, or for a rank outside the decode side."""
    require_int("decode_rank", decode_rank, min=0, max=decode.tp_size - 1, error=PlanError)
    pieces = reshard(model, prefill, decode, ANY_TOKENS)[decode_rank]
    last = len(prefill.stages) - 1
    lead = next(p.sender for p in pieces if p.sender.stage == last)
    return {p.sender: Share(p, p.sender == lead) for p in pieces}
