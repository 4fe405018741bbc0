"""Gather sessions: one decode request fed by several senders, committed only as a whole."""

from __future__ import annotations

import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, TokenRange
from kvplane.pd.actions import Finished, Release, Transmit
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Cancel,
    Outcome,
    PeerLost,
    SliceReady,
    StartTransfer,
    Timeout,
    TimerKind,
    TransferRequest,
)
from kvplane.pd.gather import GatherSession, member_session_id
from kvplane.pd.ledger import DESTINATION
from kvplane.pd.states import Ownership, SessionState
from kvplane.pd.timers import Timings
from kvplane.transfer.resharding import KVBox, Piece, SenderId

SID, EPOCH, TOKEN = SessionId("req"), 3, 9
P0, P1 = PeerId("p0"), PeerId("p1")
T = Timings(retransmit_s=0.1, drain_s=1.0, in_doubt_s=0.5, deadline_s=3.0)
S = SessionState
ALL = TokenRange(0, 1)
START = StartTransfer(request_id=RequestId("r"), dst_block_ids=(4, 5), prefix_tokens=0,
                      num_tokens=40)  # fmt: skip


def piece(tp: int, heads: tuple[int, int], layers: tuple[int, ...] = (0, 1)) -> Piece:
    return Piece(SenderId(0, tp), KVBox(heads, layers, ALL))


def new(members: dict[PeerId, Piece] | None = None, *, start: bool = True) -> GatherSession:
    members = members or {P0: piece(0, (0, 2)), P1: piece(1, (2, 4))}
    g = GatherSession(SID, members, heads=(0, 4), layers=(0, 1), epoch=EPOCH, token=TOKEN,
                      timings=T)  # fmt: skip
    g.open()
    if start:
        g.send(START)
    return g


def ready(peer: PeerId, k: int, start: int, end: int, last: bool = False) -> SliceReady:
    tp = int(peer[1:])
    mid = member_session_id(SID, Piece(SenderId(0, tp), KVBox((0, 1), (0,), ALL)))
    return SliceReady(session_id=mid, epoch=EPOCH, slice_id=k, is_last=last, start=start, end=end)


def test_members_have_their_own_session_ids_and_ledgers() -> None:
    g = new(start=False)
    assert [m.session_id for m in g.members.values()] == ["req/0.0", "req/0.1"]
    assert {p: (led.session_id, led.peer_id) for p, led in g.ledgers().items()} == {
        P0: ("req/0.0", P0), P1: ("req/0.1", P1),
    }  # fmt: skip
    assert g.peer_of(SessionId("req/0.1")) == P1 and g.state is S.BOOTSTRAPPING
    with pytest.raises(ProtocolError, match=r"^gather session req has no member 'req/0.7'$"):
        g.peer_of(SessionId("req/0.7"))


def test_start_asks_every_sender_for_the_same_destination() -> None:
    g = new(start=False)
    out = g.send(START)
    sent = [a for a in out if isinstance(a, Transmit)]
    assert [(a.peer_id, a.event) for a in sent] == [
        (p, TransferRequest(session_id=f"req/0.{i}", epoch=EPOCH, request_id="r",
                            dst_block_ids=(4, 5), prefix_tokens=0, num_tokens=40))
        for i, p in enumerate((P0, P1))
    ]  # fmt: skip
    assert g.state is S.WAITING_FOR_INPUT
    with pytest.raises(ProtocolError, match=r"^gather session req cannot start in waiting_for_"):
        g.send(START)


def test_commits_only_when_every_sender_committed_and_the_union_tiles() -> None:
    g = new()
    g.receive(P0, ready(P0, 1, 24, 40, last=True))
    g.receive(P0, ready(P0, 0, 0, 24))
    assert g.members[P0].state is S.SUCCESS and g.state is S.TRANSFERRING
    assert g.tiling is not None and g.tiling.received_cells == 2 * 2 * 40
    g.receive(P1, ready(P1, 0, 0, 40, last=True))
    assert g.state is S.SUCCESS and g.tiling.complete and g.released and g.reason == ""


def test_claims_that_do_not_tile_the_destination_are_refused_up_front() -> None:
    with pytest.raises(ProtocolError) as info:
        new({P0: piece(0, (0, 2)), P1: piece(1, (1, 4))}, start=False)
    assert str(info.value) == (
        "piece heads [1, 4) × layers (0, 1) × [0, 1) from stage 0 tp 1 overlaps "
        "heads [0, 2) × layers (0, 1) × [0, 1) from stage 0 tp 0"
    )
    with pytest.raises(ProtocolError, match=r" is incomplete: 4 of 8 cells received from 1 piece"):
        new({P0: piece(0, (0, 2))}, start=False)
    with pytest.raises(ProtocolError, match=r"^gather session req: a sender is named twice "):
        new({P0: piece(0, (0, 2)), P1: piece(0, (2, 4))}, start=False)


def test_an_overlapping_slice_fails_its_sender_and_every_other() -> None:
    g = new()
    g.receive(P0, ready(P0, 0, 0, 24))
    out = g.receive(P0, ready(P0, 1, 10, 40, last=True))
    why = ("piece heads [0, 2) × layers (0, 1) × [10, 40) from stage 0 tp 0 overlaps "
           "heads [0, 2) × layers (0, 1) × [0, 24) from stage 0 tp 0")  # fmt: skip
    assert g.state is S.FAILED and g.reason == f"sender p0: {why}"
    aborts = [(a.peer_id, a.event.reason) for a in out if isinstance(a, Transmit)]
    assert aborts == [(P0, why), (P1, "sender p0 failed")]
    assert [m.state for m in g.members.values()] == [S.FAILED, S.FAILED]
    assert all(isinstance(a.event, Abort) for a in out if isinstance(a, Transmit))


def test_a_lost_sender_fails_the_request_and_every_ledger_balances() -> None:
    g = new()
    g.receive(P0, ready(P0, 0, 0, 40, last=True))  # p0 done and released
    g.receive(P1, ready(P1, 0, 0, 8))
    out = g.receive(P1, PeerLost(peer_id=P1))
    assert g.state is S.FAILED and g.reason == "sender p1: peer lost"
    assert g.members[P0].state is S.SUCCESS  # its transfer was complete: nothing is owed
    assert [a.state for a in out if isinstance(a, Finished)] == [S.FAILED]
    assert g.ledgers()[P1].state(DESTINATION) is Ownership.IN_DOUBT and not g.released
    out = g.receive(P1, Timeout(timer=TimerKind.RELEASE, unit=DESTINATION))
    assert [a.via for a in out if isinstance(a, Release)] == [Ownership.EXPIRED]
    assert g.released
    for ledger in g.ledgers().values():
        ledger.check_integrity()


def test_a_sender_abort_aborts_the_others_and_drains_them() -> None:
    g = new()
    g.receive(P1, ready(P1, 0, 0, 8))
    member = g.members[P0].session_id
    g.receive(P0, Abort(session_id=member, epoch=EPOCH, token=TOKEN, outcome=Outcome.ABORTED))
    assert g.state is S.ABORTED and g.reason == "sender p0: aborted by the sender"
    assert g.members[P1].state is S.ABORTED and not g.released
    p1 = g.members[P1].session_id
    g.receive(P1, AbortAck(session_id=p1, epoch=EPOCH, token=TOKEN, outcome=Outcome.ABORTED))
    assert g.released


def test_cancel_reaches_every_sender() -> None:
    g = new()
    out = g.send(Cancel(reason="client gone"))
    assert [a.peer_id for a in out if isinstance(a, Transmit)] == [P0, P1]
    assert g.state is S.ABORTED and g.reason == "client gone"


def test_unknown_senders_and_refused_events_change_nothing() -> None:
    g = new()
    with pytest.raises(ProtocolError, match=r"^gather session req: 'p9' is no sender$"):
        g.receive(PeerId("p9"), ready(P0, 0, 0, 8))
    with pytest.raises(ProtocolError, match=r"^event for session 'req/0.1' sent to 'req/0.0'$"):
        g.receive(P0, ready(P1, 0, 0, 8))
    assert g.tiling is not None and g.tiling.received_cells == 0 and g.state is S.WAITING_FOR_INPUT
