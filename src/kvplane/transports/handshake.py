"""The mutual handshake that opens every ``tcp``/``shm`` connection, bound to that connection.

HELLO (initiator: purpose, nonce) → CHALLENGE (target: nonce, proof) → AUTH (initiator: its
agent, the agent it means, proof) → WELCOME (target's agent, region table): neither side names
anyone before the other proved the secret. Each proof is an HMAC over both nonces, the
transport and the socket's endpoints (the initiator's also over both names). Owns the proofs,
the first-byte wait and the handshake deadline; a failure raises and the caller closes, never
answering. See docs/transports.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvplane.errors import HandshakeError, MalformedMessageError
from kvplane.transports.channel import MAX_FDS, Channel
from kvplane.transports.wire import (
    HEADER,
    WIRE_VERSION,
    Auth,
    Challenge,
    FrameType,
    Hello,
    Welcome,
    decode,
    encode,
    pack_header,
    parse_header,
)

NONCE_BYTES = 32
_KEY_LABEL = b"kvplane stream handshake v3"
"""The proofs' key is HMAC(secret, this): the PD codec's MACs under the same secret never
verify here, nor ours there."""
_INITIATOR, _TARGET = b"initiator", b"target"


def binding(sock: socket.socket, initiator: bool) -> bytes:
    """What both ends of ``sock`` see alike and a relay cannot: ``initiator>target`` endpoint
    addresses (TCP) or process ids and the socket name (Unix; pids from ``SO_PEERCRED``)."""
    if sock.family == socket.AF_UNIX:
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", cred)[0]
        ends = (os.getpid(), pid) if initiator else (pid, os.getpid())
        name = sock.getpeername() if initiator else sock.getsockname()
        return f"unix:{ends[0]}>{ends[1]}@{name!r}".encode()
    ours, theirs = _endpoint(sock.getsockname()), _endpoint(sock.getpeername())
    first, second = (ours, theirs) if initiator else (theirs, ours)
    return f"ip:{first}>{second}".encode()


def _endpoint(addr: tuple[object, ...]) -> str:
    host = str(addr[0]).removeprefix("::ffff:")  # a dual-stack socket's view of an IPv4 peer
    return f"[{host}]:{addr[1]}"


@dataclass(frozen=True, slots=True)
class Exchange:
    """What both proofs of one connection cover: the HELLO, the target's nonce and the
    connection's :func:`binding`; the initiator's proof also covers the names its AUTH carries
    (its agent, the agent it means), which the target's cannot: it is told them only after."""

    hello: Hello
    nonce: bytes
    bound: bytes

    def proof(self, secret: bytes | None, role: bytes, names: tuple[str, str] = ("", "")) -> bytes:
        """``role``'s HMAC-SHA256 over the exchange and ``names`` (empty without a secret)."""
        if secret is None:
            return b""
        key = hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()
        h = self.hello
        transcript = msgspec.msgpack.encode(
            (role, WIRE_VERSION, h.transport, *names, h.nonce, self.nonce, self.bound)
        )
        return hmac.new(key, transcript, hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes by ``deadline`` (``TimeoutError`` after), however slowly they trickle."""
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        _arm(sock, deadline)
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionResetError("peer closed the connection during the handshake")
        view = view[got:]
    return bytes(buf)


def _arm(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake passed its deadline")
    sock.settimeout(left)


def await_first_byte(sock: socket.socket, seconds: float) -> None:
    """Wait up to ``seconds`` for the peer's first byte (peeked, left in the socket):
    ``TimeoutError`` after, ``ConnectionResetError`` if the peer closes first."""
    sock.settimeout(seconds)
    if not sock.recv(1, socket.MSG_PEEK):
        raise ConnectionResetError("peer closed the connection before its first byte")


def _expect(ch: Channel, ftype: FrameType, deadline: float, fds: list[int] | None = None) -> bytes:
    if fds is None:
        raw = _recv(ch.sock, HEADER.size, deadline)
    else:  # the WELCOME of shm carries descriptors on its first byte
        _arm(ch.sock, deadline)
        data, got, _flags, _addr = socket.recv_fds(ch.sock, HEADER.size, MAX_FDS)
        fds.extend(got)
        if not data:
            raise ConnectionResetError("peer closed the connection during the handshake")
        raw = data + _recv(ch.sock, HEADER.size - len(data), deadline)
    header = parse_header(raw)
    if header.ftype is not ftype:
        raise MalformedMessageError(
            f"expected {ftype.name} during handshake, got {header.ftype.name}"
        )
    return _recv(ch.sock, header.length, deadline)


def client_handshake(
    ch: Channel, agent: str, transport: str, secret: bytes | None, *, expect: str = "",
    with_fds: bool = False, timeout_s: float = 10.0,
) -> tuple[str, Welcome, list[int]]:  # fmt: skip
    """Initiator side, over by ``timeout_s``: returns the target's agent (from its WELCOME),
    its region table and any passed fds. ``expect``: the agent we mean to reach ("" any);
    it and our ``agent`` go out only after the target proved the secret. ``HandshakeError``
    if the target fails to prove the secret, is someone else, or closes unanswered."""
    deadline = time.monotonic() + timeout_s
    hello = Hello(WIRE_VERSION, transport, secrets.token_bytes(NONCE_BYTES))
    ch.sock.settimeout(timeout_s)
    ch.send_frame(FrameType.HELLO, 0, encode(hello))
    try:
        challenge = decode(_expect(ch, FrameType.CHALLENGE, deadline), Challenge)
    except ConnectionError:
        raise HandshakeError(
            "the target closed the connection unanswered (another wire version or transport, "
            "or past its connection caps)"
        ) from None
    who = repr(expect) if expect else "the target"
    exchange = Exchange(hello, challenge.nonce, binding(ch.sock, initiator=True))
    want = exchange.proof(secret, _TARGET)
    if len(challenge.nonce) != NONCE_BYTES or not hmac.compare_digest(challenge.mac, want):
        raise HandshakeError(f"authentication failed: {who} did not prove the shared secret "
                             "for this connection")  # fmt: skip
    names = (agent, expect)  # told only now, to a target that proved the secret
    ch.send_frame(
        FrameType.AUTH, 0, encode(Auth(*names, exchange.proof(secret, _INITIATOR, names)))
    )
    fds: list[int] = []
    try:
        welcome = decode(_expect(ch, FrameType.WELCOME, deadline, fds if with_fds else None),
                         Welcome)  # fmt: skip
    except ConnectionError:
        for fd in fds:
            socket.close(fd)
        raise HandshakeError(f"authentication failed: {who} refused our proof (another "
                             "shared secret, or not the agent we meant?)") from None  # fmt: skip
    except BaseException:
        for fd in fds:
            socket.close(fd)
        raise
    if not welcome.agent or (expect and welcome.agent != expect):
        for fd in fds:
            socket.close(fd)
        raise HandshakeError(f"reached {welcome.agent!r}, not {expect!r}")
    return welcome.agent, welcome, fds


def server_handshake(
    ch: Channel, agent: str, transport: str, secret: bytes | None,
    welcome: Callable[[], tuple[Welcome, list[int]]], *, timeout_s: float = 10.0,
) -> str:  # fmt: skip
    """Target side, over by ``timeout_s``: checks the initiator's purpose, proves the secret,
    checks the initiator's proof and names, then calls ``welcome`` (which may raise to refuse)
    and sends its table with our agent; returns the initiator's agent. Nothing tells who we
    are before the initiator's proof, and an AUTH meant for another agent is refused like a bad
    proof. Raises (``HandshakeError``, ``TimeoutError``, ``MalformedMessageError``,
    ``OSError``) without answering: the caller closes."""
    deadline = time.monotonic() + timeout_s
    hello = decode(_expect(ch, FrameType.HELLO, deadline), Hello)
    if (hello.version, hello.transport) != (WIRE_VERSION, transport):
        raise HandshakeError(f"refused a HELLO for {hello.transport} v{hello.version}, "
                             f"not {transport} v{WIRE_VERSION}")  # fmt: skip
    if len(hello.nonce) != NONCE_BYTES:
        raise HandshakeError("refused a malformed HELLO")
    nonce = secrets.token_bytes(NONCE_BYTES)
    exchange = Exchange(hello, nonce, binding(ch.sock, initiator=False))
    _arm(ch.sock, deadline)
    ch.send_frame(FrameType.CHALLENGE, 0, encode(Challenge(nonce, exchange.proof(secret, _TARGET))))
    auth = decode(_expect(ch, FrameType.AUTH, deadline), Auth)
    names = (auth.agent, auth.target)
    if not hmac.compare_digest(auth.mac, exchange.proof(secret, _INITIATOR, names)):
        raise HandshakeError(f"refused {auth.agent!r}: authentication failed")
    if not auth.agent:
        raise HandshakeError("refused an AUTH without an agent")
    if auth.target not in ("", agent):
        raise HandshakeError(f"refused {auth.agent!r}: it meant {auth.target!r}")
    table, fds = welcome()
    body = encode(msgspec.structs.replace(table, agent=agent))
    frame = pack_header(FrameType.WELCOME, 0, len(body)) + body
    _arm(ch.sock, deadline)
    if fds:
        sent = socket.send_fds(ch.sock, [frame], fds)
        ch.send(frame[sent:])
    else:
        ch.send(frame)
    return auth.agent
