"""Receiver sessions: requests, duplicates, reordering, tiling, commits, aborts and their acks."""

from __future__ import annotations

from kvplane.ids import PeerId, RequestId, SessionId
from kvplane.pd.actions import ArmTimer, Finished, Release, Transmit
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Cancel,
    Outcome,
    PeerLost,
    SliceReady,
    SliceResult,
    SliceStatus,
    StartTransfer,
    Timeout,
    TimerKind,
    TransferRequest,
)
from kvplane.pd.ledger import DESTINATION
from kvplane.pd.receiver import ReceiverSession
from kvplane.pd.states import Ownership, Role, SessionState
from kvplane.pd.timers import Timings

SID, PEER, EPOCH, TOKEN = SessionId("s"), PeerId("p"), 9, 4
T = Timings(retransmit_s=0.1, drain_s=1.0, in_doubt_s=0.5, deadline_s=3.0)
S = SessionState
START = StartTransfer(
    request_id=RequestId("r"), dst_block_ids=(1, 2), prefix_tokens=8, num_tokens=40
)
REQ = TransferRequest(
    session_id=SID,
    epoch=EPOCH,
    request_id="r",
    dst_block_ids=(1, 2),
    prefix_tokens=8,
    num_tokens=40,
)


def new(start: StartTransfer | None = START) -> ReceiverSession:
    r = ReceiverSession(SID, PEER, epoch=EPOCH, token=TOKEN, timings=T)
    assert r.open() == [ArmTimer(SID, TimerKind.DEADLINE, 0, 3.0)]
    if start is START:
        assert r.send(start) == [Transmit(PEER, REQ), ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1)]
    elif start is not None:
        r.send(start)
    return r


def ready(k: int, start: int, end: int, last: bool = False) -> SliceReady:
    return SliceReady(session_id=SID, epoch=EPOCH, slice_id=k, is_last=last, start=start, end=end)


def res(ev: SliceReady, status: SliceStatus) -> Transmit:
    return Transmit(
        PEER,
        SliceResult(
            session_id=SID, epoch=EPOCH, slice_id=ev.slice_id, is_last=ev.is_last,
            start=ev.start, end=ev.end, status=status,
        ),
    )  # fmt: skip


def release(via: Ownership, state: SessionState) -> Release:
    return Release(SID, PEER, Role.RECEIVER, DESTINATION, via, state)


def test_request_is_resent_until_the_first_slice_then_reordered_slices_commit() -> None:
    r = new()
    assert r.receive(Timeout(timer=TimerKind.RETRANSMIT)) == [
        Transmit(PEER, REQ),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
    ]
    s0, s1, s2 = ready(0, 8, 20), ready(1, 20, 32), ready(2, 32, 40, last=True)
    assert r.receive(s0) == [res(s0, SliceStatus.ACCEPTED)]
    assert r.ledger.state(DESTINATION) is Ownership.SUBMITTED and r.state is S.TRANSFERRING
    assert r.receive(Timeout(timer=TimerKind.RETRANSMIT)) == []  # disarmed by the first slice
    assert r.receive(s2) == [res(s2, SliceStatus.ACCEPTED)]  # reordered: waits for slice 1
    assert r.receive(s0) == [res(s0, SliceStatus.DUPLICATE)]
    assert r.receive(s1) == [
        res(s2, SliceStatus.COMMITTED),
        release(Ownership.BACKEND_DONE, S.SUCCESS),
        Finished(SID, PEER, Role.RECEIVER, S.SUCCESS, "all slices arrived"),
    ]
    assert r.receive(s1) == [res(s2, SliceStatus.COMMITTED)]  # the verdict, for any duplicate
    assert r.stats["duplicate_slices"] == 2
    r.ledger.check_integrity()


def test_all_in_the_prefix_commits_on_one_empty_final_slice() -> None:
    r = new(
        StartTransfer(request_id=RequestId("r"), dst_block_ids=(), prefix_tokens=40, num_tokens=40)
    )
    out = r.receive(ready(0, 40, 40, last=True))
    assert r.state is S.SUCCESS and isinstance(out[-1], Finished)


def abort_frame(outcome: Outcome, reason: str) -> Transmit:
    return Transmit(
        PEER, Abort(session_id=SID, epoch=EPOCH, token=TOKEN, outcome=outcome, reason=reason)
    )


def test_a_gap_in_the_slices_fails_the_session_and_tells_the_sender() -> None:
    r = new()
    r.receive(ready(0, 8, 20))
    out = r.receive(ready(1, 24, 40, last=True))
    assert out[:2] == [
        abort_frame(Outcome.FAILED, "slice 1 starts at 24, expected 20"),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
    ]
    assert r.state is S.FAILED and r.ledger.state(DESTINATION) is Ownership.SUBMITTED


def test_a_slice_outside_the_transfer_or_resent_differently_fails() -> None:
    r = new()
    r.receive(ready(0, 0, 20))
    assert r.state is S.FAILED and r.reason == "slice 0 [0, 20) is outside the transfer"
    r2 = new()
    r2.receive(ready(0, 8, 20))
    r2.receive(ready(0, 8, 21))
    assert r2.state is S.FAILED and r2.reason == "slice 0 resent differently"
    r3 = new()
    r3.receive(ready(1, 20, 40, last=True))
    r3.receive(ready(2, 40, 40))
    assert r3.state is S.FAILED and "conflicts with final slice 1" in r3.reason


def test_cancel_commits_and_holds_the_destination_until_the_drained_ack() -> None:
    r = new()
    r.receive(ready(0, 8, 20))
    assert r.send(Cancel(reason="user")) == [
        abort_frame(Outcome.ABORTED, "user"),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
        ArmTimer(SID, TimerKind.DRAIN, 0, 2.0),
        Finished(SID, PEER, Role.RECEIVER, S.ABORTED, "user"),
    ]
    assert r.receive(ready(1, 20, 40, last=True)) == [abort_frame(Outcome.ABORTED, "user")]
    assert r.receive(Timeout(timer=TimerKind.RETRANSMIT)) == [
        abort_frame(Outcome.ABORTED, "user"),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
    ]
    ack = AbortAck(session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.ABORTED, drained=True)
    assert r.receive(ack) == [release(Ownership.BACKEND_DONE, S.ABORTED)]
    assert r.receive(ack) == [] and r.stats["duplicate_acks"] == 1
    assert r.receive(Timeout(timer=TimerKind.DRAIN)) == []


def test_an_unclean_ack_or_no_ack_holds_in_doubt_until_the_deadline() -> None:
    r = new()
    r.send(Cancel())
    ack = AbortAck(session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.ABORTED, drained=False)
    assert r.receive(ack) == [ArmTimer(SID, TimerKind.RELEASE, 0, 0.5)]
    assert r.ledger.state(DESTINATION) is Ownership.IN_DOUBT
    assert r.receive(Timeout(timer=TimerKind.RELEASE)) == [release(Ownership.EXPIRED, S.ABORTED)]
    silent = new()
    silent.send(Cancel())
    assert silent.receive(Timeout(timer=TimerKind.DRAIN)) == [
        ArmTimer(SID, TimerKind.RELEASE, 0, 0.5)
    ]
    assert silent.receive(Timeout(timer=TimerKind.RETRANSMIT)) == []  # gave up resending


def test_cancel_before_the_request_releases_at_once_but_still_tells_the_sender() -> None:
    r = new(start=None)
    out = r.send(Cancel(reason="early"))
    assert out[0] == abort_frame(Outcome.ABORTED, "early")
    assert release(Ownership.NOT_SUBMITTED, S.ABORTED) in out
    assert r.ledger.all_released()


def test_senders_request_is_granted_while_undecided_and_answered_with_the_verdict_after() -> None:
    r = new()
    r.receive(ready(0, 8, 20))
    req = Abort(session_id=SID, epoch=EPOCH, token=77, outcome=Outcome.FAILED, reason="prefill oom")
    ack = AbortAck(session_id=SID, epoch=EPOCH, token=77, outcome=Outcome.FAILED)
    assert r.receive(req) == [
        Transmit(PEER, ack),
        release(Ownership.BACKEND_DONE, S.FAILED),
        Finished(SID, PEER, Role.RECEIVER, S.FAILED, "prefill oom"),
    ]
    assert r.receive(req) == [Transmit(PEER, ack)]
    done = new()
    done.receive(ready(0, 8, 40, last=True))
    late = Abort(session_id=SID, epoch=EPOCH, token=77, outcome=Outcome.ABORTED)
    assert done.receive(late) == [res(ready(0, 8, 40, last=True), SliceStatus.COMMITTED)]
    assert done.state is S.SUCCESS


def test_deadline_and_peer_loss() -> None:
    r = new()
    out = r.receive(Timeout(timer=TimerKind.DEADLINE))
    assert out[0] == abort_frame(Outcome.FAILED, "deadline") and r.state is S.FAILED
    lost = new()
    assert lost.receive(PeerLost(peer_id=PEER)) == [
        ArmTimer(SID, TimerKind.RELEASE, 0, 0.5),
        Finished(SID, PEER, Role.RECEIVER, S.FAILED, "peer lost"),
    ]
    assert lost.ledger.state(DESTINATION) is Ownership.IN_DOUBT
    assert lost.receive(Timeout(timer=TimerKind.RELEASE)) == [release(Ownership.EXPIRED, S.FAILED)]
    lost.ledger.check_integrity()
