"""The endpoint's four-frame handshake, both sides: who is answered, admitted and told what.

:class:`Greeter` runs on the endpoint's loop thread and owns the handshakes in progress (the
answered ``Hello`` s and our dials). It decides; the endpoint's :class:`Link` sends, binds
routes and performs the participant's actions. Nothing of ours (profile, transport advert) goes
out before the peer proved it is live: a reply carries our nonce only, our ``Hello`` follows in
the acknowledgement, sealed on the association. See docs/pd.md ("Freshness").
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from kvplane.errors import IncompatiblePeerError
from kvplane.ids import PeerId
from kvplane.pd.actions import Action
from kvplane.pd.association import NONCE_BYTES, Association, associate
from kvplane.pd.events import AnyWireEvent, Hello, HelloConfirm, HelloReply
from kvplane.pd.greetings import Dial, Greeting, Greetings
from kvplane.pd.handshake import Verdict
from kvplane.pd.log_budget import LogBudget
from kvplane.pd.participant import Participant

__all__ = ["Greeter", "Link"]
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Link:
    """What the greeter asks of its endpoint (all on the loop thread): send a frame on an
    association (None: a handshake frame), bind a peer's route, forget routes, perform the
    participant's actions, count a dropped frame, disconnect a dialled address."""

    send_on: Callable[[bytes, AnyWireEvent, Association | None], None]
    bind: Callable[[PeerId, bytes, Association], None]
    unroute: Callable[[Iterable[PeerId]], None]
    dispatch: Callable[[list[Action]], None]
    drop: Callable[[str], None]
    hang_up: Callable[[str], None]


class Greeter:
    """Handshakes of one endpoint. ``secret``: the codec's (None: CRC seeds, and refusals
    never carry reasons). Counters in :attr:`counters` (``handshakes_*``)."""

    def __init__(
        self, participant: Participant, secret: bytes | None, link: Link, log_budget: LogBudget
    ) -> None:
        self.participant = participant
        self.secret = secret
        self.link = link
        self.log_budget = log_budget
        self.greetings = Greetings()
        self.pending: dict[bytes, Dial] = {}
        self.counters: Counter[str] = Counter()

    def assoc_of(self, conn: bytes) -> Association | None:
        """The provisional association of ``conn``'s handshake in progress, if any."""
        shake = self.greetings.get(conn) or self.pending.get(conn)
        return None if shake is None else shake.assoc

    def on_frame(self, conn: bytes, peer: PeerId | None, event: AnyWireEvent, now: float) -> bool:
        """Handle a handshake frame from ``conn`` (``peer``: its bound peer, if any); False
        when ``event`` is no handshake frame this greeter expects."""
        if isinstance(event, Hello) and peer is None:
            self._on_hello(conn, event, now)
        elif isinstance(event, HelloConfirm) and (greeting := self.greetings.pop(conn)):
            self._on_confirm(conn, greeting, event, now)
        elif isinstance(event, HelloReply | HelloConfirm) and conn in self.pending:
            self._on_dial_answer(conn, self.pending[conn], event, now)
        elif isinstance(event, HelloReply) and peer is not None and not event.accepted:
            self._revoked(peer, event, now)
        else:
            return False
        return True

    # -- responder side --------------------------------------------------------------------------
    def _on_hello(self, conn: bytes, hello: Hello, now: float) -> None:
        """Answer a fresh ``Hello`` with our nonce alone; an accepted one waits in its peer
        id's greeting slot for its ``HelloConfirm``. A copy of one answered already is dropped."""
        if self.greetings.replayed(hello.nonce):
            self.link.drop("replayed_hello")
            return
        self.greetings.pop(conn)  # a new handshake on this connection replaces its last one
        disclose = self.secret is not None
        why = ""
        if len(hello.nonce) != NONCE_BYTES:
            why = f"a Hello needs a fresh {NONCE_BYTES}-byte nonce"
        elif not self.greetings.has_room(conn, hello.peer_id, now):
            why = f"{self.greetings.capacity} other handshakes are in progress; retry later"
            self.counters["handshakes_busy"] += 1
        if why:
            verdict = Verdict(compatible=False, reasons=(why,))
            reply = self.participant.refusal(hello.nonce, (why,), disclose=disclose)
        else:
            nonce = secrets.token_bytes(NONCE_BYTES)
            reply, verdict = self.participant.answer(hello, nonce=nonce, disclose=disclose)
        self.link.send_on(conn, reply, None)
        if not reply.accepted:
            self._refused(f"refused peer {hello.peer_id!r}", verdict)
            return
        assoc = associate(self.secret, hello, reply.nonce, we_initiated=False)
        self.greetings.add(conn, hello, reply.nonce, assoc, now)

    def _on_confirm(
        self, conn: bytes, greeting: Greeting, confirm: HelloConfirm, now: float
    ) -> None:
        """The initiator proved it saw our nonce: admit it and acknowledge with our ``Hello``
        (sealed on the association), or refuse on the association."""
        if confirm.echo != greeting.nonce or confirm.hello is not None:
            self.link.drop("stale_confirm")
            return
        theirs = greeting.hello
        verdict, actions = self.participant.accept(theirs, now)
        if verdict.compatible:
            self.counters["handshakes_accepted"] += 1
            self.link.bind(PeerId(theirs.peer_id), conn, greeting.assoc)
            self.link.send_on(
                conn, self.participant.welcome(theirs, greeting.nonce), greeting.assoc
            )
        else:  # the table changed since our reply (a newer incarnation, or it filled up)
            refusal = self.participant.refusal(theirs.nonce, verdict.reasons)
            self.link.send_on(conn, refusal, greeting.assoc)
            self._refused(f"refused peer {theirs.peer_id!r}", verdict)
        self.link.dispatch(actions)

    def _revoked(self, peer: PeerId, refusal: HelloReply, now: float) -> None:
        """The initiator judged our ``Hello`` (in our acknowledgement) after we admitted it,
        and refused us: it is gone (its sessions fail; a new handshake may bring it back)."""
        self.counters["handshakes_revoked"] += 1
        why = "; ".join(refusal.reasons) or "refused"
        self._refused(f"peer {peer!r} refused us", Verdict(compatible=False, reasons=(why,)))
        self.link.dispatch(self.participant.lose_peer(peer, now, f"the peer refused us: {why}"))
        self.link.unroute([peer])

    def _refused(self, who: str, verdict: Verdict) -> None:
        self.counters["handshakes_refused"] += 1
        why = "; ".join(verdict.reasons)
        self.log_budget.log(log, logging.WARNING, "%s: %s", who[:300], why[:600])

    # -- initiator side --------------------------------------------------------------------------
    def dial(self, alias: bytes, address: str) -> Future[PeerId]:
        """Start a handshake on the connection ``alias`` just made to ``address``; the future
        completes with the peer's id, or an ``IncompatiblePeerError``."""
        fut: Future[PeerId] = Future()
        hello = self.participant.hello(secrets.token_bytes(NONCE_BYTES))
        self.pending[alias] = Dial(address, fut, hello)
        self.link.send_on(alias, hello, None)
        return fut

    def abandon(self, fut: Future[PeerId]) -> None:
        """Forget the dial of ``fut`` (it timed out) and disconnect its address."""
        for alias, dial in list(self.pending.items()):
            if dial.future is fut:
                del self.pending[alias]
                self.link.hang_up(dial.address)

    def _on_dial_answer(
        self, alias: bytes, dial: Dial, event: HelloReply | HelloConfirm, now: float
    ) -> None:
        """The peer's reply (then: confirm its nonce), or its acknowledgement carrying its
        ``Hello`` (then: judge and admit it, or refuse it on the association)."""
        if isinstance(event, HelloReply):
            if dial.assoc is not None and event.accepted:
                self.link.drop("unexpected")
                return
            verdict = self.participant.check_reply(event, nonce=dial.hello.nonce)
            if verdict.compatible and len(event.nonce) != NONCE_BYTES:
                verdict = Verdict(compatible=False, reasons=("the reply carries no nonce",))
            if not verdict.compatible:
                self._fail_dial(alias, dial, verdict, event.peer_id)
                return
            dial.peer_nonce = event.nonce
            dial.assoc = associate(self.secret, dial.hello, event.nonce, we_initiated=True)
            self.link.send_on(alias, HelloConfirm(echo=event.nonce), dial.assoc)
            return
        peer = event.hello
        stale = peer is None or peer.nonce != dial.peer_nonce or event.echo != dial.hello.nonce
        if dial.assoc is None or peer is None or stale:
            self.link.drop("stale_confirm")
            return
        dial.peer = peer
        verdict, actions = self.participant.accept(peer, now)
        if not verdict.compatible:  # tell the peer, which admitted us already
            refusal = self.participant.refusal(peer.nonce, verdict.reasons)
            self.link.send_on(alias, refusal, dial.assoc)
            self._fail_dial(alias, dial, verdict)
        else:
            del self.pending[alias]
            self.counters["handshakes_completed"] += 1
            self.link.bind(PeerId(peer.peer_id), alias, dial.assoc)
            dial.future.set_result(PeerId(peer.peer_id))
        self.link.dispatch(actions)

    def _fail_dial(self, alias: bytes, dial: Dial, verdict: Verdict, refuser: str = "") -> None:
        del self.pending[alias]
        self._refused(f"handshake with {dial.address} refused", verdict)
        self.link.hang_up(dial.address)
        reasons = "; ".join(verdict.reasons)
        who = (dial.peer and dial.peer.peer_id) or refuser or dial.address
        dial.future.set_exception(IncompatiblePeerError(f"peer {who} is incompatible: {reasons}"))
