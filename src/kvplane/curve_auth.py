"""zmq CURVE authentication from the cluster secret: derived keypairs, socket options, ZAP gate.

Owns the one derivation of CURVE keys from a shared secret (per purpose: the order sockets, the
PD endpoint), the options that make a socket a CURVE server or client, and the ZAP gate that
admits only the derived client key. It reads no frames and knows no protocol: the sockets'
owners (``pd/endpoint``, ``serving/rpc``) do. pyzmq is its only dependency beyond the stdlib.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from kvplane.errors import InvalidArgumentError

__all__ = [
    "HANDSHAKE_FAILED", "ZAP_ENDPOINT", "CurveKeys", "ZapGate", "derive_keys", "secure_client",
    "secure_server",
]  # fmt: skip

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler (fixed by the ZAP specification, RFC 27)."""
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Monitor events of a connection refused before any frame of it is read."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Two CURVE keypairs (z85, 40 bytes each), one for servers, one for clients; everyone
    holding the cluster secret derives the same four keys for the same purpose."""

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


def derive_keys(secret: bytes, purpose: bytes, what: str) -> CurveKeys:
    """The CURVE keys of ``purpose`` (1-7 ASCII bytes, e.g. ``b"rpc"``, ``b"pd"``) for cluster
    ``secret``. Deterministic; distinct secrets or purposes give unrelated keys.
    ``InvalidArgumentError`` (naming ``what``) for an empty or non-bytes secret, a bad purpose,
    or a libzmq without CURVE."""
    if not isinstance(secret, bytes) or not secret:
        raise InvalidArgumentError(f"the secret of {what} must be non-empty bytes")
    if not isinstance(purpose, bytes) or not 1 <= len(purpose) <= 7 or not purpose.isalnum():
        raise InvalidArgumentError(f"CURVE key purpose must be 1-7 ASCII letters, got {purpose!r}")
    if not zmq.has("curve"):
        raise InvalidArgumentError(f"this libzmq has no CURVE: {what} cannot authenticate")
    server_public, server_secret = _keypair(secret, b"kvplane-" + purpose + b"-srv")
    client_public, client_secret = _keypair(secret, b"kvplane-" + purpose + b"-cli")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def secure_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock``'s next ``connect`` calls CURVE clients of the servers of ``keys``
    (libzmq copies security options per ``bind``/``connect`` call)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def secure_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock``'s next ``bind`` calls CURVE servers with the servers' keypair; a connection
    is served only once the context's ZAP handler (a :class:`ZapGate`) admits its client key."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)


class ZapGate:
    """A CURVE server's gate: the ZAP socket bound in one context, admitting only the clients'
    key of ``keys``. Its owner polls :attr:`sock` and calls :meth:`serve` on one thread; a
    connection is not served before its ZAP request is answered."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> None:
        self.keys = keys
        self._client = keys.client_public_raw
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.denied = 0

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` (not bound yet) a CURVE server with the servers' keypair."""
        secure_server(sock, self.keys)

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
