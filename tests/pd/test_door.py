"""The PD endpoint's door on real sockets: CURVE refuses peers without the cluster's keys
before any frame is read, a frame over ``max_frame`` cuts its connection, frames stalled
half-way and connections beyond the cap cost bounded memory."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvplane.curve_auth import CurveKeys, secure_client
from kvplane.errors import TransferTimeoutError
from kvplane.ids import PeerId
from kvplane.pd.codec import Codec
from kvplane.pd.door import CURVE_OVERHEAD, pd_keys, queue_depth
from kvplane.pd.endpoint import ControlClient, Endpoint
from kvplane.pd.events import Probe
from kvplane.pd.participant import Participant
from kvplane.testing.session_pair import sim_profile

SECRET = b"door-test-secret-of-the-cluster"
OTHER = b"door-test-secret-of-another-one"


def endpoint(secret: bytes | None, name: str = "target", **options: object) -> Endpoint:
    part = Participant(PeerId(name), sim_profile(), incarnation=1)
    ep = Endpoint(part, secret=secret, **options)  # type: ignore[arg-type]
    ep.start()
    return ep


@pytest.fixture
def keyed() -> Iterator[Endpoint]:
    ep = endpoint(SECRET)
    yield ep
    ep.close()


def counters(ep: Endpoint, secret: bytes | None) -> dict[str, int]:
    """The endpoint's counters, asked for over the wire (it still serves a keyed probe)."""
    probe = ControlClient(ep.address, secret=secret, timeout_s=5.0)
    try:
        return probe.probe(1).counters
    finally:
        probe.close()


def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def dealer(
    address: str, keys: CurveKeys | None
) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 1000)  # a refused DEALER has no pipe to queue into
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(address)
    return ctx, sock


def test_a_dealer_without_keys_is_refused_before_any_frame_is_read(keyed: Endpoint) -> None:
    """It used to reach the codec: 20 frames of 512 KiB each were read, buffered and dropped
    one by one (``dropped_unauthenticated``); now the CURVE handshake refuses the connection."""
    ctx, sock = dealer(keyed.address, None)
    try:
        with contextlib.suppress(zmq.Again):  # refused already: nowhere to send
            for _ in range(20):
                sock.send(os.urandom(512 << 10))
        assert wait_until(lambda: keyed.snapshot().get("refused_handshakes", 0) >= 1)
        assert sock.poll(300) == 0  # nothing comes back either
    finally:
        sock.close(linger=0)
        ctx.term()
    snap = counters(keyed, SECRET)
    assert snap["frames_in"] == 1  # the probe just made, nothing else
    assert snap.get("dropped_unauthenticated", 0) == 0 and snap["sessions_live"] == 0
    assert keyed.outbox.empty()


def test_keys_of_another_secret_and_a_stranger_client_key_are_refused(keyed: Endpoint) -> None:
    stranger = ControlClient(keyed.address, secret=OTHER, timeout_s=0.5)
    try:
        with pytest.raises(TransferTimeoutError):
            stranger.probe(3)  # another cluster's server key: the handshake fails
    finally:
        stranger.close()
    public, secret = zmq.curve_keypair()  # our server key, a client key not derived from ours
    forged = CurveKeys(pd_keys(SECRET).server_public, b"", bytes(public), bytes(secret))
    ctx, sock = dealer(keyed.address, forged)
    try:
        with contextlib.suppress(zmq.Again):
            sock.send(Codec(secret=SECRET).encode(Probe(nonce=9)))
        assert sock.poll(500) == 0
    finally:
        sock.close(linger=0)
        ctx.term()
    snap = counters(keyed, SECRET)
    assert snap["refused_key"] >= 1 and snap["refused_handshakes"] >= 2
    assert snap["frames_in"] == 1


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_frame_over_max_frame_cuts_its_connection(secret: bytes | None) -> None:
    """MAXMSGSIZE was 4 * max_frame: frames up to four times too big were buffered whole and
    dropped by the codec. Now a frame of exactly ``max_frame`` still arrives (under CURVE,
    which adds CURVE_OVERHEAD bytes), one byte more cuts the connection unread."""
    max_frame = 4096
    ep = endpoint(secret, max_frame=max_frame)
    keys = None if secret is None else pd_keys(secret)
    codec = Codec(secret=secret, max_frame=max_frame)
    try:
        ctx, sock = dealer(ep.address, keys)
        try:
            body = b"\xc1" * (max_frame - codec.tag_bytes)  # never valid msgpack
            sock.send(codec.seal(body))  # exactly max_frame: read, and dropped as malformed
            assert wait_until(lambda: ep.snapshot().get("dropped_malformed", 0) == 1)
            sock.send(codec.seal(body + b"\xc1"))  # one byte over: the connection is cut
            assert wait_until(lambda: ep.snapshot().get("connections_closed", 0) >= 1)
        finally:
            sock.close(linger=0)
            ctx.term()
        snap = counters(ep, secret)
    finally:
        ep.close()
    assert snap["frames_in"] == 2 and snap["dropped_malformed"] == 1  # the probe and the first
    assert snap.get("dropped_oversized", 0) == 0
    assert ep.door.max_message == max_frame + (CURVE_OVERHEAD if secret else 0)


def _greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting (64 bytes) as a client offering ``mechanism``."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" * 32


def _ready() -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    return b"\x04" + bytes([len(body)]) + body


def _stall(port: int, secure: bool, declared: int) -> socket.socket:
    """A raw tcp peer that sends all but the last byte of a frame declared ``declared`` bytes
    long and stalls: a message (NULL) or a handshake command (CURVE) libzmq must buffer."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    head = _greeting(b"CURVE") if secure else _greeting(b"NULL") + _ready()
    flags = b"\x06" if secure else b"\x02"  # long command / long message
    conn.setblocking(False)
    with contextlib.suppress(OSError):  # cut already, or the kernel buffer is full: stalled
        conn.sendall(head + flags + struct.pack(">Q", declared) + b"\0" * (declared - 1))
    return conn


def _hung_up(conn: socket.socket) -> bool:
    """Whether the endpoint closed ``conn`` (its greeting bytes, then end of file)."""
    conn.settimeout(0.2)
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while conn.recv(4096):
            pass
        return True
    return False


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("secret", [SECRET, None])
def test_frames_stalled_half_way_hold_bounded_memory(secret: bytes | None) -> None:
    """96 peers that never finish a frame: 32 of the largest allowed size and 64 of four times
    it (the old MAXMSGSIZE allowed those: 72 MiB held, measured 281 -> 684 MiB with 100 of
    4 MiB in a real worker). Now only the 32 allowed ones are buffered: at most 8 MiB."""
    max_frame = 256 << 10
    ep = endpoint(secret, max_frame=max_frame)
    port = int(ep.address.rsplit(":", 1)[1])
    conns: list[socket.socket] = []
    try:
        before = _rss()
        for i in range(96):
            size = max_frame if i < 32 else 4 * max_frame - 64
            conns.append(_stall(port, secret is not None, size))
        time.sleep(1.0)  # the endpoint reads what it is sent
        grown = _rss() - before
        snap = ep.snapshot()
    finally:
        for conn in conns:
            conn.close()
        ep.close()
    assert grown < 24 << 20, f"{grown / 2**20:.1f} MiB"
    assert snap.get("frames_in", 0) == 0


def test_past_the_cap_a_newcomer_evicts_the_oldest_unproven_connection() -> None:
    """Before, connections past the cap were cut and the first ones held their slots until
    their zmq handshake timed out (5 s), so whoever connected first, junk or not, kept a new
    peer out; now each newcomer evicts the oldest connection that has not proven it holds
    the key, and a keyed peer gets in at once."""
    ep = endpoint(SECRET, max_connections=8)
    port = int(ep.address.rsplit(":", 1)[1])
    conns = []
    try:
        for i in range(20):
            conns.append(socket.create_connection(("127.0.0.1", port)))
            # accepted in order: the door's age order is the test's
            assert wait_until(lambda n=i + 1: ep.snapshot().get("connections_accepted", 0) == n)
        snap = ep.snapshot()
        assert snap["connections_open"] == 8 and snap.get("evicted_connections", 0) == 12
        assert snap.get("refused_connections", 0) == 0
        assert [_hung_up(conn) for conn in conns] == [True] * 12 + [False] * 8
        assert counters(ep, SECRET)["evicted_connections"] == 13  # a keyed peer got in
    finally:
        for conn in conns:
            conn.close()
    assert wait_until(lambda: ep.snapshot()["connections_open"] == 0)
    ep.close()


def test_a_keyed_peer_pairs_while_200_junk_connections_are_held_and_is_never_evicted() -> None:
    """200 connections that say nothing held open at the prefill endpoint, before and after a
    decode endpoint pairs with it. Before, the 64 first ones filled the cap and the decode
    endpoint was cut at each try until they timed out (5 s), so its 2 s handshake failed; now
    it pairs at once (bound: 2 s, under the junk's 5 s lifetime), and 200 more junk
    connections evict only junk: the pair's connection is the one left when they go."""
    prefill, decode = endpoint(SECRET, "prefill"), endpoint(SECRET, "decode")
    port = int(prefill.address.rsplit(":", 1)[1])
    junk: list[socket.socket] = []
    try:
        junk += [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        assert wait_until(lambda: prefill.snapshot().get("connections_accepted", 0) == 200)
        assert decode.connect(prefill.address, timeout_s=2.0) == "prefill"
        junk += [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        assert wait_until(lambda: prefill.snapshot().get("connections_accepted", 0) == 401)
        snap = prefill.snapshot()
        assert snap["connections_open"] == 64 and snap.get("refused_connections", 0) == 0
        assert snap["evicted_connections"] == 401 - 64
        for conn in junk:
            conn.close()
        assert wait_until(lambda: prefill.snapshot()["connections_open"] == 1)
        assert prefill.call(prefill.participant.peers.live_peers) == ["decode"]
        assert prefill.snapshot().get("session_peer_lost", 0) == 0
    finally:
        for conn in junk:
            conn.close()
        decode.close()
        prefill.close()


def test_an_endpoint_that_dialled_out_still_serves_as_a_curve_server() -> None:
    """The ROUTER both binds (CURVE server) and connects (CURVE client): libzmq copies the
    security options per bind/connect, so a dial does not turn the listener into a client."""
    prefill, decode = endpoint(SECRET, "prefill"), endpoint(SECRET, "decode")
    try:
        assert decode.connect(prefill.address) == "prefill"
        assert counters(decode, SECRET)["handshakes_completed"] == 1  # decode's listener
        assert counters(prefill, SECRET)["handshakes_accepted"] == 1
    finally:
        decode.close()
        prefill.close()


def test_the_receive_queue_is_bounded_in_bytes() -> None:
    assert queue_depth(1 << 20) == 16 and queue_depth(4096) == 1000 and queue_depth(64 << 10) == 256


def test_a_bind_that_fails_leaves_nothing_open() -> None:
    with endpoint(SECRET) as ep:
        threads = threading.active_count()
        with pytest.raises(zmq.ZMQError):
            Endpoint(Participant(PeerId("twin"), sim_profile(), incarnation=1),
                     bind=ep.address, secret=SECRET)  # fmt: skip
        assert threading.active_count() == threads  # no door thread, no zmq I/O thread
        assert counters(ep, SECRET)["frames_in"] == 1  # the first one still serves
