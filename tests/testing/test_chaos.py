"""The seeded fault injectors: a transport never reports bytes it did not move."""

from __future__ import annotations

import time

import pytest
import torch

from kvplane.errors import ConfigError, TransportError
from kvplane.ids import PeerId
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import Abort, Outcome
from kvplane.pd.participant import Participant
from kvplane.testing.chaos import FaultPlan, FaultyEndpoint, FaultyTransport
from kvplane.testing.session_pair import sim_profile
from kvplane.transports.base import DescriptorList, Poll, XferKind, XferState
from kvplane.transports.local import LocalFabric, LocalTransport


def _pair(
    plan: FaultPlan,
) -> tuple[FaultyTransport, LocalTransport, DescriptorList, DescriptorList]:
    fabric = LocalFabric()
    a, b = LocalTransport(fabric=fabric, agent="a"), LocalTransport(fabric=fabric, agent="b")
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    faulty = FaultyTransport(a, plan)
    return (
        faulty,
        b,
        DescriptorList.of([(ra.region_id, 0, 64)]),
        DescriptorList.of([(rb.region_id, 0, 64)]),
    )


def _wait(t: FaultyTransport, h: object) -> Poll:
    end = time.monotonic() + 5
    while True:
        got = t.poll(h)  # type: ignore[arg-type]
        if got.state.terminal or time.monotonic() > end:
            return got
        time.sleep(0.001)


@pytest.mark.parametrize(
    ("fate", "state"), [("fail", XferState.FAILED), ("in_doubt", XferState.IN_DOUBT)]
)
def test_injected_outcomes_come_after_the_real_batch(fate: str, state: XferState) -> None:
    t, b, s, d = _pair(FaultPlan(**{fate: 1.0}))
    peer = t.connect(b.metadata())
    h = t.submit(XferKind.WRITE, s, d, peer)
    got = _wait(t, h)
    assert got.state is state and "injected" in got.reason
    assert t.inner.poll(h).state is XferState.DONE  # the bytes did land; we only lie late
    assert t.injected == {fate: 1}
    t.close()
    b.close()


def test_submit_errors_and_delays() -> None:
    t, b, s, d = _pair(FaultPlan(submit_error=1.0))
    peer = t.connect(b.metadata())
    with pytest.raises(TransportError, match="injected"):
        t.submit(XferKind.WRITE, s, d, peer)
    t.close()
    t, b, s, d = _pair(FaultPlan(delay=1.0, delay_s=0.05))
    peer = t.connect(b.metadata())
    start = time.monotonic()
    h = t.submit(XferKind.WRITE, s, d, peer)
    got = _wait(t, h)
    assert got.state is XferState.DONE
    assert time.monotonic() - start >= 0.05
    # the end is injected: the inner batch's (earlier) end time is not passed on as its own
    assert got.ended_at is None and t.inner.poll(h).ended_at is not None
    t.close()
    b.close()


def test_plan_validation() -> None:
    with pytest.raises(ConfigError, match="drop"):
        FaultPlan(drop=1.5)
    with pytest.raises(ConfigError, match="delay_s"):
        FaultPlan(delay_s=-1)
    assert FaultPlan(fail=0.1).transport_faults and not FaultPlan(fail=0.1).frame_faults


def test_a_held_frame_is_a_deadline_of_the_faulty_endpoint_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frame held back for reordering bounds the loop's wait (an idle loop would otherwise
    sleep up to MAX_WAIT_MS past its time) and goes out once, when due."""
    sent: list[object] = []
    monkeypatch.setattr(Endpoint, "_send", lambda self, identity, event: sent.append(event))
    plan = FaultPlan(reorder=1.0, reorder_s=0.2)
    with FaultyEndpoint(Participant(PeerId("p"), sim_profile(), incarnation=1), plan=plan) as ep:
        frame = Abort(session_id="s", epoch=1, token=7, outcome=Outcome.ABORTED)
        held_until, own = ep.call(
            lambda: (ep._send(b"peer", frame), ep._held[0][0], ep.participant.next_deadline())[1:]
        )
        assert ep.call(ep._next_deadline) == min(t for t in (held_until, own) if t is not None)
        assert sent == []
        ep.start()
        end = time.monotonic() + 5.0
        while not sent and time.monotonic() < end:
            time.sleep(0.005)
        assert sent == [frame] and ep.call(lambda: ep._held) == []
