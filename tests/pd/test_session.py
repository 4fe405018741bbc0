"""The exhaustive table test: every (role, state, event kind) follows the table or raises.

For each pair a fresh session is driven into ``state`` by a recipe (some kinds need a recipe
whose data makes the event meaningful: COMMITTED needs every slice announced, an abort ack
needs an abort we sent), then one representative event of ``kind`` is applied. A pair in the
table must end exactly in the table's target; a pair absent from it must raise
``ProtocolError`` and leave every field of the session, its ledger included, unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId
from kvplane.pd.actions import ArmTimer, DestinationKnown, Finished, StartSubmit, Transmit
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
from kvplane.pd.ledger import DESTINATION
from kvplane.pd.receiver import ReceiverSession
from kvplane.pd.sender import SenderSession
from kvplane.pd.session import Session
from kvplane.pd.states import TABLES, EventKind, Ownership, Role, SessionState
from kvplane.pd.timers import Timings

SID, PEER, EPOCH, TOKEN, PEER_TOKEN = SessionId("s"), PeerId("peer"), 7, 5, 99
TIMINGS = Timings()
S = SessionState
REQUEST = TransferRequest(
    session_id=SID, epoch=EPOCH, request_id="r", dst_block_ids=(0, 1, 2), prefix_tokens=0,
    num_tokens=40,
)  # fmt: skip


def sender() -> SenderSession:
    s = SenderSession(SID, PEER, token=TOKEN, timings=TIMINGS)
    s.open()
    return s


def receiver() -> ReceiverSession:
    r = ReceiverSession(SID, PEER, epoch=EPOCH, token=TOKEN, timings=TIMINGS)
    r.open()
    return r


def submit(s: Session, k: int, start: int, end: int, last: bool = False) -> None:
    s.send(SubmitSlice(slice_id=SliceId(k), is_last=last, start=start, end=end))


def fact(s: Session, cls: type, k: int) -> None:
    s.receive(cls(slice_id=SliceId(k)))


def abort(outcome: Outcome, token: int = PEER_TOKEN) -> Abort:
    return Abort(session_id=SID, epoch=EPOCH, token=token, outcome=outcome, reason="r")


# -- sender recipes ------------------------------------------------------------------------------
def s_waiting() -> SenderSession:
    s = sender()
    submit(s, 0, 0, 10)
    s.receive(REQUEST)  # slice 0 stays ADMITTED
    return s


def s_mixed() -> SenderSession:
    """TRANSFERRING: slice 0 done+announced, 1 SUBMITTED, 2 SUBMITTING, 3 ADMITTED."""
    s = s_waiting()
    for cls in (SubmitStarted, SubmitAccepted, TransportDone):
        fact(s, cls, 0)
    for k, (a, b) in enumerate([(10, 20), (20, 30), (30, 35)], start=1):
        submit(s, k, a, b)
    fact(s, SubmitStarted, 1)
    fact(s, SubmitAccepted, 1)
    fact(s, SubmitStarted, 2)
    return s


def s_final() -> SenderSession:
    """TRANSFERRING: the only (final) slice is done and announced; awaiting the verdict."""
    s = sender()
    s.receive(REQUEST)
    submit(s, 0, 0, 40, last=True)
    for cls in (SubmitStarted, SubmitAccepted, TransportDone):
        fact(s, cls, 0)
    return s


def s_final_requested() -> SenderSession:
    s = s_final()
    s.send(Cancel())  # nothing in flight: the Abort request goes out at once
    return s


def s_waiting_requested() -> SenderSession:
    s = s_waiting()
    s.send(Cancel())
    return s


def s_success() -> SenderSession:
    s = s_final()
    s.receive(committed())
    return s


def s_after_abort(outcome: Outcome) -> Callable[[], SenderSession]:
    def build() -> SenderSession:
        s = s_mixed()
        s.receive(abort(outcome))
        return s

    return build


def committed() -> SliceResult:
    return SliceResult(
        session_id=SID, epoch=EPOCH, slice_id=0, is_last=True, start=0, end=40,
        status=SliceStatus.COMMITTED,
    )  # fmt: skip


# -- receiver recipes ----------------------------------------------------------------------------
START = StartTransfer(
    request_id=RequestId("r"), dst_block_ids=(0, 1, 2), prefix_tokens=0, num_tokens=40
)


def ready(k: int, start: int, end: int, last: bool = False) -> SliceReady:
    return SliceReady(session_id=SID, epoch=EPOCH, slice_id=k, is_last=last, start=start, end=end)


def r_waiting() -> ReceiverSession:
    r = receiver()
    r.send(START)
    return r


def r_transferring() -> ReceiverSession:
    r = r_waiting()
    r.receive(ready(0, 0, 10))
    return r


def r_success() -> ReceiverSession:
    r = r_waiting()
    r.receive(ready(0, 0, 40, last=True))
    return r


def r_ended(cmd: Cancel | Fail) -> Callable[[], ReceiverSession]:
    def build() -> ReceiverSession:
        r = r_transferring()
        r.send(cmd)
        return r

    return build


RECIPES: dict[Role, dict[SessionState, dict[str, Callable[[], Session]]]] = {
    Role.SENDER: {
        S.BOOTSTRAPPING: {"": sender},
        S.WAITING_FOR_INPUT: {"": s_waiting, "requested": s_waiting_requested},
        S.TRANSFERRING: {"": s_mixed, "final": s_final, "requested": s_final_requested},
        S.SUCCESS: {"": s_success},
        S.ABORTED: {"": s_after_abort(Outcome.ABORTED)},
        S.FAILED: {"": s_after_abort(Outcome.FAILED)},
    },
    Role.RECEIVER: {
        S.BOOTSTRAPPING: {"": receiver},
        S.WAITING_FOR_INPUT: {"": r_waiting},
        S.TRANSFERRING: {"": r_transferring},
        S.SUCCESS: {"": r_success},
        S.ABORTED: {"": r_ended(Cancel())},
        S.FAILED: {"": r_ended(Fail(reason="x"))},
    },
}
VARIANT = {
    EventKind.SLICE_COMMITTED: "final",
    EventKind.ABORT_ACK: "requested",
    EventKind.FAIL_ACK: "requested",
}


def representative(kind: EventKind, s: Session) -> object:
    """One event of ``kind`` that is meaningful for the session's data."""
    nxt = len(getattr(s, "slices", {}))
    last_end = max((x.end for x in getattr(s, "slices", {}).values()), default=0)
    in_flight = 1 if isinstance(s, SenderSession) and 1 in s.ledger else 0
    admitted = (
        next(iter(s.ledger.units((Ownership.ADMITTED,))), 0) if isinstance(s, SenderSession) else 0
    )
    submitting = next(iter(s.ledger.units((Ownership.SUBMITTING,))), 0)
    ack = SliceResult(
        session_id=SID, epoch=EPOCH, slice_id=0, is_last=False, start=0, end=10,
        status=SliceStatus.ACCEPTED,
    )  # fmt: skip
    nxt_slice = SubmitSlice(
        slice_id=SliceId(nxt), is_last=False, start=last_end, end=min(40, last_end + 1)
    )
    acks = {o: AbortAck(session_id=SID, epoch=EPOCH, token=TOKEN, outcome=o) for o in Outcome}
    events: dict[EventKind, Callable[[], object]] = {
        EventKind.START_TRANSFER: lambda: START,
        EventKind.SUBMIT_SLICE: lambda: nxt_slice,
        EventKind.CANCEL: Cancel,
        EventKind.FAIL: lambda: Fail(reason="x"),
        EventKind.SUBMIT_STARTED: lambda: SubmitStarted(slice_id=SliceId(admitted)),
        EventKind.SUBMIT_ACCEPTED: lambda: SubmitAccepted(slice_id=SliceId(submitting)),
        EventKind.SUBMIT_SKIPPED: lambda: SubmitSkipped(slice_id=SliceId(admitted)),
        EventKind.TRANSPORT_DONE: lambda: TransportDone(slice_id=SliceId(in_flight)),
        EventKind.TRANSPORT_FAILED: lambda: TransportFailed(slice_id=SliceId(in_flight)),
        EventKind.TRANSPORT_IN_DOUBT: lambda: TransportInDoubt(slice_id=SliceId(in_flight)),
        EventKind.TIMEOUT_DEADLINE: lambda: Timeout(timer=TimerKind.DEADLINE),
        EventKind.TIMEOUT_VERDICT: lambda: Timeout(timer=TimerKind.VERDICT),
        EventKind.TIMEOUT_RETRANSMIT: lambda: Timeout(timer=TimerKind.RETRANSMIT),
        EventKind.TIMEOUT_DRAIN: lambda: Timeout(timer=TimerKind.DRAIN),
        EventKind.TIMEOUT_RELEASE: lambda: Timeout(timer=TimerKind.RELEASE, unit=1),
        EventKind.PEER_LOST: lambda: PeerLost(peer_id=PEER),
        EventKind.TRANSFER_REQUEST: lambda: REQUEST,
        EventKind.SLICE_READY: lambda: ready(nxt, last_end, last_end + 1),
        EventKind.SLICE_ACK: lambda: ack,
        EventKind.SLICE_COMMITTED: committed,
        EventKind.ABORT: lambda: abort(Outcome.ABORTED),
        EventKind.FAIL_NOTICE: lambda: abort(Outcome.FAILED),
        EventKind.ABORT_ACK: lambda: acks[Outcome.ABORTED],
        EventKind.FAIL_ACK: lambda: acks[Outcome.FAILED],
        EventKind.COMMIT: lambda: None,
    }  # fmt: skip
    return events[kind]()


def snapshot(s: Session) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in vars(s).items():
        out[key] = (value.records(), value.releases) if key == "ledger" else copy.deepcopy(value)
    return out


def apply(s: Session, kind: EventKind, event: object) -> None:
    if kind is EventKind.COMMIT:
        s._run(kind, None)
    elif isinstance(event, StartTransfer | SubmitSlice | Cancel | Fail):
        s.send(event)
    else:
        s.receive(event)


CASES = [(role, state, kind) for role in Role for state in SessionState for kind in EventKind]


@pytest.mark.parametrize(("role", "state", "kind"), CASES, ids=lambda v: v.value)
def test_every_pair_follows_the_table_or_raises_unchanged(
    role: Role, state: SessionState, kind: EventKind
) -> None:
    recipes = RECIPES[role][state]
    session = recipes.get(VARIANT.get(kind, ""), recipes[""])()
    assert session.state is state
    target = TABLES[role].get((state, kind))
    if kind is EventKind.COMMIT and target is not None:  # internal: reached by the final slice
        assert isinstance(session, ReceiverSession)
        session.receive(ready(1, 10, 40, last=True))
        assert session.state is target
        return
    event = representative(kind, session)
    if target is None:
        before = snapshot(session)
        with pytest.raises(ProtocolError):
            apply(session, kind, event)
        assert snapshot(session) == before
    else:
        apply(session, kind, event)
        assert session.state is target
        session.ledger.check_integrity()


def test_commit_is_the_table_followup() -> None:
    r = r_transferring()
    actions = r.receive(ready(1, 10, 40, last=True))
    assert r.state is S.SUCCESS
    assert [type(a) for a in actions] == [Transmit, type(actions[1]), Finished]
    assert r.ledger.state(DESTINATION) is Ownership.BACKEND_DONE


def test_events_before_open_are_refused() -> None:
    s = SenderSession(SID, PEER, token=TOKEN, timings=TIMINGS)
    with pytest.raises(ProtocolError, match="open"):
        s.receive(REQUEST)
    assert s.open() == [ArmTimer(SID, TimerKind.DEADLINE, 0, TIMINGS.sender_deadline_s)]
    with pytest.raises(ProtocolError, match="already open"):
        s.open()


def test_commands_and_facts_go_through_their_own_door() -> None:
    s = sender()
    with pytest.raises(ProtocolError, match="command"):
        s.receive(Cancel())
    with pytest.raises(ProtocolError, match="commands"):
        s.send(REQUEST)  # type: ignore[arg-type]


def test_wire_events_for_another_session_or_epoch_are_refused() -> None:
    r = r_waiting()
    with pytest.raises(ProtocolError, match="sent to"):
        r.receive(
            SliceReady(session_id="other", epoch=EPOCH, slice_id=0, is_last=False, start=0, end=1)
        )
    with pytest.raises(ProtocolError, match="stale work"):
        r.receive(
            SliceReady(session_id=SID, epoch=EPOCH + 1, slice_id=0, is_last=False, start=0, end=1)
        )
    assert r.state is S.WAITING_FOR_INPUT


def test_start_submit_is_emitted_once_the_destination_is_known() -> None:
    s = sender()
    assert s.send(SubmitSlice(slice_id=SliceId(0), is_last=False, start=0, end=10)) == []
    actions = s.receive(REQUEST)
    assert actions == [
        ArmTimer(SID, TimerKind.VERDICT, 0, TIMINGS.sender_deadline_s),
        DestinationKnown(SID, PEER, REQUEST),
        StartSubmit(SID, PEER, SliceId(0), False, 0, 10, REQUEST),
    ]
    assert s.epoch == EPOCH and s.state is S.WAITING_FOR_INPUT
