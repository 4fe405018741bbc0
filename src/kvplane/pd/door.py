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
import threading
from collections import Counter

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvplane.curve_auth import HANDSHAKE_FAILED, CurveKeys, ZapGate, derive_keys, secure_client
from kvplane.validators import require_size

__all__ = [
    "CURVE_OVERHEAD", "HANDSHAKE_MS", "HEARTBEAT_MS", "HEARTBEAT_TIMEOUT_MS", "MAX_CONNECTIONS",
    "Door", "pd_keys", "queue_depth",
]  # fmt: skip

MAX_CONNECTIONS = 64
"""Inbound connections a ROUTER holds at once (authenticated or not); more are cut at once."""
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
        self._open: set[int] = set()
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
                if len(self._open) < self.max_connections:
                    self._open.add(value)
                    self.counters["connections_accepted"] += 1
                elif self._cut(value):
                    self.counters["refused_connections"] += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                if value in self._open:
                    self._open.discard(value)
                    self.counters["connections_closed"] += 1
            elif kind & HANDSHAKE_FAILED:
                self.counters["refused_handshakes"] += 1

    def _cut(self, fd: int) -> bool:
        """Shut down accepted connection ``fd`` (libzmq then closes it as a peer hang-up).
        Only a socket on our listening port: the number may already belong to another file."""
        if self._port < 0:
            return False
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return False
        try:
            if sock.getsockname()[1] != self._port:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            sock.detach()

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
