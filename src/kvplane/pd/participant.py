"""One worker's side of the PD protocol: many sessions, epochs, tombstones, timers and leases.

Still sans-IO (``now`` is an argument): stale work never recreates state, and peer loss fails
only that peer's sessions. See docs/pd.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import msgspec

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId
from kvplane.metrics import MetricsRegistry
from kvplane.pd.actions import Action, ArmTimer, Finished, Transmit
from kvplane.pd.events import (
    Abort,
    AbortAck,
    AnyWireEvent,
    Cancel,
    Fail,
    Heartbeat,
    Hello,
    HelloConfirm,
    HelloReply,
    LeaseRenew,
    Outcome,
    PeerLost,
    SessionEvent,
    StartTransfer,
    SubmitSlice,
    Timeout,
    TimerKind,
    TransferRequest,
    wire_text,
)
from kvplane.pd.gather import GatherSession
from kvplane.pd.gathers import GatherBook
from kvplane.pd.handshake import PeerProfile, Verdict
from kvplane.pd.peers import DEFAULT_CAPACITY, PeerTable, Standing
from kvplane.pd.receiver import ReceiverSession
from kvplane.pd.sender import SenderSession
from kvplane.pd.session import Session
from kvplane.pd.states import OUTCOME_STATE, Ownership, Role
from kvplane.pd.timers import TimerQueue, Timings
from kvplane.pd.tombstones import TOMB_TOKEN, Tombstone, TombstoneTable, answer
from kvplane.transfer.resharding import Piece
from kvplane.validators import require_id, require_int

TimerKey = tuple[int, TimerKind, int]
WITHHELD = "incompatible (reasons are sent only to a peer that holds the shared secret)"
"""The one reason a refusal carries when its reasons may not be disclosed."""
_REFUSAL_COUNTER = {
    Standing.INCOMPATIBLE: "incompatible_peer",
    Standing.STALE: "stale_incarnation",
    Standing.FULL: "peer_table_full",
}


class Participant:
    """All PD sessions of one worker (either role), driven with explicit ``now`` values.
    ``kv_role``: which way its KV flows, so the handshake also judges TP head ranges (module
    docstring; None: either role, no such check); ``check_metadata``: judges a peer's
    ``transport_metadata`` (PeerTable)."""

    def __init__(
        self,
        peer_id: PeerId,
        profile: PeerProfile,
        *,
        incarnation: int,
        timings: Timings | None = None,
        metrics: MetricsRegistry | None = None,
        tombstone_capacity: int = 65536,
        transport: str = "",
        transport_metadata: bytes = b"",
        kv_role: Role | None = None,
        peer_capacity: int = DEFAULT_CAPACITY,
        check_metadata: Callable[[bytes], str | None] | None = None,
    ) -> None:
        require_int("incarnation", incarnation, min=0, max=(1 << 62) - 1)
        require_id("Participant.peer_id", peer_id)
        self.peer_id = peer_id
        self.incarnation = incarnation
        self.timings = timings or Timings()
        sends = None if kv_role is None else kv_role is Role.SENDER
        self.peers = PeerTable(profile, self.timings.heartbeat_s, sends=sends,
                               capacity=peer_capacity, check_metadata=check_metadata)  # fmt: skip
        self._hello = Hello(
            peer_id=peer_id,
            incarnation=incarnation,
            profile=profile,
            fingerprint=self.peers.fingerprint,
            transport=transport,
            transport_metadata=transport_metadata,
            lease_ms=max(1, int(self.timings.lease_s * 1000)),
        )
        self.sessions: dict[SessionId, Session] = {}
        self.gathers = GatherBook()
        self._by_peer: dict[PeerId, set[SessionId]] = {}
        self._serial_of: dict[SessionId, int] = {}
        self._by_serial: dict[int, SessionId] = {}
        self._tombs = TombstoneTable(tombstone_capacity)
        self._timers: TimerQueue[TimerKey] = TimerQueue()
        self._next_serial = 0
        self._next_epoch = incarnation
        self._next_token = TOMB_TOKEN  # _token() hands out TOMB_TOKEN + 1 on: none is a tomb's
        self.counters: Counter[str] = Counter()
        self._events = None if metrics is None else metrics.counter(
            "pd_participant_events", "PD participant events: drops, late frames, peer loss",
            ["event"])  # fmt: skip
        self._finished = None if metrics is None else metrics.counter(
            "pd_sessions_finished", "PD sessions by terminal state", ["role", "state"])  # fmt: skip

    # -- handshake -------------------------------------------------------------------------------
    def hello(self, nonce: bytes = b"") -> Hello:
        """Our ``Hello``, carrying ``nonce`` (the endpoint draws a fresh one per handshake)."""
        return self._hello if not nonce else msgspec.structs.replace(self._hello, nonce=nonce)

    def answer(
        self, hello: Hello, *, nonce: bytes = b"", disclose: bool = True
    ) -> tuple[HelloReply, Verdict]:
        """Our reply to ``hello`` and the verdict behind it; admits no one. Neither an
        acceptance (``hello``'s nonce echoed, our fresh ``nonce``) nor a refusal (incompatible,
        stale incarnation, full table) carries our ``Hello``: it goes out only in
        :meth:`welcome`, once the handshake is confirmed. A refusal's reasons name our layout,
        so it carries them only when ``disclose`` (the peer proved the shared secret)."""
        judgment = self.peers.judge(hello)
        if judgment.admissible:
            reply = HelloReply(accepted=True, echo=hello.nonce, nonce=nonce)
            return reply, judgment.verdict
        self._count(_REFUSAL_COUNTER[judgment.standing])
        verdict = judgment.verdict
        return self.refusal(hello.nonce, verdict.reasons, disclose=disclose), verdict

    def refusal(
        self, echo: bytes, reasons: tuple[str, ...], *, disclose: bool = True
    ) -> HelloReply:
        """A refusal answering the ``Hello`` (or acknowledgement) of nonce ``echo``; its
        ``reasons`` and our peer id only when ``disclose``, else :data:`WITHHELD`."""
        shown = reasons if disclose else (WITHHELD,)
        reasons = tuple(wire_text(r) for r in shown[:64])
        peer_id = self.peer_id if disclose else ""
        return HelloReply(accepted=False, echo=echo, reasons=reasons, peer_id=peer_id)

    def welcome(self, hello: Hello, nonce: bytes = b"") -> HelloConfirm:
        """The acknowledgement of a confirmed handshake with ``hello``'s peer: its nonce echoed
        and our ``Hello`` carrying ``nonce`` (the one our reply sent)."""
        return HelloConfirm(echo=hello.nonce, hello=self.hello(nonce))

    def check_reply(self, reply: HelloReply, *, nonce: bytes = b"") -> Verdict:
        """Our verdict on the answer to our ``Hello`` of ``nonce``; admits no one. It must echo
        that nonce and accept; the peer's ``Hello`` is judged when its acknowledgement brings
        it (:meth:`accept`)."""
        if reply.echo != nonce:
            self._count("stale_reply")
            return Verdict(compatible=False, reasons=("the reply answers another Hello",))
        if not reply.accepted:
            self._count("refused_by_peer")
            reasons = tuple(f"peer refused: {r}" for r in reply.reasons)
            return Verdict(compatible=False, reasons=reasons or ("peer refused",))
        return Verdict(compatible=True)

    def accept(self, hello: Hello, now: float) -> tuple[Verdict, list[Action]]:
        """Admit the peer of a completed handshake, judged now (the table may have changed
        since :meth:`answer`). A newer incarnation of a live peer fails its old sessions (the
        actions); an older one is stale: refused and counted, nothing changes."""
        judgment = self.peers.judge(hello)
        if not judgment.admissible:
            self._count(_REFUSAL_COUNTER[judgment.standing])
            return judgment.verdict, []
        out: list[Action] = []
        if judgment.standing is Standing.RESTARTED:
            self._count("peer_restarted")
            out = self._lose(PeerId(hello.peer_id), now, "peer restarted")
        self.peers.admit(hello, judgment, now)
        return judgment.verdict, out

    def on_hello(self, hello: Hello, now: float) -> tuple[HelloConfirm | HelloReply, list[Action]]:
        """:meth:`answer`, :meth:`accept` and :meth:`welcome` at once, for a link that cannot
        replay frames (an in-memory simulation): our acknowledgement carrying our ``Hello``,
        or a refusal. An endpoint admits only once the handshake is confirmed."""
        reply, verdict = self.answer(hello)
        if not reply.accepted:
            return reply, []
        verdict, actions = self.accept(hello, now)
        if not verdict.compatible:
            return self.refusal(hello.nonce, verdict.reasons), actions
        return self.welcome(hello), actions

    def on_hello_reply(
        self, reply: HelloConfirm | HelloReply, now: float, *, nonce: bytes = b""
    ) -> tuple[Verdict, list[Action]]:
        """The initiator's side of :meth:`on_hello`: a refusal's verdict, or the peer's
        acknowledgement checked (it echoes ``nonce``) and its ``Hello`` admitted. An
        acceptance without the peer's ``Hello`` (an endpoint's first reply) admits no one."""
        if isinstance(reply, HelloReply):
            verdict = self.check_reply(reply, nonce=nonce)
            if verdict.compatible:
                why = "the peer's Hello comes with its HelloConfirm, not its HelloReply"
                return Verdict(compatible=False, reasons=(why,)), []
            return verdict, []
        if reply.echo != nonce or reply.hello is None:
            self._count("stale_reply")
            return Verdict(compatible=False, reasons=("the reply answers another Hello",)), []
        return self.accept(reply.hello, now)

    # -- sessions ----------------------------------------------------------------------------------
    def open_receiver(
        self, session_id: SessionId, peer_id: PeerId, start: StartTransfer, now: float
    ) -> tuple[ReceiverSession, list[Action]]:
        """Open a receiver session (new epoch) and send its ``TransferRequest``."""
        self._check_new(session_id, peer_id)
        self._next_epoch += 1
        sess = ReceiverSession(
            session_id, peer_id, epoch=self._next_epoch, token=self._token(), timings=self.timings
        )
        actions = self._install(sess, now)
        return sess, actions + self._drive(sess, lambda: sess.send(start), now, local=True)

    def open_gather(
        self, session_id: SessionId, members: Mapping[PeerId, Piece], start: StartTransfer,
        now: float, *, heads: tuple[int, int], layers: tuple[int, ...],
    ) -> tuple[GatherSession, list[Action]]:  # fmt: skip
        """Open a gather session (new epoch): one receiver session per sender of ``members``
        (see :class:`GatherSession`), each installed under its member wire id, and send each
        its ``TransferRequest``. ``ProtocolError`` (nothing changed) for pieces that do not
        tile ``heads`` × ``layers``, a sender not connected or an id already open."""
        g = GatherSession(session_id, members, heads=heads, layers=layers, timings=self.timings,
                          epoch=self._next_epoch + 1, token=self._next_token + 1)  # fmt: skip
        for peer_id in members:
            self._check_new(session_id, peer_id)
        clash = self.gathers.clash(g, self.sessions)
        if clash is not None:
            raise ProtocolError(clash)
        self._next_epoch, self._next_token = self._next_epoch + 1, self._next_token + 1
        self.gathers.add(g)
        out = [a for m in g.members.values() for a in self._install(m, now)]
        first = next(iter(g.members.values()))
        return g, out + self._drive(first, lambda: g.send(start), now, local=True)

    def abandon(self, session_id: SessionId, peer_id: PeerId, reason: str) -> list[Action]:
        """End a receiver session that was never opened (its request ended while it waited for
        memory): send the sender one ``Abort`` of a new epoch, so that its session, open since
        the prefill order and holding that side's memory, ends now instead of at its deadline,
        and leave a tombstone that repeats the notice to a late frame. The ``Abort`` is not
        resent: if it is lost, the sender's deadline still ends its session."""
        self._check_new(session_id, peer_id)
        if session_id in self._tombs:
            raise ProtocolError(f"session {session_id} has already ended here")
        self._next_epoch += 1
        notice = Abort(session_id=session_id, epoch=self._next_epoch, token=self._token(),
                       outcome=Outcome.ABORTED, reason=wire_text(reason))  # fmt: skip
        state = OUTCOME_STATE[Outcome.ABORTED]
        tomb = Tombstone(Role.RECEIVER, peer_id, notice.epoch, state, True, None, notice)
        self._tombs.bury(session_id, tomb)
        self._count("abandoned_receivers")
        return [Transmit(peer_id, notice)]

    def open_sender(
        self, session_id: SessionId, peer_id: PeerId, now: float
    ) -> tuple[SenderSession | None, list[Action]]:
        """The sender session for ``session_id``: the live one, a new one, or None if torn down."""
        live = self.sessions.get(session_id)
        if live is not None:
            if not isinstance(live, SenderSession) or live.peer_id != peer_id:
                raise ProtocolError(f"session {session_id} is open as another role or peer")
            return live, []
        if session_id in self._tombs:
            return None, []
        self._check_new(session_id, peer_id)
        sess = SenderSession(session_id, peer_id, token=self._token(), timings=self.timings)
        return sess, self._install(sess, now)

    def send(
        self, session_id: SessionId, command: SubmitSlice | Cancel | Fail, now: float
    ) -> list[Action]:
        """Apply a local command; ``ProtocolError`` (nothing changed) if the session is not live.
        A gather's id takes ``Cancel``/``Fail`` for all its senders."""
        gather = self.gathers.get(session_id)
        if gather is not None and isinstance(command, Cancel | Fail):
            first = next(m for m in gather.members.values() if m.session_id in self.sessions)
            return self._drive(first, lambda: gather.send(command), now, local=True)
        sess = self._live(session_id)
        return self._drive(sess, lambda: sess.send(command), now, local=True)

    def receive_local(self, session_id: SessionId, event: object, now: float) -> list[Action]:
        """Apply transport evidence; evidence for a retired session is counted and dropped."""
        sess = self.sessions.get(session_id)
        if sess is None:
            self._count("late_evidence")
            return []
        return self._drive(sess, self.gathers.feed(sess, event), now, local=True)

    def submittable(self, session_id: SessionId, slice_id: int) -> bool:
        """True while a ``StartSubmit``'s slice may still be submitted (ADMITTED, not cancelled).

        A ``StartSubmit`` can be overtaken by a cancel (even within one batch of actions); a
        driver checks this right before calling the transport.
        """
        sess = self.sessions.get(session_id)
        return (
            isinstance(sess, SenderSession)
            and slice_id in sess.ledger
            and sess.ledger.state(slice_id) is Ownership.ADMITTED
        )

    def session(self, session_id: SessionId) -> Session | None:
        return self.sessions.get(session_id)

    def tombstone(self, session_id: SessionId) -> Tombstone | None:
        return self._tombs.get(session_id)

    # -- frames from peers -----------------------------------------------------------------------
    def on_event(self, peer_id: PeerId, event: AnyWireEvent, now: float) -> list[Action]:
        """Handle a decoded, authenticated frame from ``peer_id``; never raises for its content."""
        if not self.peers.touch(peer_id, now):
            self._count("unknown_peer")
            return []
        if isinstance(event, Heartbeat):
            lease_ms = self._hello.lease_ms
            return [
                Transmit(
                    peer_id, LeaseRenew(peer_id=self.peer_id, seq=event.seq, lease_ms=lease_ms)
                )
            ]
        if isinstance(event, LeaseRenew):
            return []
        if not isinstance(event, SessionEvent):
            self._count("unexpected_event")
            return []
        sid = event.sid
        sess = self.sessions.get(sid)
        if sess is not None:
            if sess.peer_id != peer_id:
                self._count("wrong_peer")
                return []
            if sess.epoch is not None and event.epoch != sess.epoch:
                self._count("stale_epoch")
                return []
            return self._drive(sess, self.gathers.feed(sess, event), now, local=False)
        tomb = self._tombs.get(sid)
        if tomb is not None and tomb.peer_id == peer_id:
            if tomb.epoch is None or event.epoch == tomb.epoch:
                self._count("late_frame")
                return answer(tomb, event)
            if event.epoch < tomb.epoch:
                self._count("stale_epoch")
                return []
        if event.epoch <= self._tombs.floor(peer_id):
            self._count("stale_epoch")
            return []
        if isinstance(event, TransferRequest):
            sender = SenderSession(sid, peer_id, token=self._token(), timings=self.timings)
            out = self._install(sender, now)
            return out + self._drive(sender, lambda: sender.receive(event), now, local=False)
        if isinstance(event, Abort):
            self._tombs.bury(
                sid,
                Tombstone(Role.SENDER, peer_id, event.epoch, OUTCOME_STATE[event.outcome], True),
            )
            self._count("abort_for_unknown_session")
            ack = AbortAck(
                session_id=sid, epoch=event.epoch, token=event.token, outcome=event.outcome
            )
            return [Transmit(peer_id, ack)]
        self._count("unknown_session")
        return []

    # -- clock -----------------------------------------------------------------------------------
    def tick(self, now: float) -> list[Action]:
        """Expire leases, send heartbeats and deliver due timers."""
        out: list[Action] = []
        for peer_id in self.peers.expired(now):
            self._count("peer_lost")
            out += self._lose(peer_id, now, "lease expired")
        for peer_id, seq in self.peers.heartbeats_due(now):
            out.append(Transmit(peer_id, Heartbeat(peer_id=self.peer_id, seq=seq)))
        for serial, timer, unit in self._timers.due(now):
            sid = self._by_serial.get(serial)
            sess = None if sid is None else self.sessions.get(sid)
            if sess is not None:
                ev = Timeout(timer=timer, unit=unit)
                out += self._drive(sess, self.gathers.feed(sess, ev), now, local=True)
        return out

    def next_deadline(self) -> float | None:
        times = [
            t for t in (self._timers.next_deadline(), self.peers.next_deadline()) if t is not None
        ]
        return min(times) if times else None

    def lose_peer(self, peer_id: PeerId, now: float, reason: str) -> list[Action]:
        """Declare ``peer_id`` dead now (e.g. the transport saw the connection reset)."""
        self.peers.lose(peer_id, now)
        return self._lose(peer_id, now, reason)

    # -- internals -------------------------------------------------------------------------------
    def _lose(self, peer_id: PeerId, now: float, reason: str) -> list[Action]:
        out: list[Action] = []
        for sid in sorted(self._by_peer.get(peer_id, ())):
            sess = self.sessions.get(sid)  # a gather's failure may have retired it
            if sess is not None:
                ev = PeerLost(peer_id=peer_id, reason=reason)
                out += self._drive(sess, self.gathers.feed(sess, ev), now, local=True)
        return out

    def _token(self) -> int:
        """A fresh abort token, never :data:`TOMB_TOKEN` (so a tombstone's ack matches none)."""
        self._next_token += 1
        return self._next_token

    def _check_new(self, session_id: SessionId, peer_id: PeerId) -> None:
        if session_id in self.sessions:
            raise ProtocolError(f"session {session_id} is already open")
        if not self.peers.is_live(peer_id):
            raise ProtocolError(
                f"peer {peer_id} is not connected (no accepted handshake or lease lost)"
            )

    def _live(self, session_id: SessionId) -> Session:
        sess = self.sessions.get(session_id)
        if sess is None:
            state = "retired" if session_id in self._tombs else "unknown"
            raise ProtocolError(f"session {session_id} is {state}; the caller keeps its memory")
        return sess

    def _install(self, sess: Session, now: float) -> list[Action]:
        self._tombs.pop(sess.session_id)  # a new session of a retired id replaces its tombstone
        self._next_serial += 1
        self.sessions[sess.session_id] = sess
        self._serial_of[sess.session_id] = self._next_serial
        self._by_serial[self._next_serial] = sess.session_id
        self._by_peer.setdefault(sess.peer_id, set()).add(sess.session_id)
        return self._absorb(sess, sess.open(), now)

    def _drive(
        self, sess: Session, fn: Callable[[], list[Action]], now: float, *, local: bool
    ) -> list[Action]:
        try:
            actions = fn()
        except ProtocolError:
            if local:
                raise
            self._count("protocol_error")
            return []
        out = self._absorb(sess, actions, now)
        for done in self.gathers.group(sess):
            if done.retirable:
                self._retire(done)
        return out

    def _absorb(self, sess: Session, actions: list[Action], now: float) -> list[Action]:
        out: list[Action] = []
        for act in actions:  # a gather's actions name its members: each has its own serial
            if isinstance(act, ArmTimer):
                serial = self._serial_of[act.session_id]
                self._timers.arm((serial, act.timer, act.unit), now + act.delay_s)
                continue
            if isinstance(act, Finished):
                self.counters[f"finished_{act.role.value}_{act.state.value}"] += 1
                if self._finished is not None:
                    self._finished.labels(act.role.value, act.state.value).inc()
            out.append(act)
        return out

    def _retire(self, sess: Session) -> None:
        sid = sess.session_id
        serial = self._serial_of.pop(sid)
        del self._by_serial[serial]
        del self.sessions[sid]
        self._by_peer[sess.peer_id].discard(sid)
        for timer in TimerKind:
            for unit in {0, *(r.unit for r in sess.ledger.records())}:
                self._timers.cancel((serial, timer, unit))
        self._tombs.bury(sid, sess.tombstone())
        self.gathers.retire(sid)
        self.counters["retired"] += 1

    def _count(self, reason: str) -> None:
        self.counters[reason] += 1
        if self._events is not None:
            self._events.labels(reason).inc()

    def check_integrity(self) -> None:
        """Every live session's ledger is consistent and indexed; retired ones hold nothing."""
        for sid, sess in self.sessions.items():
            sess.ledger.check_integrity()
            if sid not in self._serial_of or sid not in self._by_peer.get(sess.peer_id, set()):
                raise ProtocolError(f"session {sid} is not indexed")
        indexed = sum(len(v) for v in self._by_peer.values())
        if indexed != len(self.sessions) or len(self._by_serial) != len(self.sessions):
            raise ProtocolError("participant indexes disagree with its sessions")
        if set(self.sessions) & self._tombs.ids():
            raise ProtocolError("a session is both live and retired")
        self.gathers.check_integrity(self.sessions)
