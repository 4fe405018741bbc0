"""Connection bounds of the stream transports: caps, timeouts and the counters of their drops.

Owns :class:`ConnectionLimits` (the configuration), :class:`Admission` (how many accepted
connections are handshaking or open; past a cap it evicts the oldest handshaking one, never an
authenticated one) and the socket timeouts that bound a silent peer. Sockets are armed or shut
here, never read or written. See docs/transports.md.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import socket
import struct
import threading
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError
from kvplane.metrics import MetricsRegistry
from kvplane.validators import require_finite_positive, require_int

RECV_SHARE = 3
"""A receive timeout is armed at ``1 / RECV_SHARE`` of a silence bound (see :func:`arm_silence`)."""
SEND_SHARE = 4
"""A send timeout is armed at ``1 / SEND_SHARE`` of a silence bound (see :func:`arm_silence`)."""
FIRST_BYTE_TIMEOUT_S = 1.0
"""Default of ``ConnectionLimits.first_byte_timeout_s`` (and of ``kvplane serve
--first-byte-timeout``): an accepted connection silent this long is dropped."""
TARGET_STALL_S = 60.0
"""Default stall bound of a target holding pins for a peer (``target_stall_s`` of ``tcp`` and
``shm``): silent (or, on tcp, taking none of a READ reply) this long, the peer is dropped and
its pins released. Met with slack: see :func:`arm_silence`."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Caps and timeouts of the connections one stream transport accepts.

    ``max_pending``: accepted connections still in their handshake; ``max_connections``: all
    accepted connections (handshaking or open). A connection that would pass either cap
    evicts the oldest handshaking one (closed unanswered); with none handshaking it is itself
    closed at once, unanswered: authenticated connections are never evicted.
    ``first_byte_timeout_s``: an accepted connection that sends no byte by then is dropped.
    ``handshake_timeout_s``: the whole handshake must end by then (a deadline, not a per-read
    timeout, so trickled bytes do not extend it). ``idle_timeout_s``: an open connection that
    holds nothing and sends no byte for this long is dropped (our own initiators send
    keep-alives, see ``keepalive_s``).
    """

    max_pending: int = 64
    max_connections: int = 512
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S

    def __post_init__(self) -> None:
        require_int("max_pending", self.max_pending, min=1)
        require_int("max_connections", self.max_connections, min=1)
        for what in ("handshake_timeout_s", "idle_timeout_s", "first_byte_timeout_s"):
            require_finite_positive(what, getattr(self, what), InvalidArgumentError)
        if self.max_pending > self.max_connections:
            raise InvalidArgumentError(
                f"max_pending {self.max_pending} exceeds max_connections {self.max_connections}"
            )


def keepalive_s(idle_timeout_s: float) -> float:
    """How often an initiator whose target drops idle connections after ``idle_timeout_s``
    sends a keep-alive: twice per receive window of :func:`arm_silence`, so one late ping is
    never fatal."""
    return idle_timeout_s / (2 * RECV_SHARE)


class Refusal(enum.Enum):
    """Why an accepted connection was closed before its handshake ran: every admitted one is
    authenticated, so there is none to evict for it."""

    TOTAL_CAP = "total_cap"


class Drop(enum.Enum):
    """Why a connection was ended by us: a bound triggered, its handshake failed, or a newer
    connection took its handshake slot."""

    EVICTED = "evicted"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    HANDSHAKE_FAILED = "handshake_failed"
    IDLE = "idle"
    STALL = "stall"


class Phase(enum.Enum):
    """Where an admitted connection's slot stands."""

    PENDING = "pending"
    OPEN = "open"
    EVICTED = "evicted"
    CLOSED = "closed"


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted connection's slot in :class:`Admission` (compared by identity)."""

    sock: socket.socket
    phase: Phase = Phase.PENDING


class Admission:
    """Counts one listener's connections by phase; evicts or refuses past :class:`ConnectionLimits`.

    ``admit`` (accept thread) → ``opened`` (once the peer proved itself) → ``release`` (at
    close). Handshaking connections queue by age; the oldest is evicted (its socket shut, so
    its thread ends) for a newcomer when a cap is reached. Thread-safe; every refusal,
    eviction and drop is counted in ``metrics``.
    """

    def __init__(self, limits: ConnectionLimits, transport: str, metrics: MetricsRegistry) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._queue: dict[Ticket, None] = {}
        """Handshaking tickets, oldest first (a dict keeps insertion order)."""
        self.open = 0
        self._labels = {"transport": transport}
        self._m_refused = metrics.counter(
            "stream_connections_refused", "accepted connections closed unanswered past a cap",
            ["transport", "reason"],
        )  # fmt: skip
        self._m_dropped = metrics.counter(
            "stream_connections_dropped",
            "connections we ended: a bound, the handshake or an eviction",
            ["transport", "reason"],
        )  # fmt: skip
        self._m_live = metrics.gauge(
            "stream_connections", "accepted connections by phase", ["transport", "phase"]
        )

    @property
    def pending(self) -> int:
        """Connections admitted and still handshaking."""
        return len(self._queue)

    def admit(self, sock: socket.socket) -> Ticket | None:
        """A pending slot for the just-accepted ``sock``. At a cap the oldest handshaking
        connection is evicted (shut down and counted) and its slot handed over; with none
        handshaking, None (counted): ``sock`` is the caller's to close."""
        limits = self.limits
        with self._lock:
            full = self.pending >= limits.max_pending
            full = full or self.pending + self.open >= limits.max_connections
            if full and not self._queue:
                self._m_refused.labels(reason=Refusal.TOTAL_CAP.value, **self._labels).inc()
                return None
            if full:
                victim = next(iter(self._queue))
                del self._queue[victim]
                victim.phase = Phase.EVICTED
                # under the lock: its thread closes the socket only after ``release``
                with contextlib.suppress(OSError):
                    victim.sock.shutdown(socket.SHUT_RDWR)
                self.dropped(Drop.EVICTED)
            ticket = Ticket(sock)
            self._queue[ticket] = None
            self._gauges()
        return ticket

    def opened(self, ticket: Ticket) -> bool:
        """``ticket``'s peer proved itself: it is open from now on and never evicted. False if
        it was evicted first (the caller ends it without a reply)."""
        with self._lock:
            if ticket.phase is not Phase.PENDING:
                return False
            del self._queue[ticket]
            ticket.phase = Phase.OPEN
            self.open += 1
            self._gauges()
            return True

    def release(self, ticket: Ticket) -> None:
        """``ticket``'s connection is ending (before its socket is closed); its slot is free
        unless an eviction already handed it over. Idempotent."""
        with self._lock:
            if ticket.phase is Phase.PENDING:
                del self._queue[ticket]
            elif ticket.phase is Phase.OPEN:
                self.open -= 1
            ticket.phase = Phase.CLOSED
            self._gauges()

    def dropped(self, why: Drop) -> None:
        self._m_dropped.labels(reason=why.value, **self._labels).inc()

    def _gauges(self) -> None:
        self._m_live.labels(phase="handshake", **self._labels).set(self.pending)
        self._m_live.labels(phase="open", **self._labels).set(self.open)


def _timeval(seconds: float, share: int) -> bytes:
    """``struct timeval`` of ``seconds / share``; never (0, 0) (none) for ``seconds > 0``."""
    micros = max(1, round(seconds * 1e6 / share)) if seconds > 0 else 0
    return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)


def arm_silence(sock: socket.socket, seconds: float) -> None:
    """Arm ``sock`` so that a peer silent for ``seconds`` fails our next call (0: disarm).

    A timeout bounds one call, and a call that waits for all its bytes (``MSG_WAITALL``,
    ``sendall``) returns the part it got when it ends, so the next call fails one timeout
    later: ``SO_RCVTIMEO`` is armed at ``seconds / RECV_SHARE`` (a silent sender is dropped
    within ``2 / RECV_SHARE`` of ``seconds`` after its last byte, the rest being slack for a
    loaded host) and ``SO_SNDTIMEO`` at ``seconds / SEND_SHARE`` (a peer's zero-window probes
    free a little send buffer that restarts the wait). On TCP, ``TCP_USER_TIMEOUT`` also ends
    a connection whose sent bytes stay unacknowledged (zero window) that long."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds, RECV_SHARE))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds, SEND_SHARE))
    if sock.family in (socket.AF_INET, socket.AF_INET6) and hasattr(socket, "TCP_USER_TIMEOUT"):
        millis = max(1, round(seconds * 1e3 * 2 / RECV_SHARE)) if seconds > 0 else 0
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, millis)


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a socket call ended by a timeout armed by :func:`arm_silence`."""
    return isinstance(exc, TimeoutError | BlockingIOError) or (
        isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.ETIMEDOUT)
    )
