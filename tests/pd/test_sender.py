"""Sender sessions: slices, announcements, retransmits, requests, drains, deadlines, peer loss."""

from __future__ import annotations

import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId, SliceId
from kvplane.pd.actions import (
    ArmTimer,
    DestinationKnown,
    Finished,
    Release,
    StartSubmit,
    Transmit,
)
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
    SubmitAccepted,
    SubmitSlice,
    SubmitStarted,
    Timeout,
    TimerKind,
    TransferRequest,
    TransportDone,
    TransportFailed,
    TransportInDoubt,
)
from kvplane.pd.sender import SenderSession
from kvplane.pd.states import Ownership, Role, SessionState
from kvplane.pd.timers import Timings

SID, PEER, EPOCH, TOKEN = SessionId("s"), PeerId("d"), 3, 11
T = Timings(retransmit_s=0.1, drain_s=1.0, in_doubt_s=0.5)
S = SessionState


def request(prefix: int = 16, num: int = 90) -> TransferRequest:
    return TransferRequest(
        session_id=SID, epoch=EPOCH, request_id="r", dst_block_ids=(4, 5, 6, 7, 8, 9),
        prefix_tokens=prefix, num_tokens=num,
    )  # fmt: skip


def new() -> SenderSession:
    s = SenderSession(SID, PEER, token=TOKEN, timings=T)
    s.open()
    return s


def slice_cmd(k: int, start: int, end: int, last: bool = False) -> SubmitSlice:
    return SubmitSlice(slice_id=SliceId(k), is_last=last, start=start, end=end)


def ready(k: int, start: int, end: int, last: bool = False) -> SliceReady:
    return SliceReady(session_id=SID, epoch=EPOCH, slice_id=k, is_last=last, start=start, end=end)


def result(k: int, start: int, end: int, last: bool, status: SliceStatus) -> SliceResult:
    return SliceResult(
        session_id=SID, epoch=EPOCH, slice_id=k, is_last=last, start=start, end=end, status=status
    )


def run(s: SenderSession, k: int) -> list[object]:
    out: list[object] = []
    for cls in (SubmitStarted, SubmitAccepted, TransportDone):
        out += s.receive(cls(slice_id=SliceId(k)))
    return out


def release(k: int, via: Ownership, state: SessionState) -> Release:
    return Release(SID, PEER, Role.SENDER, k, via, state)


def test_happy_path_clips_to_the_prefix_and_ends_on_the_receivers_verdict() -> None:
    s = new()
    assert s.send(slice_cmd(0, 0, 64)) == []  # no destination yet: waits ADMITTED
    req = request()
    assert s.receive(req) == [
        ArmTimer(SID, TimerKind.VERDICT, 0, T.sender_deadline_s),  # replaces the open's deadline
        DestinationKnown(SID, PEER, req),  # once: the driver may plan ahead from now on
        StartSubmit(SID, PEER, SliceId(0), False, 16, 64, req),
    ]
    assert s.receive(req) == []  # a duplicate request: no second hint, no second start
    assert run(s, 0) == [
        Transmit(PEER, ready(0, 16, 64)),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
        release(0, Ownership.BACKEND_DONE, S.TRANSFERRING),
    ]
    assert s.send(slice_cmd(1, 64, 90, last=True)) == [
        StartSubmit(SID, PEER, SliceId(1), True, 64, 90, req)
    ]
    assert run(s, 1)[0] == Transmit(PEER, ready(1, 64, 90, last=True))
    assert s.receive(result(0, 16, 64, False, SliceStatus.ACCEPTED)) == []
    assert s.receive(result(1, 64, 90, True, SliceStatus.COMMITTED)) == [
        Finished(SID, PEER, Role.SENDER, S.SUCCESS, "committed by the receiver")
    ]
    assert s.state is S.SUCCESS and s.ledger.all_released() and s.ledger.releases == 2
    s.ledger.check_integrity()


def test_retransmits_unacked_slices_then_pokes_with_the_last_until_the_verdict() -> None:
    s = new()
    s.receive(request(prefix=0, num=20))
    s.send(slice_cmd(0, 0, 10))
    s.send(slice_cmd(1, 10, 20, last=True))
    run(s, 0)
    run(s, 1)
    tick = Timeout(timer=TimerKind.RETRANSMIT)
    assert s.receive(tick) == [
        Transmit(PEER, ready(0, 0, 10)),
        Transmit(PEER, ready(1, 10, 20, last=True)),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
    ]
    s.receive(result(0, 0, 10, False, SliceStatus.ACCEPTED))
    s.receive(result(1, 10, 20, True, SliceStatus.DUPLICATE))
    assert s.receive(tick) == [
        Transmit(PEER, ready(1, 10, 20, last=True)),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
    ]
    s.receive(result(1, 10, 20, True, SliceStatus.COMMITTED))
    assert s.receive(tick) == []  # disarmed by the verdict: a stale timeout is ignored
    assert s.stats["stale_timeouts"] == 1 and s.state is S.SUCCESS


def test_cancel_is_a_request_sent_after_the_drain() -> None:
    s = new()
    s.receive(request(prefix=0, num=30))
    s.send(slice_cmd(0, 0, 10))
    s.receive(SubmitStarted(slice_id=SliceId(0)))
    s.receive(SubmitAccepted(slice_id=SliceId(0)))
    s.send(slice_cmd(1, 10, 20))  # admitted, not started
    assert s.send(Cancel(reason="client went away")) == [
        ArmTimer(SID, TimerKind.DRAIN, 0, 1.0),
        release(1, Ownership.NOT_SUBMITTED, S.TRANSFERRING),
    ]
    assert s.state is S.TRANSFERRING  # the receiver decides
    abort = Abort(
        session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.ABORTED,
        reason="client went away", drained=True,
    )  # fmt: skip
    assert s.receive(TransportDone(slice_id=SliceId(0))) == [
        Transmit(PEER, abort),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
        release(0, Ownership.BACKEND_DONE, S.TRANSFERRING),
    ]
    assert s.receive(Timeout(timer=TimerKind.RETRANSMIT)) == [
        Transmit(PEER, abort),
        ArmTimer(SID, TimerKind.RETRANSMIT, 0, 0.1),
    ]
    with pytest.raises(ProtocolError, match="not_submitted"):
        s.receive(SubmitStarted(slice_id=SliceId(1)))  # cancelled: it may never be submitted
    ack = AbortAck(session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.ABORTED)
    assert s.receive(ack) == [Finished(SID, PEER, Role.SENDER, S.ABORTED, "client went away")]
    with pytest.raises(ProtocolError, match="aborted cannot take submit_started"):
        s.receive(SubmitStarted(slice_id=SliceId(1)))  # the cancelled slice may not be submitted
    assert s.send(slice_cmd(2, 20, 30, last=True)) == [
        release(2, Ownership.NOT_SUBMITTED, S.ABORTED)
    ]


def test_a_hung_transfer_goes_in_doubt_and_is_released_only_by_its_deadline() -> None:
    s = new()
    s.receive(request(prefix=0, num=10))
    s.send(slice_cmd(0, 0, 10, last=True))
    s.receive(SubmitStarted(slice_id=SliceId(0)))
    s.receive(SubmitAccepted(slice_id=SliceId(0)))
    s.send(Fail(reason="prefill crashed"))
    out = s.receive(Timeout(timer=TimerKind.DRAIN))
    assert out[0] == ArmTimer(SID, TimerKind.RELEASE, 0, 0.5)
    assert out[1] == Transmit(
        PEER,
        Abort(
            session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.FAILED,
            reason="prefill crashed", drained=False,
        ),
    )  # fmt: skip
    assert s.ledger.state(0) is Ownership.IN_DOUBT
    assert s.receive(TransportDone(slice_id=SliceId(0))) == []  # late evidence: still in doubt
    assert s.stats["late_evidence"] == 1 and s.ledger.state(0) is Ownership.IN_DOUBT
    ack = AbortAck(session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.FAILED)
    assert s.receive(ack)[-1] == Finished(SID, PEER, Role.SENDER, S.FAILED, "prefill crashed")
    assert s.receive(Timeout(timer=TimerKind.RELEASE, unit=0)) == [
        release(0, Ownership.EXPIRED, S.FAILED)
    ]
    assert s.receive(Timeout(timer=TimerKind.RELEASE, unit=0)) == []  # fired once, never again
    s.ledger.check_integrity()


def test_receivers_abort_is_obeyed_at_once_and_acknowledged_after_the_drain() -> None:
    s = new()
    s.receive(request(prefix=0, num=10))
    s.send(slice_cmd(0, 0, 10, last=True))
    s.receive(SubmitStarted(slice_id=SliceId(0)))
    s.receive(SubmitAccepted(slice_id=SliceId(0)))
    abort = Abort(session_id=SID, epoch=EPOCH, token=42, outcome=Outcome.ABORTED, reason="user")
    assert s.receive(abort) == [
        ArmTimer(SID, TimerKind.DRAIN, 0, 1.0),
        Finished(SID, PEER, Role.SENDER, S.ABORTED, "user"),
    ]
    assert s.receive(abort) == []  # idempotent; still draining, so no ack yet
    ack = AbortAck(session_id=SID, epoch=EPOCH, token=42, outcome=Outcome.ABORTED, drained=True)
    assert s.receive(TransportDone(slice_id=SliceId(0))) == [
        Transmit(PEER, ack),
        release(0, Ownership.BACKEND_DONE, S.ABORTED),
    ]
    assert s.receive(abort) == [Transmit(PEER, ack)]  # re-acknowledged, never re-announced


def test_transport_failure_requests_failed_and_commits_on_the_verdict() -> None:
    s = new()
    s.receive(request(prefix=0, num=10))
    s.send(slice_cmd(0, 0, 10, last=True))
    s.receive(SubmitStarted(slice_id=SliceId(0)))
    s.receive(SubmitAccepted(slice_id=SliceId(0)))
    out = s.receive(TransportFailed(slice_id=SliceId(0), reason="nic"))
    assert out[0] == Transmit(
        PEER,
        Abort(
            session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.FAILED, reason="slice 0: nic"
        ),
    )
    assert release(0, Ownership.BACKEND_DONE, S.TRANSFERRING) in out
    ack = AbortAck(session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.FAILED)
    assert s.receive(ack)[-1].state is S.FAILED  # type: ignore[union-attr]
    wrong = AbortAck(session_id=SID, epoch=EPOCH, token=TOKEN + 1, outcome=Outcome.FAILED)
    assert s.receive(wrong) == []  # terminal: duplicate acks are ignored


def test_in_doubt_evidence_arms_the_release_deadline() -> None:
    s = new()
    s.receive(request(prefix=0, num=10))
    s.send(slice_cmd(0, 0, 10, last=True))
    s.receive(SubmitStarted(slice_id=SliceId(0)))
    out = s.receive(TransportInDoubt(slice_id=SliceId(0), reason="submit raised"))
    assert out[0] == ArmTimer(SID, TimerKind.RELEASE, 0, 0.5)
    assert isinstance(out[1], Transmit) and isinstance(out[1].event, Abort)
    assert out[1].event.drained is False and s.ledger.state(0) is Ownership.IN_DOUBT


def test_own_deadline_fails_unilaterally_and_notifies_once_drained() -> None:
    s = new()
    s.receive(request(prefix=0, num=20))
    s.send(slice_cmd(0, 0, 10))
    out = s.receive(Timeout(timer=TimerKind.VERDICT))
    notice = Abort(
        session_id=SID, epoch=EPOCH, token=TOKEN, outcome=Outcome.FAILED,
        reason="sender deadline", drained=True,
    )  # fmt: skip
    assert out == [
        Transmit(PEER, notice),
        release(0, Ownership.NOT_SUBMITTED, S.FAILED),
        Finished(SID, PEER, Role.SENDER, S.FAILED, "deadline: no verdict from the receiver"),
    ]
    assert s.receive(request(prefix=0, num=20)) == [Transmit(PEER, notice)]  # repeated on contact
    late = result(0, 0, 20, True, SliceStatus.COMMITTED)
    assert s.receive(late) == [] and s.state is S.FAILED and s.stats["late_verdicts"] == 1


def test_peer_loss_fails_without_messages_and_holds_in_flight_memory_in_doubt() -> None:
    s = new()
    s.receive(request(prefix=0, num=20))
    s.send(slice_cmd(0, 0, 10))
    s.receive(SubmitStarted(slice_id=SliceId(0)))
    s.send(slice_cmd(1, 10, 20, last=True))
    out = s.receive(PeerLost(peer_id=PEER))
    assert out == [
        ArmTimer(SID, TimerKind.RELEASE, 0, 0.5),
        release(1, Ownership.NOT_SUBMITTED, S.FAILED),
        Finished(SID, PEER, Role.SENDER, S.FAILED, "peer lost"),
    ]
    assert not any(isinstance(a, Transmit) for a in out)


def test_cancel_before_the_request_waits_for_the_epoch() -> None:
    s = new()
    s.send(slice_cmd(0, 0, 10))
    assert s.send(Cancel()) == [release(0, Ownership.NOT_SUBMITTED, S.BOOTSTRAPPING)]
    out = s.receive(request(prefix=0, num=10))
    assert isinstance(out[1], Transmit) and isinstance(out[1].event, Abort)
    assert s.state is S.WAITING_FOR_INPUT and s.epoch == EPOCH


@pytest.mark.parametrize(
    ("cmd", "match"),
    [
        (slice_cmd(1, 10, 20), "expected 0"),
        (slice_cmd(0, 5, 20), "starts at 5"),
        (slice_cmd(0, 0, 200, last=True), "does not fit"),
        (slice_cmd(0, 0, 50, last=True), "does not fit"),
    ],
)
def test_bad_slices_are_refused_without_changes(cmd: SubmitSlice, match: str) -> None:
    s = new()
    s.receive(request(prefix=0, num=90))
    with pytest.raises(ProtocolError, match=match):
        s.send(cmd)
    assert s.slices == {} and len(s.ledger) == 0 and s.state is S.WAITING_FOR_INPUT


def test_no_slice_after_the_last_and_mismatched_request_is_a_failed_request() -> None:
    s = new()
    s.send(slice_cmd(0, 0, 10, last=True))
    with pytest.raises(ProtocolError, match="after the last"):
        s.send(slice_cmd(1, 10, 20))
    out = s.receive(request(prefix=0, num=99))  # the peers disagree on the prompt length
    assert s.requested == (Outcome.FAILED, "slices [0] do not fit 99 tokens")
    assert isinstance(out[1], Transmit) and isinstance(out[1].event, Abort)
    assert out[-1] == release(0, Ownership.NOT_SUBMITTED, S.WAITING_FOR_INPUT)


def test_a_different_request_for_the_same_epoch_is_a_protocol_error() -> None:
    s = new()
    s.receive(request())
    with pytest.raises(ProtocolError, match="different request"):
        s.receive(request(prefix=0))
    assert s.receive(request()) == [] and s.stats["duplicate_requests"] == 1


def test_long_reasons_are_cut_to_what_a_frame_carries() -> None:
    from kvplane.pd.codec import Codec
    from kvplane.pd.events import MAX_TEXT

    s = new()
    s.receive(request(prefix=0, num=10))
    out = s.send(Cancel(reason="x" * 5000))
    abort = next(a.event for a in out if isinstance(a, Transmit))
    assert isinstance(abort, Abort) and abort.reason == "x" * MAX_TEXT
    codec = Codec()
    assert codec.decode(codec.encode(abort)) == abort  # the peer can read it
