"""The stream handshake is mutual and bound to its connection: relays, replays, strangers fail.

Real transports on real sockets; the attacker is a byte relay or a raw socket that knows no
secret. A refused peer learns nothing from the target: not one byte.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import msgspec
import pytest
import torch

from kvplane.errors import TransportError
from kvplane.transports.base import XferKind, XferState
from kvplane.transports.shm import ShmTransport
from kvplane.transports.tcp import TcpTransport
from kvplane.transports.wire import WIRE_VERSION, FrameType, Metadata, encode, pack_header

SECRET = b"a shared secret of the cluster"


class _Relay:
    """A byte pump between whoever connects to it and ``target``; keeps what the target sent."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.from_target = bytearray()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            near, _ = self.sock.accept()
            far = socket.create_connection(self._target)
            for a, b, keep in ((near, far, None), (far, near, self.from_target)):
                t = threading.Thread(target=self._pump, args=(a, b, keep), daemon=True)
                t.start()
                self._threads.append(t)

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket, keep: bytearray | None) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                if keep is not None:
                    keep += data
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()
        for t in self._threads:
            t.join(5)


def _meta_at(agent: str, address: str) -> bytes:
    return encode(Metadata(WIRE_VERSION, "tcp", agent, address))


def _dropped(t: TcpTransport | ShmTransport, reason: str) -> float:
    labels = {"transport": t.name, "reason": reason}
    return t.metrics.value("stream_connections_dropped", labels, "_total")


def _eventually(check, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_a_relay_without_the_secret_cannot_join_two_peers_that_share_it(kit):
    """A local process relays a client's handshake to the real target byte for byte. Before,
    the target's challenge covered only its nonce, so the relayed proof passed and the relay
    held an authenticated connection to the target's memory; now each proof covers the
    connection's own endpoints, so both ends refuse."""
    target = TcpTransport(secret=SECRET, agent="target")
    client = TcpTransport(secret=SECRET, agent="client")
    relay = _Relay(target.address)
    try:
        target.register(torch.zeros(64, dtype=torch.uint8))
        with pytest.raises(TransportError, match="authentication failed"):
            client.connect(_meta_at("target", relay.address))
        assert _eventually(lambda: _dropped(target, "handshake_failed") >= 1)
        opened = target.metrics.value("stream_connections", {"transport": "tcp", "phase": "open"})
        assert opened == 0 and target.pinned_regions() == 0  # never past the handshake
        peer = client.connect(target.metadata())  # direct: fine
        assert peer.peer_id == "target"
    finally:
        relay.close()
        client.close()
        target.close()
    assert kit.kv_threads() == []


def test_a_replayed_target_handshake_does_not_fool_an_initiator(kit):
    """What a real target once sent, replayed by an impostor that knows no secret: before, the
    initiator never checked the target and took the replayed WELCOME (a forged region table);
    now the target's proof covers the initiator's fresh nonce, so a replay is refused."""
    target = TcpTransport(secret=SECRET, agent="target")
    relay = _Relay(target.address)
    recorder = TcpTransport(secret=SECRET, agent="client")
    try:
        with contextlib.suppress(TransportError):
            recorder.connect(_meta_at("target", relay.address))
        assert _eventually(lambda: len(relay.from_target) > 0)
    finally:
        recorder.close()
        relay.close()
        target.close()
    recorded = bytes(relay.from_target)
    impostor = socket.create_server(("127.0.0.1", 0))
    client = TcpTransport(secret=SECRET, agent="client")

    def replay() -> None:
        with contextlib.suppress(OSError):
            conn, _ = impostor.accept()
            conn.sendall(recorded)
            while conn.recv(4096):
                pass
            conn.close()

    thread = threading.Thread(target=replay, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{impostor.getsockname()[1]}"
        with pytest.raises(TransportError, match="authentication failed"):
            client.connect(_meta_at("target", address))
        assert client._links == {}
    finally:
        client.close()
        impostor.close()
        thread.join(5)


@pytest.mark.parametrize(
    "body",
    [
        msgspec.msgpack.encode({"version": 99, "transport": "tcp", "nonce": bytes(32)}),
        msgspec.msgpack.encode({"version": WIRE_VERSION, "transport": "shm", "nonce": bytes(32)}),
        b"\xc1 not msgpack",
    ],
    ids=["old-version", "other-transport", "garbage"],
)
def test_a_refused_hello_gets_not_one_byte_back(body: bytes) -> None:
    """Before, any HELLO was answered with the target's agent and a challenge, and a refusal
    with a REJECT naming what the target expected."""
    t = TcpTransport(secret=SECRET, agent="target")
    host, _, port = t.address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(pack_header(FrameType.HELLO, 0, len(body)) + body)
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while data := s.recv(4096):
                    got += data
        assert got == b""
        assert _eventually(lambda: _dropped(t, "handshake_failed") == 1)
    finally:
        t.close()


def _challenge(t: TcpTransport, agent: str, target: str) -> tuple[bytes, dict[str, object], bytes]:
    """A stranger's HELLO: every byte the target sent, the CHALLENGE body decoded as plain
    msgpack, and what came after our AUTH (naming ``agent`` and ``target``, a bogus proof)."""
    from kvplane.transports.wire import HEADER, parse_header

    hello = msgspec.msgpack.encode(
        {"version": WIRE_VERSION, "transport": "tcp", "nonce": bytes(32)}
    )
    host, _, port = t.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(pack_header(FrameType.HELLO, 0, len(hello)) + hello)
        got = b""
        while (
            len(got) < HEADER.size
            or len(got) < HEADER.size + parse_header(got[: HEADER.size]).length
        ):
            data = s.recv(4096)
            assert data, f"closed unanswered after {len(got)} bytes"
            got += data
        header = parse_header(got[: HEADER.size])
        assert header.ftype is FrameType.CHALLENGE
        body = msgspec.msgpack.decode(got[HEADER.size :])
        auth = msgspec.msgpack.encode({"agent": agent, "target": target, "mac": bytes(32)})
        s.sendall(pack_header(FrameType.AUTH, 0, len(auth)) + auth)
        after = b""
        with contextlib.suppress(ConnectionResetError):
            while data := s.recv(4096):
                after += data
    return got, body, after


def test_a_stranger_reading_the_challenge_learns_a_nonce_and_nothing_of_who_it_is() -> None:
    """Before (v2), the CHALLENGE named the target's agent to anyone who sent a HELLO. Now a
    CHALLENGE holds a fresh nonce and a proof, whoever the stranger claims to be or means to
    reach; the agent comes in the WELCOME, to a peer that proved itself, and an AUTH with a
    bad proof or meant for another agent gets nothing."""
    name = "prefill-7f3a-secret-name"
    t = TcpTransport(secret=SECRET, agent=name)
    try:
        seen = [_challenge(t, "stranger", target) for target in ("", name, "a-guess")]
        for got, body, after in seen:
            assert sorted(body) == ["mac", "nonce"]  # a dict: a struct's fields by name
            assert len(body["nonce"]) == 32 and len(body["mac"]) == 32  # type: ignore[arg-type]
            assert name.encode() not in got and after == b""
        assert len({bytes(b["nonce"]) for _, b, _ in seen}) == 3  # type: ignore[arg-type]
        assert _eventually(lambda: _dropped(t, "handshake_failed") == 3)
        friend = TcpTransport(secret=SECRET, agent="friend")
        try:
            with pytest.raises(TransportError, match="refused our proof"):
                friend.connect(_meta_at("a-guess", t.address))  # not who we meant: refused
            assert friend.connect(t.metadata()).peer_id == name  # named in the WELCOME
        finally:
            friend.close()
    finally:
        t.close()


def test_an_initiator_names_nobody_to_a_target_that_has_not_proved_the_secret() -> None:
    """An impostor listens where a genuine target was and records what the initiator sends.
    Before (v3), the HELLO carried the initiator's agent and the agent it meant, to anyone
    listening; now the HELLO holds a version, the transport and a nonce, and the names go out
    in the AUTH, only after the target's proof (which the impostor cannot make)."""
    impostor = socket.create_server(("127.0.0.1", 0))
    heard = bytearray()

    def listen() -> None:
        with contextlib.suppress(OSError):
            conn, _ = impostor.accept()
            conn.settimeout(5)
            with conn, contextlib.suppress(OSError):
                while data := conn.recv(4096):
                    heard.extend(data)

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    client = TcpTransport(secret=SECRET, agent="decode-9c1e-who-am-i", connect_timeout_s=0.5)
    try:
        address = f"127.0.0.1:{impostor.getsockname()[1]}"
        with pytest.raises(TransportError):
            client.connect(_meta_at("prefill-4b2d-whom-i-mean", address))
    finally:
        client.close()
        impostor.close()
        thread.join(5)
    assert heard[:4] == b"KVPT" and len(heard) > 32  # the HELLO arrived
    assert b"who-am-i" not in heard and b"whom-i-mean" not in heard


@pytest.mark.parametrize("kind", [TcpTransport, ShmTransport])
def test_mutual_both_ways_with_a_secret_and_insecure_mode_still_works(kind, kit):
    """Peers with the same secret move bytes; a peer with another secret or none is refused
    whichever side it is on; two insecure peers (secret None) still handshake."""
    ours = kind(secret=SECRET, agent="ours")
    other = kind(secret=b"another secret entirely", agent="other")
    open_ = kind(agent="open")
    open2 = kind(agent="open2")
    try:
        mem = (
            ours.allocate(64)
            if isinstance(ours, ShmTransport)
            else torch.zeros(64, dtype=torch.uint8)
        )
        region = ours.register(mem).region_id
        for stranger in (other, open_):
            with pytest.raises(TransportError, match="authentication failed"):
                stranger.connect(ours.metadata())  # the target did not prove it to them
            with pytest.raises(TransportError, match="authentication failed"):
                ours.connect(stranger.metadata())  # nor they to us
        friend = kind(secret=SECRET, agent="friend")
        try:
            src = friend.register(torch.full((64,), 3, dtype=torch.uint8)).region_id
            peer = friend.connect(ours.metadata())
            h = friend.submit(XferKind.WRITE, kit.one(src, 0, 64), kit.one(region, 0, 64), peer)
            assert kit.wait(friend, h).state is XferState.DONE and int(mem.sum()) == 3 * 64
        finally:
            friend.close()
        assert open2.connect(open_.metadata()).peer_id == "open"
        assert ours.pinned_regions() == 0
    finally:
        for t in (ours, other, open_, open2):
            t.close()


def test_a_proof_covers_role_nonces_names_and_the_connection() -> None:
    from kvplane.transports.handshake import Exchange
    from kvplane.transports.wire import Hello

    hello = Hello(WIRE_VERSION, "tcp", bytes(32))
    base = Exchange(hello, b"\x01" * 32, b"ip:[127.0.0.1]:1>[127.0.0.1]:2")
    shm_hello = Hello(WIRE_VERSION, "shm", bytes(32))
    other_nonce = Hello(WIRE_VERSION, "tcp", b"\x03" * 32)
    relayed = b"ip:[127.0.0.1]:3>[127.0.0.1]:2"
    proofs = {
        base.proof(SECRET, b"target"),
        base.proof(SECRET, b"initiator"),
        base.proof(SECRET, b"initiator", ("a", "b")),
        base.proof(SECRET, b"initiator", ("a", "c")),
        base.proof(SECRET, b"initiator", ("c", "b")),
        Exchange(hello, b"\x02" * 32, base.bound).proof(SECRET, b"target"),
        Exchange(other_nonce, base.nonce, base.bound).proof(SECRET, b"target"),
        Exchange(hello, base.nonce, relayed).proof(SECRET, b"target"),
        Exchange(shm_hello, base.nonce, base.bound).proof(SECRET, b"target"),
        base.proof(b"another secret", b"target"),
    }
    assert len(proofs) == 10 and all(len(p) == 32 for p in proofs)
    assert base.proof(None, b"target") == b""
