"""shm specifics: exported vs local-only regions, memfd segments, same-host check, validation."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import socket
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from kvplane.errors import (
    IncompatiblePeerError,
    InvalidArgumentError,
    MalformedMessageError,
    PlanError,
    TransportError,
)
from kvplane.transports import shm as shm_module
from kvplane.transports.base import FailureKind, XferKind, XferState
from kvplane.transports.shm import ShmTransport, host_id
from kvplane.transports.wire import WIRE_VERSION, FrameType, Metadata, decode_metadata, encode


def test_only_memory_from_allocate_is_exported(kit):
    a, b = ShmTransport(agent="a"), ShmTransport(agent="b")
    try:
        private = b.register(torch.zeros(256, dtype=torch.uint8)).region_id
        pool = b.allocate(1024)
        shared = b.register(pool[512:]).region_id  # a view inside a segment is exported too
        meta = decode_metadata(b.metadata(), "shm")
        assert [(r.region_id, r.length, r.segment_offset) for r in meta.regions] == [
            (shared, 512, 512)
        ]
        assert meta.host == host_id()
        src = a.register(torch.arange(256, dtype=torch.uint8)).region_id  # local-only is fine here
        peer = a.connect(b.metadata())
        assert peer.regions == {shared: 512}
        with pytest.raises(PlanError, match="unknown region"):
            a.submit(XferKind.WRITE, kit.one(src, 0, 8), kit.one(private, 0, 8), peer)
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 256), kit.one(shared, 256, 256), peer)
        assert kit.wait(a, h).state is XferState.DONE
        assert torch.equal(pool[768:], torch.arange(256, dtype=torch.uint8))
        assert int(pool[:768].sum()) == 0
    finally:
        a.close()
        b.close()
    assert kit.kv_threads() == []


def test_segments_are_anonymous_and_released(kit):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    t = ShmTransport(agent="anon")
    buf = t.allocate(4096)
    assert buf.dtype == torch.uint8 and buf.numel() == 4096 and int(buf.sum()) == 0
    region = t.register(buf.view(torch.float32))
    assert region.length == 4096
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before  # memfd segments have no file-system name
    t.close()
    with pytest.raises(TransportError, match="is closed"):
        t.allocate(16)


@pytest.mark.parametrize("advice", [shm_module.MADV_POPULATE_WRITE, 9999])
def test_mapping_a_segment_in_use_keeps_its_bytes_and_shares_writes(monkeypatch, advice):
    """Filling the page tables writable must not write a byte (the owner and other peers may be
    using the memory); an advice the kernel refuses (9999) falls back to ``MAP_POPULATE``."""
    monkeypatch.setattr(shm_module, "MADV_POPULATE_WRITE", advice)
    fd = os.memfd_create("kvplane-test-map")
    try:
        os.ftruncate(fd, 3 * 4096 + 100)
        owner = torch.frombuffer(shm_module._map(fd, 3 * 4096 + 100), dtype=torch.uint8)
        pattern = torch.arange(owner.numel(), dtype=torch.int64).remainder(251).to(torch.uint8)
        owner.copy_(pattern)
        peer = torch.frombuffer(shm_module._map(fd, 3 * 4096 + 100), dtype=torch.uint8)
        assert torch.equal(peer, pattern) and torch.equal(owner, pattern)
        peer[4096:8192].fill_(7)
        assert int(owner[4096:8192].min()) == int(owner[4096:8192].max()) == 7
        assert torch.equal(owner[:4096], pattern[:4096])
    finally:
        os.close(fd)


def test_refusals():
    t = ShmTransport(agent="r")
    try:
        bad = r"nbytes must be a byte count in \[1, 2\*\*62\], got 0"
        with pytest.raises(InvalidArgumentError, match=bad):
            t.allocate(0)
        other_host = encode(Metadata(WIRE_VERSION, "shm", "far", "kvplane-shm-x", "another-boot"))
        with pytest.raises(IncompatiblePeerError, match="runs on another host"):
            t.connect(other_host)
        gone = encode(Metadata(WIRE_VERSION, "shm", "gone", "kvplane-shm-nobody", host_id()))
        with pytest.raises(TransportError, match="cannot reach shm peer 'gone'"):
            t.connect(gone)
    finally:
        t.close()


def test_batches_cancelled_while_queued_on_a_link_leave_no_pin_and_the_rest_land(kit):
    """Eight 4 MiB batches queued on one link; cancelling the last three while they wait ends
    them with no pin left on the target, and every other batch lands its exact bytes."""
    a, b = ShmTransport(agent="a"), ShmTransport(agent="b")
    size, n = 4 << 20, 8
    try:
        pool = b.allocate(n * size)
        dst = b.register(pool).region_id
        data = torch.randint(
            0, 256, (n * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
        )
        src = a.register(data).region_id
        peer = a.connect(b.metadata())
        handles = [
            a.submit(
                XferKind.WRITE, kit.one(src, i * size, size), kit.one(dst, i * size, size), peer
            )
            for i in range(n)
        ]
        for h in handles[5:]:
            a.cancel(h)
        states = [kit.wait(a, h).state for h in handles]
        assert states[:5] == [XferState.DONE] * 5
        assert all(s in (XferState.DONE, XferState.FAILED) for s in states[5:])
        for i, s in enumerate(states):
            if s is XferState.DONE:
                assert torch.equal(pool[i * size : (i + 1) * size], data[i * size : (i + 1) * size])
        end = time.monotonic() + 10.0
        while (b.pinned_regions() or a.live_batches()) and time.monotonic() < end:
            time.sleep(0.01)
        assert b.pinned_regions() == 0 and a.live_batches() == 0
        b.deregister(dst)  # nothing holds the region any more
    finally:
        a.close()
        b.close()
    assert kit.kv_threads() == []


def test_the_sender_pins_queued_batches_ahead_of_running_them(kit, monkeypatch):
    """While one batch copies, the PINs of the batches queued behind it are already granted:
    batch B's copy sees C's and D's regions pinned on the target, which without pins ahead
    happens only after B's COMMIT. D, cancelled while pinned ahead, ends FAILED with no byte
    moved and its pin released; the others land their exact bytes; no pin is left."""
    a, b = ShmTransport(agent="a"), ShmTransport(agent="b")
    size, n = 1 << 16, 4
    pinned: list[int] = []
    copies: list[bool] = []
    copying, go, ahead, resume = (threading.Event() for _ in range(4))
    real_pin, real_copy = b._regions.pin, shm_module.copy_pairs

    def logged_pin(ids, *, exported_only=False):
        got = real_pin(ids, exported_only=exported_only)
        pinned.extend(int(i) for i in ids)
        return got

    def gated_copy(*args, **kwargs):
        if not copies:  # A: hold the sender until B, C and D are queued behind it
            copying.set()
            copies.append(go.wait(5.0))
        elif len(copies) == 1:  # B: are C and D pinned before B has even copied?
            end = time.monotonic() + 5.0
            while not set(regions[2:]) <= set(pinned) and time.monotonic() < end:
                time.sleep(0.001)
            copies.append(set(regions[2:]) <= set(pinned))
            ahead.set()
            resume.wait(5.0)
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(b._regions, "pin", logged_pin)
    monkeypatch.setattr(shm_module, "copy_pairs", gated_copy)
    try:
        pools = [b.allocate(size) for _ in range(n)]
        regions = [b.register(p).region_id for p in pools]
        data = torch.randint(0, 256, (n * size,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(5))  # fmt: skip
        src = a.register(data).region_id
        peer = a.connect(b.metadata())
        submit = [
            lambda i=i: a.submit(
                XferKind.WRITE, kit.one(src, i * size, size), kit.one(regions[i], 0, size), peer
            )
            for i in range(n)
        ]
        handles = [submit[0]()]
        assert copying.wait(5.0)  # A is copying, its gate closed
        handles += [s() for s in submit[1:]]
        go.set()
        assert ahead.wait(5.0)
        a.cancel(handles[3])  # D: pinned ahead, not begun
        resume.set()
        polls = [kit.wait(a, h) for h in handles]
        assert [p.state for p in polls] == [XferState.DONE] * 3 + [XferState.FAILED]
        assert copies == [True, True]
        assert pinned == [int(r) for r in regions]  # each pinned once
        for i, pool in enumerate(pools[:3]):
            assert torch.equal(pool, data[i * size : (i + 1) * size])
        assert int(pools[3].sum()) == 0  # nothing of D moved
        end = time.monotonic() + 10.0
        while (b.pinned_regions() or a.live_batches()) and time.monotonic() < end:
            time.sleep(0.01)
        assert b.pinned_regions() == 0 and a.live_batches() == 0  # D's pin went with its ABORT
    finally:
        a.close()
        b.close()
    assert kit.kv_threads() == []


def test_closing_mid_copy_keeps_the_targets_pin_until_the_copy_has_ended(kit, monkeypatch):
    """The target drops a connection's pins at EOF; our close must not shut the socket while
    our sender still copies into the target's memory (before: the target saw EOF at once, its
    owner deregistered the region and the copy went on writing into it)."""
    real_copy, copying, go, ended = shm_module.copy_pairs, threading.Event(), threading.Event(), []

    def gated_copy(*args, **kwargs):
        copying.set()
        assert go.wait(20)
        real_copy(*args, **kwargs)
        ended.append(time.monotonic())

    monkeypatch.setattr(shm_module, "copy_pairs", gated_copy)
    a, b = ShmTransport(agent="a"), ShmTransport(agent="b")
    try:
        pool = b.allocate(1 << 20)
        dst = b.register(pool).region_id
        src = a.register(torch.full((1 << 20,), 0xAB, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 1 << 20), kit.one(dst, 0, 1 << 20), peer)
        assert copying.wait(10)
        closer = threading.Thread(target=a.close)
        closer.start()
        time.sleep(0.2)  # a close that does not wait would have shut the socket by now
        assert b.pinned_regions() == 1 and not ended  # still pinned while the copy runs
        go.set()
        closer.join(20)
        end = time.monotonic() + 10
        while b.pinned_regions() and time.monotonic() < end:
            time.sleep(1e-3)
        unpinned = time.monotonic()
        assert ended and ended[0] <= unpinned and b.pinned_regions() == 0
        got = a.poll(h)  # close ends it, not the link: started, so in doubt, LOCAL_ERROR
        assert (got.state, got.failure) == (XferState.IN_DOUBT, FailureKind.LOCAL_ERROR)
        b.deregister(dst)
    finally:
        go.set()
        a.close()
        b.close()


def test_a_done_batch_has_released_its_pins(kit, monkeypatch):
    """The initiator unpins before its COMMIT, so the ACK cannot end the batch DONE while a
    pin is still held (a deregister right after DONE was spuriously refused 17 in 3,000; a
    slow unpin here makes the old order fail every time)."""
    a, b = ShmTransport(agent="a"), ShmTransport(agent="b")
    quiesce = a._batches.quiesce

    def slow_quiesce(batch):
        time.sleep(0.02)
        quiesce(batch)

    monkeypatch.setattr(a._batches, "quiesce", slow_quiesce)
    try:
        dst = b.register(b.allocate(4096)).region_id
        src = a.register(torch.ones(4096, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        seen: list[int] = []
        for _ in range(5):
            h = a.submit(XferKind.WRITE, kit.one(src, 0, 4096), kit.one(dst, 0, 4096), peer)
            a.on_done(h, lambda: seen.append(a.pinned_regions()))
            assert kit.wait(a, h).state is XferState.DONE
        assert seen == [0] * 5
    finally:
        a.close()
        b.close()


def test_memory_from_allocate_stays_mapped_after_close():
    """close() must not unmap a segment a caller's tensor still uses (torch keeps the mmap
    object, not a buffer export, so mmap.close() succeeded and the tensor dangled: SIGSEGV)."""
    import subprocess
    import sys

    code = (
        "from kvplane.transports.shm import ShmTransport\n"
        "t = ShmTransport(agent='u'); x = t.allocate(1 << 20); x[:] = 7; t.close()\n"
        "x[5] = 9; print(int(x.sum()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout.strip()) == (0, str(7 * ((1 << 20) - 1) + 9))


def test_a_region_registered_while_a_peer_connects_comes_with_its_segment(kit, monkeypatch):
    """The WELCOME lists regions before it snapshots segments (segments only grow), so a
    region registered in between never names a segment whose fd it does not carry (before:
    the connect failed after installing a link with no views, whose next job died)."""
    b = ShmTransport(agent="b")
    a = ShmTransport(agent="a")
    real = ShmTransport._region_infos
    grown: list[int] = []

    def grow_then_region_infos(self):
        if self is b and threading.current_thread().name.endswith("-serve") and not grown:
            grown.append(int(b.register(b.allocate(4096)).region_id))  # mid-WELCOME
        return real(self)

    monkeypatch.setattr(ShmTransport, "_region_infos", grow_then_region_infos)
    try:
        first = b.register(b.allocate(4096)).region_id
        peer = a.connect(b.metadata())
        assert grown and first in a._links[peer.peer_id].views
        src = a.register(torch.ones(64, dtype=torch.uint8)).region_id
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(first, 0, 64), peer)
        assert kit.wait(a, h).state is XferState.DONE
    finally:
        a.close()
        b.close()


def test_segments_are_sealed_so_no_one_can_shrink_them():
    t = ShmTransport(agent="sealed")
    try:
        t.allocate(8192)
        fd = t._segments[1].fd
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        assert seals & fcntl.F_SEAL_SEAL  # and the seals cannot be taken off
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # what a faulty peer would do to make our copies SIGBUS
    finally:
        t.close()


@pytest.mark.parametrize("fault", ["unsealed", "short"])
def test_a_welcome_segment_that_could_fault_our_copies_is_refused(fault):
    a, b = ShmTransport(agent="a"), ShmTransport(agent="b")
    try:
        b.register(b.allocate(1 << 16))
        seg = b._segments[1]
        if fault == "unsealed":  # a peer that did not seal: it could truncate it at any time
            bad = os.memfd_create("unsealed", os.MFD_CLOEXEC)
            os.ftruncate(bad, 1 << 16)
        else:  # sealed, but smaller than the WELCOME says
            bad = os.memfd_create("short", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(bad, 4096)
            fcntl.fcntl(bad, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        os.close(seg.fd)
        b._segments[1] = shm_module._Segment(bad, seg.mapping, seg.tensor)
        with pytest.raises(MalformedMessageError, match="WELCOME segment"):
            a.connect(b.metadata())
        assert a.live_batches() == 0 and a._links == {}
    finally:
        a.close()
        b.close()


def test_a_second_pin_for_one_transfer_is_malformed_and_leaks_nothing():
    """A PIN repeated for one transfer id used to overwrite the first, whose pin then outlived
    COMMIT and even EOF, so the region could never be deregistered."""
    from kvplane.transports.channel import Channel
    from kvplane.transports.handshake import client_handshake
    from kvplane.transports.wire import pack_header

    t = ShmTransport(agent="target")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        region = t.register(t.allocate(4096)).region_id
        sock.connect("\0" + t.address)
        ch = Channel(sock)
        _, _, fds = client_handshake(ch, "buggy", "shm", None, with_fds=True)
        for fd in fds:
            os.close(fd)
        ids = np.array([int(region)], dtype="<i8").tobytes()
        for _ in range(2):
            ch.send(pack_header(FrameType.PIN, 1, 8, 1) + ids)
        with contextlib.suppress(OSError):  # the target may have dropped us already
            ch.send_frame(FrameType.COMMIT, 1)
        end = time.monotonic() + 5
        while time.monotonic() < end and (t.pinned_regions() or not _closed_by_peer(sock)):
            time.sleep(0.01)
        assert t.pinned_regions() == 0
        t.deregister(region)
    finally:
        sock.close()
        t.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer has closed ``sock`` (replies already sent are skipped)."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:  # closed with our frames unread
        return True
    finally:
        sock.setblocking(True)


def test_a_pin_refused_without_a_reason_is_still_refused(kit):
    """PINNED with FLAG_ERROR and an empty body is a refusal: the batch must not copy and end
    DONE as if the target held the pin."""
    a, b = ShmTransport(agent="a"), ShmTransport(agent="b")
    try:
        pool = b.allocate(4096)
        dst = b.register(pool).region_id
        src = a.register(torch.ones(4096, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())

        def refuse(ids, *, exported_only=False):
            raise TransportError("")

        b._regions.pin = refuse  # the target answers PIN with an error and no reason
        got = kit.wait(a, a.submit(XferKind.WRITE, kit.one(src, 0, 4096), kit.one(dst, 0, 4096),
                                   peer))  # fmt: skip
        assert (got.state, got.failure) == (XferState.FAILED, FailureKind.BACKEND_ERROR)
        assert "no reason given" in got.reason and int(pool.sum()) == 0
    finally:
        a.close()
        b.close()


def test_a_dead_peers_segments_are_unmapped_without_reconnecting_or_closing(kit):
    """Peers restart under new agent names, so nothing reconnects the dead one's link: its
    segments (here 16 MiB) must be unmapped once its control socket reports EOF."""
    a, b = ShmTransport(agent="a"), ShmTransport(agent="b-dies")
    try:
        b.register(b.allocate(16 << 20))
        a.connect(b.metadata())
        state = a._links[b.agent]
        assert isinstance(state, shm_module._ShmLink)
        mapped = [weakref.ref(m) for m in state.mappings.values()]
        assert mapped
        del state
        b.close()  # the peer's end of the control socket closes, as when it is killed
        end = time.monotonic() + 10

        def gone() -> bool:
            gc.collect()
            return (
                b.agent not in a._links
                and all(r() is None for r in mapped)
                and not [n for n in kit.kv_threads() if "->b-dies" in n]  # link threads ended
            )

        while not gone() and time.monotonic() < end:
            time.sleep(0.01)
        assert b.agent not in a._links and all(r() is None for r in mapped)
        assert not [n for n in kit.kv_threads() if "->b-dies" in n]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("holding", [True, False])
def test_a_peer_silent_while_it_holds_pins_is_dropped_by_the_stall_bound(holding: bool) -> None:
    """Before, a PIN disarmed every bound: a peer that pinned a region and went silent (hung,
    or hostile) kept the pin, the region undeletable and a thread for ever. Now a target
    holding pins drops a peer silent for ``target_stall_s`` (0.6 s here; by 1.2 of it after
    its last byte), releases the pins and counts a ``stall``; a peer holding nothing stays
    under the idle bound (10 s here), so is still connected then."""
    from kvplane.transports.bounds import ConnectionLimits
    from kvplane.transports.channel import Channel
    from kvplane.transports.handshake import client_handshake
    from kvplane.transports.wire import pack_header

    stall = 0.6
    t = ShmTransport(agent="target", target_stall_s=stall,
                     limits=ConnectionLimits(idle_timeout_s=10.0))  # fmt: skip
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        region = t.register(t.allocate(4096)).region_id
        sock.connect("\0" + t.address)
        ch = Channel(sock)
        _, _, fds = client_handshake(ch, "hangs", "shm", None, with_fds=True)
        for fd in fds:
            os.close(fd)
        ids = np.array([int(region)], dtype="<i8").tobytes()
        ch.send(pack_header(FrameType.PIN, 1, 8, 1) + ids)
        last = time.monotonic()
        assert ch.recv_header().ftype is FrameType.PINNED and t.pinned_regions() == 1
        if not holding:
            ch.send_frame(FrameType.ABORT, 1)
            last = time.monotonic()
        labels = {"transport": "shm", "reason": "stall"}
        if holding:
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""  # the target closed
            assert time.monotonic() - last <= 1.2 * stall
            assert t.metrics.value("stream_connections_dropped", labels, "_total") == 1
            end = time.monotonic() + 5
            while t.pinned_regions() and time.monotonic() < end:
                time.sleep(0.005)
            assert t.pinned_regions() == 0
            t.deregister(region)
        else:  # the idle bound (10 s) drops by a third of it at the earliest: not yet
            time.sleep(2 * stall)
            assert not _closed_by_peer(sock) and t.pinned_regions() == 0
            assert t.metrics.value("stream_connections_dropped", labels, "_total") == 0
    finally:
        sock.close()
        t.close()
