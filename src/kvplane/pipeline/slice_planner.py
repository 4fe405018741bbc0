"""The slice driver's planner: each session's decode peer, and its slices' plans made ahead.

A plan made ahead is used only when it matches the ``StartSubmit``. Owned by the driver
thread; not thread-safe. See docs/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable

from kvplane.errors import KVPlaneError, ProtocolError
from kvplane.ids import PeerId, SessionId, SliceId, TokenRange
from kvplane.pd.actions import DestinationKnown, StartSubmit
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import TransferRequest
from kvplane.pipeline.advert import decode_advert
from kvplane.pipeline.driver_records import PeerLink, PlannedSession, SliceBegin, SliceSource
from kvplane.pipeline.slicing import PlannedSlice, plan_slice
from kvplane.transfer import OpGrouping
from kvplane.transports.base import Transport

LOOKAHEAD = 2
"""How many slices past the latest begun one a session's plans are made ahead."""
MAX_WAITING = 1024
"""Most ``DestinationKnown`` hints kept while their request's memory is not admitted yet."""


class SlicePlanner:
    """See the module docstring. ``count(key)`` counts a planning event for the driver's
    counters (``sessions_expected``, ``planned_ahead``, ``plans_ready``, ``begun_in_call``)."""

    def __init__(
        self,
        endpoint: Endpoint,
        transport: Transport,
        sources: Callable[[SessionId], SliceSource | None],
        *,
        grouping: OpGrouping,
        count: Callable[[str], None],
    ) -> None:
        self._ep = endpoint
        self._transport = transport
        self._sources = sources
        self._grouping = grouping
        self._count = count
        self._links: dict[PeerId, PeerLink] = {}
        self._sessions: dict[SessionId, PlannedSession] = {}
        self._waiting: dict[SessionId, DestinationKnown] = {}
        """Hints that came before their request's memory (``source_ready`` retries them)."""

    @property
    def waiting(self) -> dict[SessionId, DestinationKnown]:
        """The hints waiting for their request's memory (read-only to callers)."""
        return self._waiting

    @property
    def sessions(self) -> dict[SessionId, PlannedSession]:
        """The sessions known, with their plans made ahead (read-only to callers)."""
        return self._sessions

    def session(self, session_id: SessionId) -> PlannedSession | None:
        return self._sessions.get(session_id)

    def forget(self, session_id: SessionId) -> None:
        """The session has ended (or sent its last slice): drop its waiting hint and plans."""
        self._waiting.pop(session_id, None)
        self._sessions.pop(session_id, None)

    def adopt(self, hints: list[DestinationKnown], sourced: list[SessionId]) -> None:
        """Know the sessions whose destination the hints name, so :meth:`plan_ahead` plans
        their slices from the first on (linking a new peer here, off the critical path). A hint
        that came before its request's memory waits for ``sourced`` to name it (the oldest of
        more than :data:`MAX_WAITING` are dropped: the first slice is then planned when it
        starts)."""
        retried = [self._waiting.pop(sid) for sid in sourced if sid in self._waiting]
        for hint in hints + retried:
            sid = hint.session_id
            if sid in self._sessions:
                continue  # begun already
            if self._sources(sid) is None:  # its memory is not here yet
                self._waiting[sid] = hint
                while len(self._waiting) > MAX_WAITING:
                    del self._waiting[next(iter(self._waiting))]
                continue
            try:
                link = self.link(hint.peer_id)
            except KVPlaneError:  # the slice's own StartSubmit fails it, in order
                continue
            self._sessions[sid] = PlannedSession(link, hint.request, {})
            self._count("sessions_expected")

    def plan_ahead(self) -> bool:
        """Plan one future slice of a known session while the prefill computes it; True if
        one was planned (more may follow)."""
        for sid, sess in list(self._sessions.items()):
            source = self._sources(sid)
            if source is None:  # the request's memory is gone: forget the session
                del self._sessions[sid]
                continue
            while sess.next_plan < len(source.schedule) and sess.next_plan in sess.plans:
                sess.next_plan += 1
            slice_id = max(sess.next_plan, sess.begun)
            if slice_id >= len(source.schedule) or slice_id > sess.begun + LOOKAHEAD:
                continue
            tokens, is_last = source.schedule[slice_id]
            sess.next_plan = slice_id + 1
            try:
                sess.plans[slice_id] = self._plan(
                    source, sess.link, sess.request, tokens, slice_id=slice_id, is_last=is_last
                )
            except KVPlaneError:
                sess.next_plan = len(source.schedule)  # plan it (and fail) when it is due
            self._count("planned_ahead")
            return True
        return False

    def _plan(
        self, source: SliceSource, link: PeerLink, request: TransferRequest, tokens: TokenRange,
        *, slice_id: int, is_last: bool,
    ) -> PlannedSlice:  # fmt: skip
        return plan_slice(
            list(source.pools), list(link.pools), request, tokens,
            slice_id=SliceId(slice_id), is_last=is_last, grouping=self._grouping,
            share=source.share,
        )  # fmt: skip

    def planned(self, act: StartSubmit, source: SliceSource) -> PlannedSlice:
        """The slice's plans: made ahead of time when the schedule predicted this slice, else
        made now (``KVPlaneError`` when it cannot be planned or its peer cannot be linked)."""
        sid = act.session_id
        sess = self._sessions.get(sid)
        if sess is None:  # a session is bound to one peer incarnation: link it once
            self._waiting.pop(sid, None)
            sess = PlannedSession(self.link(act.peer_id), act.request, {})
            self._sessions[sid] = sess
        ready = self.ahead(act, source, sess)
        if ready is not None:
            return ready
        sess.begun = max(sess.begun, int(act.slice_id) + 1)
        tokens = TokenRange(act.start, act.end)
        return self._plan(
            source, sess.link, act.request, tokens, slice_id=int(act.slice_id), is_last=act.is_last
        )

    def ahead(
        self, act: StartSubmit, source: SliceSource, sess: PlannedSession
    ) -> PlannedSlice | None:
        """The plans made ahead for ``act``'s slice if they match what the session asks for
        (taken: the slice counts as begun), else None (any stale ones are dropped)."""
        ready = sess.plans.pop(int(act.slice_id), None)
        if ready is None or int(act.slice_id) >= len(source.schedule):
            return None
        n = act.request.num_tokens
        tokens, is_last = source.schedule[int(act.slice_id)]
        lo = min(max(tokens.start, act.request.prefix_tokens), n)
        if (lo, max(lo, min(tokens.end, n)), is_last) != (act.start, act.end, act.is_last):
            return None
        sess.begun = max(sess.begun, int(act.slice_id) + 1)
        self._count("plans_ready")
        return ready

    def ready_begins(
        self, arrived: list[StartSubmit]
    ) -> tuple[list[SliceBegin], list[StartSubmit]]:
        """Of ``StartSubmit`` s just arrived, in order: those whose plans were made ahead, ready
        to begin (no planning or connecting here), and the others — each session's from its
        first unready slice on, to keep its order — to plan later."""
        begins: list[SliceBegin] = []
        late: list[StartSubmit] = []
        held: set[SessionId] = set()
        for act in arrived:
            sid = act.session_id
            sess, source = self._sessions.get(sid), self._sources(sid)
            if sid in held or sess is None or source is None:
                ready = None
            else:
                ready = self.ahead(act, source, sess)
            if ready is None or source is None:
                held.add(sid)
                late.append(act)
            else:
                self._count("begun_in_call")
                begins.append(SliceBegin(act, source, ready))
        return begins, late

    def link(self, peer_id: PeerId) -> PeerLink:
        """The transport peer and pools of ``peer_id``'s current incarnation (connects once);
        ``ProtocolError`` without a handshake with it or when it speaks another transport."""
        rec = self._ep.call(lambda: self._ep.participant.peers.get(peer_id))
        if rec is None:
            raise ProtocolError(f"no handshake with peer {peer_id}")
        hello = rec.hello
        known = self._links.get(peer_id)
        if known is not None and known.incarnation == hello.incarnation:
            return known
        advert, pools = decode_advert(hello.transport_metadata, hello.profile)
        if advert.transport != self._transport.name:
            raise ProtocolError(
                f"peer {peer_id} speaks transport {advert.transport!r}, we {self._transport.name!r}"
            )
        link = PeerLink(
            hello.incarnation, self._transport.connect(advert.transport_metadata), tuple(pools)
        )
        self._links[peer_id] = link
        return link
