"""Tests for kvplane.serving.gather_wait: a gathered request's verdict from its members."""

from __future__ import annotations

import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, TokenRange
from kvplane.pd.events import Cancel, StartTransfer
from kvplane.pd.gather import GatherSession
from kvplane.pd.states import SessionState
from kvplane.pd.timers import Timings
from kvplane.serving.gather_wait import GatherWait
from kvplane.transfer.resharding import KVBox, Piece, SenderId

S = SessionState
M0, M1 = SessionId("req/0.0"), SessionId("req/0.1")
START = StartTransfer(request_id=RequestId("r"), dst_block_ids=(4, 5), prefix_tokens=0,
                      num_tokens=40)  # fmt: skip


def wait() -> GatherWait:
    members = {
        PeerId(f"p{tp}"): Piece(SenderId(0, tp), KVBox(heads, (0, 1), TokenRange(0, 1)))
        for tp, heads in ((0, (0, 2)), (1, (2, 4)))
    }
    g = GatherSession(SessionId("req"), members, heads=(0, 4), layers=(0, 1), epoch=1, token=1,
                      timings=Timings())  # fmt: skip
    g.open()
    g.send(START)
    return GatherWait(g)


def test_members_released_as_success_are_no_success_without_the_gathers() -> None:
    w = wait()
    assert w.member_ids == (M0, M1)
    for mid in (M0, M1):
        assert not w.done
        assert w.finish(mid, S.SUCCESS, "") is False
        w.release(mid, S.SUCCESS)
    assert w.done and w.gather.state is S.WAITING_FOR_INPUT  # nothing was tiled
    state, why = w.verdict()
    assert (state, why) == (
        S.FAILED,
        "gather req ended waiting_for_input without every member committing the tiling and "
        "releasing",
    )


def test_the_first_member_failure_answers_and_the_gathers_failure_is_the_verdict() -> None:
    w = wait()
    w.gather.send(Cancel(reason="client left"))
    assert w.finish(M1, S.ABORTED, "client left") is True
    assert w.finish(M0, S.ABORTED, "client left") is False
    w.release(M0, S.ABORTED)
    assert not w.done
    w.release(M1, S.ABORTED)
    assert w.verdict() == (S.ABORTED, "client left")


def test_unknown_and_repeated_members_and_an_early_verdict_are_refused() -> None:
    w = wait()
    with pytest.raises(ProtocolError, match="gather req is not over"):
        w.verdict()
    with pytest.raises(ProtocolError, match=r"gather req has no member 'req/1\.0'"):
        w.release(SessionId("req/1.0"), S.SUCCESS)
    w.release(M0, S.SUCCESS)
    with pytest.raises(ProtocolError, match=r"member req/0\.0 of req released twice"):
        w.release(M0, S.SUCCESS)
    w.finish(M0, S.SUCCESS, "")
    with pytest.raises(ProtocolError, match=r"member req/0\.0 of req finished twice"):
        w.finish(M0, S.FAILED, "late")
