"""Tombstones: what remains of retired sessions, so late frames are answered, never revived.

Bounded LRU; an eviction raises that peer's epoch floor. See docs/pd.md.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvplane.ids import PeerId, SessionId
from kvplane.pd.actions import Action, Transmit
from kvplane.pd.events import (
    Abort,
    AbortAck,
    Outcome,
    SessionEvent,
    SliceReady,
    SliceResult,
    TransferRequest,
)
from kvplane.pd.states import STATE_OUTCOME, Role, SessionState
from kvplane.validators import require_int

TOMB_TOKEN = 0
"""The token of an Abort a tombstone sends for a session that never had one of ours (a sender
that ended before its request came): ``Participant`` starts its token counter here and hands
out ``TOMB_TOKEN + 1`` on, so this token's ack matches nothing."""


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A retired session: role, peer, epoch, final state, and what to repeat to the peer."""

    role: Role
    peer_id: PeerId
    epoch: int | None
    state: SessionState
    clean: bool
    verdict: SliceResult | None = None
    notice: Abort | None = None


def answer(tomb: Tombstone, event: SessionEvent) -> list[Action]:
    """The idempotent answer of a retired session to a late frame of its own epoch."""
    peer = tomb.peer_id
    if isinstance(event, Abort):
        if tomb.verdict is not None:
            return [Transmit(peer, tomb.verdict)]
        ack = AbortAck(
            session_id=event.session_id,
            epoch=event.epoch,
            token=event.token,
            outcome=STATE_OUTCOME.get(tomb.state, event.outcome),
            drained=tomb.clean,
        )
        return [Transmit(peer, ack)]
    if isinstance(event, SliceReady | TransferRequest):
        if tomb.verdict is not None:
            return [Transmit(peer, tomb.verdict)]
        if tomb.notice is not None:
            return [Transmit(peer, tomb.notice)]
        if isinstance(event, TransferRequest) and tomb.role is Role.SENDER and tomb.epoch is None:
            # a sender that failed before any request came: the receiver waits for nothing
            notice = Abort(session_id=event.session_id, epoch=event.epoch, token=TOMB_TOKEN,
                           outcome=STATE_OUTCOME.get(tomb.state, Outcome.FAILED),
                           reason="the sender ended before the request came",
                           drained=tomb.clean)  # fmt: skip
            return [Transmit(peer, notice)]
    return []


class TombstoneTable:
    """Tombstones by session id, least recently buried evicted first, with per-peer floors."""

    def __init__(self, capacity: int) -> None:
        self.capacity = require_int("tombstone capacity", capacity, min=1)
        self._tombs: OrderedDict[SessionId, Tombstone] = OrderedDict()
        self._floor: dict[PeerId, int] = {}

    def __contains__(self, sid: SessionId) -> bool:
        return sid in self._tombs

    def __len__(self) -> int:
        return len(self._tombs)

    def get(self, sid: SessionId) -> Tombstone | None:
        return self._tombs.get(sid)

    def pop(self, sid: SessionId) -> Tombstone | None:
        return self._tombs.pop(sid, None)

    def bury(self, sid: SessionId, tomb: Tombstone) -> None:
        self._tombs[sid] = tomb
        self._tombs.move_to_end(sid)
        while len(self._tombs) > self.capacity:
            _, old = self._tombs.popitem(last=False)
            if old.epoch is not None:
                self._floor[old.peer_id] = max(self._floor.get(old.peer_id, 0), old.epoch)

    def floor(self, peer_id: PeerId) -> int:
        """Frames from ``peer_id`` for unknown sessions with an epoch at or below this are stale."""
        return self._floor.get(peer_id, 0)

    def ids(self) -> set[SessionId]:
        return set(self._tombs)
