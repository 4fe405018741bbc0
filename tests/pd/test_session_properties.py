"""Stateful property test: random (often wrong) events against one sender and one receiver.

Whatever arrives, in any order: an event either applies or raises ``ProtocolError`` with every
field of the session unchanged; the state only moves forward and never leaves a terminal state;
``Finished`` is emitted at most once; every ``Release`` matches one ledger release; ledgers stay
consistent.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId
from kvplane.pd.actions import Finished, Release
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Cancel,
    Fail,
    Outcome,
    PeerLost,
    SliceReady,
    SliceResult,
    SliceStatus,
    StartTransfer,
    SubmitAccepted,
    SubmitSkipped,
    SubmitSlice,
    SubmitStarted,
    Timeout,
    TimerKind,
    TransferRequest,
    TransportDone,
    TransportFailed,
    TransportInDoubt,
)
from kvplane.pd.receiver import ReceiverSession
from kvplane.pd.sender import SenderSession
from kvplane.pd.session import Session
from kvplane.pd.timers import Timings

SID, PEER, EPOCH, TOKEN = SessionId("s"), PeerId("p"), 5, 3
N = 24
START = StartTransfer(request_id=RequestId("r"), dst_block_ids=(0,), prefix_tokens=0, num_tokens=N)
ids = st.integers(0, 4)
ranges = st.tuples(st.integers(0, N), st.integers(0, N)).map(sorted)


def wire_events() -> st.SearchStrategy[object]:
    common = {"session_id": SID, "epoch": EPOCH}
    return st.one_of(
        st.builds(
            lambda p: TransferRequest(
                request_id="r", dst_block_ids=(0, 1), prefix_tokens=p, num_tokens=N, **common
            ),
            st.sampled_from([0, 4]),
        ),
        st.builds(
            lambda k, last, r: SliceReady(slice_id=k, is_last=last, start=r[0], end=r[1], **common),
            ids, st.booleans(), ranges,
        ),
        st.builds(
            lambda k, last, r, status: SliceResult(
                slice_id=k, is_last=last, start=r[0], end=r[1], status=status, **common
            ),
            ids, st.booleans(), ranges, st.sampled_from(list(SliceStatus)),
        ),
        st.builds(
            lambda t, o, d: Abort(token=t, outcome=o, drained=d, **common),
            st.sampled_from([TOKEN, 77]), st.sampled_from(list(Outcome)), st.booleans(),
        ),
        st.builds(
            lambda t, o, d: AbortAck(token=t, outcome=o, drained=d, **common),
            st.sampled_from([TOKEN, 77]), st.sampled_from(list(Outcome)), st.booleans(),
        ),
    )  # fmt: skip


def local_events() -> st.SearchStrategy[object]:
    facts = [
        SubmitStarted,
        SubmitAccepted,
        SubmitSkipped,
        TransportDone,
        TransportFailed,
        TransportInDoubt,
    ]
    return st.one_of(
        st.builds(lambda cls, k: cls(slice_id=SliceId(k)), st.sampled_from(facts), ids),
        st.builds(lambda t, u: Timeout(timer=t, unit=u), st.sampled_from(list(TimerKind)), ids),
        st.just(PeerLost(peer_id=PEER)),
        st.just(Cancel()),
        st.just(Fail(reason="f")),
        st.builds(
            lambda k, last, r: SubmitSlice(slice_id=SliceId(k), is_last=last, start=r[0], end=r[1]),
            ids, st.booleans(), ranges,
        ),
        st.just(START),
    )  # fmt: skip


def snapshot(s: Session) -> dict[str, Any]:
    return {
        k: (v.records(), v.releases) if k == "ledger" else copy.deepcopy(v)
        for k, v in vars(s).items()
    }


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        t = Timings()
        self.sessions: list[Session] = [
            SenderSession(SID, PEER, token=TOKEN, timings=t),
            ReceiverSession(SID, PEER, epoch=EPOCH, token=TOKEN, timings=t),
        ]
        for s in self.sessions:
            s.open()
        self.finished = [0, 0]
        self.releases = [0, 0]

    @rule(which=st.integers(0, 1), event=st.one_of(wire_events(), local_events()))
    def anything(self, which: int, event: object) -> None:
        self.apply(which, event)

    @rule(data=st.data())
    def sender_progress(self, data: st.DataObject) -> None:
        """Mostly-valid sender events, so long runs reach TRANSFERRING and SUCCESS too."""
        s = self.sessions[0]
        assert isinstance(s, SenderSession)
        nxt = len(s.slices)
        start = s.slices[nxt - 1].end if nxt else 0
        end = data.draw(st.integers(start, N))
        last_id = s.last_slice
        common = {"session_id": SID, "epoch": EPOCH}
        events: list[object] = [
            SubmitSlice(slice_id=SliceId(nxt), is_last=end == N, start=start, end=end),
            TransferRequest(
                request_id="r", dst_block_ids=(0,), prefix_tokens=0, num_tokens=N, **common
            ),
        ]
        if nxt:
            k = SliceId(data.draw(st.integers(0, nxt - 1)))
            events += [
                SubmitStarted(slice_id=k),
                SubmitAccepted(slice_id=k),
                TransportDone(slice_id=k),
            ]
            rec = s.slices[k]
            status = SliceStatus.COMMITTED if k == last_id else SliceStatus.ACCEPTED
            events.append(
                SliceResult(
                    slice_id=k,
                    is_last=rec.is_last,
                    start=rec.start,
                    end=rec.end,
                    status=status,
                    **common,
                )
            )
        self.apply(0, data.draw(st.sampled_from(events)))

    @rule(data=st.data())
    def receiver_progress(self, data: st.DataObject) -> None:
        r = self.sessions[1]
        assert isinstance(r, ReceiverSession)
        nxt = len(r.slices)
        start = max((x.end for x in r.slices.values()), default=0)
        end = data.draw(st.integers(start, N))
        ready = SliceReady(
            session_id=SID, epoch=EPOCH, slice_id=nxt, is_last=end == N, start=start, end=end
        )
        self.apply(1, data.draw(st.sampled_from([START, ready])))

    def apply(self, which: int, event: object) -> None:
        s = self.sessions[which]
        before_state, before = s.state, snapshot(s)
        is_command = isinstance(event, StartTransfer | SubmitSlice | Cancel | Fail)
        try:
            actions = s.send(event) if is_command else s.receive(event)  # type: ignore[arg-type]
        except ProtocolError:
            assert snapshot(s) == before
            return
        assert s.state.rank >= before_state.rank
        if before_state.terminal:
            assert s.state is before_state
        self.finished[which] += sum(isinstance(a, Finished) for a in actions)
        self.releases[which] += sum(isinstance(a, Release) for a in actions)

    @invariant()
    def consistent(self) -> None:
        for i, s in enumerate(self.sessions):
            s.ledger.check_integrity()
            assert self.releases[i] == s.ledger.releases
            assert self.finished[i] == (1 if s.terminal else 0)


TestSessionMachine = SessionMachine.TestCase
TestSessionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
