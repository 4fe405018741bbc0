"""What a decode worker waits for before it uses a request gathered from several senders.

:class:`GatherWait` collects each member session's ``Release`` and ``Finished`` (the actions
name members, not the gather) and gives the request's verdict once every member has both: the
gather's own state (SUCCESS only when every member committed and the pieces tiled the
destination) and every member's release. A member's ``Release(SUCCESS)`` alone is never
success; the first member failure decides the reason. Pure: the worker acts on the verdict.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvplane.errors import ProtocolError
from kvplane.ids import SessionId
from kvplane.pd.gather import GatherSession
from kvplane.pd.states import SessionState

S = SessionState


class GatherWait:
    """The members of ``gather`` heard from so far. ``gather`` is read only once every member
    finished (then the PD loop has retired them all and never touches it again)."""

    def __init__(self, gather: GatherSession) -> None:
        self.gather = gather
        self.member_ids = tuple(m.session_id for m in gather.members.values())
        self._released: dict[SessionId, SessionState] = {}
        self._finished: dict[SessionId, tuple[SessionState, str]] = {}

    def _check(self, member_id: SessionId, seen: Iterable[SessionId], what: str) -> None:
        if member_id not in self.member_ids:
            raise ProtocolError(f"gather {self.gather.session_id} has no member {member_id!r}")
        if member_id in seen:
            raise ProtocolError(f"member {member_id} of {self.gather.session_id} {what} twice")

    def release(self, member_id: SessionId, state: SessionState) -> None:
        """Member ``member_id``'s ledger released the destination, ending in ``state``.
        ``ProtocolError`` for an unknown member or a second release."""
        self._check(member_id, self._released, "released")
        self._released[member_id] = state

    def finish(self, member_id: SessionId, state: SessionState, reason: str) -> bool:
        """Member ``member_id`` ended in ``state``; True when it is the request's first
        failure (the worker answers then). ``ProtocolError`` as :meth:`release`."""
        self._check(member_id, self._finished, "finished")
        first = state is not S.SUCCESS and not any(
            s is not S.SUCCESS for s, _ in self._finished.values()
        )
        self._finished[member_id] = (state, reason)
        return first

    @property
    def finished(self) -> bool:
        """Every member ended."""
        return len(self._finished) == len(self.member_ids)

    @property
    def done(self) -> bool:
        """Every member ended and released: the verdict is final and the memory is ours."""
        return self.finished and len(self._released) == len(self.member_ids)

    def verdict(self) -> tuple[SessionState, str]:
        """The request's state and reason once :attr:`done` (``ProtocolError`` before): SUCCESS
        only when the gather is SUCCESS and every member released SUCCESS; else the gather's
        failure, or the first failed member's, or FAILED for a gather that never tiled."""
        if not self.done:
            raise ProtocolError(f"gather {self.gather.session_id} is not over")
        state = self.gather.state
        ok = all(s is S.SUCCESS for s in self._released.values())
        if state is S.SUCCESS and ok:
            return S.SUCCESS, ""
        if state in (S.FAILED, S.ABORTED):
            return state, self.gather.reason
        for mid, (s, reason) in self._finished.items():
            if s is not S.SUCCESS:
                return s, f"member {mid}: {reason}"
        why = "without every member committing the tiling and releasing"
        return S.FAILED, f"gather {self.gather.session_id} ended {state.value} {why}"
