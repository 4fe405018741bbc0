"""local: same-process copies (loopback and fabric), reference equality, bad input refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.errors import (
    IncompatiblePeerError,
    InvalidArgumentError,
    PlanError,
    TransportError,
    UnknownPeerError,
)
from kvplane.ids import PeerId
from kvplane.metrics import MetricsRegistry
from kvplane.transports.base import DescriptorList, Peer, Poll, Transport, XferKind, XferState
from kvplane.transports.local import LocalFabric, LocalTransport


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_is_a_transport_and_loopback_write_read(kit):
    t = LocalTransport(agent="solo")
    assert isinstance(t, Transport)
    a, b = _bytes(8192, 1), torch.zeros(8192, dtype=torch.uint8)
    ra, rb = t.register(a), t.register(b)
    peer = t.connect(t.metadata())
    assert peer == Peer(PeerId("solo"), {ra.region_id: 8192, rb.region_id: 8192})
    rng = np.random.default_rng(0)
    for kind in (XferKind.WRITE, XferKind.READ):
        s, d = kit.random_batch(
            rng, ra.region_id, 8192, rb.region_id, 8192, max_desc=200, max_run=40
        )
        expected = kit.reference(a, b, s, d)
        h = t.submit(kind, s, d, peer, notify=kind.value.encode())
        assert t.poll(h) == Poll(XferState.DONE, s.total_bytes, None, "")
        assert torch.equal(b, expected)
        assert t.notifications() == [(PeerId("solo"), kind.value.encode())]
    assert t.pinned_regions() == 0 and t.live_batches() == 0
    t.close()


def test_fabric_connects_two_transports_and_notifies_the_target():
    fabric = LocalFabric()
    metrics = MetricsRegistry()
    a = LocalTransport(fabric=fabric, agent="a", metrics=metrics)
    b = LocalTransport(fabric=fabric, agent="b")
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16, dtype=torch.float32)
    rs, rd = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())
    h = a.submit(XferKind.WRITE, kit_one(rs.region_id, 8, 16), kit_one(rd.region_id, 0, 16), peer,
                 notify=b"")  # fmt: skip
    assert a.poll(h).state is XferState.DONE
    assert dst[:4].tolist() == [2.0, 3.0, 4.0, 5.0] and dst[4:].sum() == 0
    assert b.notifications() == [(PeerId("a"), b"")] and a.notifications() == []
    assert metrics.value("transport_bytes", {"transport": "local", "kind": "write"}, "_total") == 16
    b.close()
    h = a.submit(XferKind.WRITE, kit_one(rs.region_id, 0, 4), kit_one(rd.region_id, 0, 4), peer)
    got = a.poll(h)
    assert got.state is XferState.FAILED and got.failure.value == "remote_disconnect"
    with pytest.raises(TransportError, match="no open local transport 'b'"):
        a.connect(_meta_of("b"))  # b closed: it left the fabric
    assert a.pinned_regions() == 0 and a.live_batches() == 0
    a.close()


def kit_one(region, offset, length) -> DescriptorList:
    return DescriptorList.of([(int(region), offset, length)])


def _meta_of(agent: str) -> bytes:
    from kvplane.transports.wire import WIRE_VERSION, Metadata, encode

    return encode(Metadata(WIRE_VERSION, "local", agent))


def test_bad_input_is_refused_before_any_byte_moves():
    t = LocalTransport(agent="x")
    a, b = _bytes(100, 1), torch.zeros(100, dtype=torch.uint8)
    ra, rb = t.register(a), t.register(b)
    peer = t.connect(t.metadata())
    one = kit_one
    A, B = int(ra.region_id), int(rb.region_id)
    cases = [
        (PlanError, "runs past the region end 100", one(A, 90, 20), one(B, 0, 20)),
        (PlanError, "unknown region", one(99, 0, 4), one(B, 0, 4)),
        (PlanError, "source length 4 != destination length 5", one(A, 0, 4), one(B, 0, 5)),
        (PlanError, "1 source descriptors but 2", one(A, 0, 4),
         DescriptorList.of([(B, 0, 2), (B, 2, 2)])),
        (PlanError, "overlap", DescriptorList.of([(A, 0, 4), (A, 4, 4)]),
         DescriptorList.of([(B, 0, 4), (B, 2, 4)])),
        (PlanError, "overlaps a source", one(A, 0, 8), one(A, 4, 8)),
    ]  # fmt: skip
    for error, message, s, d in cases:
        with pytest.raises(error, match=message):
            t.submit(XferKind.WRITE, s, d, peer)
    s, d = one(ra.region_id, 0, 4), one(rb.region_id, 0, 4)
    with pytest.raises(UnknownPeerError, match="peer 'nobody' is not connected"):
        t.submit(XferKind.WRITE, s, d, Peer(PeerId("nobody")))
    with pytest.raises(InvalidArgumentError, match="kind must be an XferKind"):
        t.submit("write", s, d, peer)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="deadline_s must be a finite number > 0"):
        t.submit(XferKind.WRITE, s, d, peer, deadline_s=0)
    with pytest.raises(InvalidArgumentError, match="notify must be None or bytes"):
        t.submit(XferKind.WRITE, s, d, peer, notify="text")  # type: ignore[arg-type]
    with pytest.raises(TransportError, match="overlaps region"):
        t.register(a[50:])
    with pytest.raises(InvalidArgumentError) as caught:
        t.deregister(ra)  # type: ignore[arg-type]
    assert str(caught.value) == f"region_id must be an int in [0, 2**63), got {ra!r}"
    with pytest.raises(IncompatiblePeerError, match="for transport 'tcp', not 'local'"):
        t.connect(_tcp_meta())
    assert torch.count_nonzero(b) == 0
    assert t.pinned_regions() == 0 and t.live_batches() == 0 and len(t.regions()) == 2
    t.close()
    with pytest.raises(TransportError, match="is closed"):
        t.register(torch.zeros(4))


def _tcp_meta() -> bytes:
    from kvplane.transports.wire import WIRE_VERSION, Metadata, encode

    return encode(Metadata(WIRE_VERSION, "tcp", "elsewhere", "127.0.0.1:1"))


def test_typed_tensors_and_empty_batch_with_notify():
    t = LocalTransport(agent="typed")
    src = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    dst = torch.zeros(3, 4, dtype=torch.bfloat16)
    rs, rd = t.register(src), t.register(dst)
    peer = t.connect(t.metadata())
    h = t.submit(XferKind.WRITE, kit_one(rs.region_id, 8, 8), kit_one(rd.region_id, 16, 8), peer)
    assert t.poll(h).state is XferState.DONE
    assert dst[2].tolist() == [4.0, 5.0, 6.0, 7.0] and dst[:2].sum() == 0
    h = t.submit(
        XferKind.WRITE, DescriptorList.empty(), DescriptorList.empty(), peer, notify=b"end"
    )
    assert t.poll(h) == Poll(XferState.DONE, 0, None, "")
    assert t.notifications() == [(PeerId("typed"), b"end")]
    t.deregister(rs.region_id)
    with pytest.raises(TransportError, match="is not registered"):
        t.deregister(rs.region_id)
    t.close()
    t.close()  # idempotent


def test_a_copy_that_fails_part_way_ends_in_doubt_not_failed(kit, monkeypatch):
    """An engine error raised after bytes began to move (here: a copy part failing, as when
    close() stops the copy helpers mid-batch) must not say FAILED, which lets the caller reuse
    the destination as if nothing had landed."""
    from kvplane.transports import local as local_module
    from kvplane.transports.base import FailureKind

    def half_copy(src_views, dst_views, src, dst, *args, **kwargs):
        next(iter(dst_views.values()))[:8] = 1  # some bytes landed
        raise RuntimeError("cannot schedule new futures after shutdown")

    monkeypatch.setattr(local_module, "copy_pairs", half_copy)
    fabric = LocalFabric()
    a, b = LocalTransport(fabric=fabric), LocalTransport(fabric=fabric)
    try:
        src = a.register(torch.ones(64, dtype=torch.uint8)).region_id
        dst = b.register(torch.zeros(64, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        got = a.poll(a.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(dst, 0, 64), peer))
        assert got.state is XferState.IN_DOUBT and got.failure is FailureKind.BACKEND_ERROR
        assert a.pinned_regions() == 0 and b.pinned_regions() == 0 and a.live_batches() == 0
    finally:
        a.close()
        b.close()
