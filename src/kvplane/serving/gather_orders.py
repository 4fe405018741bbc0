"""The orders of one request gathered from several prefill ranks, to and from the wire.

The router turns :func:`~kvplane.serving.router.gather_sets.gather_set`'s pieces into
:class:`~kvplane.serving.messages.SenderPiece` s (:func:`sender_pieces`, choosing the lead);
the prefill worker turns its own back into a :class:`~kvplane.pipeline.shares.Share`
(:func:`share_for`) and the decode worker all of them into its gather's members
(:func:`members`). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvplane.errors import InvalidArgumentError
from kvplane.ids import PeerId, SessionId
from kvplane.pd.gather import member_session_id
from kvplane.pd.handshake import Placement
from kvplane.pipeline.shares import ANY_TOKENS, Share
from kvplane.serving.messages import DecodeOrder, PrefillOrder, SenderPiece
from kvplane.transfer.resharding import KVBox, Piece, SenderId


def piece_of(s: SenderPiece) -> Piece:
    """The :class:`Piece` ``s`` names (its cells for every token of a slice)."""
    return Piece(SenderId(s.stage, s.tp_rank), KVBox(s.heads, s.layers, ANY_TOKENS))


def sender_pieces(chosen: Sequence[tuple[str, Piece]]) -> tuple[SenderPiece, ...]:
    """``(peer, piece)`` per sender as wire pieces, in the given order; the lead is the
    lowest TP rank of the highest pipeline stage, as :func:`~kvplane.pipeline.shares.shares`
    chooses it. ``InvalidArgumentError`` for no senders."""
    if not chosen:
        raise InvalidArgumentError("a gathered request needs at least one sender")
    lead = min(chosen, key=lambda c: (-c[1].sender.stage, c[1].sender.tp_rank))[0]
    out = []
    for peer, piece in chosen:
        at = piece.sender
        box = piece.box
        out.append(
            SenderPiece(
                peer=peer,
                stage=at.stage,
                tp_rank=at.tp_rank,
                heads=box.heads,
                layers=box.layers,
                lead=peer == lead,
            )
        )
    return tuple(out)


def member_id(session_id: str, s: SenderPiece) -> str:
    """The wire session id of the member of gather ``session_id`` that ``s`` feeds."""
    return str(member_session_id(SessionId(session_id), piece_of(s)))


def share_for(s: SenderPiece, session_id: str, peer_id: str, placement: Placement) -> Share:
    """The :class:`Share` a prefill worker of PD peer ``peer_id`` at ``placement`` sends for
    the member session ``session_id`` that ``s`` names. ``InvalidArgumentError`` when ``s``
    names another peer or rank, or ``session_id`` is not a member id of that rank."""
    if s.peer != peer_id or (s.stage, s.tp_rank) != (placement.pp_stage, placement.tp_rank):
        at = (placement.pp_stage, placement.tp_rank)
        why = f"share of {s.peer} (stage, TP rank) {(s.stage, s.tp_rank)}"
        raise InvalidArgumentError(f"{why} sent to {peer_id} at {at}")
    suffix = f"/{s.stage}.{s.tp_rank}"
    if not session_id.endswith(suffix) or len(session_id) == len(suffix):
        raise InvalidArgumentError(f"session {session_id!r} is no member id ending {suffix!r}")
    return Share(piece_of(s), s.lead)


def members(senders: Sequence[SenderPiece]) -> dict[PeerId, Piece]:
    """The members of the gather fed by ``senders``: each peer with its piece."""
    return {PeerId(s.peer): piece_of(s) for s in senders}


def gather_orders(
    base: DecodeOrder, senders: Sequence[SenderPiece], *, decode_peer: str, step_size: int = 0
) -> tuple[DecodeOrder, list[PrefillOrder]]:
    """The orders of ``base``'s request (its id, gather session id, prompt, token budget) fed
    by ``senders``: the decode order naming them all (``prefill_peer`` the lead), and per
    sender a prefill order to send its share to ``decode_peer`` under its member session id.
    ``InvalidArgumentError`` as :class:`DecodeOrder` (no lead, a sender named twice)."""
    lead = next((s.peer for s in senders if s.lead), base.prefill_peer)
    dec = msgspec.structs.replace(base, prefill_peer=lead, senders=tuple(senders))
    pre = []
    for s in senders:
        sid = member_id(base.session_id, s)
        pre.append(PrefillOrder(request_id=base.request_id, session_id=sid, share=s,
                                token_ids=base.token_ids, decode_peer=decode_peer,
                                step_size=step_size))  # fmt: skip
    return dec, pre
