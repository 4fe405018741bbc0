"""The transport conformance suite, run over every available transport.

``local`` runs in-process (two transports in one fabric); ``shm``, ``tcp``, ``nixl`` and
``mooncake`` run across two real processes (the far side is a :class:`PeerProcess`). Every test
checks bytes against an independent torch gather/scatter reference and ends with integrity
checks (no pins, no live batches, no leaked link threads). Adapters whose engine is not
installed are skipped with the install hint as reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.errors import PlanError, TransportError, UnknownPeerError
from kvplane.ids import PeerId, RegionId
from kvplane.testing.peer_process import PeerProcess, pattern
from kvplane.transports.base import (
    DescriptorList,
    FailureKind,
    Peer,
    Transport,
    XferKind,
    XferState,
)
from kvplane.transports.local import LocalFabric, LocalTransport
from kvplane.transports.registry import CROSS_PROCESS, available, create_transport

NAMES = ["local", "shm", "tcp", "nixl", "mooncake"]
AVAILABLE = available()
SIZE = 1 << 20
PEER_DRIVEN = frozenset({"shm", "tcp", "mooncake"})
"""Transports that cannot finish a write while the peer process is stopped. (NIXL over UCX may
complete it with process_vm_writev, without the peer's help, once the endpoint is wired up.)"""
BIG = 80 << 20  # beyond what loopback socket buffers hold (tcp_rmem max 32 MiB + send buffer)


class InProcessSide:
    """The far side for ``local``: a second LocalTransport in the same fabric (same API as
    PeerProcess, minus signals)."""

    def __init__(self, fabric: LocalFabric) -> None:
        self.t = LocalTransport(fabric=fabric)
        self.buffers: dict[RegionId, torch.Tensor] = {}
        self.handles: dict[int, Any] = {}
        self.peers: dict[PeerId, Peer] = {}

    def alloc(self, nbytes: int, seed: int | None = None) -> RegionId:
        buf = pattern(nbytes, seed) if seed is not None else torch.zeros(nbytes, dtype=torch.uint8)
        region = self.t.register(buf)
        self.buffers[region.region_id] = buf
        return region.region_id

    def metadata(self) -> bytes:
        return self.t.metadata()

    def connect(self, meta: bytes) -> Peer:
        peer = self.t.connect(meta)
        self.peers[peer.peer_id] = peer
        return peer

    def read(self, region: RegionId, offset: int, length: int) -> bytes:
        return self.buffers[region][offset : offset + length].numpy().tobytes()

    def submit(self, kind, src, dst, peer, *, notify=None, deadline_s=30.0) -> int:
        h = self.t.submit(kind, src, dst, self.peers[peer], notify=notify, deadline_s=deadline_s)
        self.handles[h.xfer_id] = h
        return h.xfer_id

    def wait(self, xfer_id: int, timeout_s: float = 30.0) -> Any:
        return self.t.poll(self.handles[xfer_id])

    def notifications(self, timeout_s: float = 0.0) -> list[tuple[PeerId, bytes]]:
        return self.t.notifications()

    def status(self) -> dict[str, int]:
        return {"pinned": self.t.pinned_regions(), "live": self.t.live_batches(), "threads": 0}

    def close(self) -> None:
        self.t.close()


@dataclass
class Pair:
    name: str
    t: Transport
    far: Any
    peer: Peer
    src: torch.Tensor  # ours, seeded
    mine: RegionId
    far_zero: RegionId
    far_seeded: RegionId


def _buffer(t: Transport, nbytes: int) -> torch.Tensor:
    allocate = getattr(t, "allocate", None)
    return allocate(nbytes) if allocate is not None else torch.zeros(nbytes, dtype=torch.uint8)


def _far_bytes(pair: Pair, region: RegionId, n: int = SIZE) -> torch.Tensor:
    return torch.frombuffer(bytearray(pair.far.read(region, 0, n)), dtype=torch.uint8)


def _skip_if_unavailable(name: str) -> None:
    if AVAILABLE[name] is not None:
        pytest.skip(AVAILABLE[name])


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    name = request.param
    _skip_if_unavailable(name)
    fabric = LocalFabric()
    t = LocalTransport(fabric=fabric) if name == "local" else create_transport(name)
    far = InProcessSide(fabric) if name == "local" else PeerProcess(name)
    src = _buffer(t, SIZE)
    src.copy_(pattern(SIZE, 7))
    mine = t.register(src).region_id
    p = Pair(name, t, far, Peer(PeerId("?")), src, mine, far.alloc(SIZE), far.alloc(SIZE, 11))
    p.peer = t.connect(far.metadata())
    far.connect(t.metadata())
    yield p
    assert t.pinned_regions() == 0 and t.live_batches() == 0
    assert far.status()["pinned"] == 0 and far.status()["live"] == 0
    far.close()
    t.close()


@pytest.mark.parametrize("seed, max_desc, max_run", [(0, 1, 300_000), (1, 40, 5000), (2, 700, 700)])
def test_write_random_batches_equal_reference(pair, kit, seed, max_desc, max_run):
    rng = np.random.default_rng(seed)
    s, d = kit.random_batch(rng, pair.mine, SIZE, pair.far_zero, SIZE, max_desc=max_desc,
                            max_run=max_run)  # fmt: skip
    before = _far_bytes(pair, pair.far_zero)
    h = pair.t.submit(XferKind.WRITE, s, d, pair.peer, notify=f"w{seed}".encode())
    got = kit.wait(pair.t, h)
    assert (got.state, got.bytes_done, got.failure) == (XferState.DONE, s.total_bytes, None)
    assert torch.equal(_far_bytes(pair, pair.far_zero), kit.reference(pair.src, before, s, d))
    assert pair.far.notifications(10.0) == [(pair.t.agent, f"w{seed}".encode())]


def test_one_batch_spans_several_peer_regions(pair, kit):
    """One WRITE whose destinations lie in two of the peer's regions (as when a final slice's
    KV and its whole-only records run as one batch) lands each byte in its own region."""
    other = pair.far.alloc(SIZE)
    pair.peer = pair.t.connect(pair.far.metadata())  # refreshes the peer's region table
    rng = np.random.default_rng(9)
    s1, d1 = kit.random_batch(rng, pair.mine, SIZE, pair.far_zero, SIZE, max_desc=60,
                              max_run=9000)  # fmt: skip
    s2, d2 = kit.random_batch(rng, pair.mine, SIZE, other, SIZE, max_desc=60, max_run=9000)
    both = [
        DescriptorList(
            np.concatenate([a.regions, b.regions]),
            np.concatenate([a.offsets, b.offsets]),
            np.concatenate([a.lengths, b.lengths]),
        )
        for a, b in ((s1, s2), (d1, d2))
    ]
    before = _far_bytes(pair, pair.far_zero), _far_bytes(pair, other)
    h = pair.t.submit(XferKind.WRITE, both[0], both[1], pair.peer, notify=b"two")
    got = kit.wait(pair.t, h)
    assert (got.state, got.bytes_done) == (XferState.DONE, s1.total_bytes + s2.total_bytes)
    assert torch.equal(_far_bytes(pair, pair.far_zero), kit.reference(pair.src, before[0], s1, d1))
    assert torch.equal(_far_bytes(pair, other), kit.reference(pair.src, before[1], s2, d2))
    assert pair.far.notifications(10.0) == [(pair.t.agent, b"two")]


@pytest.mark.parametrize("seed", [3, 4])
def test_read_random_batches_equal_reference(pair, kit, seed):
    rng = np.random.default_rng(seed)
    s, d = kit.random_batch(rng, pair.far_seeded, SIZE, pair.mine, SIZE, max_desc=300,
                            max_run=9000)  # fmt: skip
    expected = kit.reference(pattern(SIZE, 11), pair.src.clone(), s, d)
    h = pair.t.submit(XferKind.READ, s, d, pair.peer, notify=b"read")
    got = kit.wait(pair.t, h)
    assert (got.state, got.bytes_done) == (XferState.DONE, s.total_bytes)
    assert torch.equal(pair.src, expected)
    assert pair.far.notifications(10.0) == [(pair.t.agent, b"read")]
    pair.src.copy_(pattern(SIZE, 7))


@pytest.mark.parametrize("kind", [XferKind.WRITE, XferKind.READ])
def test_a_done_batch_has_released_its_pins(pair, kit, kind):
    """Whoever sees DONE may deregister at once: the pins go before the terminal transition.
    Checked at the transition itself (a completion hook runs on the thread that makes it, so a
    transport that ends first and unpins after is caught every time), then by deregistering
    right after ``poll`` says DONE, many times."""
    far = pair.far_zero if kind is XferKind.WRITE else pair.far_seeded
    for i in range(60):
        region = pair.t.register(torch.full((4096,), i, dtype=torch.uint8)).region_id
        mine, theirs = kit.one(region, 0, 4096), kit.one(far, 4096 * (i % 8), 4096)
        pins_at_done: list[int] = []
        h = pair.t.submit(kind, *((mine, theirs) if kind is XferKind.WRITE else (theirs, mine)),
                          pair.peer)  # fmt: skip
        pair.t.on_done(h, lambda seen=pins_at_done: seen.append(pair.t.pinned_regions()))
        while (got := pair.t.poll(h)).state is XferState.PENDING:
            pass
        assert got.state is XferState.DONE
        pair.t.deregister(region)  # not "in use by 1 in-flight batch"
        assert pins_at_done in ([0], [])  # [] only if it ended before on_done was registered
    _settle_far(pair.far)


def test_notify_arrives_only_after_the_bytes(pair, kit):
    """The far side writes into our region; the moment its notify shows, every byte is here."""
    rng = np.random.default_rng(5)
    target = _buffer(pair.t, SIZE)
    region = pair.t.register(target).region_id
    far_peer = pair.far.connect(pair.t.metadata())
    for i in range(3):
        s, d = kit.random_batch(rng, pair.far_seeded, SIZE, region, SIZE, max_desc=400,
                                max_run=4096)  # fmt: skip
        expected = kit.reference(pattern(SIZE, 11), target.clone(), s, d)
        xid = pair.far.submit(XferKind.WRITE, s, d, far_peer.peer_id, notify=bytes([i]))
        end = time.monotonic() + 20
        notes: list[tuple[PeerId, bytes]] = []
        while not notes and time.monotonic() < end:
            notes = pair.t.notifications()
            if not notes:
                pair.far.wait(xid, 0.0)  # engines such as NIXL progress when polled
        assert notes == [(pair.peer.peer_id, bytes([i]))]
        assert torch.equal(target, expected)
    pair.t.deregister(region)


def test_bad_input_is_refused_before_any_byte_moves(pair, kit):
    before = _far_bytes(pair, pair.far_zero)
    one = kit.one
    cases = [
        (PlanError, one(pair.mine, 0, 16), one(pair.far_zero, SIZE - 8, 16)),  # past the end
        (PlanError, one(pair.mine, 0, 16), one(999, 0, 16)),  # unknown peer region
        (PlanError, one(pair.mine, SIZE, 1), one(pair.far_zero, 0, 1)),  # past our region
        (PlanError, one(pair.mine, 0, 16), one(pair.far_zero, 0, 8)),  # length mismatch
        (PlanError, DescriptorList.of([(pair.mine, 0, 8), (pair.mine, 8, 8)]),
         DescriptorList.of([(pair.far_zero, 0, 8), (pair.far_zero, 4, 8)])),  # dst written twice
    ]  # fmt: skip
    for error, s, d in cases:
        with pytest.raises(error):
            pair.t.submit(XferKind.WRITE, s, d, pair.peer)
    with pytest.raises(UnknownPeerError):
        pair.t.submit(XferKind.WRITE, one(pair.mine, 0, 1), one(pair.far_zero, 0, 1),
                      Peer(PeerId("stranger")))  # fmt: skip
    with pytest.raises(TransportError, match="overlaps region"):
        pair.t.register(pair.src[100:200])
    assert torch.equal(_far_bytes(pair, pair.far_zero), before)
    assert pair.t.pinned_regions() == 0 and pair.t.live_batches() == 0


def _stalled_write(pair: Pair, kit, deadline_s: float) -> tuple[Any, RegionId, RegionId]:
    """Stop the far process and submit a write bigger than the socket buffers."""
    far_big = pair.far.alloc(BIG)
    pair.peer = pair.t.connect(pair.far.metadata())
    big = _buffer(pair.t, BIG)
    mine = pair.t.register(big).region_id
    pair.far.stop()
    h = pair.t.submit(XferKind.WRITE, kit.one(mine, 0, BIG), kit.one(far_big, 0, BIG), pair.peer,
                      deadline_s=deadline_s)  # fmt: skip
    time.sleep(0.2)
    return h, mine, far_big


def _settle_far(far: Any, timeout_s: float = 20.0) -> None:
    """Wait until the far process holds no pin and no live batch: after a stall it ends the
    batches of a torn-down or finished stream on its own threads, a moment after ours end."""
    end = time.monotonic() + timeout_s
    while any(far.status()[k] for k in ("pinned", "live")) and time.monotonic() < end:
        time.sleep(0.01)
    assert far.status()["pinned"] == 0 and far.status()["live"] == 0


def test_deregister_in_flight_refused_then_completes(pair, kit):
    if pair.name not in CROSS_PROCESS:
        pytest.skip("local copies synchronously: nothing stays in flight")
    h, mine, far_big = _stalled_write(pair, kit, 60.0)
    try:
        state = pair.t.poll(h).state
        if pair.name in PEER_DRIVEN or state is not XferState.DONE:
            assert state is XferState.PENDING
            with pytest.raises(TransportError, match="in use by 1 in-flight"):
                pair.t.deregister(mine)
    finally:
        pair.far.cont()
    assert kit.wait(pair.t, h).state is XferState.DONE
    kit.settle(pair.t)
    _settle_far(pair.far)
    pair.t.deregister(mine)
    pair.far.deregister(far_big)


def test_deadline_and_cancel_end_stalled_batches(pair, kit):
    if pair.name not in CROSS_PROCESS:
        pytest.skip("local copies synchronously: nothing stays in flight")
    h, mine, far_big = _stalled_write(pair, kit, 0.5)
    try:
        h2 = pair.t.submit(XferKind.WRITE, kit.one(mine, 0, BIG), kit.one(far_big, 0, BIG),
                           pair.peer)  # fmt: skip  # stalls too (or queues behind the first)
        pair.t.cancel(h2)
        got = pair.t.poll(h2)
        if pair.name in PEER_DRIVEN or got.state is not XferState.DONE:
            # FAILED only if it never started (queued behind h), else its bytes are in doubt
            assert got.state in (XferState.FAILED, XferState.IN_DOUBT)
            assert got.failure is FailureKind.CANCELLED
        start = time.monotonic()
        got = kit.wait(pair.t, h, 10.0)
        if pair.name in PEER_DRIVEN or got.state is not XferState.DONE:
            # started, and its bytes may still land once the far process runs again
            assert got.state is XferState.IN_DOUBT and got.failure is FailureKind.TIMEOUT
        assert time.monotonic() - start < 5.0
    finally:
        pair.far.cont()
    kit.settle(pair.t)
    pair.peer = pair.t.connect(pair.far.metadata())  # tcp tore the stalled stream down
    h3 = pair.t.submit(XferKind.WRITE, kit.one(mine, 0, 64), kit.one(far_big, 0, 64), pair.peer)
    assert kit.wait(pair.t, h3).state is XferState.DONE
    kit.settle(pair.t)
    _settle_far(pair.far)
    pair.t.deregister(mine)
    pair.far.deregister(far_big)


@pytest.mark.parametrize("name", [n for n in NAMES if n in CROSS_PROCESS])
def test_peer_killed_mid_transfer_fails_within_deadline(name, kit):
    _skip_if_unavailable(name)
    t = create_transport(name)
    far = PeerProcess(name)
    try:
        far_big = far.alloc(BIG)
        peer = t.connect(far.metadata())
        big = _buffer(t, BIG)
        mine = t.register(big).region_id
        far.stop()
        h = t.submit(XferKind.WRITE, kit.one(mine, 0, BIG), kit.one(far_big, 0, BIG), peer,
                     deadline_s=10.0)  # fmt: skip
        time.sleep(0.2)
        if name in PEER_DRIVEN:
            assert t.poll(h).state is XferState.PENDING
        start = time.monotonic()
        far.kill()
        got = kit.wait(t, h, 15.0)
        if name in PEER_DRIVEN or got.state is not XferState.DONE:
            assert got.state is XferState.FAILED
            assert got.failure in (FailureKind.REMOTE_DISCONNECT, FailureKind.TIMEOUT)
        after = t.submit(XferKind.WRITE, kit.one(mine, 0, 4096), kit.one(far_big, 0, 4096), peer,
                         deadline_s=5.0)  # fmt: skip  # dead peer: a typed failure, no hang
        got = kit.wait(t, after, 15.0)
        assert got.state is XferState.FAILED
        assert got.failure in (FailureKind.REMOTE_DISCONNECT, FailureKind.TIMEOUT)
        assert time.monotonic() - start < 10.0
        kit.settle(t)
        t.deregister(mine)
        # the link's threads exit on their own after the EOF; give them a bounded moment
        end = time.monotonic() + 5.0
        while [n for n in kit.kv_threads() if f"->{peer.peer_id}" in n] and time.monotonic() < end:
            time.sleep(0.01)
        assert not [n for n in kit.kv_threads() if f"->{peer.peer_id}" in n]
    finally:
        far.close()
        t.close()
    assert not [n for n in kit.kv_threads() if t.agent in n]
