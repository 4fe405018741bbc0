"""Tombstones answer late frames of their epoch and raise the epoch floor when evicted."""

from __future__ import annotations

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.ids import PeerId, SessionId
from kvplane.pd.actions import Transmit
from kvplane.pd.events import Abort, AbortAck, Outcome, SliceReady, SliceResult, SliceStatus
from kvplane.pd.states import Role, SessionState
from kvplane.pd.tombstones import Tombstone, TombstoneTable, answer

D = PeerId("d")
VERDICT = SliceResult(
    session_id="s", epoch=4, slice_id=1, is_last=True, start=0, end=8, status=SliceStatus.COMMITTED
)
NOTICE = Abort(session_id="s", epoch=4, token=2, outcome=Outcome.FAILED, reason="deadline")
READY = SliceReady(session_id="s", epoch=4, slice_id=0, is_last=False, start=0, end=4)


def test_a_committed_receiver_repeats_its_verdict() -> None:
    tomb = Tombstone(Role.RECEIVER, D, 4, SessionState.SUCCESS, True, verdict=VERDICT)
    assert answer(tomb, READY) == [Transmit(D, VERDICT)]
    assert answer(tomb, Abort(session_id="s", epoch=4, token=9, outcome=Outcome.ABORTED)) == [
        Transmit(D, VERDICT)
    ]


def test_an_ended_session_reacknowledges_aborts_with_its_own_outcome_and_repeats_notices() -> None:
    tomb = Tombstone(Role.SENDER, D, 4, SessionState.FAILED, False, notice=NOTICE)
    got = answer(tomb, Abort(session_id="s", epoch=4, token=9, outcome=Outcome.ABORTED))
    assert got == [
        Transmit(
            D,
            AbortAck(session_id="s", epoch=4, token=9, outcome=Outcome.FAILED, drained=False),
        )
    ]
    assert answer(tomb, READY) == [Transmit(D, NOTICE)]
    assert answer(Tombstone(Role.SENDER, D, 4, SessionState.ABORTED, True), READY) == []


def test_eviction_is_lru_and_raises_the_floor_of_the_evicted_peer() -> None:
    table = TombstoneTable(2)
    for i, epoch in enumerate([5, 3, 9]):
        table.bury(SessionId(f"s{i}"), Tombstone(Role.SENDER, D, epoch, SessionState.SUCCESS, True))
    assert SessionId("s0") not in table and len(table) == 2
    assert table.floor(D) == 5 and table.floor(PeerId("other")) == 0
    table.bury(SessionId("s1"), table.pop(SessionId("s1")))  # type: ignore[arg-type]
    table.bury(SessionId("s3"), Tombstone(Role.SENDER, D, None, SessionState.FAILED, True))
    assert table.ids() == {SessionId("s1"), SessionId("s3")} and table.floor(D) == 9
    with pytest.raises(InvalidArgumentError):
        TombstoneTable(0)
