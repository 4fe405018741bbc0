"""Connection bounds of the stream transports: caps, timeouts and the counters of their drops.

Owns :class:`ConnectionLimits` (the configuration), :class:`Admission` (how many accepted
connections are handshaking or open, refusing past the caps) and the socket timeouts that bound
a silent peer. Sockets are armed here, never read or written. See docs/transports.md.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Caps and timeouts of the connections one stream transport accepts.

    ``max_pending``: accepted connections still in their handshake; ``max_connections``: all
    accepted connections (handshaking or open). A connection past either cap is closed at
    once, unanswered. ``handshake_timeout_s``: the whole handshake must end by then (a
    deadline, not a per-read timeout, so trickled bytes do not extend it). ``idle_timeout_s``:
    an open connection that holds nothing and sends no byte for this long is dropped (our own
    initiators send keep-alives, see ``keepalive_s``).
    """

    max_pending: int = 64
    max_connections: int = 512
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        require_int("max_pending", self.max_pending, min=1)
        require_int("max_connections", self.max_connections, min=1)
        for what in ("handshake_timeout_s", "idle_timeout_s"):
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
    """Why an accepted connection was closed before its handshake ran."""

    PENDING_CAP = "pending_cap"
    TOTAL_CAP = "total_cap"


class Drop(enum.Enum):
    """Why a connection was ended by us: a bound triggered, or its handshake failed."""

    HANDSHAKE_TIMEOUT = "handshake_timeout"
    HANDSHAKE_FAILED = "handshake_failed"
    IDLE = "idle"
    STALL = "stall"


class Admission:
    """Counts one listener's connections by phase; refuses past :class:`ConnectionLimits`.

    ``admit`` (accept thread) → ``opened`` (after the handshake) → ``release`` (at close).
    Thread-safe; every refusal and drop is counted in ``metrics``.
    """

    def __init__(self, limits: ConnectionLimits, transport: str, metrics: MetricsRegistry) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self.pending = 0
        self.open = 0
        self._labels = {"transport": transport}
        self._m_refused = metrics.counter(
            "stream_connections_refused", "accepted connections closed unanswered past a cap",
            ["transport", "reason"],
        )  # fmt: skip
        self._m_dropped = metrics.counter(
            "stream_connections_dropped", "connections we ended: a bound or the handshake",
            ["transport", "reason"],
        )  # fmt: skip
        self._m_live = metrics.gauge(
            "stream_connections", "accepted connections by phase", ["transport", "phase"]
        )

    def admit(self) -> bool:
        """Take a pending slot for a just-accepted connection; False (counted) past a cap."""
        with self._lock:
            why = None
            if self.pending + self.open >= self.limits.max_connections:
                why = Refusal.TOTAL_CAP
            elif self.pending >= self.limits.max_pending:
                why = Refusal.PENDING_CAP
            else:
                self.pending += 1
                self._gauges()
        if why is not None:
            self._m_refused.labels(reason=why.value, **self._labels).inc()
        return why is None

    def opened(self) -> None:
        """A pending connection finished its handshake."""
        with self._lock:
            self.pending -= 1
            self.open += 1
            self._gauges()

    def release(self, was_open: bool) -> None:
        """A connection admitted by :meth:`admit` closed (``was_open``: after ``opened``)."""
        with self._lock:
            if was_open:
                self.open -= 1
            else:
                self.pending -= 1
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
