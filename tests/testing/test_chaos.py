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
from kvplane.testing.chaos import FaultyEndpoint, FaultyTransport, worker_hooks
from kvplane.testing.faults import FaultPlan, FrameFaults, TransferFaults
from kvplane.testing.session_pair import sim_profile
from kvplane.transports.base import DescriptorList, Poll, XferKind, XferState
from kvplane.transports.local import LocalFabric, LocalTransport


def _pair(
    faults: TransferFaults,
) -> tuple[FaultyTransport, LocalTransport, DescriptorList, DescriptorList]:
    fabric = LocalFabric()
    a, b = LocalTransport(fabric=fabric, agent="a"), LocalTransport(fabric=fabric, agent="b")
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    faulty = FaultyTransport(a, faults)
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
    t, b, s, d = _pair(TransferFaults(**{fate: 1.0}))
    peer = t.connect(b.metadata())
    h = t.submit(XferKind.WRITE, s, d, peer)
    got = _wait(t, h)
    assert got.state is state and "injected" in got.reason
    assert t.inner.poll(h).state is XferState.DONE  # the bytes did land; we only lie late
    assert t.injected == {fate: 1}
    t.close()
    b.close()


def test_submit_errors_and_delays() -> None:
    t, b, s, d = _pair(TransferFaults(submit_error=1.0))
    peer = t.connect(b.metadata())
    with pytest.raises(TransportError, match="injected"):
        t.submit(XferKind.WRITE, s, d, peer)
    t.close()
    t, b, s, d = _pair(TransferFaults(late=1.0, late_s=0.05))
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
    with pytest.raises(
        ConfigError, match=r"TransferFaults\.late_s must be a finite number >= 0, got -1"
    ):
        TransferFaults(late_s=-1)
    with pytest.raises(ConfigError, match="a real endpoint sends events, not bytes"):
        FaultPlan(frames=FrameFaults(corrupt=0.1))
    with pytest.raises(ConfigError, match=r"FaultPlan\.seed must be an int, got True"):
        FaultPlan(seed=True)
    hooks = worker_hooks(FaultPlan(transfers=TransferFaults(fail=0.1)))
    assert hooks.wrap_transport is not None and hooks.make_endpoint is None
    hooks = worker_hooks(FaultPlan(frames=FrameFaults(drop=0.1)))
    assert hooks.wrap_transport is None and hooks.make_endpoint is not None


def test_a_hung_batch_stays_pending_until_cancelled_then_reports_its_truth() -> None:
    t, b, s, d = _pair(TransferFaults(hang=1.0))
    peer = t.connect(b.metadata())
    h = t.submit(XferKind.WRITE, s, d, peer)
    time.sleep(0.05)
    assert t.inner.poll(h).state is XferState.DONE  # the bytes landed
    assert t.poll(h).state is XferState.PENDING and t.injected == {"hang": 1}
    t.cancel(h)
    assert t.poll(h).state is XferState.DONE
    t.close()
    b.close()


def test_a_held_frame_is_a_deadline_of_the_faulty_endpoint_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frame held back for reordering bounds the loop's wait (an idle loop would otherwise
    sleep up to MAX_WAIT_MS past its time) and goes out once, when due."""
    sent: list[object] = []
    monkeypatch.setattr(Endpoint, "_send", lambda self, identity, event: sent.append(event))
    faults = FrameFaults(reorder=1.0, reorder_s=0.2)
    participant = Participant(PeerId("p"), sim_profile(), incarnation=1)
    with FaultyEndpoint(participant, faults=faults) as ep:
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
