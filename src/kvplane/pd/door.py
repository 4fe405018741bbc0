"""Who may connect to a zmq listener, and what an unproven peer can make it hold.

:class:`ListenerDoor`, one implementation for the PD endpoint and every order socket
(``serving/rpc_auth``): a zmq handshake timeout, CURVE with ZAP on a thread of its own, refused
handshakes counted from the socket's monitor, a cap on inbound connections where a newcomer
evicts the oldest *unproven* one. :class:`Door`, the PD endpoint's, adds :func:`pd_keys` and
bounds on PD frames (size, queue, heartbeats). Neither reads a frame. See docs/pd.md.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvplane.curve_auth import HANDSHAKE_FAILED, CurveKeys, ZapGate, derive_keys, secure_client
from kvplane.validators import require_size

__all__ = [
    "CURVE_OVERHEAD", "HANDSHAKE_MS", "HEARTBEAT_MS", "HEARTBEAT_TIMEOUT_MS", "MAX_CONNECTIONS",
    "Door", "ListenerDoor", "bytes_received", "pd_keys", "queue_depth",
]  # fmt: skip

MAX_CONNECTIONS = 64
"""Inbound connections a listener holds at once (proven or not): a newcomer past it evicts the
oldest unproven one (:meth:`ListenerDoor.proven`), or is cut at once when all are proven."""
GREETING_BYTES = 64
"""A ZMTP 3 greeting: what any client sends first, proving nothing."""
CURVE_HELLO_BYTES = 202
"""A CURVE HELLO command (flags, size, 200-byte body). Its box is sealed to the server's
public key, which is derived from the secret: libzmq closes a connection whose HELLO does not
open, and answers a good one, so a client that sent more than a greeting and a HELLO and is
still connected has shown it holds the key."""
HANDSHAKE_MS = 5_000
"""A connection that has not finished its zmq (CURVE or NULL) handshake by then is closed
(libzmq's default: 30 s)."""
log = logging.getLogger(__name__)
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
_POLL_MS = 50
_TCP_INFO = struct.Struct("=128xQ")
"""Linux ``struct tcp_info`` up to ``tcpi_bytes_received`` (offset 128, since Linux 4.1)."""
Count = Callable[[str, int], None]


def bytes_received(sock: socket.socket) -> int | None:
    """How many bytes the kernel has received on TCP socket ``sock`` (read or not); None where
    ``TCP_INFO`` does not say (not Linux, a kernel before 4.1, not a TCP socket)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except (OSError, AttributeError):
        return None
    return _TCP_INFO.unpack_from(raw)[0] if len(raw) >= _TCP_INFO.size else None


class ListenerDoor:
    """The admission side of one bound zmq socket (see the module docstring). Build it, call
    :meth:`guard` before the socket's tcp ``bind``, :meth:`dialing` before each ``connect`` of
    the same socket and :meth:`start` once bound; :meth:`close` before the context ends.

    ``keys``: CURVE keys (None: a plain listener, still capped and timed). ``count``: called
    on the door's thread with each counter increment (``refused_handshakes``,
    ``evicted_connections``, ``refused_connections``, ``connections_accepted``,
    ``connections_closed``, ``door_errors``) besides the door's own counters, which any thread
    reads with :meth:`snapshot`. ``InvalidArgumentError`` for ``max_connections`` < 1."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        keys: CurveKeys | None,
        max_connections: int = MAX_CONNECTIONS,
        name: str = "door",
        count: Count | None = None,
    ) -> None:
        self.max_connections = require_size("max_connections", max_connections, min=1)
        self.keys = keys
        self.gate = None if keys is None else ZapGate(ctx, keys)
        self.name = name
        self._hook = count
        self._counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._open: dict[int, str] = {}
        """Inbound connections, oldest first: fd -> the peer's address when accepted (an fd
        number is reused once closed; the address tells a reuse apart). Door thread only."""
        self._proof = GREETING_BYTES + (CURVE_HELLO_BYTES if keys is not None else 0)
        self._port = -1
        self._monitor: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def guard(self, sock: zmq.Socket[bytes]) -> None:
        """Set ``sock``'s handshake timeout, its monitor and (with keys) its CURVE server
        options; call before it binds its tcp address (after any inproc bind)."""
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        self._monitor = sock.get_monitor_socket(_WATCHED)
        if self.gate is not None:
            self.gate.secure(sock)

    def dialing(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock``'s next ``connect`` a CURVE client of the keys' servers (no-op
        without keys). Its bound listener keeps the server options it was bound with."""
        if self.keys is not None:
            secure_client(sock, self.keys)

    def start(self, address: str) -> None:
        """Serve ZAP and the monitor on a daemon thread; ``address``: the bound tcp address
        (an accepted connection's local port is its port; not tcp: nothing is cut)."""
        tail = address.rsplit(":", 1)[-1]
        self._port = int(tail) if tail.isdigit() else -1
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    @property
    def connections_open(self) -> int:
        """Inbound connections held now."""
        return len(self._open)

    def snapshot(self) -> dict[str, int]:
        """The counters, ``connections_open`` and (with keys) ``refused_key`` (ZAP denials)."""
        with self._lock:
            out = dict(self._counters)
        out["connections_open"] = self.connections_open
        if self.gate is not None:
            out["refused_key"] = self.gate.denied
        return out

    def _count(self, key: str) -> None:
        with self._lock:
            self._counters[key] += 1
        if self._hook is not None:
            self._hook(key, 1)

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
            except zmq.ZMQError:  # a socket closed under us: the owner is closing
                if self._stop.is_set():
                    return
                self._count("door_errors")
            except Exception:  # a bug: without this thread no handshake would complete
                self._count("door_errors")
                log.exception("%s error (the door keeps serving)", self.name)

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
                    self._count("connections_closed")
            elif kind & HANDSHAKE_FAILED:
                self._count("refused_handshakes")

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
                    self._count("refused_connections")
                return
            if self._cut(victim, self._open.pop(victim)):
                self._count("evicted_connections")
        self._open[fd] = peer
        self._count("connections_accepted")

    def proven(self, fd: int, peer: str) -> bool:
        """Whether connection ``fd`` (to ``peer``) has got where only a key holder gets: more
        bytes received than a greeting (and, with keys, a CURVE HELLO) while still open (see
        :data:`CURVE_HELLO_BYTES`). Where the kernel does not say, no connection is."""
        with self._socket(fd, peer) as sock:
            got = None if sock is None else bytes_received(sock)
        return got is not None and got > self._proof

    def _peer(self, fd: int) -> str | None:
        """The peer address of our accepted connection ``fd``; None if ``fd`` is not one."""
        with self._socket(fd, None) as sock:
            try:
                return None if sock is None else repr(sock.getpeername())
            except OSError:  # closed since the check (libzmq owns it)
                return None

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


# -- the PD endpoint's door ------------------------------------------------------------------------
CURVE_OVERHEAD = 33
"""Bytes CURVE adds to a message on the wire ("MESSAGE" command, nonce, box MAC, flags): the
ROUTER's largest message is the codec's ``max_frame`` plus this."""
HEARTBEAT_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 15_000
"""zmq heartbeats: a connection that completes no message (not even a PONG) for this long is
closed, so a frame stalled half-way holds its buffer for at most this long."""
QUEUE_BYTES = 16 << 20
"""Bytes of whole frames one connection may have queued for the loop (see :func:`queue_depth`)."""


def pd_keys(secret: bytes) -> CurveKeys:
    """The PD endpoints' CURVE keys for cluster ``secret`` (distinct from the order sockets')."""
    return derive_keys(secret, b"pd", "the PD endpoint")


def queue_depth(max_frame: int) -> int:
    """The ROUTER's receive queue per connection, in frames: :data:`QUEUE_BYTES` of the
    largest frames, at least 16 and at most zmq's default 1,000."""
    return max(16, min(1000, QUEUE_BYTES // max_frame))


class Door(ListenerDoor):
    """The door of one PD endpoint's ROUTER (call order: :class:`ListenerDoor`). ``secret``:
    the cluster secret (None: plain); ``max_frame``: the codec's largest frame."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        *,
        secret: bytes | None,
        max_frame: int,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.max_frame = require_size("max_frame", max_frame, min=1)
        keys = None if secret is None else pd_keys(secret)
        super().__init__(ctx, keys=keys, max_connections=max_connections, name="pd-door")

    @property
    def max_message(self) -> int:
        """The ROUTER's ``MAXMSGSIZE``: a larger message cuts its connection before it is
        buffered whole."""
        return self.max_frame + (CURVE_OVERHEAD if self.keys is not None else 0)

    def guard(self, sock: zmq.Socket[bytes]) -> None:
        """Bound ``sock``'s messages, receive queue and silence (heartbeats), then set what
        every listener door sets; call before it binds its tcp address."""
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
        sock.setsockopt(zmq.RCVHWM, queue_depth(self.max_frame))
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        super().guard(sock)
