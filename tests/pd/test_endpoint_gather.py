"""Gather sessions over real endpoints (zmq on 127.0.0.1): a decode endpoint fed by two prefill
endpoints commits once both delivered; one prefill endpoint dying fails the request for both."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from kvplane.ids import PeerId, RequestId, SessionId, SliceId, TokenRange
from kvplane.pd.actions import Action, Finished, Release, StartSubmit
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import (
    StartTransfer,
    SubmitAccepted,
    SubmitSlice,
    SubmitStarted,
    TransportDone,
)
from kvplane.pd.participant import Participant
from kvplane.pd.states import Ownership, Role, SessionState
from kvplane.pd.timers import Timings
from kvplane.testing.session_pair import sim_profile
from kvplane.transfer.resharding import KVBox, Piece, SenderId

FAST = Timings(heartbeat_s=0.05, lease_s=0.3, in_doubt_s=0.05)
GID = SessionId("req")
START = StartTransfer(request_id=RequestId("r"), dst_block_ids=(1, 2), prefix_tokens=0,
                      num_tokens=32)  # fmt: skip
ALL = TokenRange(0, 1)
S = SessionState
A = TypeVar("A")


class Node:
    """An endpoint whose actions are collected; a sender's slices complete at once."""

    def __init__(self, name: str, incarnation: int) -> None:
        self.actions: list[Action] = []
        self.lock = threading.Lock()
        self.released = threading.Event()
        part = Participant(PeerId(name), sim_profile(), incarnation=incarnation, timings=FAST)
        self.ep = Endpoint(part, on_action=self.on_action)

    def on_action(self, act: Action) -> None:
        with self.lock:
            self.actions.append(act)
        if isinstance(act, StartSubmit):
            for cls in (SubmitStarted, SubmitAccepted, TransportDone):
                self.ep.receive_local(act.session_id, cls(slice_id=act.slice_id))
        if isinstance(act, Release) and act.role is Role.RECEIVER:
            self.released.set()

    def seen(self, kind: type[A]) -> list[A]:
        with self.lock:
            return [a for a in self.actions if isinstance(a, kind)]


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node, Node]]:
    p0, p1, decode = Node("p0", 1), Node("p1", 1), Node("decode", 1 << 30)
    for n in (p0, p1, decode):
        n.ep.start()
    yield p0, p1, decode
    for n in (decode, p1, p0):
        n.ep.close()


def open_gather(p0: Node, p1: Node, decode: Node) -> None:
    peers = [decode.ep.connect(p.ep.address) for p in (p0, p1)]
    assert peers == ["p0", "p1"]
    members = {peers[i]: Piece(SenderId(0, i), KVBox((2 * i, 2 * i + 2), (0, 1), ALL))
               for i in range(2)}  # fmt: skip
    decode.ep.open_gather(GID, members, START, heads=(0, 4), layers=(0, 1))


def wait_for(pred: Callable[[], object], timeout_s: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if pred():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached")


def test_a_gather_over_endpoints_commits_when_both_senders_delivered(
    nodes: tuple[Node, Node, Node],
) -> None:
    p0, p1, decode = nodes
    open_gather(p0, p1, decode)
    for i, p in enumerate((p0, p1)):
        wait_for(lambda: p.ep.participant.sessions)  # noqa: B023 - called at once
        slice_ = SubmitSlice(slice_id=SliceId(0), is_last=True, start=0, end=32)
        p.ep.send(SessionId(f"req/0.{i}"), slice_)
    wait_for(lambda: len(decode.seen(Finished)) == 2)
    wait_for(lambda: decode.ep.gather_state(GID) is None)
    finished = sorted((a.session_id, a.state) for a in decode.seen(Finished))
    assert finished == [("req/0.0", S.SUCCESS), ("req/0.1", S.SUCCESS)]
    assert decode.ep.snapshot()["sessions_live"] == 0
    decode.ep.call(decode.ep.participant.check_integrity)


def test_a_prefill_endpoint_dying_mid_transfer_fails_the_gather_and_frees_everything(
    nodes: tuple[Node, Node, Node],
) -> None:
    p0, p1, decode = nodes
    open_gather(p0, p1, decode)
    wait_for(lambda: p0.ep.participant.sessions and p1.ep.participant.sessions)
    half = SubmitSlice(slice_id=SliceId(0), is_last=False, start=0, end=16)
    p0.ep.send(SessionId("req/0.0"), half)
    wait_for(lambda: decode.ep.gather_state(GID) is S.TRANSFERRING)
    p1.ep.close()  # p1 dies with its session open
    wait_for(lambda: len(decode.seen(Release)) == 2)
    wait_for(lambda: decode.ep.gather_state(GID) is None)
    finished = sorted((a.session_id, a.state, a.reason) for a in decode.seen(Finished))
    assert finished == [
        ("req/0.0", S.FAILED, "sender p1 failed"), ("req/0.1", S.FAILED, "peer lost"),
    ]  # fmt: skip
    vias = sorted((a.session_id, a.via) for a in decode.seen(Release))
    assert vias == [("req/0.0", Ownership.BACKEND_DONE), ("req/0.1", Ownership.EXPIRED)]
    wait_for(lambda: p0.ep.participant.sessions == {})
    sender = [(a.role, a.state) for a in p0.seen(Finished)]
    assert sender == [(Role.SENDER, S.FAILED)]
    p0_units = sorted(a.unit for a in p0.seen(Release))
    assert p0_units == [0]  # the slice it sent is released: no leak on the survivor
    for n in (p0, decode):
        n.ep.call(n.ep.participant.check_integrity)
