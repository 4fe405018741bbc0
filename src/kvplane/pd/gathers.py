"""The gather sessions one participant hosts, found by their own id or by a member's wire id.

:class:`GatherBook` is the participant's index of :class:`~kvplane.pd.gather.GatherSession` s:
a member's wire event, timer or peer loss goes through its gather (:meth:`GatherBook.feed`),
so the tiling is checked and one member's failure fails the others. It owns no session state
and arms no timer: the participant installs each member as an ordinary receiver session (its
own serial, timers, tombstone) and tells the book when one retires. Sans-IO.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from functools import partial

from kvplane.errors import ProtocolError
from kvplane.ids import SessionId
from kvplane.pd.actions import Action
from kvplane.pd.gather import GatherSession
from kvplane.pd.session import Session


class GatherBook:
    """Live gather sessions: a gather stays until its last member retires."""

    def __init__(self) -> None:
        self._by_id: dict[SessionId, GatherSession] = {}
        self._of_member: dict[SessionId, GatherSession] = {}

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, session_id: SessionId) -> GatherSession | None:
        """The live gather of id ``session_id``, or None."""
        return self._by_id.get(session_id)

    def clash(self, gather: GatherSession, live: Container[SessionId]) -> str | None:
        """Why ``gather`` cannot be hosted next to the ``live`` session ids (a container), or
        None: its id or a member's wire id is already a gather, a member or a live session."""
        ids = [gather.session_id, *(m.session_id for m in gather.members.values())]
        for sid in ids:
            if sid in self._by_id or sid in self._of_member or sid in live:
                return f"session {sid} is already open"
        return None

    def add(self, gather: GatherSession) -> None:
        """Host ``gather`` (checked with :meth:`clash` by the caller: ``ProtocolError`` here
        only for a gather id already hosted)."""
        if gather.session_id in self._by_id:
            raise ProtocolError(f"session {gather.session_id} is already open")
        self._by_id[gather.session_id] = gather
        for member in gather.members.values():
            self._of_member[member.session_id] = gather

    def feed(self, sess: Session, event: object) -> Callable[[], list[Action]]:
        """The call that applies ``event`` to ``sess``: through its gather for a member (the
        tiling checked, a failure spread), else the session's own ``receive``."""
        gather = self._of_member.get(sess.session_id)
        if gather is None:
            return partial(sess.receive, event)
        return partial(gather.receive, sess.peer_id, event)

    def group(self, sess: Session) -> tuple[Session, ...]:
        """``sess`` and, for a member, every other member still hosted (those an event to
        ``sess`` may end)."""
        gather = self._of_member.get(sess.session_id)
        if gather is None:
            return (sess,)
        return tuple(m for m in gather.members.values() if m.session_id in self._of_member)

    def retire(self, session_id: SessionId) -> None:
        """Member ``session_id`` retired (any other id: nothing); its gather goes with its last
        member."""
        gather = self._of_member.pop(session_id, None)
        if gather is None:
            return
        if all(m.session_id not in self._of_member for m in gather.members.values()):
            del self._by_id[gather.session_id]

    def check_integrity(self, live: Container[SessionId]) -> None:
        """Every hosted member is a ``live`` session id (a container) and belongs to a hosted
        gather; ``ProtocolError`` otherwise."""
        for sid, gather in self._of_member.items():
            if sid not in live or self._by_id.get(gather.session_id) is not gather:
                raise ProtocolError(f"gather member {sid} is not hosted consistently")
