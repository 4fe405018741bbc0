"""The prefill side's transfer driver: turns ``StartSubmit`` actions into plan runs and evidence.

Theory of operation
-------------------
The PD session decides *when* a slice may move (``StartSubmit``); this driver decides nothing
else. It keeps one ordered queue per session — slices of one (request, peer) are submitted in
order, the next only after the previous one's evidence — and runs the heads of all queues
concurrently on one thread with non-blocking :class:`~kvplane.transfer.PlanRun` steps, while the
bytes move on the transport's own threads and the worker loop computes the next prefill step.

For each slice: plan it (:func:`~kvplane.runtime.slicing.plan_slice`, pure), then, in one call
on the PD loop thread, check ``Participant.submittable`` (a cancel may have overtaken the
``StartSubmit``) and report ``SubmitStarted`` — or ``SubmitSkipped`` when nothing moves. Only
then are the runs started (validated against both sides' regions, deadline = the per-slice
timeout). When every run of the slice is terminal the evidence goes back: ``TransportDone``,
``TransportFailed`` or ``TransportInDoubt`` (any op whose fate is unknown). A slice that cannot
even be planned (peer unreachable, request the pools cannot serve) fails its session with
``Fail``; its memory is then released by the ledger (NOT_SUBMITTED), never by the driver.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvplane.errors import KVPlaneError, ProtocolError
from kvplane.ids import PeerId, RegionId, SessionId, SliceId, TokenRange
from kvplane.pd.actions import StartSubmit
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import (
    Fail,
    SubmitSkipped,
    SubmitStarted,
    TransportDone,
    TransportFailed,
    TransportInDoubt,
)
from kvplane.runtime.advert import RemotePool, decode_advert
from kvplane.runtime.observe import RuntimeMetrics
from kvplane.runtime.slicing import LocalPool, PlannedSlice, plan_slice
from kvplane.runtime.timeline import Mark, Timeline
from kvplane.transfer import OpGrouping, PlanExecutor, PlanOutcome, PlanRun
from kvplane.transports.base import Peer, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SliceSource:
    """The prefill memory of one request: its pools with block ids (KV, state, tail order), and
    the slice schedule (``(range, is_last)`` per slice id) the prefill will follow, so slices
    can be planned before they are computed."""

    request_id: str
    pools: tuple[LocalPool, ...]
    schedule: tuple[tuple[TokenRange, bool], ...] = ()


@dataclass(slots=True)
class _Session:
    """What the driver knows of one session: its peer link, request and ready plans."""

    link: PeerLink
    act: StartSubmit
    plans: dict[int, PlannedSlice]
    next_plan: int = 0


@dataclass(frozen=True, slots=True)
class PeerLink:
    """A decode peer as the planner sees it: transport peer and advertised pools."""

    incarnation: int
    peer: Peer
    pools: tuple[RemotePool, ...]


@dataclass(slots=True)
class _Job:
    act: StartSubmit
    source: SliceSource
    planned: PlannedSlice
    runs: list[PlanRun]
    started: float


class SliceDriver:
    """See the module docstring. ``sources(session_id)`` gives a live request's memory."""

    def __init__(
        self,
        endpoint: Endpoint,
        transport: Transport,
        sources: Callable[[SessionId], SliceSource | None],
        *,
        local_regions: dict[RegionId, int],
        slice_timeout_s: float,
        metrics: RuntimeMetrics,
        timeline: Timeline,
        grouping: OpGrouping = OpGrouping.WHOLE,
        max_inflight_ops: int = 8,
    ) -> None:
        self._ep = endpoint
        self._transport = transport
        self._sources = sources
        self._regions = local_regions
        self._timeout = slice_timeout_s
        self._metrics = metrics
        self._timeline = timeline
        self._grouping = grouping
        self._executor = PlanExecutor(transport, max_inflight=max_inflight_ops)
        self._links: dict[PeerId, PeerLink] = {}
        self._sessions: dict[SessionId, _Session] = {}
        self._queues: dict[SessionId, deque[StartSubmit]] = {}
        self._active: dict[SessionId, _Job] = {}
        self._inbox: deque[StartSubmit] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvplane-slice-driver", daemon=True)
        self.counters: dict[str, int] = {}

    # -- any thread --------------------------------------------------------------------------------
    def submit(self, act: StartSubmit) -> None:
        with self._cond:
            self._inbox.append(act)
            self._cond.notify()

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def busy(self) -> int:
        """Slices queued or in flight."""
        with self._cond:
            return len(self._inbox) + len(self._active) + sum(map(len, self._queues.values()))

    # -- the driver thread --------------------------------------------------------------------
    def _loop(self) -> None:
        planning = False
        while True:
            with self._cond:
                idle = not (self._inbox or self._active or any(self._queues.values()))
                if idle and not planning:
                    self._cond.wait(timeout=0.05)
                if self._stop:
                    break
                while self._inbox:
                    act = self._inbox.popleft()
                    self._queues.setdefault(act.session_id, deque()).append(act)
            try:
                progressed = self._turn()
                # plan ahead only while nothing is in flight: planning must not delay polls
                planning = progressed or (not self._active and self._plan_ahead())
                if not progressed and self._active:
                    time.sleep(2e-4)
            except Exception:  # a bug must not stop the driver: count it and keep driving
                self._count("loop_errors")
                log.exception("slice driver error (the driver keeps running)")
        for job in self._active.values():  # closing: stop what is in flight (best effort)
            for run in job.runs:
                run.cancel("worker closing")

    def _turn(self) -> bool:
        """Begin the head of every idle queue, step every run; True if anything moved."""
        for sid in [s for s, q in self._queues.items() if q and s not in self._active]:
            self._begin(self._queues[sid].popleft())
        for sid, q in list(self._queues.items()):
            if not q and sid not in self._active:
                del self._queues[sid]
        progressed = False
        for sid, job in list(self._active.items()):
            for run in job.runs:
                progressed |= bool(run.step())
            if all(run.done for run in job.runs):
                del self._active[sid]
                self._finish(job)
                progressed = True
        return progressed

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def _fail(self, act: StartSubmit, reason: str) -> None:
        self._count("plan_failures")
        with contextlib.suppress(ProtocolError):  # the session already ended: nothing to fail
            self._ep.send(act.session_id, Fail(reason=reason))

    def _plan_ahead(self) -> bool:
        """Plan one future slice of a known session while the prefill computes it."""
        for sid, sess in list(self._sessions.items()):
            source = self._sources(sid)
            if source is None:  # the request's memory is gone: forget the session
                del self._sessions[sid]
                continue
            while sess.next_plan < len(source.schedule) and sess.next_plan in sess.plans:
                sess.next_plan += 1
            if sess.next_plan >= len(source.schedule):
                continue
            slice_id = sess.next_plan
            tokens, is_last = source.schedule[slice_id]
            try:
                sess.plans[slice_id] = self._plan(
                    source, sess.link, sess.act, tokens, slice_id=slice_id, is_last=is_last
                )
            except KVPlaneError:
                sess.next_plan = len(source.schedule)  # plan it (and fail) when it is due
            self._count("planned_ahead")
            return True
        return False

    def _plan(
        self, source: SliceSource, link: PeerLink, act: StartSubmit, tokens: TokenRange,
        *, slice_id: int, is_last: bool,
    ) -> PlannedSlice:  # fmt: skip
        return plan_slice(
            list(source.pools), list(link.pools), act.request, tokens,
            slice_id=SliceId(slice_id), is_last=is_last, grouping=self._grouping,
        )  # fmt: skip

    def _planned(self, act: StartSubmit, source: SliceSource) -> PlannedSlice:
        """The slice's plans: made ahead of time when the schedule predicted this slice."""
        sid = act.session_id
        sess = self._sessions.get(sid)
        if sess is None:  # a session is bound to one peer incarnation: link it once
            sess = _Session(self._link(act.peer_id), act, {})
            self._sessions[sid] = sess
        ready = sess.plans.pop(int(act.slice_id), None)
        n = act.request.num_tokens
        if ready is not None and int(act.slice_id) < len(source.schedule):
            tokens, is_last = source.schedule[int(act.slice_id)]
            lo = min(max(tokens.start, act.request.prefix_tokens), n)
            if (lo, max(lo, min(tokens.end, n)), is_last) == (act.start, act.end, act.is_last):
                self._count("plans_ready")
                return ready
        tokens = TokenRange(act.start, act.end)
        return self._plan(
            source, sess.link, act, tokens, slice_id=int(act.slice_id), is_last=act.is_last
        )

    def _begin(self, act: StartSubmit) -> None:
        source = self._sources(act.session_id)
        if source is None:
            self._count("no_source")
            return
        try:
            planned = self._planned(act, source)
        except KVPlaneError as exc:
            self._fail(act, f"slice {act.slice_id} cannot be planned: {exc}")
            return
        evidence = SubmitSkipped if planned.empty else SubmitStarted
        ep, sid, slice_id = self._ep, act.session_id, act.slice_id

        def begin() -> bool:
            if not ep.participant.submittable(sid, slice_id):
                return False
            ep.receive_local(sid, evidence(slice_id=slice_id))
            return True

        if not ep.call(begin):
            self._count("overtaken")
            return
        if planned.empty:
            self._metrics.slices.labels("skipped").inc()
            return
        self._metrics.planned(list(zip(planned.plans, planned.dst_block_sizes, strict=True)))
        runs: list[PlanRun] = []
        try:
            for plan in planned.plans:
                runs.append(
                    self._executor.start(
                        plan,
                        self._sessions[sid].link.peer,
                        local_regions=self._regions,
                        deadline_s=self._timeout,
                    )
                )
        except KVPlaneError as exc:  # invalid against the regions: nothing of this run moved
            for run in runs:
                run.cancel(str(exc))
            self._active[sid] = _Job(act, source, planned, runs, time.monotonic())
            self._report(sid, TransportFailed(slice_id=slice_id, reason=str(exc)[:400]))
            return
        self._metrics.slices.labels("submitted").inc()
        self._timeline.record(
            Mark.SLICE_SUBMIT, source.request_id, slice_id=int(slice_id), nbytes=planned.num_bytes
        )
        self._active[sid] = _Job(act, source, planned, runs, time.monotonic())

    def _report(self, sid: SessionId, event: object) -> None:
        with contextlib.suppress(ProtocolError):
            self._ep.receive_local(sid, event)

    def _finish(self, job: _Job) -> None:
        if job.act.is_last:
            self._sessions.pop(job.act.session_id, None)
        results = [run.result() for run in job.runs]
        slice_id = job.act.slice_id
        sid = job.act.session_id
        rid = job.source.request_id
        elapsed = time.monotonic() - job.started
        if all(r.ok for r in results):
            self._metrics.slices.labels("done").inc()
            self._metrics.slice_seconds.observe(elapsed)
            self._metrics.moved(list(job.planned.plans))
            self._timeline.record(
                Mark.SLICE_DONE, rid, slice_id=int(slice_id), nbytes=job.planned.num_bytes
            )
            self._report(sid, TransportDone(slice_id=slice_id))
            return
        reason = next((r.reason for r in results if not r.ok), "")[:400]
        if any(r.outcome is PlanOutcome.IN_DOUBT for r in results):
            self._metrics.slices.labels("in_doubt").inc()
            event: object = TransportInDoubt(slice_id=slice_id, reason=reason)
        else:
            self._metrics.slices.labels("failed").inc()
            event = TransportFailed(slice_id=slice_id, reason=reason)
        self._timeline.record(Mark.SLICE_FAILED, rid, slice_id=int(slice_id), detail=reason)
        self._report(sid, event)

    def _link(self, peer_id: PeerId) -> PeerLink:
        """The transport peer and pools of ``peer_id``'s current incarnation (connects once)."""
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
