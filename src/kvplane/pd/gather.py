"""A decode rank's request fed by several senders (prefill TP ranks or PP stages), sans-IO.

:class:`GatherSession` owns one :class:`~kvplane.pd.receiver.ReceiverSession` per sender, each
with its own wire session id and ledger (so the ledger keeps one entry per (session, sender)),
and a :class:`~kvplane.pd.tiling.Tiling` of what they accepted. Members move only through
``RECEIVER_TABLE``; the group has no table of its own: its state is a function of theirs plus a
sticky first failure, which fails every other member. It commits only when every member
committed and the union tiles the destination once. No I/O, no memory, no plans.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId, TokenRange
from kvplane.pd.actions import Action
from kvplane.pd.events import Cancel, Fail, SliceReady, StartTransfer
from kvplane.pd.ledger import OwnershipLedger
from kvplane.pd.receiver import ReceiverSession
from kvplane.pd.states import SessionState
from kvplane.pd.tiling import Tiling
from kvplane.pd.timers import Timings
from kvplane.transfer.resharding import KVBox, Piece

S = SessionState
_FAILED = (S.ABORTED, S.FAILED)


def member_session_id(session_id: SessionId, piece: Piece) -> SessionId:
    """The wire session id of the member that receives ``piece`` (unique per sender)."""
    return SessionId(f"{session_id}/{piece.sender.stage}.{piece.sender.tp_rank}")


class GatherSession:
    """One request of one decode rank: ``members`` maps each sender's peer id to the piece it
    owns (heads × layers; its tokens are ignored: every sender sends the request's tokens) and
    ``heads`` × ``layers`` is the decode rank's destination. ``ProtocolError`` at construction
    when the pieces do not tile it exactly once (a duplicate, an overlap, a gap). Drive it like a
    session: :meth:`open` once, commands to :meth:`send`, a sender's events to :meth:`receive`
    with its peer id (:meth:`peer_of` finds the peer of a member's timer)."""

    def __init__(
        self,
        session_id: SessionId,
        members: Mapping[PeerId, Piece],
        *,
        heads: tuple[int, int],
        layers: tuple[int, ...],
        epoch: int,
        token: int,
        timings: Timings,
    ) -> None:
        if not members:
            raise ProtocolError(f"gather session {session_id} needs at least one sender")
        claims = Tiling(KVBox(heads, layers, TokenRange(0, 1)))
        for piece in members.values():
            claims.add(Piece(piece.sender, KVBox(piece.box.heads, piece.box.layers,
                                                 TokenRange(0, 1))))  # fmt: skip
        claims.check_complete()
        senders = [p.sender for p in members.values()]
        if len(set(senders)) != len(senders):
            raise ProtocolError(f"gather session {session_id}: a sender is named twice {senders}")
        self.session_id = session_id
        self.heads, self.layers = heads, tuple(layers)
        self.pieces = dict(members)
        self.members = {
            peer: ReceiverSession(member_session_id(session_id, piece), peer, epoch=epoch,
                                  token=token, timings=timings)
            for peer, piece in members.items()
        }  # fmt: skip
        self._by_id = {m.session_id: peer for peer, m in self.members.items()}
        self.tiling: Tiling | None = None
        self.failure: tuple[SessionState, str] | None = None
        """The first member failure: (ABORTED or FAILED, why); sticky."""

    # -- state -----------------------------------------------------------------------------------
    @property
    def state(self) -> SessionState:
        """FAILED/ABORTED from the first member failure; SUCCESS when every member committed and
        the tiling is complete (never without it); else TRANSFERRING once any member is,
        WAITING_FOR_INPUT once started, BOOTSTRAPPING before."""
        if self.failure is not None:
            return self.failure[0]
        states = [m.state for m in self.members.values()]
        complete = self.tiling is not None and self.tiling.complete
        if complete and all(s is S.SUCCESS for s in states):
            return S.SUCCESS
        if any(s in (S.TRANSFERRING, S.SUCCESS) for s in states):
            return S.TRANSFERRING
        return S.WAITING_FOR_INPUT if self.tiling is not None else S.BOOTSTRAPPING

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @property
    def reason(self) -> str:
        return self.failure[1] if self.failure is not None else ""

    @property
    def released(self) -> bool:
        """Every member's ledger released its destination: the blocks may be freed (or, after
        SUCCESS, handed to the request)."""
        return all(m.ledger.all_released() for m in self.members.values())

    def ledgers(self) -> dict[PeerId, OwnershipLedger]:
        """One ledger per (session, sender)."""
        return {peer: m.ledger for peer, m in self.members.items()}

    def peer_of(self, member_id: SessionId) -> PeerId:
        """The sender whose member session has wire id ``member_id`` (``ProtocolError`` if
        none)."""
        peer = self._by_id.get(member_id)
        if peer is None:
            raise ProtocolError(f"gather session {self.session_id} has no member {member_id!r}")
        return peer

    # -- driving ---------------------------------------------------------------------------------
    def open(self) -> list[Action]:
        """Open every member (arms each one's deadline)."""
        return [a for m in self.members.values() for a in m.open()]

    def send(self, command: StartTransfer | Cancel | Fail) -> list[Action]:
        """Apply a local command to every member still live: ``StartTransfer`` asks every sender
        for the same destination blocks and tokens; ``Cancel``/``Fail`` end the request for all
        senders. ``ProtocolError`` (nothing changed) for a second start or a start after a
        failure (until then every member is BOOTSTRAPPING and takes it)."""
        if isinstance(command, StartTransfer):
            if self.tiling is not None or self.failure is not None:
                raise ProtocolError(
                    f"gather session {self.session_id} cannot start in {self.state.value}"
                )
            tokens = TokenRange(command.prefix_tokens, command.num_tokens)
            tiling = Tiling(KVBox(self.heads, self.layers, tokens))
            started = [a for m in self.members.values() for a in m.send(command)]
            self.tiling = tiling
            return started
        if not isinstance(command, Cancel | Fail):
            raise ProtocolError(f"gather session {self.session_id}: unknown command {command!r}")
        out: list[Action] = []
        for m in self.members.values():
            if not m.terminal:
                out += m.send(command)
        if self.failure is None and any(m.state in _FAILED for m in self.members.values()):
            state = S.ABORTED if isinstance(command, Cancel) else S.FAILED
            self.failure = (state, command.reason)
        return out

    def receive(self, peer_id: PeerId, event: object) -> list[Action]:
        """Apply sender ``peer_id``'s wire event, or a local fact about it (``Timeout``,
        ``PeerLost``), to its member. A new slice whose cells another accepted slice holds
        fails the member (the bytes may be mixed: nothing of them is used); a member that fails
        fails the others. ``ProtocolError`` (nothing changed) for an unknown peer or an event
        the member refuses."""
        member = self.members.get(peer_id)
        if member is None:
            raise ProtocolError(f"gather session {self.session_id}: {peer_id!r} is no sender")
        piece = self._slice_piece(peer_id, event)
        clash = None if piece is None or self.tiling is None else self.tiling.conflict(piece)
        if clash is not None:
            out = member.send(Fail(reason=clash))
        else:
            out = member.receive(event)
            accepted = isinstance(event, SliceReady) and int(event.slice_id) in member.slices
            if piece is not None and self.tiling is not None and accepted:
                self.tiling.add(piece)  # checked for conflicts above
        if self.failure is None and member.state in _FAILED:
            self.failure = (member.state, f"sender {peer_id}: {member.reason}")
            out += self._fail_others(peer_id, member.state)
        return out

    def _slice_piece(self, peer: PeerId, event: object) -> Piece | None:
        """The cells a slice the member has not seen would add, while it may still accept one."""
        member = self.members[peer]
        if not isinstance(event, SliceReady) or int(event.slice_id) in member.slices:
            return None
        if not member.would_accept(event) or member.terminal:
            return None
        box = self.pieces[peer].box
        part = KVBox(box.heads, box.layers, TokenRange(event.start, event.end))
        return Piece(self.pieces[peer].sender, part)

    def _fail_others(self, peer: PeerId, state: SessionState) -> list[Action]:
        why = f"sender {peer} {state.value}"
        command = Cancel(reason=why) if state is S.ABORTED else Fail(reason=why)
        out: list[Action] = []
        for other, m in self.members.items():
            if other != peer and not m.terminal:
                out += m.send(command)
        return out
