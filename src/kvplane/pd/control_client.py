"""A blocking DEALER that speaks PD frames to an endpoint: health probes, benches, fuzzers.

With a secret it is a CURVE client of the PD endpoints (keys derived from the secret). It can
shake hands like an endpoint (:meth:`ControlClient.handshake`, or its two halves), after which
its frames travel on the association. It holds no participant and keeps no peer state. See
docs/pd.md.
"""

from __future__ import annotations

import secrets

import msgspec
import zmq

from kvplane.curve_auth import secure_client
from kvplane.errors import IncompatiblePeerError, TransferTimeoutError
from kvplane.pd.association import NONCE_BYTES, Association, associate
from kvplane.pd.codec import DEFAULT_MAX_FRAME, Codec, MalformedMessage
from kvplane.pd.door import pd_keys
from kvplane.pd.events import AnyWireEvent, Hello, HelloConfirm, HelloReply, Probe, ProbeReply


class ControlClient:
    """A blocking DEALER connected to one endpoint; ``TransferTimeoutError`` when no frame
    comes within ``timeout_s``."""

    def __init__(
        self,
        address: str,
        *,
        secret: bytes | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        timeout_s: float = 5.0,
    ) -> None:
        self.codec = Codec(secret=secret, max_frame=max_frame)
        self.timeout_ms = int(timeout_s * 1000)
        self.assoc: Association | None = None
        """The association once :meth:`handshake` succeeded (every frame then travels on it)."""
        self.peer: Hello | None = None
        """The endpoint's ``Hello``, from its acknowledgement of our handshake."""
        self._ctx = zmq.Context()
        self.sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        if secret is not None:
            secure_client(self.sock, pd_keys(secret))
        self.sock.connect(address)

    def send_raw(self, *parts: bytes) -> None:
        self.sock.send_multipart(list(parts))

    def send(self, event: AnyWireEvent) -> None:
        self.sock.send(self.codec.encode(event, self.assoc))

    def recv(self) -> AnyWireEvent | MalformedMessage:
        try:
            return self.codec.decode(self.sock.recv(), self.assoc)
        except zmq.Again as exc:
            raise TransferTimeoutError(f"no reply within {self.timeout_ms} ms") from exc

    def request(self, event: AnyWireEvent) -> AnyWireEvent | MalformedMessage:
        self.send(event)
        return self.recv()

    def handshake(self, hello: Hello) -> HelloReply:
        """Shake hands as the peer that ``hello`` describes (a fresh nonce replaces its own):
        the endpoint's reply; when it accepted, the confirm round trip is done too and
        :attr:`peer` holds the endpoint's ``Hello``. ``IncompatiblePeerError`` if the endpoint
        accepted but then never acknowledged."""
        ours, reply = self.greet(hello)
        if reply.accepted:
            self.confirm(ours, reply)
        return reply

    def greet(self, hello: Hello) -> tuple[Hello, HelloReply]:
        """The first half of :meth:`handshake`: send ``hello`` with a fresh nonce; that
        ``Hello`` and the endpoint's reply to it (frames answering others are skipped)."""
        ours = msgspec.structs.replace(hello, nonce=secrets.token_bytes(NONCE_BYTES))
        self.send(ours)
        while True:
            reply = self.recv()
            if isinstance(reply, HelloReply) and reply.echo == ours.nonce:
                return ours, reply

    def confirm(self, ours: Hello, reply: HelloReply) -> Hello:
        """The second half: confirm the accepting ``reply`` to ``ours`` on the new association
        and return the endpoint's ``Hello`` from its acknowledgement (also :attr:`peer`);
        ``IncompatiblePeerError`` for anything else."""
        self.assoc = associate(self.codec.secret, ours, reply.nonce, we_initiated=True)
        self.send(HelloConfirm(echo=reply.nonce))
        ack = self.recv()
        if not (
            isinstance(ack, HelloConfirm)
            and ack.echo == ours.nonce
            and ack.hello is not None
            and ack.hello.nonce == reply.nonce
        ):
            raise IncompatiblePeerError(f"the endpoint did not acknowledge our handshake: {ack!r}")
        self.peer = ack.hello
        return ack.hello

    def probe(self, nonce: int = 1) -> ProbeReply:
        """Ask for health; skips unrelated frames; ``TransferTimeoutError`` if none comes."""
        self.send(Probe(nonce=nonce))
        while True:
            got = self.recv()
            if isinstance(got, ProbeReply) and got.nonce == nonce:
                return got

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()
