"""Who may connect to a PD endpoint's ROUTER, and how much an unproven peer can make it hold.

:class:`Door` sets the ROUTER's bounds (message size, receive queue, handshake and heartbeat
timeouts) and, with a secret, its CURVE options: server before ``bind``, client before each
``connect`` (libzmq copies security options per call). On a thread of its own it answers ZAP
(only the client key derived from the secret passes), counts refused handshakes from the
socket's monitor and caps inbound connections. It reads no PD frame: the endpoint does.
See docs/pd.md ("The endpoint").
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterator

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvplane.curve_auth import HANDSHAKE_FAILED, CurveKeys, ZapGate, derive_keys, secure_client
from kvplane.validators import require_size

__all__ = [
    "CURVE_OVERHEAD", "HANDSHAKE_MS", "HEARTBEAT_MS", "HEARTBEAT_TIMEOUT_MS", "MAX_CONNECTIONS",
    "Door", "bytes_received", "pd_keys", "queue_depth",
]  # fmt: skip

MAX_CONNECTIONS = 64
"""Inbound connections a ROUTER holds at once (proven or not): a newcomer past it evicts the
oldest unproven one (:meth:`Door.proven`), or is cut at once when all are proven."""
GREETING_BYTES = 64
"""A ZMTP 3 greeting: what any client sends first, proving nothing."""
CURVE_HELLO_BYTES = 202
"""A CURVE HELLO command (flags, size, 200-byte body). Its box is sealed to the server's
public key, which is derived from the secret: libzmq closes a connection whose HELLO does not
open, and answers a good one, so a client that sent more than a greeting and a HELLO and is
still connected has shown it holds the key."""
CURVE_OVERHEAD = 33
"""Bytes CURVE adds to a message on the wire ("MESSAGE" command, nonce, box MAC, flags): the
ROUTER's largest message is the codec's ``max_frame`` plus this."""
HANDSHAKE_MS = 5_000
"""A connection that has not finished its zmq (CURVE) handshake by then is closed."""
HEARTBEAT_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 15_000
"""zmq heartbeats: a connection that completes no message (not even a PONG) for this long is
closed, so a frame stalled half-way holds its buffer for at most this long."""
QUEUE_BYTES = 16 << 20
"""Bytes of whole frames one connection may have queued for the loop (see :func:`queue_depth`)."""
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
_POLL_MS = 50
_TCP_INFO = struct.Struct("=128xQ")
"""Linux ``struct tcp_info`` up to ``tcpi_bytes_received`` (offset 128, since Linux 4.1)."""


def bytes_received(sock: socket.socket) -> int | None:
    """How many bytes the kernel has received on TCP socket ``sock`` (read or not); None where
    ``TCP_INFO`` does not say (not Linux, a kernel before 4.1, not a TCP socket)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except (OSError, AttributeError):
        return None
    return _TCP_INFO.unpack_from(raw)[0] if len(raw) >= _TCP_INFO.size else None


def pd_keys(secret: bytes) -> CurveKeys:
    """The PD endpoints' CURVE keys for cluster ``secret`` (distinct from the order sockets')."""
    return derive_keys(secret, b"pd", "the PD endpoint")


def queue_depth(max_frame: int) -> int:
    """The ROUTER's receive queue per connection, in frames: :data:`QUEUE_BYTES` of the
    largest frames, at least 16 and at most zmq's default 1,000."""
    return max(16, min(1000, QUEUE_BYTES // max_frame))


class Door:
    """The admission side of one ROUTER (see the module docstring). Build it, call
    :meth:`guard` before the ROUTER's ``bind``, :meth:`dialing` before each ``connect`` and
    :meth:`start` once bound; :meth:`close` before the context ends. Its counters are read by
    any thread (:meth:`snapshot`) and written only by its own."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        secret: bytes | None,
        max_frame: int,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.max_connections = require_size("max_connections", max_connections, min=1)
        self.max_frame = require_size("max_frame", max_frame, min=1)
        self.keys = None if secret is None else pd_keys(secret)
        self.gate = None if self.keys is None else ZapGate(ctx, self.keys)
        self.counters: Counter[str] = Counter()
        self._open: dict[int, str] = {}
        """Inbound connections, oldest first: fd -> the peer's address when accepted (an fd
        number is reused once closed; the address tells a reuse apart)."""
        self._proof = GREETING_BYTES + (CURVE_HELLO_BYTES if self.keys is not None else 0)
        self._port = -1
        self._monitor: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def max_message(self) -> int:
        """The ROUTER's ``MAXMSGSIZE``: a larger message cuts its connection before it is
        buffered whole."""
        return self.max_frame + (CURVE_OVERHEAD if self.keys is not None else 0)

    def guard(self, router: zmq.Socket[bytes]) -> None:
        """Set ``router``'s bounds, its monitor and (with a secret) its CURVE server options;
        call before it binds its tcp address (after any inproc bind)."""
        router.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        router.setsockopt(zmq.RCVHWM, queue_depth(self.max_frame))
        router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        router.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._monitor = router.get_monitor_socket(_WATCHED)
        if self.gate is not None:
            self.gate.secure(router)

    def dialing(self, router: zmq.Socket[bytes]) -> None:
        """Make ``router``'s next ``connect`` a CURVE client of the PD servers (no-op without
        a secret). Its bound listener keeps the server options it was bound with."""
        if self.keys is not None:
            secure_client(router, self.keys)

    def start(self, address: str) -> None:
        """Serve ZAP and the monitor on a daemon thread; ``address``: the bound tcp address
        (an accepted connection's local port is its port)."""
        tail = address.rsplit(":", 1)[-1]
        self._port = int(tail) if tail.isdigit() else -1  # not tcp: connections are not cut
        self._thread = threading.Thread(target=self._run, name="pd-door", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, int]:
        out = dict(self.counters)
        out["connections_open"] = len(self._open)
        if self.gate is not None:
            out["refused_key"] = self.gate.denied
        return out

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._monitor, None if self.gate is None else self.gate.sock):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(_POLL_MS))
                if self.gate is not None and self.gate.sock in ready:
                    self.gate.serve()
                if self._monitor is not None and self._monitor in ready:
                    self._events(self._monitor)
            except zmq.ZMQError:  # a socket closed under us: the endpoint is closing
                if self._stop.is_set():
                    return
                self.counters["door_errors"] += 1

    def _events(self, monitor: zmq.Socket[bytes]) -> None:
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._admit(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                if self._open.pop(value, None) is not None:
                    self.counters["connections_closed"] += 1
            elif kind & HANDSHAKE_FAILED:
                self.counters["refused_handshakes"] += 1

    def _admit(self, fd: int) -> None:
        """Hold accepted connection ``fd``: under the cap at once; at it, by evicting the
        oldest unproven connection (counted ``evicted_connections``); with every held one
        proven, ``fd`` is cut (counted ``refused_connections``)."""
        peer = self._peer(fd)
        if peer is None:  # closed already, or not on our port
            return
        if len(self._open) >= self.max_connections:
            victim = next((v for v, p in self._open.items() if not self.proven(v, p)), None)
            if victim is None:
                if self._cut(fd, peer):
                    self.counters["refused_connections"] += 1
                return
            if self._cut(victim, self._open.pop(victim)):
                self.counters["evicted_connections"] += 1
        self._open[fd] = peer
        self.counters["connections_accepted"] += 1

    def proven(self, fd: int, peer: str) -> bool:
        """Whether connection ``fd`` (to ``peer``) has got where only a key holder gets: more
        bytes received than a greeting (and, with a secret, a CURVE HELLO) while still open
        (see :data:`CURVE_HELLO_BYTES`). Where the kernel does not say, no connection is."""
        with self._socket(fd, peer) as sock:
            got = None if sock is None else bytes_received(sock)
        return got is not None and got > self._proof

    def _peer(self, fd: int) -> str | None:
        """The peer address of our accepted connection ``fd``; None if ``fd`` is not one."""
        with self._socket(fd, None) as sock:
            return None if sock is None else repr(sock.getpeername())

    @contextlib.contextmanager
    def _socket(self, fd: int, peer: str | None) -> Iterator[socket.socket | None]:
        """A borrowed view of ``fd`` (never closed here) if it is an accepted connection on our
        listening port (to ``peer``, when given); else None. libzmq owns the fd."""
        if self._port < 0:
            yield None
            return
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            yield None
            return
        try:
            try:
                ours = sock.getsockname()[1] == self._port
                ours = ours and (peer is None or repr(sock.getpeername()) == peer)
            except OSError:  # not a socket, not connected: not ours
                ours = False
            yield sock if ours else None
        finally:
            sock.detach()

    def _cut(self, fd: int, peer: str) -> bool:
        """Shut down accepted connection ``fd`` to ``peer`` (libzmq then closes it as a peer
        hang-up); False when the number now belongs to another file or connection."""
        with self._socket(fd, peer) as sock:
            if sock is None:
                return False
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                return True
        return False

    def close(self) -> None:
        """Stop the thread and close the door's sockets (before the context terminates)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._monitor.close(linger=0)
        if self.gate is not None:
            self.gate.close()
