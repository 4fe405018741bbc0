"""Mutual authentication of the order sockets: zmq CURVE keys derived from the cluster secret.

Owns the key derivation, the socket options of both sides and the server's ZAP check (only the
client key derived from the secret passes). It must not read or send orders: ``rpc`` does.
See docs/serving.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from kvplane.errors import InvalidArgumentError

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler (fixed by the ZAP specification, RFC 27)."""
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Monitor events of a connection refused before any frame of it is read."""


@dataclass(frozen=True, slots=True)
class OrderKeys:
    """The order sockets' CURVE keypairs (z85, 40 bytes each), one for servers, one for
    clients; everyone holding the cluster secret derives the same four keys."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def client_public_raw(self) -> bytes:
        """The clients' public key as ZAP presents it (32 raw bytes)."""
        return bytes(z85.decode(self.client_public))


def _keypair(secret: bytes, label: bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys: the secret key is BLAKE2b-256 of ``secret``, personalised by
    ``label`` (any 32 bytes are a Curve25519 secret key)."""
    seed = hashlib.blake2b(secret, digest_size=32, person=label).digest()
    secret_z85 = bytes(z85.encode(seed))
    return bytes(zmq.curve_public(secret_z85)), secret_z85


def order_keys(secret: bytes) -> OrderKeys:
    """The order sockets' keys for cluster ``secret`` (non-empty bytes, else
    ``InvalidArgumentError``). Deterministic; distinct secrets give unrelated keys."""
    if not isinstance(secret, bytes) or not secret:
        raise InvalidArgumentError("the order sockets' secret must be non-empty bytes")
    if not zmq.has("curve"):
        raise InvalidArgumentError("this libzmq has no CURVE: order sockets cannot authenticate")
    server_public, server_secret = _keypair(secret, b"kvplane-rpc-srv")
    client_public, client_secret = _keypair(secret, b"kvplane-rpc-cli")
    return OrderKeys(server_public, server_secret, client_public, client_secret)


def secure_client(sock: zmq.Socket[bytes], keys: OrderKeys) -> None:
    """Make ``sock`` (not connected yet) a CURVE client of the order servers."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class ZapGate:
    """A CURVE server's gate: :meth:`secure` sets the server keys on a socket (before it
    binds), and the ZAP socket bound in the socket's context admits only the clients' key.
    The owner polls :attr:`sock` and calls :meth:`serve` on its own loop thread; a connection
    is not served before its ZAP request is answered."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: OrderKeys) -> None:
        self.keys = keys
        self._client = keys.client_public_raw
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.denied = 0

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (not bound yet) a CURVE server with the servers' keypair."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.server_secret)

    def serve(self) -> int:
        """Answer every ZAP request waiting (never blocks); the number answered."""
        n = 0
        while True:
            try:
                req = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            ok = len(req) >= 7 and req[5] == b"CURVE" and req[6] == self._client
            if not ok:
                self.denied += 1
            rid = req[1] if len(req) > 1 else b""
            status = [b"200", b"OK"] if ok else [b"400", b"unknown client key"]
            self.sock.send_multipart([b"1.0", rid, *status, b"", b""])

    def close(self) -> None:
        self.sock.close(linger=0)
