"""Stateful property test of a gather session: random (often wrong) events from three senders.

Whatever arrives, in any order: an event either applies or raises ``ProtocolError`` with the
group and every member unchanged; the group's state only moves forward and never leaves a
terminal state; it is SUCCESS only when every member committed and the tiling is complete; after
a failure every member is terminal; the tiling holds exactly the cells of the members' accepted
slices; every ledger stays consistent.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, TokenRange
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Cancel,
    Fail,
    Outcome,
    PeerLost,
    SliceReady,
    StartTransfer,
    Timeout,
    TimerKind,
)
from kvplane.pd.gather import GatherSession
from kvplane.pd.states import SessionState
from kvplane.pd.timers import Timings
from kvplane.transfer.resharding import KVBox, Piece, SenderId

SID, EPOCH, TOKEN, N = SessionId("g"), 2, 5, 24
ALL = TokenRange(0, 1)
PEERS = (PeerId("p0"), PeerId("p1"), PeerId("p2"))
PIECES = {
    PEERS[0]: Piece(SenderId(0, 0), KVBox((0, 2), (0, 1), ALL)),
    PEERS[1]: Piece(SenderId(0, 1), KVBox((2, 4), (0, 1), ALL)),
    PEERS[2]: Piece(SenderId(1, 0), KVBox((0, 4), (2,), ALL)),
}
START = StartTransfer(request_id=RequestId("r"), dst_block_ids=(0,), prefix_tokens=0, num_tokens=N)
ranges = st.tuples(st.integers(0, N), st.integers(0, N)).map(sorted)


def member_events(session_id: str) -> st.SearchStrategy[object]:
    common = {"session_id": session_id, "epoch": EPOCH}
    return st.one_of(
        st.builds(
            lambda k, last, r: SliceReady(slice_id=k, is_last=last, start=r[0], end=r[1], **common),
            st.integers(0, 3), st.booleans(), ranges,
        ),
        st.builds(
            lambda o, d: Abort(token=TOKEN, outcome=o, drained=d, **common),
            st.sampled_from(list(Outcome)), st.booleans(),
        ),
        st.builds(
            lambda t, o, d: AbortAck(token=t, outcome=o, drained=d, **common),
            st.sampled_from([TOKEN, 77]), st.sampled_from(list(Outcome)), st.booleans(),
        ),
        st.builds(lambda t: Timeout(timer=t, unit=0), st.sampled_from(list(TimerKind))),
        st.builds(lambda p: PeerLost(peer_id=p), st.sampled_from(PEERS)),
    )  # fmt: skip


def snapshot(g: GatherSession) -> dict[str, Any]:
    members = {
        p: {k: (v.records(), v.releases) if k == "ledger" else copy.deepcopy(v)
            for k, v in vars(m).items()}
        for p, m in g.members.items()
    }  # fmt: skip
    tiling = None if g.tiling is None else copy.deepcopy(vars(g.tiling))
    return {"members": members, "tiling": tiling, "failure": g.failure}


class GatherMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.g = GatherSession(SID, PIECES, heads=(0, 4), layers=(0, 1, 2), epoch=EPOCH,
                               token=TOKEN, timings=Timings())  # fmt: skip
        self.g.open()
        self.state = self.g.state

    @rule(which=st.integers(0, 2), wrong=st.integers(0, 11), data=st.data())
    def event(self, which: int, wrong: int, data: st.DataObject) -> None:
        """A random (often wrong) event one time in twelve; else the member's next slice, often
        its last, so long runs reach SUCCESS too."""
        peer = PEERS[which]
        m = self.g.members[peer]
        if wrong == 0:
            event = data.draw(member_events(m.session_id))
        else:
            start = max((s.end for s in m.slices.values()), default=0)
            end = data.draw(st.one_of(st.just(N), st.integers(start, N)))
            event = SliceReady(session_id=m.session_id, epoch=EPOCH, slice_id=len(m.slices),
                               is_last=end == N, start=start, end=end)  # fmt: skip
        self.apply(lambda: self.g.receive(peer, event))

    @rule(pick=st.integers(0, 19))
    def command(self, pick: int) -> None:
        """``Cancel`` or ``Fail`` one time in ten; else ``StartTransfer`` (again: refused)."""
        command = {0: Cancel(reason="c"), 1: Fail(reason="f")}.get(pick, START)
        self.apply(lambda: self.g.send(command))

    def apply(self, call: Any) -> None:
        before = snapshot(self.g)
        try:
            call()
        except ProtocolError:
            assert snapshot(self.g) == before
            return
        state = self.g.state
        assert state.rank >= self.state.rank
        if self.state.terminal:
            assert state is self.state
        self.state = state

    @invariant()
    def consistent(self) -> None:
        g = self.g
        members = g.members.values()
        for m in members:
            m.ledger.check_integrity()
        if g.state is SessionState.SUCCESS:
            assert g.tiling is not None and g.tiling.complete
            assert all(m.state is SessionState.SUCCESS for m in members)
        if g.failure is not None:
            assert all(m.terminal for m in members)
        if g.tiling is not None:
            cells = sum(
                (s.end - s.start) * PIECES[p].box.cells
                for p, m in g.members.items()
                for s in m.slices.values()
            )
            assert g.tiling.received_cells == cells


TestGatherProperties = GatherMachine.TestCase
TestGatherProperties.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
