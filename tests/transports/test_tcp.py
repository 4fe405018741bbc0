"""tcp specifics: shared-secret handshake, hostile frames, refresh keeps the link, options."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kvplane.errors import IncompatiblePeerError, InvalidArgumentError, TransportError
from kvplane.transports.base import XferKind, XferState
from kvplane.transports.tcp import TcpTransport
from kvplane.transports.wire import HEADER, FrameType, pack_header


def test_shared_secret_admits_matching_peers_only(kit):
    a = TcpTransport(secret=b"s3cret", agent="a")
    b = TcpTransport(secret=b"s3cret", agent="b")
    wrong = TcpTransport(secret=b"other", agent="w")
    none = TcpTransport(agent="n")
    try:
        dst = torch.zeros(64, dtype=torch.uint8)
        region = b.register(dst).region_id
        src = a.register(torch.full((64,), 5, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(region, 0, 64), peer)
        assert kit.wait(a, h).state is XferState.DONE and int(dst.sum()) == 5 * 64
        for intruder in (wrong, none):
            with pytest.raises(TransportError, match="authentication failed"):
                intruder.connect(b.metadata())
        assert b.pinned_regions() == 0
    finally:
        for t in (a, b, wrong, none):
            t.close()
    assert kit.kv_threads() == []


def _closed_by_peer(s: socket.socket) -> bool:
    """True once the target hung up on us without sending a byte (EOF or reset)."""
    try:
        return s.recv(HEADER.size) == b""
    except ConnectionResetError:
        return True


def _raw(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def test_hostile_frames_drop_the_connection_and_the_listener_keeps_serving(kit):
    b = TcpTransport(agent="target")
    a = TcpTransport(agent="client")
    try:
        dst = torch.zeros(32, dtype=torch.uint8)
        region = b.register(dst).region_id
        garbage = [
            b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40,
            pack_header(FrameType.DATA, 1, 1 << 40, count=1),  # oversized payload
            pack_header(FrameType.HELLO, 0, 10) + b"\xc1" * 10,
        ]  # undecodable body
        for blob in garbage:
            with _raw(b.address) as s:
                s.sendall(blob)
                assert _closed_by_peer(s)
        src = a.register(torch.full((32,), 9, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 32), kit.one(region, 0, 32), peer)
        assert kit.wait(a, h).state is XferState.DONE and int(dst.sum()) == 9 * 32
    finally:
        a.close()
        b.close()
    assert kit.kv_threads() == []


def test_connect_again_refreshes_regions_and_keeps_the_link(kit):
    a, b = TcpTransport(agent="a"), TcpTransport(agent="b")
    try:
        src = a.register(torch.arange(64, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        assert peer.regions == {}
        threads = kit.kv_threads()
        late = torch.zeros(64, dtype=torch.uint8)
        region = b.register(late).region_id
        peer = a.connect(b.metadata())
        assert peer.regions == {region: 64}
        deadline = time.monotonic() + 5  # the refresh connection's target thread winds down
        while kit.kv_threads() != threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kit.kv_threads() == threads  # the link was kept, not replaced
        h = a.submit(XferKind.WRITE, kit.one(src, 10, 4), kit.one(region, 0, 4), peer)
        assert kit.wait(a, h).state is XferState.DONE
        assert late[:4].tolist() == [10, 11, 12, 13]
    finally:
        a.close()
        b.close()


def test_peer_deregistering_mid_batch_fails_it_cleanly(kit):
    a, b = TcpTransport(agent="a"), TcpTransport(agent="b")
    try:
        src = a.register(torch.ones(128, dtype=torch.uint8)).region_id
        dst = b.register(torch.zeros(128, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        b.deregister(dst)  # a still believes in it: the target must refuse, not write
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 128), kit.one(dst, 0, 128), peer)
        got = kit.wait(a, h)
        assert got.state is XferState.FAILED and "region" in got.reason
        h = a.submit(XferKind.READ, kit.one(dst, 0, 128), kit.one(src, 0, 128), peer)
        got = kit.wait(a, h)
        assert got.state is XferState.FAILED and "peer refused" in got.reason
        deadline = time.monotonic() + 5
        while (a.pinned_regions() or b.pinned_regions()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.pinned_regions() == 0 and b.pinned_regions() == 0 and a.live_batches() == 0
    finally:
        a.close()
        b.close()


def test_option_validation():
    with pytest.raises(InvalidArgumentError, match="port must be an int"):
        TcpTransport(port=70000)
    with pytest.raises(InvalidArgumentError, match="secret must be non-empty bytes"):
        TcpTransport(secret="text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="connect_timeout_s must be a finite number > 0"):
        TcpTransport(connect_timeout_s=0)
    t = TcpTransport(agent="dup")
    try:
        with pytest.raises(TransportError, match="cannot listen"):
            TcpTransport(port=int(t.address.rpartition(":")[2]))
        with pytest.raises(IncompatiblePeerError, match="for transport 'shm', not 'tcp'"):
            t.connect(_shm_meta())
    finally:
        t.close()


def _shm_meta() -> bytes:
    from kvplane.transports.wire import WIRE_VERSION, Metadata, encode

    return encode(Metadata(WIRE_VERSION, "shm", "x"))


@pytest.mark.parametrize("bad", [0, True, "2"])
def test_bad_copy_threads_refused_before_listening(bad) -> None:
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(InvalidArgumentError, match="threads must be a positive int"):
        TcpTransport(agent="c", copy_threads=bad)
    assert {t.name for t in threading.enumerate()} == before  # no listener was started


def test_a_batch_timing_out_behind_a_cancelled_stalled_stream_tears_it_down(kit):
    """The target hangs with its socket open; our sender blocks in ``sendall`` on a big WRITE
    that the caller then cancels. A later batch that times out queued behind it tears the
    stream down, so the blocked sender, its pins and the link are freed (before: the link
    stayed up, every later batch timed out and the pins piled up until close)."""
    from kvplane.testing.peer_process import PeerProcess

    n = 256 << 20
    a = TcpTransport(agent="wedge")
    far = PeerProcess("tcp")
    try:
        dst = far.alloc(n)
        peer = a.connect(far.metadata())
        src = a.register(torch.ones(n, dtype=torch.uint8)).region_id
        far.stop()
        big = a.submit(XferKind.WRITE, kit.one(src, 0, n), kit.one(dst, 0, n), peer,
                       deadline_s=60)  # fmt: skip
        time.sleep(0.5)  # the sender is blocked in sendall now
        a.cancel(big)
        assert a.poll(big).state is XferState.IN_DOUBT  # bytes may still land: in doubt
        late = a.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(dst, 0, 64), peer,
                        deadline_s=0.5)  # fmt: skip
        assert kit.wait(a, late, 10).state is XferState.FAILED
        kit.settle(a, 10)  # while the far side hangs
    finally:
        far.cont()
        far.close()
        a.close()


def test_a_target_drops_a_peer_that_goes_silent_while_it_holds_pins(kit, monkeypatch):
    """A peer that stops mid-frame (host gone with no FIN, or hung) no longer keeps the
    target's region pinned for ever: after ``target_stall_s`` without a byte, the target
    drops the connection and its pins; an idle connection holding nothing is left alone."""
    import kvplane.transports.tcp as tcp_module

    go = threading.Event()

    def stall_after_100_bytes(sock, views, descs, stage):
        sock.sendall(b"\x01" * 100)
        assert go.wait(20)
        raise ConnectionResetError("the test released the stalled sender")

    b = TcpTransport(agent="target", target_stall_s=0.5)
    a = TcpTransport(agent="silent")
    try:
        dst = b.register(torch.zeros(4096, dtype=torch.uint8)).region_id
        src = a.register(torch.ones(4096, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        idle_since = time.monotonic()
        time.sleep(0.8)  # idle longer than the stall timeout: the link must survive it
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(dst, 0, 64), peer)
        assert kit.wait(a, h).state is XferState.DONE and time.monotonic() - idle_since > 0.5
        monkeypatch.setattr(tcp_module, "send_payload", stall_after_100_bytes)
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 4096), kit.one(dst, 0, 4096), peer)
        end = time.monotonic() + 10
        while not b.pinned_regions() and time.monotonic() < end:
            time.sleep(1e-3)
        while b.pinned_regions() and time.monotonic() < end:
            time.sleep(0.01)
        assert b.pinned_regions() == 0  # dropped while our sender still hangs mid-frame
        b.deregister(dst)
        go.set()
        assert kit.wait(a, h).state.terminal
    finally:
        go.set()
        a.close()
        b.close()
    with pytest.raises(InvalidArgumentError):
        TcpTransport(target_stall_s=0)


def test_a_target_drops_a_reader_that_stops_taking_its_reply(kit):
    """A READ reply is sent while the target holds its pins: a peer that asks for 64 MiB and
    then reads nothing must not keep them (and the region undeletable) for ever."""
    from kvplane.transports.base import DescriptorList
    from kvplane.transports.channel import Channel
    from kvplane.transports.handshake import client_handshake
    from kvplane.transports.wire import pack_table

    t = TcpTransport(agent="target", target_stall_s=0.5)
    sock = None
    try:
        region = t.register(torch.zeros(64 << 20, dtype=torch.uint8)).region_id
        host, _, port = t.address.rpartition(":")
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        ch = Channel(sock)
        client_handshake(ch, "never-reads", "tcp", None)
        table = DescriptorList.of([(int(region), 0, 64 << 20)])
        ch.send(pack_header(FrameType.READ_REQ, 1, 0, 1) + pack_table(table))
        end = time.monotonic() + 10
        while not t.pinned_regions() and time.monotonic() < end:
            time.sleep(1e-3)
        assert t.pinned_regions() == 1  # serving the reply
        while t.pinned_regions() and time.monotonic() < end:
            time.sleep(0.01)
        assert t.pinned_regions() == 0  # the reply stalled for target_stall_s: dropped
        t.deregister(region)
    finally:
        if sock is not None:
            sock.close()
        t.close()


def test_close_mid_stream_ends_the_batch_in_doubt_by_a_local_error(kit, monkeypatch):
    """close() while a WRITE's bytes are on the wire: some landed, so not FAILED; and it was
    our close, not the peer, so not REMOTE_DISCONNECT (the link's own rule)."""
    import kvplane.transports.tcp as tcp_module
    from kvplane.transports.base import FailureKind

    real_send, sent = tcp_module.send_payload, threading.Event()

    def send_then_stall(sock, views, descs, stage):
        real_send(sock, views, descs, stage)
        sent.set()
        time.sleep(0.5)  # still "sending" when close() arrives

    monkeypatch.setattr(tcp_module, "send_payload", send_then_stall)
    a, b = TcpTransport(agent="closing"), TcpTransport(agent="far")
    try:
        dst = b.register(torch.zeros(4096, dtype=torch.uint8)).region_id
        src = a.register(torch.ones(4096, dtype=torch.uint8)).region_id
        peer = a.connect(b.metadata())
        h = a.submit(XferKind.WRITE, kit.one(src, 0, 4096), kit.one(dst, 0, 4096), peer)
        assert sent.wait(10)
        a.close()
        got = a.poll(h)
        assert (got.state, got.failure) == (XferState.IN_DOUBT, FailureKind.LOCAL_ERROR)
        assert a.pinned_regions() == 0 and a.live_batches() == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("direction", ["receive", "send"])
def test_a_stalled_peer_is_dropped_within_the_stall_of_its_last_byte(direction: str) -> None:
    """Calls that wait for all their bytes (``MSG_WAITALL``, ``sendall``) return a part at their
    timeout and the next call waits again (and a send call also takes the bit of buffer our
    kernel frees when the peer's zero window is probed): armed at a third of the stall
    (receive) and a quarter (send), a peer that sends (or takes) a little and then hangs fails
    the call within ``stall`` of its last byte (measured: 0.71 s receiving, 0.51 s sending)."""
    from kvplane.transports.bounds import arm_silence
    from kvplane.transports.wire import recv_exact

    stall = 1.0
    with socket.create_server(("127.0.0.1", 0)) as srv:
        far = socket.create_connection(srv.getsockname())
        ours, _ = srv.accept()
    try:
        arm_silence(ours, stall)
        if direction == "receive":
            far.sendall(b"x" * 10)  # a few bytes, then silence
            last = time.monotonic()
            with pytest.raises(OSError):
                recv_exact(ours, memoryview(bytearray(100)))
        else:
            far.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the peer takes nothing
            last = time.monotonic()
            with pytest.raises(OSError):
                ours.sendall(bytes(64 << 20))
        since_last = time.monotonic() - last
        assert stall / 4 - 0.05 <= since_last <= stall
    finally:
        ours.close()
        far.close()


@pytest.mark.parametrize(
    ("seconds", "receive", "send"),
    [
        (0.0, (0, 0), (0, 0)),
        (1e-7, None, None),
        (1.2, (0, 400_000), (0, 300_000)),  # whole kernel ticks (the kernel rounds to them)
        (12.0, (4, 0), (3, 0)),
    ],
)
def test_the_stall_timeout_arms_a_share_and_never_none_for_a_positive_stall(
    seconds: float, receive: tuple[int, int] | None, send: tuple[int, int] | None
) -> None:
    """``armed`` None: anything but (0, 0), which means no timeout (the kernel rounds a tiny
    one up to a tick)."""
    import struct

    from kvplane.transports.bounds import arm_silence

    a, b = socket.socketpair()
    try:
        arm_silence(a, seconds)
        for opt, armed in ((socket.SO_RCVTIMEO, receive), (socket.SO_SNDTIMEO, send)):
            got = struct.unpack("ll", a.getsockopt(socket.SOL_SOCKET, opt, 16))
            assert got != (0, 0) if armed is None else got == armed
    finally:
        a.close()
        b.close()
