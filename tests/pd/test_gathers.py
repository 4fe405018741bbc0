"""A participant hosting gather sessions: one decode request fed by two prefill participants,
over the real protocol (frames pumped between three participants)."""

from __future__ import annotations

import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId, TokenRange
from kvplane.pd.actions import Action, Finished, Release, StartSubmit, Transmit
from kvplane.pd.events import (
    Cancel,
    StartTransfer,
    SubmitAccepted,
    SubmitSlice,
    SubmitStarted,
    TransferRequest,
    TransportDone,
)
from kvplane.pd.participant import Participant
from kvplane.pd.states import Ownership, Role, SessionState
from kvplane.pd.timers import Timings
from kvplane.testing.session_pair import sim_profile
from kvplane.transfer.resharding import KVBox, Piece, SenderId

T = Timings(deadline_s=5.0, verdict_grace_s=1.0, retransmit_s=0.5, heartbeat_s=1.0, lease_s=3.0)
P0, P1, D = PeerId("p0"), PeerId("p1"), PeerId("decode")
S = SessionState
GID = SessionId("req")
START = StartTransfer(request_id=RequestId("r"), dst_block_ids=(0, 1), prefix_tokens=0,
                      num_tokens=32)  # fmt: skip
ALL = TokenRange(0, 1)
MEMBERS = {
    P0: Piece(SenderId(0, 0), KVBox((0, 2), (0, 1), ALL)),
    P1: Piece(SenderId(0, 1), KVBox((2, 4), (0, 1), ALL)),
}


def node(name: PeerId, incarnation: int = 1) -> Participant:
    return Participant(name, sim_profile(), incarnation=incarnation, timings=T)


class Cluster:
    """Two prefill participants and one decode participant, frames delivered at once."""

    def __init__(self) -> None:
        self.nodes = {P0: node(P0), P1: node(P1), D: node(D, 1 << 20)}
        for p in (P0, P1):
            reply, _ = self.nodes[p].on_hello(self.nodes[D].hello(), 0.0)
            assert self.nodes[D].on_hello_reply(reply, 0.0)[0].compatible
        self.rest: list[Action] = []

    def pump(self, actions: list[Action], src: PeerId, now: float = 0.0) -> None:
        queue = [(src, a) for a in actions]
        while queue:
            frm, act = queue.pop(0)
            if isinstance(act, Transmit):
                dst = self.nodes[act.peer_id]
                queue += [(dst.peer_id, a) for a in dst.on_event(frm, act.event, now)]
            else:
                self.rest.append(act)

    def open(self) -> None:
        _, acts = self.nodes[D].open_gather(GID, MEMBERS, START, 0.0, heads=(0, 4), layers=(0, 1))
        self.pump(acts, D)

    def send_all(self, p: PeerId, now: float = 0.0) -> None:
        """Prefill ``p`` sends its one slice ``[0, 32)`` and the transport completes it."""
        prefill, sid = self.nodes[p], SessionId(f"req/0.{p[1:]}")
        slice_ = SubmitSlice(slice_id=SliceId(0), is_last=True, start=0, end=32)
        seen = len(self.rest)
        self.pump(prefill.send(sid, slice_, now), p, now)
        assert [a.slice_id for a in self.rest[seen:] if isinstance(a, StartSubmit)] == [0]
        for ev in (SubmitStarted, SubmitAccepted, TransportDone):
            self.pump(prefill.receive_local(sid, ev(slice_id=SliceId(0)), now), p, now)

    def check(self) -> None:
        for n in self.nodes.values():
            n.check_integrity()


def finished(actions: list[Action], role: Role) -> list[tuple[str, S]]:
    return sorted((a.session_id, a.state) for a in actions if isinstance(a, Finished)
                  and a.role is role)  # fmt: skip


def test_a_gather_commits_once_both_senders_delivered_and_retires_every_member() -> None:
    c = Cluster()
    c.open()
    decode = c.nodes[D]
    gather = decode.gathers.get(GID)
    assert gather is not None and gather.state is S.WAITING_FOR_INPUT
    assert sorted(decode.sessions) == ["req/0.0", "req/0.1"] and GID in decode.gathers
    assert sorted(c.nodes[P0].sessions) == ["req/0.0"] and sorted(c.nodes[P1].sessions) == [
        "req/0.1"
    ]
    c.send_all(P0)
    assert gather.state is S.TRANSFERRING and decode.sessions.keys() == {"req/0.1"}
    c.send_all(P1)
    assert gather.state is S.SUCCESS and gather.tiling is not None and gather.tiling.complete
    assert finished(c.rest, Role.RECEIVER) == [("req/0.0", S.SUCCESS), ("req/0.1", S.SUCCESS)]
    assert finished(c.rest, Role.SENDER) == [("req/0.0", S.SUCCESS), ("req/0.1", S.SUCCESS)]
    assert all(n.sessions == {} for n in c.nodes.values()) and len(decode.gathers) == 0
    assert decode.tombstone(SessionId("req/0.1")).state is S.SUCCESS
    c.check()


def test_losing_one_sender_fails_the_request_for_all_and_every_ledger_balances() -> None:
    c = Cluster()
    c.open()
    decode = c.nodes[D]
    gather = decode.gathers.get(GID)
    assert gather is not None
    c.pump(decode.lose_peer(P1, 1.0, "connection reset"), D, 1.0)
    assert gather.state is S.FAILED and gather.reason == "sender p1: peer lost"
    assert c.nodes[P0].sessions == {}  # p0 got the Abort, drained and acknowledged it
    assert finished(c.rest, Role.SENDER) == [("req/0.0", S.FAILED)]
    releases = [(a.session_id, a.via) for a in c.rest if isinstance(a, Release)]
    assert releases == [("req/0.0", Ownership.BACKEND_DONE)]
    ledger = gather.members[P1].ledger  # p1 may still be writing: held until the release timer
    assert [r.state for r in ledger.records()] == [Ownership.IN_DOUBT] and not gather.released
    assert sorted(decode.sessions) == ["req/0.1"] and GID in decode.gathers
    c.pump(decode.tick(1.0 + T.in_doubt_s), D, 1.0 + T.in_doubt_s)
    releases = [(a.session_id, a.via) for a in c.rest if isinstance(a, Release)]
    assert releases[1:] == [("req/0.1", Ownership.EXPIRED)] and gather.released
    assert decode.sessions == {} and len(decode.gathers) == 0
    c.check()


def test_a_members_deadline_arrives_through_tick_and_fails_the_whole_gather() -> None:
    c = Cluster()
    c.open()
    c.send_all(P0)  # p0's member committed; p1 never sends
    decode = c.nodes[D]
    gather = decode.gathers.get(GID)
    assert gather is not None and gather.state is S.TRANSFERRING
    c.pump(decode.tick(0.9), D, 0.9)  # heartbeats keep both leases
    c.pump(c.nodes[P1].tick(0.9), P1, 0.9)
    c.pump(c.nodes[P0].tick(0.9), P0, 0.9)
    c.pump(decode.tick(T.deadline_s + 0.1), D, T.deadline_s + 0.1)
    assert gather.state is S.FAILED and gather.reason.startswith("sender p1: ")
    assert decode.counters["finished_receiver_failed"] == 1
    assert decode.counters["finished_receiver_success"] == 1  # p0's member alone; unused


def test_a_cancel_by_the_gathers_id_reaches_every_sender() -> None:
    c = Cluster()
    c.open()
    decode = c.nodes[D]
    c.pump(decode.send(GID, Cancel(reason="client went away"), 0.5), D, 0.5)
    gather = decode.gathers.get(GID)
    assert gather is None or gather.state is S.ABORTED
    assert finished(c.rest, Role.SENDER) == [("req/0.0", S.ABORTED), ("req/0.1", S.ABORTED)]
    assert all(n.sessions == {} for n in c.nodes.values())
    c.check()


def test_a_gather_that_cannot_open_changes_nothing() -> None:
    c = Cluster()
    decode = c.nodes[D]
    stranger = dict(MEMBERS) | {PeerId("p9"): Piece(SenderId(0, 2), KVBox((4, 6), (0, 1), ALL))}
    with pytest.raises(ProtocolError, match=r"^peer p9 is not connected"):
        decode.open_gather(GID, stranger, START, 0.0, heads=(0, 6), layers=(0, 1))
    gap = {P0: MEMBERS[P0]}
    with pytest.raises(ProtocolError, match=r"incomplete: 4 of 8 cells"):
        decode.open_gather(GID, gap, START, 0.0, heads=(0, 4), layers=(0, 1))
    assert decode.sessions == {} and len(decode.gathers) == 0
    c.open()
    with pytest.raises(ProtocolError, match=r"^session req is already open$"):
        decode.open_gather(GID, MEMBERS, START, 0.0, heads=(0, 4), layers=(0, 1))
    decode.open_receiver(SessionId("req2/0.1"), P1, START, 0.0)
    with pytest.raises(ProtocolError, match=r"^session req2/0.1 is already open$"):
        decode.open_gather(SessionId("req2"), MEMBERS, START, 0.0, heads=(0, 4), layers=(0, 1))
    assert sorted(decode.sessions) == ["req/0.0", "req/0.1", "req2/0.1"]
    c.check()


def test_a_late_request_for_a_retired_member_meets_its_tombstone() -> None:
    c = Cluster()
    c.open()
    c.send_all(P0)
    c.send_all(P1)
    epoch = c.nodes[D].tombstone(SessionId("req/0.0")).epoch  # type: ignore[union-attr]
    assert epoch is not None
    late = TransferRequest(session_id="req/0.0", epoch=epoch, request_id="r",
                           dst_block_ids=(0, 1), prefix_tokens=0, num_tokens=32)  # fmt: skip
    assert c.nodes[P0].on_event(D, late, 1.0) == [] and c.nodes[P0].sessions == {}
