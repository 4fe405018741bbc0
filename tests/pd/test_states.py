"""The transition tables as data: ordering, stickiness, the ledger table, classification."""

from __future__ import annotations

import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SliceId
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Hello,
    Outcome,
    PeerLost,
    SliceResult,
    SliceStatus,
    SubmitStarted,
    Timeout,
    TimerKind,
)
from kvplane.pd.states import (
    IN_FLIGHT,
    LEDGER_TABLE,
    RECEIVER_TABLE,
    RELEASING,
    SENDER_TABLE,
    TABLES,
    TERMINAL,
    EventKind,
    Ownership,
    Role,
    SessionState,
    classify,
)


@pytest.mark.parametrize("role", list(Role))
def test_transitions_only_move_forward_and_terminal_states_are_sticky(role: Role) -> None:
    for (src, kind), dst in TABLES[role].items():
        assert dst.rank >= src.rank, (role, src, kind, dst)
        if src.terminal:
            assert dst == src, f"{role}: terminal {src} left on {kind}"


@pytest.mark.parametrize("role", list(Role))
def test_every_non_terminal_state_can_fail_on_deadline_and_peer_loss(role: Role) -> None:
    table = TABLES[role]
    for state in SessionState:
        if not state.terminal:
            deadline = table[(state, EventKind.TIMEOUT_DEADLINE)]
            verdict = table.get((state, EventKind.TIMEOUT_VERDICT))
            assert SessionState.FAILED in (deadline, verdict), (role, state)
            assert table[(state, EventKind.PEER_LOST)] is SessionState.FAILED


def test_the_senders_deadline_is_the_opens_until_the_request_then_the_verdicts() -> None:
    """The request is what leaves BOOTSTRAPPING; VERDICT is armed then and DEADLINE disarmed,
    so after it a DEADLINE timeout is stale and must not end the session."""
    s = SessionState
    assert SENDER_TABLE[(s.BOOTSTRAPPING, EventKind.TRANSFER_REQUEST)] is s.WAITING_FOR_INPUT
    assert SENDER_TABLE[(s.BOOTSTRAPPING, EventKind.TIMEOUT_DEADLINE)] is s.FAILED
    assert (s.BOOTSTRAPPING, EventKind.TIMEOUT_VERDICT) not in SENDER_TABLE
    for state in (s.WAITING_FOR_INPUT, s.TRANSFERRING):
        assert SENDER_TABLE[(state, EventKind.TIMEOUT_DEADLINE)] is state
        assert SENDER_TABLE[(state, EventKind.TIMEOUT_VERDICT)] is s.FAILED
    assert not any(kind is EventKind.TIMEOUT_VERDICT for (_, kind) in RECEIVER_TABLE)


def test_only_the_receiver_commits_and_the_sender_follows_its_verdict() -> None:
    success = {k for (s, k), d in RECEIVER_TABLE.items() if d is SessionState.SUCCESS and s != d}
    assert success == {EventKind.COMMIT}
    assert {k for (s, k), d in SENDER_TABLE.items() if d is SessionState.SUCCESS and s != d} == {
        EventKind.SLICE_COMMITTED
    }
    # the sender's own cancel and fail are requests: they never move it
    for state in SessionState:
        assert SENDER_TABLE[(state, EventKind.CANCEL)] is state
        assert SENDER_TABLE.get((state, EventKind.FAIL), state) is state
    # the only ways a sender becomes ABORTED are the receiver's abort or its ack
    aborted = {k for (s, k), d in SENDER_TABLE.items() if d is SessionState.ABORTED and s != d}
    assert aborted == {EventKind.ABORT, EventKind.ABORT_ACK}


def test_tables_have_the_documented_size() -> None:
    assert len(SENDER_TABLE) == 100
    assert len(RECEIVER_TABLE) == 63
    assert (SessionState.BOOTSTRAPPING, EventKind.SLICE_READY) not in RECEIVER_TABLE
    assert (SessionState.SUCCESS, EventKind.SUBMIT_SLICE) not in SENDER_TABLE


def test_ledger_table_is_the_issue_graph_plus_the_deadline_release() -> None:
    o = Ownership
    edges = {(src, dst) for (src, _), dst in LEDGER_TABLE.items()}
    assert edges == {
        (o.ADMITTED, o.SUBMITTING),
        (o.ADMITTED, o.NOT_SUBMITTED),
        (o.SUBMITTING, o.SUBMITTED),
        (o.SUBMITTING, o.IN_DOUBT),
        (o.SUBMITTED, o.BACKEND_DONE),
        (o.SUBMITTED, o.IN_DOUBT),
        (o.IN_DOUBT, o.EXPIRED),
    }
    assert {o.NOT_SUBMITTED, o.BACKEND_DONE, o.EXPIRED} == RELEASING
    assert {o.SUBMITTING, o.SUBMITTED} == IN_FLIGHT
    for (src, _), _dst in LEDGER_TABLE.items():
        assert src not in RELEASING, "a released unit has no way out (released exactly once)"
    # IN_DOUBT has exactly one way out: its deadline
    assert [d for (s, _), d in LEDGER_TABLE.items() if s is o.IN_DOUBT] == [o.EXPIRED]


def test_classify_distinguishes_outcomes_and_statuses() -> None:
    common = dict(session_id="s", epoch=1)
    assert classify(Abort(token=1, outcome=Outcome.ABORTED, **common)) is EventKind.ABORT  # type: ignore[arg-type]
    assert classify(Abort(token=1, outcome=Outcome.FAILED, **common)) is EventKind.FAIL_NOTICE  # type: ignore[arg-type]
    assert classify(AbortAck(token=1, outcome=Outcome.ABORTED, **common)) is EventKind.ABORT_ACK  # type: ignore[arg-type]
    assert classify(AbortAck(token=1, outcome=Outcome.FAILED, **common)) is EventKind.FAIL_ACK  # type: ignore[arg-type]
    for status, kind in [
        (SliceStatus.ACCEPTED, EventKind.SLICE_ACK),
        (SliceStatus.DUPLICATE, EventKind.SLICE_ACK),
        (SliceStatus.COMMITTED, EventKind.SLICE_COMMITTED),
    ]:
        ev = SliceResult(slice_id=0, is_last=True, start=0, end=0, status=status, **common)  # type: ignore[arg-type]
        assert classify(ev) is kind
    assert classify(Timeout(timer=TimerKind.RELEASE, unit=3)) is EventKind.TIMEOUT_RELEASE
    assert classify(PeerLost(peer_id=PeerId("p"))) is EventKind.PEER_LOST
    assert classify(SubmitStarted(slice_id=SliceId(0))) is EventKind.SUBMIT_STARTED


def test_classify_refuses_peer_level_events() -> None:
    from kvplane.testing.session_pair import sim_profile

    hello = Hello(peer_id="p", incarnation=1, profile=sim_profile(), fingerprint=b"")
    with pytest.raises(ProtocolError, match="not a session event"):
        classify(hello)
    with pytest.raises(ProtocolError):
        classify(object())


def test_state_ranks() -> None:
    assert [s.rank for s in SessionState] == [0, 1, 2, 3, 3, 3]
    assert {s for s in SessionState if s.terminal} == TERMINAL
