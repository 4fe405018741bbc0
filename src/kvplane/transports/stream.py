"""The connection-oriented half shared by ``tcp`` and ``shm``: links per peer, jobs, teardown.

Also the target side's admission, first-byte wait, handshake, and the idle and stall bounds
of each accepted connection.
Subclasses provide the dialing, the per-job protocol and the target side. See
docs/transports.md.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import ClassVar, TypedDict

from kvplane.errors import HandshakeError, InvalidArgumentError, KVPlaneError, TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transports.base import FailureKind, Peer, XferState
from kvplane.transports.batches import Job
from kvplane.transports.bounds import (
    TARGET_STALL_S,
    Admission,
    ConnectionLimits,
    Drop,
    Phase,
    Ticket,
    arm_silence,
    keepalive_s,
    timed_out,
)
from kvplane.transports.channel import Channel, Link, Listener
from kvplane.transports.core import TransportCore
from kvplane.transports.handshake import await_first_byte, client_handshake, server_handshake
from kvplane.transports.wire import WIRE_VERSION, Header, Metadata, RegionInfo, Welcome, encode
from kvplane.validators import require_finite_positive


class StreamOptions(TypedDict, total=False):
    """The keyword options of every stream transport (:class:`StreamTransport` has them)."""

    secret: bytes | None
    connect_timeout_s: float
    agent: str | None
    metrics: MetricsRegistry | None
    history: int
    copy_threads: int | None
    limits: ConnectionLimits | None
    target_stall_s: float


@dataclass(slots=True)
class LinkState:
    """Initiator-side state of one connection (subclasses add protocol fields)."""

    peer_id: PeerId
    link: Link | None = None


class StreamTransport(TransportCore):
    """Base of socket transports: one link per peer, one listener, shared-secret handshakes."""

    link_drain_s: ClassVar[float] = 0.0
    """How long a failing link lets its running job end before shutting the socket
    (:class:`~kvplane.transports.channel.Link`)."""
    address: str
    """Where peers reach our listener (set by the subclass before :meth:`_listen`)."""

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        connect_timeout_s: float = 10.0,
        agent: str | None = None,
        metrics: MetricsRegistry | None = None,
        history: int = 100_000,
        copy_threads: int | None = None,
        limits: ConnectionLimits | None = None,
        target_stall_s: float = TARGET_STALL_S,
    ) -> None:
        if secret is not None and (not isinstance(secret, bytes) or not secret):
            raise InvalidArgumentError("secret must be non-empty bytes or None")
        timeout = require_finite_positive(
            "connect_timeout_s", connect_timeout_s, InvalidArgumentError
        )
        self.target_stall_s = require_finite_positive(
            "target_stall_s", target_stall_s, InvalidArgumentError
        )
        """A target holding pins for a peer silent this long drops it (see ``bounds``)."""
        limits = ConnectionLimits() if limits is None else limits
        if not isinstance(limits, ConnectionLimits):
            raise InvalidArgumentError(f"limits must be ConnectionLimits, got {limits!r}")
        super().__init__(agent=agent, metrics=metrics, history=history, copy_threads=copy_threads)
        self._secret = secret
        self._connect_timeout = timeout
        self.limits = limits
        self._admission = Admission(limits, self.name, self.metrics)
        self._links: dict[PeerId, LinkState] = {}
        self._listener: Listener | None = None

    # -- subclass protocol ---------------------------------------------------------------------
    def _new_state(self, peer_id: PeerId) -> LinkState:
        return LinkState(peer_id)

    def _run(self, state: LinkState, job: object) -> None:
        raise NotImplementedError

    def _on_frame(self, state: LinkState, header: Header) -> None:
        raise NotImplementedError

    def _on_recv_exit(self, state: LinkState) -> None:
        """The receiver thread ended (the link is down)."""

    def _on_link_closed(self, state: LinkState) -> None:
        """The link's threads have stopped (release per-peer resources)."""

    def _welcome(self) -> tuple[Welcome, list[int]]:
        return Welcome(self._region_infos(), idle_ms=self._idle_ms()), []

    def _host(self) -> str:
        """The host identity our metadata carries for peers to check ("": none)."""
        return ""

    def _serve_target(self, ch: Channel, peer: PeerId) -> None:
        raise NotImplementedError

    # -- shared machinery ----------------------------------------------------------------------
    def metadata(self) -> bytes:
        self._check_open()
        regions = self._region_infos()
        return encode(Metadata(WIRE_VERSION, self.name, self.agent, self.address, self._host(),
                               regions))  # fmt: skip

    def _region_infos(self) -> list[RegionInfo]:
        return [RegionInfo(int(e.region.region_id), e.region.length, 0, *self._location(e.extra))
                for e in self._regions.entries() if e.exported]  # fmt: skip

    @staticmethod
    def _location(extra: object) -> tuple[int, int]:
        return extra if isinstance(extra, tuple) else (0, 0)

    def _idle_ms(self) -> int:
        return max(1, round(self.limits.idle_timeout_s * 1e3))

    def _listen(self, sock: socket.socket) -> None:
        """Serve the connections accepted on the listening ``sock``."""
        self._listener = Listener(sock, f"kvplane-{self.name}-{self.agent}", self._serve,
                                  self._admission)  # fmt: skip

    def _handshake(
        self, ch: Channel, expect: str, *, failure: str, address: str | None = None,
        with_fds: bool = False,
    ) -> tuple[str, Welcome, list[int]]:  # fmt: skip
        """Initiator side of the handshake on ``ch``, its socket first connected to ``address``
        unless None, each step within ``connect_timeout_s``; the socket is left blocking. Any
        failure closes ``ch``; an ``OSError`` is raised as ``TransportError("{failure}: …")``."""
        try:
            if address is not None:
                ch.sock.connect(address)
            got = client_handshake(ch, self.agent, self.name, self._secret, expect=expect,
                                   with_fds=with_fds, timeout_s=self._connect_timeout)  # fmt: skip
        except OSError as exc:
            ch.close()
            raise TransportError(f"{failure}: {exc}") from None
        except BaseException:
            ch.close()
            raise
        ch.sock.settimeout(None)
        return got

    def _install(self, peer_id: PeerId, ch: Channel, welcome: Welcome) -> tuple[Peer, LinkState]:
        """Adopt a handshaken channel as the peer's link, or only refresh a live link's table."""
        peer = Peer(peer_id, {RegionId(r.region_id): r.length for r in welcome.regions})
        with self._lock:
            current = self._links.get(peer_id)
            if current is not None and current.link is not None and not current.link.down:
                ch.close()
                return peer, current
            state = self._new_state(peer_id)
            state.link = Link(
                ch, f"kvplane-{self.name}-{self.agent}->{peer_id}",
                run_job=lambda job: self._run(state, job),
                drop_job=self._drop,
                on_frame=lambda h: self._on_frame(state, h),
                on_down=self._on_down,
                on_recv_exit=lambda link: self._on_recv_exit(state),
                drain_s=self.link_drain_s,
                keepalive_s=keepalive_s(welcome.idle_ms / 1e3) if welcome.idle_ms > 0 else 0.0,
            )  # fmt: skip
            self._links[peer_id] = state
        if current is not None and current.link is not None:
            current.link.close()
            self._on_link_closed(current)
        return peer, state

    def _start(self, job: Job) -> None:
        batch = job.batch
        with self._lock:
            state = self._links.get(job.peer.peer_id)
        link = None if state is None else state.link
        batch.job = link
        if link is None or not link.put(job):
            why = "not connected" if link is None else f"connection down: {link.reason}"
            self._batches.finish(batch, XferState.FAILED, FailureKind.REMOTE_DISCONNECT, why)
            self._batches.quiesce(batch)

    def _drop(self, job: object) -> None:
        if isinstance(job, Job) and not job.handed_off:
            self._batches.fail_all([job.batch], FailureKind.REMOTE_DISCONNECT, "connection down")
            self._batches.quiesce(job.batch)

    def _on_down(self, link: Link, why: str) -> None:
        mine = [b for b in self._batches.live() if b.job is link]
        self._batches.fail_all(mine, FailureKind.REMOTE_DISCONNECT, why)

    def _serve(self, ch: Channel, ticket: Ticket) -> None:
        """Target side of one admitted connection (its slot released by the ``Listener``):
        a first byte by ``first_byte_timeout_s``, the handshake by its deadline (any failure
        closes unanswered, counted unless evicted), then the subclass's loop, idle-bounded.
        The slot turns open once the peer proved itself, before the WELCOME."""
        limits = self.limits
        start = time.monotonic()

        def welcome() -> tuple[Welcome, list[int]]:
            if not self._admission.opened(ticket):
                raise HandshakeError("evicted by a newer connection during the handshake")
            return self._welcome()

        first = limits.first_byte_timeout_s < limits.handshake_timeout_s
        late = Drop.FIRST_BYTE_TIMEOUT if first else Drop.HANDSHAKE_TIMEOUT
        try:
            await_first_byte(ch.sock, min(limits.first_byte_timeout_s, limits.handshake_timeout_s))
            late = Drop.HANDSHAKE_TIMEOUT
            left = limits.handshake_timeout_s - (time.monotonic() - start)
            agent = server_handshake(ch, self.agent, self.name, self._secret, welcome,
                                     timeout_s=left)  # fmt: skip
            ch.sock.settimeout(None)
            self._idle(ch)
        except (OSError, KVPlaneError) as exc:
            if ticket.phase is not Phase.EVICTED:  # an eviction was counted when it happened
                timeout = isinstance(exc, TimeoutError)
                self._admission.dropped(late if timeout else Drop.HANDSHAKE_FAILED)
            return
        self._serve_target(ch, PeerId(agent))

    def _idle(self, ch: Channel) -> None:
        """Arm ``ch`` with the idle bound: the target holds nothing for the peer."""
        arm_silence(ch.sock, self.limits.idle_timeout_s)

    def _holding(self, ch: Channel) -> None:
        """Arm ``ch`` with the stall bound: the target holds pins for the peer."""
        arm_silence(ch.sock, self.target_stall_s)

    def _ended(self, exc: BaseException, holding: bool) -> None:
        """A target loop ended by ``exc``: count a triggered bound (stall if it ``holding``
        pins, else idle)."""
        if timed_out(exc):
            self._admission.dropped(Drop.STALL if holding else Drop.IDLE)

    def _close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            states = list(self._links.values())
            self._links.clear()
        for state in states:
            if state.link is not None:
                state.link.close()
            self._on_link_closed(state)
