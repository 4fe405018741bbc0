"""mooncake adapter specifics (skipped without the engine): sub-batches, notify-only batches."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvplane.ids import PeerId
from kvplane.transports.base import DescriptorList, XferKind, XferState
from kvplane.transports.mooncake import SUB_BATCH, probe

pytestmark = pytest.mark.skipif(probe() is not None, reason=str(probe()))


def test_many_descriptors_span_sub_batches_and_notify_once(kit):
    from kvplane.transports.mooncake import MooncakeTransport

    a, b = MooncakeTransport(agent="mc-a"), MooncakeTransport(agent="mc-b")
    try:
        n = 2 * SUB_BATCH + 7
        src_buf = torch.randint(0, 256, (n * 16,), dtype=torch.uint8)
        dst_buf = torch.zeros(n * 16, dtype=torch.uint8)
        src, dst = a.register(src_buf).region_id, b.register(dst_buf).region_id
        peer = a.connect(b.metadata())
        perm = np.random.default_rng(0).permutation(n)  # scattered: nothing coalesces
        s = DescriptorList(np.full(n, src), np.arange(n) * 16, np.full(n, 16))
        d = DescriptorList(np.full(n, dst), perm * 16, np.full(n, 16))
        h = a.submit(XferKind.WRITE, s, d, peer, notify=b"\x00\xffbinary")
        assert kit.wait(a, h).state is XferState.DONE
        assert torch.equal(dst_buf, kit.reference(src_buf, torch.zeros_like(dst_buf), s, d))
        h = a.submit(XferKind.WRITE, DescriptorList.empty(), DescriptorList.empty(), peer,
                     notify=b"end")  # fmt: skip
        assert kit.wait(a, h).state is XferState.DONE
        notes: list[tuple[PeerId, bytes]] = []
        end = time.monotonic() + 10
        while len(notes) < 2 and time.monotonic() < end:
            notes += b.notifications()
        assert notes == [(PeerId("mc-a"), b"\x00\xffbinary"), (PeerId("mc-a"), b"end")]
        assert a.pinned_regions() == 0 and a.live_batches() == 0
    finally:
        a.close()
        b.close()
    assert not [name for name in kit.kv_threads() if "mc-" in name]


def test_close_destroys_the_engine_even_when_the_transport_is_kept_alive():
    """The engine's destructor holds the GIL while it stops its threads: it must run in
    ``close``, not whenever the garbage collector reaches a transport caught in a cycle."""
    import weakref

    from kvplane.transports.mooncake import MooncakeTransport

    t = MooncakeTransport(agent="mc-close")
    t.register(torch.zeros(4096, dtype=torch.uint8))
    engine = weakref.ref(t._engine)
    cycle = [t]
    cycle.append(cycle)  # type: ignore[arg-type]  # the transport stays reachable
    t.close()
    assert engine() is None  # destroyed by close itself, no collection needed
    assert t.notifications() == []
    t.close()  # idempotent
    assert t.pinned_regions() == 0 and t.live_batches() == 0


def test_a_region_missing_from_the_peer_table_fails_the_batch_not_a_neighbour(kit):
    """The engine addresses are looked up in the peer table the worker holds; a region id not
    in it (a table refreshed between submit's check and the transfer) must fail the batch, not
    take the base of the next region id (where the bytes used to land)."""
    from kvplane.transports.base import FailureKind
    from kvplane.transports.mooncake import MooncakeTransport, _Remote

    a, b = MooncakeTransport(agent="mc-a"), MooncakeTransport(agent="mc-b")
    try:
        gone_buf, kept_buf = (
            torch.zeros(4096, dtype=torch.uint8),
            torch.zeros(4096, dtype=torch.uint8),
        )
        gone, kept = b.register(gone_buf).region_id, b.register(kept_buf).region_id
        src = a.register(torch.full((4096,), 0xAB, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        old = a._remotes[peer.peer_id]
        a._remotes[peer.peer_id] = _Remote(old.session, {kept: old.bases[kept]}, old.mailbox)
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 4096), kit.one(gone, 0, 4096), peer)
        got = kit.wait(a, h)
        assert (got.state, got.failure) == (XferState.FAILED, FailureKind.BACKEND_ERROR)
        assert "no base address" in got.reason
        assert int(kept_buf.sum()) == 0 and int(gone_buf.sum()) == 0
        assert a.pinned_regions() == 0 and a.live_batches() == 0
    finally:
        a.close()
        b.close()
