"""The PD protocol's only I/O: zmq ROUTER/DEALER over tcp (127.0.0.1 unless told otherwise).

:class:`Endpoint` runs one participant on one control-loop thread, the only code that touches
the socket and the participant; bad frames are dropped and counted. Its ``Door`` authenticates
connections (CURVE with a secret) and bounds them; its ``Greeter`` runs the four-frame
handshake and admits a peer only once it is complete. See docs/pd.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq

from kvplane.errors import InvalidArgumentError, TransferTimeoutError
from kvplane.ids import PeerId, SessionId
from kvplane.metrics import MetricsRegistry
from kvplane.pd.actions import Action, Transmit
from kvplane.pd.association import Association
from kvplane.pd.codec import DEFAULT_MAX_FRAME, Codec, MalformedMessage
from kvplane.pd.control_client import ControlClient
from kvplane.pd.door import MAX_CONNECTIONS, Door
from kvplane.pd.events import (
    AnyWireEvent,
    Cancel,
    Fail,
    Hello,
    HelloConfirm,
    HelloReply,
    Probe,
    ProbeReply,
    StartTransfer,
    SubmitSlice,
)
from kvplane.pd.gather import GatherSession
from kvplane.pd.greeter import Greeter, Link
from kvplane.pd.log_budget import LogBudget
from kvplane.pd.participant import Participant
from kvplane.pd.states import SessionState
from kvplane.transfer.resharding import Piece

__all__ = ["DEFAULT_BIND", "MAX_WAIT_MS", "WAKE_ID", "ControlClient", "Endpoint"]
# ControlClient lives in pd/control_client; it is named here too for callers of the endpoint
T = TypeVar("T")
log = logging.getLogger(__name__)
DEFAULT_BIND = "tcp://127.0.0.1:0"
MAX_WAIT_MS = 50
"""The control loop's longest wait, in milliseconds. Frames and commands end a wait at once and
a wait ends at the next timer deadline, so this only bounds how late the loop notices a
deadline that moved without it (none does today)."""


_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_PEER_LEVEL = frozenset({Probe, ProbeReply, Hello, HelloReply, HelloConfirm})
"""Frame types the endpoint answers itself (the rest go to the participant)."""
WAKE_ID = b"\x7fpd-wake"
"""Routing id of the in-process socket that wakes the loop (user ids may not start with 0)."""


class Endpoint:
    """One participant on the network; see the module docstring for the threading contract.

    One ROUTER socket does everything: it is bound (peers and probes connect to it), it
    *connects* to the peers this side dials (each connection gets a local routing alias, so it
    is addressable before the tcp handshake completes), and an inproc socket wakes it for
    commands from other threads. A single socket keeps the loop to one ``poll`` per wake-up.
    """

    def __init__(
        self,
        participant: Participant,
        *,
        bind: str = DEFAULT_BIND,
        secret: bytes | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        metrics: MetricsRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_action: Callable[[Action], None] | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.participant = participant
        self.codec = Codec(secret=secret, max_frame=max_frame)
        self.clock = clock
        self.outbox: queue.SimpleQueue[Action] = queue.SimpleQueue()
        self.on_action = on_action or self.outbox.put
        self.counters: Counter[str] = Counter()
        self._frames = None if metrics is None else metrics.counter(
            "pd_endpoint_frames", "PD frames by result (ok or the drop reason)", ["result"]
        )  # fmt: skip
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        wake = f"inproc://pd-wake-{id(self)}"
        self._router.bind(wake)  # before the door's options: they are for tcp peers
        door: Door | None = None
        try:  # a bad address or option: nothing is left open
            door = Door(self._ctx, secret=secret, max_frame=max_frame,
                        max_connections=max_connections)  # fmt: skip
            door.guard(self._router)
            self._router.bind(bind)
        except BaseException:
            if door is not None:
                door.close()
            self._router.close(linger=0)
            self._ctx.term()
            raise
        self.door = door
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.door.start(self.address)
        self._waker: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.setsockopt(zmq.ROUTING_ID, WAKE_ID)
        self._waker.connect(wake)
        self._wake_lock = threading.Lock()
        self._routes: dict[PeerId, bytes] = {}
        self._identities: dict[bytes, PeerId] = {}
        self._assocs: dict[bytes, Association] = {}
        self._pruned_seen = 0
        self.log_budget = LogBudget(clock=clock)
        link = Link(self._send_on, self._bind, self._unroute, self._dispatch, self._drop,
                    self._hang_up)  # fmt: skip
        self.greeter = Greeter(participant, secret, link, self.log_budget)
        self._aliases = 0
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._wait_ms = 0
        self._rcvtimeo = -2
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the control loop on a daemon thread (all state already exists)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._loop, name=f"pd-{self.participant.peer_id}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.step()
            except Exception:  # an action callback or a bug must not stop the control loop
                self.counters["loop_errors"] += 1
                log.exception("PD control loop error (the loop keeps serving)")

    def close(self) -> None:
        """Stop the loop and close every socket (idempotent)."""
        if self._closed:
            return
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._closed = True
        with self._wake_lock:
            self._waker.close(linger=0)
        self._router.close(linger=0)
        self.door.close()
        self._ctx.term()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands from any thread ------------------------------------------------------------------
    def call(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Run ``fn`` on the loop thread (inline when there is none, or when already on it)."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        fut: Future[T] = Future()
        self._commands.put((fn, fut))
        self._wake()
        return fut.result(timeout=timeout_s)

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):  # full or closed: pending
            self._waker.send(b"", _NOBLOCK)

    def connect(self, address: str, timeout_s: float = 5.0) -> PeerId:
        """Handshake with the endpoint at ``address``; its peer id, or a typed error."""
        fut = self.call(lambda: self._begin_connect(address))
        deadline = time.monotonic() + timeout_s
        if self._thread is None:
            while not fut.done() and time.monotonic() < deadline:
                self.step(timeout_ms=5)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            self.call(lambda: self.greeter.abandon(fut))
            raise TransferTimeoutError(
                f"handshake with {address} timed out after {timeout_s}s"
            ) from exc

    def _begin_connect(self, address: str) -> Future[PeerId]:
        self._aliases += 1
        alias = b"\x7fpd-out-%d" % self._aliases
        self._router.setsockopt(zmq.CONNECT_ROUTING_ID, alias)
        self.door.dialing(self._router)
        self._router.connect(address)
        return self.greeter.dial(alias, address)

    def disconnect(self, address: str) -> None:
        """Close the connection(s) this side dialled to ``address`` (none dialled: nothing);
        a re-pair then dials afresh. Any thread."""

        def run() -> None:
            with contextlib.suppress(zmq.ZMQError):  # ENOENT: never dialled, or closed
                self._router.disconnect(address)

        self.call(run)

    def open_receiver(self, session_id: SessionId, peer_id: PeerId, start: StartTransfer) -> None:
        def run() -> None:
            _, actions = self.participant.open_receiver(session_id, peer_id, start, self.clock())
            self._dispatch(actions)

        self.call(run)

    def open_gather(
        self, session_id: SessionId, members: Mapping[PeerId, Piece], start: StartTransfer,
        *, heads: tuple[int, int], layers: tuple[int, ...],
    ) -> GatherSession:  # fmt: skip
        """Open a gather session fed by the senders of ``members`` and return it
        (:meth:`Participant.open_gather`; its ``ProtocolError`` is raised here). The PD loop
        owns it: read it from another thread only after every member's ``Finished``."""

        def run() -> GatherSession:
            gather, actions = self.participant.open_gather(
                session_id, members, start, self.clock(), heads=heads, layers=layers
            )
            self._dispatch(actions)
            return gather

        return self.call(run)

    def gather_state(self, session_id: SessionId) -> SessionState | None:
        """The state of gather ``session_id`` while any of its members is live, else None."""

        def run() -> SessionState | None:
            gather = self.participant.gathers.get(session_id)
            return None if gather is None else gather.state

        return self.call(run)

    def abandon(self, session_id: SessionId, peer_id: PeerId, reason: str) -> None:
        """Tell the sender that a receiver session it waits for will never open
        (:meth:`Participant.abandon`); ``ProtocolError`` if the peer is not live."""
        self.call(lambda: self._dispatch(self.participant.abandon(session_id, peer_id, reason)))

    def open_sender(self, session_id: SessionId, peer_id: PeerId) -> bool:
        """Open (or attach to) a sender session; False if the session was already torn down."""

        def run() -> bool:
            sess, actions = self.participant.open_sender(session_id, peer_id, self.clock())
            self._dispatch(actions)
            return sess is not None

        return self.call(run)

    def send(self, session_id: SessionId, command: SubmitSlice | Cancel | Fail) -> None:
        self.call(lambda: self._dispatch(self.participant.send(session_id, command, self.clock())))

    def receive_local(self, session_id: SessionId, event: object) -> None:
        self.call(
            lambda: self._dispatch(self.participant.receive_local(session_id, event, self.clock()))
        )

    def snapshot(self) -> dict[str, int]:
        """Endpoint counters plus the participant's (prefixed ``session_``)."""
        return self.call(self._snapshot)

    # -- the control loop --------------------------------------------------------------------
    def step(self, timeout_ms: int | None = None) -> int:
        """One loop iteration: wait for frames (at most ``timeout_ms``), serve, run due timers.

        Returns the number of frames read. The wait is one blocking ``recv`` whose receive
        timeout runs to the participant's next timer deadline (at most :data:`MAX_WAIT_MS`;
        cheaper than ``poll`` + ``recv``): an idle loop wakes only when a frame, a command or a
        deadline is due, not on a fixed tick. The deadline is read again after every iteration,
        because only this thread's dispatches change the timers.
        """
        router = self._router
        wait = self._wait_ms if timeout_ms is None else max(0, min(timeout_ms, self._wait_ms))
        if wait != self._rcvtimeo:
            router.setsockopt(zmq.RCVTIMEO, wait)
            self._rcvtimeo = wait
        frames = 0
        try:  # one frame per iteration: a ready recv returns at once, no readiness check needed
            parts = router.recv_multipart()
        except zmq.Again:
            parts = None
            self.counters["idle_wakeups"] += 1
        if parts is not None:
            frames = 1
            self._on_parts(parts)
        while not self._commands.empty():
            fn, fut = self._commands.get_nowait()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller's thread
                fut.set_exception(exc)
        now = self.clock()
        self._run_due(now)
        nxt = self._next_deadline()  # read after this iteration's work: it may set timers
        left_ms = MAX_WAIT_MS if nxt is None else math.ceil((nxt - now) * 1e3)
        self._wait_ms = max(1 if left_ms <= 0 else 0, min(MAX_WAIT_MS, left_ms))  # no spin
        return frames

    # Timed work: a subclass with its own extends both hooks, so the wait covers it too.
    def _run_due(self, now: float) -> None:
        """Run what is due at ``now`` (the participant's timers)."""
        nxt = self.participant.next_deadline()
        if nxt is not None and now >= nxt:
            self._dispatch(self.participant.tick(now))
            if self.participant.peers.pruned != self._pruned_seen:
                self._pruned_seen = self.participant.peers.pruned
                self._unroute(p for p in self._routes if p not in self.participant.peers)

    def _next_deadline(self) -> float | None:
        """When the loop must next run without a frame or a command."""
        return self.participant.next_deadline()

    def _drop(self, reason: str) -> None:
        self.counters[f"dropped_{reason}"] += 1
        if self._frames is not None:
            self._frames.labels(reason).inc()

    def _on_parts(self, parts: list[bytes]) -> None:
        counters = self.counters
        if len(parts) != 2:
            counters["frames_in"] += 1
            self._drop("bad_parts")
            return
        identity, payload = parts
        if identity == WAKE_ID:
            return
        counters["frames_in"] += 1
        assoc = self._assocs.get(identity)
        if assoc is not None:  # the hot path: an established peer
            event = self.codec.decode(payload, assoc)
        else:
            event = self._decode_unbound(identity, payload)
        if type(event) is MalformedMessage:
            self._drop(event.reason.value)
            return
        counters["frames_ok"] += 1
        if self._frames is not None:
            self._frames.labels("ok").inc()
        peer = self._identities.get(identity)
        if peer is not None and type(event) not in _PEER_LEVEL:  # the hot path
            self._dispatch(self.participant.on_event(peer, event, self.clock()))  # type: ignore[arg-type]
        else:
            self._on_peer_level(identity, peer, event)  # type: ignore[arg-type]

    def _decode_unbound(self, identity: bytes, payload: bytes) -> AnyWireEvent | MalformedMessage:
        """A frame from a connection without an established association: on the provisional
        one of its handshake if it has one, else a handshake frame."""
        assoc = self.greeter.assoc_of(identity)
        if assoc is None:
            return self.codec.decode(payload)
        event = self.codec.decode(payload, assoc)
        if type(event) is not MalformedMessage:
            return event
        plain = self.codec.decode(payload)  # a new handshake on the same connection
        return event if type(plain) is MalformedMessage else plain

    def _on_peer_level(self, identity: bytes, peer: PeerId | None, event: AnyWireEvent) -> None:
        now = self.clock()
        if isinstance(event, Probe):
            self.counters["probes"] += 1
            me = str(self.participant.peer_id)
            self._send(
                identity, ProbeReply(nonce=event.nonce, peer_id=me, counters=self._snapshot())
            )
        elif not self.greeter.on_frame(identity, peer, event, now):
            self._drop("unknown_peer" if peer is None else "unexpected")

    def _hang_up(self, address: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._router.disconnect(address)

    def _bind(self, peer_id: PeerId, identity: bytes, assoc: Association) -> None:
        old = self._routes.get(peer_id)
        if old is not None and old != identity:
            self._unroute([peer_id])
        self._identities[identity] = peer_id
        self._routes[peer_id] = identity
        self._assocs[identity] = assoc

    def _unroute(self, peer_ids: Iterable[PeerId]) -> None:
        """Forget the connections of ``peer_ids`` (replaced, or their records pruned)."""
        for peer_id in list(peer_ids):
            identity = self._routes.pop(peer_id)
            self._identities.pop(identity, None)
            self._assocs.pop(identity, None)

    def _dispatch(self, actions: list[Action]) -> None:
        for act in actions:
            if isinstance(act, Transmit):
                identity = self._routes.get(act.peer_id)
                if identity is None:
                    self._drop("no_route")
                else:
                    self._send(identity, act.event)
            else:
                self.on_action(act)

    def _send(self, identity: bytes, event: AnyWireEvent) -> None:
        self._send_on(identity, event, self._assocs.get(identity))

    def _send_on(self, identity: bytes, event: AnyWireEvent, assoc: Association | None) -> None:
        try:
            frame = self.codec.encode(event, assoc)
        except InvalidArgumentError:  # over max_frame: refused here rather than by the peer
            self._drop("unencodable")
            log.exception("cannot send %s", type(event).__name__)
            return
        try:
            self._router.send(identity, _SNDMORE_NOBLOCK)
            self._router.send(frame, _NOBLOCK)
            self.counters["frames_out"] += 1
        except zmq.Again:  # peer's queue full: best effort, the protocol retransmits
            self._drop("send_blocked")

    def _snapshot(self) -> dict[str, int]:
        out = dict(self.counters)
        out["handshake_cached_verdicts"] = self.participant.peers.cached_verdicts
        greetings = self.greeter.greetings
        out.update(self.greeter.counters)
        out["handshakes_pending"] = len(greetings)
        out["handshakes_expired"] = greetings.expired
        out["handshakes_turned_away"] = greetings.turned_away
        out["handshakes_replaced"] = greetings.replaced
        out["peers_stored"] = len(self.participant.peers)
        out["log_lines_suppressed"] = self.log_budget.suppressed_total
        out.update(self.door.snapshot())
        out["sessions_live"] = len(self.participant.sessions)
        for key, value in self.participant.counters.items():
            out[f"session_{key}"] = value
        return out
