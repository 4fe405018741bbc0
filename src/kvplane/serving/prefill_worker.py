"""The prefill worker: chunked prefill with a pipelined, ledger-owned transfer of every slice.

A request's blocks are freed only when its session finished and the ledger released every
slice, never on the phase alone; only the blocks of a window group that nothing reads any
more go earlier, after each step or when a prefix store reading them ended, and a window
group's blocks are taken step by step on a reservation made at admission
(:class:`~kvplane.serving.prefill_steps.PrefillSteps`, which runs the steps). See
docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import numpy as np

from kvplane.errors import KVPlaneError, ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, TokenRange
from kvplane.metrics import SEED_HISTOGRAMS, MetricsRegistry, histogram_counters
from kvplane.pd.actions import Action, DestinationKnown, Finished, Release, StartSubmit
from kvplane.pd.events import Cancel, SubmitSlice
from kvplane.pd.states import Role, SessionState
from kvplane.pipeline.driver import SliceDriver
from kvplane.pipeline.driver_records import SliceSource
from kvplane.pipeline.slicing import SliceCutter, step_ranges
from kvplane.pipeline.timeline import Mark
from kvplane.serving import worker_requests as book
from kvplane.serving.gather_orders import share_for
from kvplane.serving.kv_publisher import KVEventSettings
from kvplane.serving.messages import Ack, AnyMessage, CancelOrder, PrefillOrder, WorkerStats
from kvplane.serving.prefill_steps import PrefillRequest, PrefillSteps
from kvplane.serving.prefix_offload import Finished as OffloadFinished
from kvplane.serving.prefix_offload import PrefixOffload, PrefixSettings, StoreFinished
from kvplane.serving.producers.base import KVProducer
from kvplane.serving.producers.model import ModelKV, PromptChecker
from kvplane.serving.rpc import Reply
from kvplane.serving.worker import Worker, WorkerHooks
from kvplane.serving.worker_config import WorkerConfig
from kvplane.simulate.calibrate import PD_LINKS
from kvplane.simulate.pipelining import AutoPipelining
from kvplane.transports.base import Transport


@dataclass(frozen=True, slots=True)
class _Admission:
    """The session's answer to one of a request's ``SubmitSlice`` commands (driver thread →
    worker loop)."""

    session_id: SessionId
    accepted: bool


class PrefillWorker(Worker):
    """See the module docstring. ``producer`` computes the KV (synthetic or a real model)."""

    role = "prefill"
    kv_role = Role.SENDER

    def __init__(
        self,
        config: WorkerConfig,
        producer: KVProducer,
        *,
        metrics: MetricsRegistry | None = None,
        transport: Transport | None = None,
        hooks: WorkerHooks | None = None,
        offload: PrefixSettings | None = None,
        kv_events: KVEventSettings | None = None,
    ) -> None:
        super().__init__(
            config, producer, metrics=metrics, transport=transport, hooks=hooks, kv_events=kv_events
        )
        self.producer = producer
        self.offload: PrefixOffload | None = None
        if offload is not None:
            kv = self.pools.kv
            self.offload = PrefixOffload(
                offload, kv, self.pools.blocks, state=self.pools.state, metrics=self.metrics,
                group_pools=self.pools.group_blocks,
            )  # fmt: skip
        self.auto: AutoPipelining | None = None
        if config.auto_pipelining:
            layout = self.pools.kv.layout
            per_token = layout.bytes_per_block // layout.block_size
            self.auto = AutoPipelining(PD_LINKS.get(config.transport), per_token)
        self.steps = PrefillSteps(
            producer, self.pools, self.timeline, counters=self.counters, offload=self.offload,
            auto=self.auto, cancel=self._cancel,
        )  # fmt: skip
        self._requests: dict[RequestId, PrefillRequest] = {}
        self._by_session: dict[SessionId, PrefillRequest] = {}
        self._waiting: deque[PrefillRequest] = deque()
        self._running: deque[PrefillRequest] = deque()
        self._sources: dict[SessionId, SliceSource] = {}
        self._sources_lock = threading.Lock()
        self.driver = SliceDriver(
            self.endpoint,
            self.transport,
            self._source,
            local_regions=self.pools.local_regions(),
            slice_timeout_s=config.slice_timeout_s,
            metrics=self.rmetrics,
            timeline=self.timeline,
            grouping=config.grouping,
            max_inflight_ops=config.max_inflight_ops,
        )

    def start(self) -> None:
        self.driver.start()
        super().start()

    def _close_parts(self) -> None:
        self.driver.close()
        if self.offload is not None:
            self.offload.close()

    def _source(self, sid: SessionId) -> SliceSource | None:
        with self._sources_lock:
            return self._sources.get(sid)

    def _on_action(self, act: Action) -> None:
        if isinstance(act, StartSubmit):
            self.driver.submit(act)  # straight to the driver: no hop through the worker loop
        elif isinstance(act, DestinationKnown):
            self.driver.expect(act)  # plans ahead from the first slice on
        else:
            if isinstance(act, Finished) and act.role is Role.SENDER:
                self.driver.forget(act.session_id)  # a hint may wait for memory it never got
            super()._on_action(act)

    def _requests_live(self) -> int:
        return len(self._requests)

    # -- orders ----------------------------------------------------------------------------------
    def _on_message(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, PrefillOrder):  # its wait for the worker loop is measured
            self.timeline.record(Mark.ORDER_RECEIVED, msg.request_id)
        super()._on_message(msg, reply)

    def _on_order(self, msg: AnyMessage, reply: Reply) -> None:
        if isinstance(msg, PrefillOrder):
            reply(Ack(detail=self._accept(msg)))
        elif isinstance(msg, CancelOrder):
            detail = self._cancel(RequestId(msg.request_id), msg.reason, msg.session_id)
            reply(Ack(detail=detail))
        else:
            super()._on_order(msg, reply)

    def _accept(self, order: PrefillOrder) -> str:
        rid = RequestId(order.request_id)
        sid, peer = SessionId(order.session_id), PeerId(order.decode_peer)
        book.check_new(self._requests, self._by_session, rid, sid)
        n = len(order.token_ids)
        capacity = min(p.capacity for p in self.pools.block_pools)  # of every KV cache group
        book.check_fits(rid, -(-n // self.config.block_size), capacity)
        if isinstance(self.producer, PromptChecker):
            self.producer.check_prompt(np.asarray(order.token_ids, dtype=np.int64))
        step = order.step_size or self.config.step_size
        at = self.pools.placement
        share = None if order.share is None else share_for(order.share, sid, self.config.name, at)
        if not self.endpoint.open_sender(sid, peer):
            self.counters["orders_for_ended_sessions"] += 1
            return "session already ended"
        tokens = np.asarray(order.token_ids, dtype=np.int64)
        req = PrefillRequest(order, sid, peer, tokens, step_ranges(n, step), share=share)
        self._requests[rid] = req
        self._by_session[sid] = req
        self.timeline.record(Mark.ORDER, rid)
        self._waiting.append(req)
        self._admit_waiting()
        return "accepted"

    def _cancel(self, rid: RequestId, reason: str, sid: str | None = None) -> str:
        """Stop request ``rid`` (only while it is bound to session ``sid``, when given)."""
        req = book.find_to_stop(self._requests, rid, sid)
        if req is None:
            return "unknown request"
        req.stopped = True
        try:
            self.endpoint.send(req.sid, Cancel(reason=reason))
        except ProtocolError:
            return "session already ended"
        finally:
            self._maybe_free(req)  # everything admitted may already be released
        return "cancelling"

    def _admit_waiting(self) -> None:
        while self._waiting:
            req = self._waiting[0]
            if req.outcome is not None or req.stopped:
                self._waiting.popleft()
                self._maybe_free(req)
                continue
            grow = self.steps.growth(req)  # a window group's blocks step by step
            got = book.admit_memory(self.pools, self.config.block_size, req, grow=grow)
            if got is None:
                return
            self._waiting.popleft()
            if self.offload is not None:
                rid, groups = RequestId(req.order.request_id), req.group_tables
                load = self.offload.begin_load(rid, *got, groups=groups)
                if load is not None:  # a load, or a wait for this worker's stores of the prefix
                    req.loading = True
                    self.timeline.record(
                        Mark.LOAD_START,
                        req.order.request_id,
                        detail=",".join(load.sources) or f"waiting {load.waiting}",
                    )
                    continue
            self._start(req)

    def _start(self, req: PrefillRequest) -> None:
        """Cut, schedule and run an admitted request (its prefix, if any, is loaded)."""
        table, slot = req.table, req.slot
        if table is None or slot is None:  # pragma: no cover - admitted requests hold both
            return
        rid = req.order.request_id
        step, align = req.order.step_size or self.config.step_size, self._alignment(req.peer)
        schedule = self.steps.schedule(req, step, align, self.config.pipelined)
        pools = book.local_pools(self.pools, req)  # one paged pool per KV cache group
        with self._sources_lock:
            self._sources[req.sid] = SliceSource(rid, pools, schedule, share=req.share)
        self.driver.source_ready(req.sid)  # a DestinationKnown that came first can plan now
        self._running.append(req)
        if self.offload is not None:  # a later request of this prefix waits for its store
            self.offload.expect(RequestId(rid), table)

    def _on_offload(self, events: list[OffloadFinished]) -> None:
        """Loads that ended start their requests (or free them, if stopped meanwhile)."""
        for ev in events:
            if isinstance(ev, StoreFinished):
                if ev.request_id and ev.group == 0:
                    self.timeline.record(Mark.STORE_DONE, ev.request_id, detail=str(ev.stored))
                done = self._requests.get(ev.request_id)
                if done is not None and done.table is not None and not done.loading:
                    self.steps.drop_window(done, done.position)  # what the store held
                continue
            req = self._requests.get(ev.request_id)
            self.timeline.record(
                Mark.LOAD_DONE, ev.request_id, nbytes=ev.tokens, detail=f"{ev.chunks} chunks"
            )
            if req is None or not req.loading:  # pragma: no cover - a loading request stays
                continue
            req.loading = False
            if req.stopped or req.outcome is not None:
                self._maybe_free(req)
                continue
            req.loaded = ev.tokens
            self._start(req)

    def _alignment(self, peer: PeerId) -> int:
        rec = self.endpoint.call(lambda: self.participant.peers.get(peer))
        sizes = [self.config.block_size]
        if rec is not None:
            sizes.append(rec.hello.profile.layouts[0].block_size)
        return SliceCutter.alignment(*sizes)

    # -- compute ---------------------------------------------------------------------------------
    def _has_work(self) -> bool:
        if self.offload is not None and self.offload.busy:
            self._on_offload(self.offload.poll())
            if self.offload.loading:
                return True
        return any(r.computing for r in self._running)

    def _work(self) -> None:
        for _ in range(len(self._running)):
            req = self._running[0]
            self._running.rotate(-1)
            if req.computing:
                self._step(req)
                return
        if self.offload is not None and self.offload.loading:  # nothing else to do: wait a bit
            self._on_offload(self.offload.wait(0.005))

    def _step(self, req: PrefillRequest) -> None:
        if req.table is None or req.cutter is None:  # pragma: no cover - computing checks it
            return
        rng = req.steps[req.next_step]
        is_last = req.next_step == len(req.steps) - 1
        if not self._grow(req, rng):
            return
        if rng.end <= req.loaded:  # the loaded prefix: already in the blocks
            req.next_step += 1
        elif not self.steps.compute(req, rng, is_last):  # failed: its KV must never be sent
            return
        self.steps.after(req, rng, is_last)  # stores; frees what nothing reads any more
        cut = req.cutter.after_step(rng.end, is_last)
        if cut is None:
            return
        slice_id, tokens = cut
        # counted admitted until the session says otherwise: memory waits for the answer
        req.admitted += 1
        command = SubmitSlice(
            slice_id=slice_id, is_last=is_last, start=tokens.start, end=tokens.end
        )
        inbox, sid = self._inbox, req.sid
        self.driver.admit(sid, command, lambda ok: inbox.put(_Admission(sid, ok)))

    def _grow(self, req: PrefillRequest, rng: TokenRange) -> bool:
        """Grow ``req``'s tables to cover ``rng`` (its reservation covers it, unless prefix
        stores of more than a step ago still hold blocks: their ends are awaited, up to the
        slice timeout) and give the slice source the blocks. False: cancelled, short."""
        deadline = time.monotonic() + self.config.slice_timeout_s
        while not self.steps.grow(req, rng):
            if self.offload is None or not self.offload.busy or time.monotonic() > deadline:
                self.counters["step_short_of_blocks"] += 1
                self._cancel(RequestId(req.order.request_id), "prefill step short of blocks")
                return False
            self._on_offload(self.offload.wait(0.005))
        with self._sources_lock:
            source = self._sources.get(req.sid)
            if source is not None:
                pools = book.local_pools(self.pools, req)
                self._sources[req.sid] = dataclasses.replace(source, pools=pools)
        return True

    def _on_admission(self, ev: _Admission) -> None:
        """A slice the session refused (it is gone, retired): nothing more to send."""
        req = self._by_session.get(ev.session_id)
        if ev.accepted or req is None:
            return
        req.admitted -= 1
        req.stopped = True
        if req.failed_at is None:
            req.failed_at = time.monotonic()
        self.counters["slices_after_session_end"] += 1
        self._maybe_free(req)

    # -- protocol actions --------------------------------------------------------------------------
    def _on_pd(self, act: object) -> None:
        if isinstance(act, _Admission):
            self._on_admission(act)
        elif isinstance(act, Release) and act.role is Role.SENDER:
            req = self._by_session.get(act.session_id)
            if req is not None:
                req.released += 1
                self._maybe_free(req)
        elif isinstance(act, Finished) and act.role is Role.SENDER:
            self._on_finished(act)

    def _on_finished(self, act: Finished) -> None:
        req = self._by_session.get(act.session_id)
        if req is None:
            self.counters["finished_unknown_session"] += 1
            return
        now = time.monotonic()
        req.outcome = act.state
        req.finished_at = now
        req.stopped = True
        self.rmetrics.finished(act.state.value, act.reason)
        self.timeline.record(Mark.SESSION_END, req.order.request_id, detail=act.state.value)
        if act.state is not SessionState.SUCCESS and req.failed_at is None:
            req.failed_at = now
        self._maybe_free(req)

    def _maybe_free(self, req: PrefillRequest) -> None:
        """Free the request's memory once nothing more will be submitted (session ended or
        stopped locally) and the ledger released every slice the session admitted; forget the
        request once its session has ended too."""
        if self.offload is not None and (req.stopped or req.outcome is not None):
            self._stop_offload(self.offload, req)
        if (req.outcome is None and not req.stopped) or req.released < req.admitted:
            return
        if req in self._waiting or req.loading:
            return  # dropped by _admit_waiting / freed when its load ends
        if req.table is not None or req.slot is not None:
            with self._sources_lock:
                self._sources.pop(req.sid, None)
            book.free_memory(self, req)
            self._running = deque(r for r in self._running if r is not req)
            self._admit_waiting()
        if req.outcome is None:
            return
        book.forget(self._requests, self._by_session, req)
        if req.outcome is SessionState.SUCCESS and req.failed_at is None:
            self.steps.observe_success(req, self.rmetrics)

    def _stop_offload(self, offload: PrefixOffload, req: PrefillRequest) -> None:
        """A stopped request: its promised store will not come, and if it is parked waiting for
        this worker's stores of its prefix it is unparked now, without a lookup (nothing is
        loading into its blocks, so :meth:`_maybe_free` may free them at once; a load in flight
        is waited for instead)."""
        rid = RequestId(req.order.request_id)
        offload.forget(rid)
        if req.loading and offload.waits.drop(rid) is not None:
            req.loading = False
            self.counters["pending_waits_cancelled"] += 1
            self.timeline.record(Mark.LOAD_DONE, rid, detail="cancelled while waiting")

    # -- observation -------------------------------------------------------------------------------
    def stats(self, *, timeline: bool = False) -> WorkerStats:
        """The base stats plus offload hits per tier, transfer amplification inputs, blocks per
        op and the model's attention plans/fallbacks; offload integrity joins the verdict."""
        base = super().stats(timeline=timeline)
        extra = report_counters(self.metrics, self.producer)
        extra.update({f"driver_{k}": v for k, v in dict(self.driver.counters).items()})
        problem = base.integrity
        if self.offload is not None:
            extra.update(self.offload.snapshot())
            try:
                self.offload.check_integrity()
            except KVPlaneError as exc:
                problem = problem or f"offload: {exc}"[:4000]
        return msgspec.structs.replace(base, counters={**base.counters, **extra}, integrity=problem)


def report_counters(metrics: MetricsRegistry, model: object) -> dict[str, int]:
    """Integer counters a report (and the router's ``/metrics``) derives the seed's metrics
    from (``WorkerStats.counters``): bytes moved and needed, the seed's histograms in the form
    of :func:`~kvplane.metrics.histogram_counters`, and a model's attention plans/fallbacks."""
    out = {
        "pd_bytes_moved": int(metrics.value("pd_bytes_moved", suffix="_total")),
        "pd_logical_bytes": int(metrics.value("pd_logical_bytes", suffix="_total")),
        **histogram_counters(metrics, SEED_HISTOGRAMS),
    }
    if isinstance(model, ModelKV):
        plans, fallbacks = model.fallback_counts
        out.update(attention_plans=plans, attention_fallbacks=fallbacks)
    return out
