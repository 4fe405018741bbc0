"""Tests for kvplane.serving.gather_orders: wire pieces to shares and gather members."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.ids import PeerId
from kvplane.pd.handshake import Placement
from kvplane.pipeline.shares import ANY_TOKENS, Share
from kvplane.serving.gather_orders import (
    gather_orders,
    member_id,
    members,
    piece_of,
    sender_pieces,
    share_for,
)
from kvplane.serving.messages import DecodeOrder, PrefillOrder, SenderPiece
from kvplane.transfer.resharding import KVBox, Piece, SenderId


def _piece(stage: int, tp: int, heads: tuple[int, int], layers: tuple[int, ...]) -> Piece:
    return Piece(SenderId(stage, tp), KVBox(heads, layers, ANY_TOKENS))


TP2 = [("p0", _piece(0, 0, (0, 2), (0, 1))), ("p1", _piece(0, 1, (2, 4), (0, 1)))]
PP2 = [("s1", _piece(1, 0, (0, 4), (1,))), ("s0", _piece(0, 0, (0, 4), (0,)))]


def test_tp_senders_lead_with_the_lowest_rank_and_round_trip_to_pieces() -> None:
    got = sender_pieces(TP2)
    assert got == (
        SenderPiece(peer="p0", stage=0, tp_rank=0, heads=(0, 2), layers=(0, 1), lead=True),
        SenderPiece(peer="p1", stage=0, tp_rank=1, heads=(2, 4), layers=(0, 1), lead=False),
    )
    assert [piece_of(s) for s in got] == [p for _, p in TP2]
    assert members(got) == {PeerId("p0"): TP2[0][1], PeerId("p1"): TP2[1][1]}


def test_pp_senders_lead_with_the_last_stage() -> None:
    assert [(s.peer, s.lead) for s in sender_pieces(PP2)] == [("s1", True), ("s0", False)]


def test_no_senders_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="at least one sender"):
        sender_pieces([])


def test_a_share_is_built_for_its_own_rank_and_member_id() -> None:
    s = sender_pieces(TP2)[1]
    assert member_id("req", s) == "req/0.1"
    got = share_for(s, "req/0.1", "p1", Placement(tp_rank=1, tp_size=2))
    assert got == Share(TP2[1][1], lead=False)


@pytest.mark.parametrize(
    ("sid", "peer", "placement", "match"),
    [
        (
            "req/0.1",
            "p0",
            Placement(tp_rank=1, tp_size=2),
            r"share of p1 .* sent to p0 at \(0, 1\)",
        ),
        ("req/0.1", "p1", Placement(tp_rank=0, tp_size=2), r"sent to p1 at \(0, 0\)"),
        ("req/0.0", "p1", Placement(tp_rank=1, tp_size=2), r"'req/0.0' is no member id ending"),
        ("/0.1", "p1", Placement(tp_rank=1, tp_size=2), r"'/0.1' is no member id"),
    ],
)
def test_a_share_for_another_rank_or_session_is_refused(
    sid: str, peer: str, placement: Placement, match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        share_for(sender_pieces(TP2)[1], sid, peer, placement)


def test_a_decode_order_names_distinct_senders_and_one_lead() -> None:
    senders = sender_pieces(TP2)
    order = DecodeOrder(
        request_id="r", session_id="req", prefill_peer="p0", token_ids=(1,), senders=senders
    )
    frame = msgspec.msgpack.encode(order)
    assert msgspec.msgpack.decode(frame, type=DecodeOrder) == order
    with pytest.raises(InvalidArgumentError, match=r"exactly one sender must lead.*\['p0'\]"):
        DecodeOrder(
            request_id="r", session_id="req", prefill_peer="p1", token_ids=(1,), senders=senders
        )
    twice = (senders[0], msgspec.structs.replace(senders[1], tp_rank=0))
    with pytest.raises(InvalidArgumentError, match=r"distinct peers and ranks"):
        DecodeOrder(
            request_id="r", session_id="req", prefill_peer="p0", token_ids=(1,), senders=twice
        )


@pytest.mark.parametrize(
    ("heads", "layers", "match"),
    [((2, 2), (0,), "heads must be non-empty"), ((0, 2), (), "layers must be distinct"),
     ((0, 2), (1, 1), r"layers must be distinct, got \(1, 1\)")],
)  # fmt: skip
def test_a_sender_piece_needs_heads_and_distinct_layers(
    heads: tuple[int, int], layers: tuple[int, ...], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        SenderPiece(peer="p", stage=0, tp_rank=0, heads=heads, layers=layers)


def test_the_orders_of_a_gathered_request_name_the_lead_and_each_members_session() -> None:
    base = DecodeOrder(request_id="r", session_id="req", prefill_peer="?", token_ids=(1, 2),
                       max_new_tokens=3)  # fmt: skip
    senders = sender_pieces(PP2)
    dec, pre = gather_orders(base, senders, decode_peer="d", step_size=8)
    assert dec == DecodeOrder(request_id="r", session_id="req", prefill_peer="s1",
                              token_ids=(1, 2), max_new_tokens=3, senders=senders)  # fmt: skip
    want = [("req/1.0", senders[0]), ("req/0.0", senders[1])]
    assert pre == [
        PrefillOrder(request_id="r", session_id=sid, token_ids=(1, 2), decode_peer="d",
                     step_size=8, share=s)
        for sid, s in want
    ]  # fmt: skip
