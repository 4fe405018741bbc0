"""The batch watcher: a tapped transport moves the same bytes and wakes its owner at the end."""

from __future__ import annotations

import threading

import pytest
import torch

from kvplane.pipeline.watcher import BatchWatcher
from kvplane.testing.chaos import FaultyTransport
from kvplane.testing.faults import TransferFaults
from kvplane.transports.base import DescriptorList, XferKind, XferState
from kvplane.transports.local import LocalFabric, LocalTransport


class _WaitOnly:
    """A transport with ``wait`` but no completion hook (the watcher needs its thread)."""

    def __init__(self, inner: LocalTransport) -> None:
        self.inner, self.name = inner, inner.name

    def __getattr__(self, attr: str) -> object:
        if attr == "on_done":
            raise AttributeError(attr)
        return getattr(self.inner, attr)


def _setup() -> tuple[LocalTransport, LocalTransport, torch.Tensor, DescriptorList, DescriptorList]:
    fabric = LocalFabric()
    a, b = LocalTransport(fabric=fabric, agent="a"), LocalTransport(fabric=fabric, agent="b")
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    return (
        a,
        b,
        dst,
        DescriptorList.of([(ra.region_id, 0, 64)]),
        DescriptorList.of([(rb.region_id, 0, 64)]),
    )


@pytest.mark.parametrize("wait_only", [False, True])
def test_a_submitted_batch_wakes_the_owner_once_it_has_landed(wait_only: bool) -> None:
    """Through the transport's completion hook (no thread of the watcher's), or from the
    watcher's thread blocked in ``wait`` when the transport has no hook."""
    a, b, dst, s, d = _setup()
    woken = threading.Event()
    w = BatchWatcher(_WaitOnly(a) if wait_only else a, woken.set)  # type: ignore[arg-type]
    assert w.active and w.threaded is wait_only and w.transport.name == "local"
    w.start()
    try:
        peer = w.transport.connect(b.metadata())
        h = w.transport.submit(XferKind.WRITE, s, d, peer)
        assert woken.wait(5.0)
        assert w.transport.poll(h).state is XferState.DONE
        assert torch.equal(dst, torch.arange(64, dtype=torch.uint8))
        assert a.live_batches() == 0 and a.pinned_regions() == 0
    finally:
        w.close()
        a.close()
        b.close()


def test_the_wake_up_is_a_hint_and_the_wrapped_poll_still_decides() -> None:
    a, b, _, s, d = _setup()
    faulty = FaultyTransport(a, TransferFaults(fail=1.0))
    woken = threading.Event()
    w = BatchWatcher(faulty, woken.set)  # type: ignore[arg-type]
    w.start()
    try:
        peer = w.transport.connect(b.metadata())
        h = w.transport.submit(XferKind.WRITE, s, d, peer)
        assert woken.wait(5.0)
        got = w.transport.poll(h)
        assert got.state is XferState.FAILED and "injected" in got.reason
        assert faulty.injected == {"fail": 1}
    finally:
        w.close()
        a.close()
        b.close()


def test_closing_with_nothing_in_flight_returns_and_tap_close_leaves_the_transport_open() -> None:
    a, b, _, s, d = _setup()
    w = BatchWatcher(a, lambda: None)
    w.start()
    w.transport.close()  # the worker owns the transport, not the tap
    assert not a.closed
    w.close()
    peer = a.connect(b.metadata())
    assert a.wait(a.submit(XferKind.WRITE, s, d, peer), 5.0).state is XferState.DONE
    a.close()
    b.close()
