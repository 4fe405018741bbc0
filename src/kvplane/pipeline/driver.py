"""The prefill side's transfer driver: turns ``StartSubmit`` actions into plan runs and evidence.

One ordered queue per session, plans made ahead, one PD-loop hop per turn. It decides nothing
about memory: the ledger releases it. See docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvplane.errors import KVPlaneError, ProtocolError
from kvplane.ids import RegionId, SessionId
from kvplane.pd.actions import DestinationKnown, StartSubmit
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import (
    Fail,
    SubmitSkipped,
    SubmitSlice,
    SubmitStarted,
    TransportDone,
    TransportFailed,
    TransportInDoubt,
)
from kvplane.pipeline.driver_records import (
    Evidence,
    PlannedSession,
    SliceBegin,
    SliceJob,
    SliceSource,
    WorkerCommand,
)
from kvplane.pipeline.observe import RuntimeMetrics
from kvplane.pipeline.slice_planner import SlicePlanner
from kvplane.pipeline.timeline import Mark, Timeline
from kvplane.pipeline.watcher import BatchWatcher
from kvplane.transfer import OpGrouping, PlanExecutor, PlanOutcome, latest_end
from kvplane.transports.base import Transport

log = logging.getLogger(__name__)

POLL_S = 2e-4
"""How often in-flight runs are polled when the transport cannot be watched."""
WATCHED_POLL_S = 0.02
"""How often in-flight runs are polled anyway when the watcher wakes the driver at every batch
end: only deadlines (seconds) and fault-injected delays need it, and each poll is a driver turn
(every 5 ms was a third of the driver's turns in ``bench pd``)."""
IDLE_S = 0.05
"""The longest idle wait (nothing queued, in flight or left to plan)."""


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
        self._sources = sources
        self._regions = local_regions
        self._timeout = slice_timeout_s
        self._metrics = metrics
        self._timeline = timeline
        self._watcher = BatchWatcher(transport, self._wake)
        self._executor = PlanExecutor(self._watcher.transport, max_inflight=max_inflight_ops)
        self._poll_s = WATCHED_POLL_S if self._watcher.active else POLL_S
        self._flights: dict[SessionId, deque[SliceJob]] = {}
        self._inbox: deque[StartSubmit] = deque()
        self._commands: deque[WorkerCommand] = deque()
        self._hints: list[DestinationKnown] = []
        self._sourced: list[SessionId] = []
        self._ended: list[SessionId] = []
        self._woken = False
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvplane-slice-driver", daemon=True)
        self.counters: dict[str, int] = {}
        self._planner = SlicePlanner(
            endpoint, transport, sources, grouping=grouping, count=self._count
        )

    # -- any thread --------------------------------------------------------------------------------
    def submit(self, act: StartSubmit) -> None:
        with self._cond:
            self._inbox.append(act)
            self._cond.notify()

    def expect(self, hint: DestinationKnown) -> None:
        """A session's destination is known: link its peer and plan its first slices ahead,
        before their steps end (a hint; the slices still begin only on ``StartSubmit``)."""
        with self._cond:
            self._hints.append(hint)
            self._cond.notify()

    def source_ready(self, session_id: SessionId) -> None:
        """The session's request memory is now in ``sources`` (its hint may have come first)."""
        with self._cond:
            self._sourced.append(session_id)
            self._cond.notify()

    def forget(self, session_id: SessionId) -> None:
        """The session has ended: drop its waiting hint and plans (it sends nothing more)."""
        with self._cond:
            self._ended.append(session_id)
            self._cond.notify()

    def admit(
        self, session_id: SessionId, command: SubmitSlice, on_result: Callable[[bool], None]
    ) -> None:
        """Send ``command`` to the session from the driver thread, in call order; then
        ``on_result(accepted)`` (False: the session refused it, e.g. it has ended)."""
        with self._cond:
            self._commands.append(WorkerCommand(session_id, command, on_result))
            self._cond.notify()

    def start(self) -> None:
        self._watcher.start()
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._watcher.close()

    def busy(self) -> int:
        """Slices queued or in flight."""
        with self._cond:
            queued = len(self._inbox) + len(self._commands)
            return queued + sum(map(len, self._flights.values()))

    @property
    def _waiting(self) -> dict[SessionId, DestinationKnown]:
        """The planner's hints waiting for memory (tests watch them; driver thread's own)."""
        return self._planner.waiting

    @property
    def _sessions(self) -> dict[SessionId, PlannedSession]:
        """The planner's known sessions (tests watch them; driver thread's own)."""
        return self._planner.sessions

    def _wake(self) -> None:
        """A watched batch ended (watcher thread): step the runs now."""
        with self._cond:
            self._woken = True
            self._cond.notify()

    # -- the driver thread --------------------------------------------------------------------
    def _loop(self) -> None:
        planning = False
        while True:
            with self._cond:
                if not (planning or self._inbox or self._commands or self._woken or self._stop
                        or self._hints or self._sourced or self._ended):  # fmt: skip
                    self._cond.wait(self._poll_s if self._flights else IDLE_S)
                if self._stop:
                    break
                fresh, commands, hints = list(self._inbox), list(self._commands), self._hints
                sourced, self._sourced = self._sourced, []
                ended, self._ended = self._ended, []
                self._inbox.clear()
                self._commands.clear()
                self._hints = []
                self._woken = False
            try:
                self._turn(fresh, commands)
                self._planner.adopt(hints, sourced)
                for sid in ended:  # after adopt: its hint came before its end
                    self._planner.forget(sid)
                # plan ahead only when no new slice waits: a begin must not wait for a plan
                planning = self._planner.plan_ahead() if not self._inbox else True
            except Exception:  # a bug must not stop the driver: count it and keep driving
                self._count("loop_errors")
                log.exception("slice driver error (the driver keeps running)")
        for jobs in self._flights.values():  # closing: stop what is in flight (best effort)
            for job in jobs:
                for run in job.runs:
                    run.cancel("worker closing")

    def _turn(self, fresh: list[StartSubmit], commands: list[WorkerCommand]) -> None:
        """Step every run; report finished slices, send the worker's commands and begin new
        slices in one PD loop call."""
        evidence = self._harvest()
        begins = [b for b in map(self._prepare, fresh) if b is not None]
        if not evidence and not begins and not commands:
            return
        ep = self._ep
        late: list[StartSubmit] = []

        def on_loop() -> None:
            for sid, event in evidence:
                with contextlib.suppress(ProtocolError):  # the session already ended
                    ep.receive_local(sid, event)
            for c in commands:  # their StartSubmits come back to this driver's inbox
                with contextlib.suppress(ProtocolError):  # refused: reported as not accepted
                    ep.send(c.session_id, c.command)
                    c.accepted = True
            if commands:  # begin what they let start now, in this same call
                late.extend(self._take_arrived(begins))
            for b in begins:
                sid, slice_id = b.act.session_id, b.act.slice_id
                if ep.participant.submittable(sid, slice_id):
                    kind = SubmitSkipped if b.planned.empty else SubmitStarted
                    with contextlib.suppress(ProtocolError):  # refused: it stays unbegun
                        ep.receive_local(sid, kind(slice_id=slice_id))
                        b.allowed = True

        try:
            ep.call(on_loop)
        finally:  # the worker counts on one answer per command
            for c in commands:
                c.on_result(c.accepted)
            if late:  # not planned ahead: planned on this thread in the next turn, in order
                with self._cond:
                    self._inbox.extendleft(reversed(late))
        for b in begins:
            if b.allowed:
                self._start(b)
            else:
                self._count("overtaken")

    def _take_arrived(self, begins: list[SliceBegin]) -> list[StartSubmit]:
        """On the PD loop, inside a turn's call (the driver thread waits on it): move the
        ``StartSubmit`` s that the turn's commands just produced from the inbox into
        ``begins`` when their plans were made ahead; the others come back
        (:meth:`SlicePlanner.ready_begins`)."""
        with self._cond:
            arrived = list(self._inbox)
            self._inbox.clear()
        ready, late = self._planner.ready_begins(arrived)
        begins.extend(ready)
        return late

    def _harvest(self) -> list[tuple[SessionId, Evidence]]:
        """Step every run; the evidence of finished slices, each session's in slice order."""
        out: list[tuple[SessionId, Evidence]] = []
        for sid, jobs in list(self._flights.items()):
            for job in jobs:
                for run in job.runs:
                    run.step()
            while jobs and jobs[0].done:
                out.append((sid, self._finish(jobs.popleft())))
            if not jobs:
                del self._flights[sid]
        return out

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def _fail(self, act: StartSubmit, reason: str) -> None:
        self._count("plan_failures")
        with contextlib.suppress(ProtocolError):  # the session already ended: nothing to fail
            self._ep.send(act.session_id, Fail(reason=reason))

    def _prepare(self, act: StartSubmit) -> SliceBegin | None:
        """Plan a new slice (or fail its session when it cannot be planned)."""
        source = self._sources(act.session_id)
        if source is None:
            self._count("no_source")
            return None
        try:
            planned = self._planner.planned(act, source)
        except KVPlaneError as exc:
            self._fail(act, f"slice {act.slice_id} cannot be planned: {exc}")
            return None
        return SliceBegin(act, source, planned)

    def _start(self, b: SliceBegin) -> None:
        """Start the runs of a slice the session let begin, and hand their first ops over."""
        act, source, planned = b.act, b.source, b.planned
        sid = act.session_id
        if planned.empty:
            self._metrics.slices.labels("skipped").inc()
            return
        self._metrics.planned(list(zip(planned.plans, planned.dst_block_sizes, strict=True)))
        job = SliceJob(act, source, planned, [], time.monotonic())
        self._flights.setdefault(sid, deque()).append(job)
        sess = self._planner.session(sid)
        try:  # one run, one batch per op position: the final slice's records ride with its KV
            if sess is None:  # it ended meanwhile (as the begin check saw, no longer)
                raise ProtocolError(f"session {sid} is no longer planned")
            job.runs.append(
                self._executor.start(
                    planned.plans,
                    sess.link.peer,
                    local_regions=self._regions,
                    deadline_s=self._timeout,
                )
            )
        except KVPlaneError as exc:  # invalid against the regions: nothing of this run moved
            job.failure = str(exc)[:400]
            for run in job.runs:
                run.cancel(job.failure)
            return
        self._metrics.slices.labels("submitted").inc()
        self._timeline.record(
            Mark.SLICE_SUBMIT,
            source.request_id,
            slice_id=int(act.slice_id),
            nbytes=planned.num_bytes,
        )
        for run in job.runs:  # submit now: the transport starts while we report
            run.step()

    def _finish(self, job: SliceJob) -> Evidence:
        """Record a finished slice; its evidence, to report to the session."""
        if job.act.is_last:
            self._planner.forget(job.act.session_id)
        results = [run.result() for run in job.runs]
        slice_id = job.act.slice_id
        rid = job.source.request_id
        if not job.failure and all(r.ok for r in results):
            done_at = latest_end([r.ended_at for r in results]) or time.monotonic()  # or unknown
            self._metrics.slices.labels("done").inc()
            self._metrics.slice_seconds.observe(done_at - job.started)
            self._metrics.moved(list(job.planned.plans))
            self._timeline.record(
                Mark.SLICE_DONE, rid, slice_id=int(slice_id), nbytes=job.planned.num_bytes,
                t=done_at,
            )  # fmt: skip
            return TransportDone(slice_id=slice_id)
        reason = job.failure or next((r.reason for r in results if not r.ok), "")[:400]
        event: Evidence
        if any(r.outcome is PlanOutcome.IN_DOUBT for r in results):
            self._metrics.slices.labels("in_doubt").inc()
            event = TransportInDoubt(slice_id=slice_id, reason=reason)
        else:
            self._metrics.slices.labels("failed").inc()
            event = TransportFailed(slice_id=slice_id, reason=reason)
        self._timeline.record(Mark.SLICE_FAILED, rid, slice_id=int(slice_id), detail=reason)
        return event
