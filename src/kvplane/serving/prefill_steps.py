"""A prefill worker's requests and their steps: the record of one request
(:class:`PrefillRequest`) and :class:`PrefillSteps`, which runs one step of one.

A step grows the tables of a window group (a pool with a null block) to cover it, on the
blocks reserved at admission (:meth:`PrefillSteps.growth`), runs the producer's compute, then
the tail record (last step) and the prefix offload's state snapshot; after it its newly full
chunks are stored and, in each window group's pool, the blocks no later step, slice or store
reads are freed (:func:`~kvplane.blocks.drop_windows`).
Owns no request book and no protocol: the worker loop (:mod:`~kvplane.serving.prefill_worker`)
decides which request steps, cuts its slices and frees its memory. Not thread-safe: the worker
loop owns it. See docs/serving.md.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvplane.blocks import BlockTable, Growth, drop_windows, window_peak
from kvplane.errors import InvalidArgumentError, KVPlaneError
from kvplane.ids import PeerId, RequestId, SessionId, TokenRange
from kvplane.pd.states import SessionState
from kvplane.pipeline.observe import RuntimeMetrics
from kvplane.pipeline.shares import Share
from kvplane.pipeline.slicing import SliceCutter, slice_schedule
from kvplane.pipeline.timeline import Mark, Timeline, request_times
from kvplane.serving import worker_requests as book
from kvplane.serving.messages import PrefillOrder
from kvplane.serving.pools import WorkerPools
from kvplane.serving.prefix_offload import PrefixOffload
from kvplane.serving.producers.base import KVProducer, ProduceStep
from kvplane.simulate.pipelining import AutoPipelining, Choice


@dataclass(slots=True, eq=False)
class PrefillRequest:
    """One request on a prefill worker: its order, session, prompt and step ranges, the
    memory it holds (a table per KV cache group and a tail slot), its slice cutter and its
    progress."""

    order: PrefillOrder
    sid: SessionId
    peer: PeerId
    tokens: np.ndarray
    steps: list[TokenRange]
    table: BlockTable | None = None
    group_tables: tuple[BlockTable, ...] = ()
    slot: int | None = None
    cutter: SliceCutter | None = None
    next_step: int = 0
    admitted: int = 0
    released: int = 0
    outcome: SessionState | None = None
    stopped: bool = False
    failed_at: float | None = None
    finished_at: float | None = None
    prefill_end: float | None = None
    loading: bool = False
    loaded: int = 0
    compute_s: float = 0.0
    computed: int = 0
    share: Share | None = None

    @property
    def computing(self) -> bool:
        return (
            self.table is not None
            and self.cutter is not None
            and not self.stopped
            and self.next_step < len(self.steps)
        )

    @property
    def position(self) -> int:
        """The first position the next step computes (the prompt's length after the last)."""
        return self.steps[self.next_step - 1].end if self.next_step else 0

    @property
    def tables(self) -> tuple[BlockTable, ...]:
        """Its table of each KV cache group, in group order (none before admission)."""
        return () if self.table is None else (self.table, *self.group_tables)


class PrefillSteps:
    """Runs one step of a prefill worker's request (see the module docstring), chooses how
    its slices go (:meth:`mode`) and learns from its end (:meth:`observe_success`).
    ``counters``: the worker's; ``auto``: the cost model of ``auto_pipelining`` (None: off);
    ``cancel``: the worker's cancel of a request whose step failed (with a one-line reason)."""

    def __init__(
        self,
        producer: KVProducer,
        pools: WorkerPools,
        timeline: Timeline,
        *,
        counters: Counter[str],
        offload: PrefixOffload | None,
        auto: AutoPipelining | None,
        cancel: Callable[[RequestId, str], object],
    ) -> None:
        self.producer, self.pools, self.timeline = producer, pools, timeline
        self.counters, self.offload, self.auto, self._cancel = counters, offload, auto, cancel
        self.layouts = tuple(kv.layout for kv in pools.kv.pools)

    def compute(self, req: PrefillRequest, rng: TokenRange, is_last: bool) -> bool:
        """One prefill step of ``rng`` through the producer; the last one writes the tail record
        and stores the prompt's chunks in the offload tiers. False: the step failed and its
        request is cancelled (nothing of it may be cut into a slice)."""
        table = req.table
        if table is None:  # pragma: no cover - computing checks it
            return False
        rid = req.order.request_id
        self.timeline.record(Mark.STEP_START, rid, slice_id=req.next_step)
        began = time.perf_counter()
        groups = book.group_block_ids(req)  # KV cache groups 1..'s blocks
        step = ProduceStep(
            RequestId(rid), req.tokens, table.block_ids, rng, is_last, req.slot, groups
        )
        try:
            out = self.producer.produce(step, self.pools.kv, self.pools.state)
        except KVPlaneError as exc:  # a step that cannot run fails its request, not the worker
            self.counters["step_errors"] += 1
            self.timeline.record(Mark.STEP_END, rid, slice_id=req.next_step, detail="failed")
            self._cancel(RequestId(rid), f"prefill step failed: {exc}"[:4000])
            return False
        req.next_step += 1
        if self.offload is not None:  # a hybrid's state at a chunk boundary, kept for reuse
            self.offload.keep_state(table, req.slot, rng.end)
        if is_last:
            if out.first_token is None or req.slot is None:
                raise InvalidArgumentError(f"producer gave no first token for request {rid!r}")
            self.pools.write_tail(req.slot, out.first_token, req.tokens)
        req.compute_s += time.perf_counter() - began
        req.computed += len(rng)
        ev = self.timeline.record(Mark.STEP_END, rid, slice_id=req.next_step - 1)
        if is_last:
            req.prefill_end = ev.t
            if self.auto is not None and req.cutter is not None and req.computed > len(rng):
                self.auto.observe(req.cutter.pipelined, req.computed, req.compute_s)
        return True

    def growth(self, req: PrefillRequest) -> tuple[Growth | None, ...]:
        """How ``req``'s table of each KV cache group is admitted: a window group's (a pool
        with a null block) step by step, its first step's blocks now and a reservation of its
        :func:`~kvplane.blocks.window_peak` (with prefix offload, counting a step's store in
        flight); another group's (None) all at once."""
        n, first = len(req.tokens), req.steps[0].end
        step = max(len(r) for r in req.steps)
        unit = 0 if self.offload is None else self.offload.store_unit
        pools = self.pools.block_pools
        return tuple(
            None
            if pool.null_block is None
            else Growth(first, window_peak(lay, n, pool.block_size, step, unit))
            for lay, pool in zip(self.layouts, pools, strict=True)
        )

    def grow(self, req: PrefillRequest, rng: TokenRange) -> bool:
        """Before the step computing ``rng``: every table covers it (a window group's grows,
        its reservation first). False: a pool is short, which only a prefix store still in
        flight from more than a step ago causes (the tables that grew keep their blocks)."""
        pools = self.pools.block_pools
        return all([t.grow_to(p, rng.end) for t, p in zip(req.tables, pools, strict=True)])

    def after(self, req: PrefillRequest, rng: TokenRange, is_last: bool) -> int:
        """After the step of ``rng`` (computed or loaded): store its newly full chunks (with
        prefix offload; the last step all the rest), then :meth:`drop_window`. Returns the
        blocks freed."""
        table = req.table
        if self.offload is not None and table is not None:
            rid = req.order.request_id
            upto = None if is_last else rng.end
            chunks = self.offload.store(RequestId(rid), table, groups=req.group_tables, upto=upto)
            if chunks:
                self.timeline.record(Mark.STORE_START, rid, detail=str(chunks))
        return self.drop_window(req, rng.end)

    def drop_window(self, req: PrefillRequest, position: int) -> int:
        """After a step whose next one computes ``position`` on: free the request's blocks no
        one reads any more, in each KV cache group's pool with a null block
        (:func:`~kvplane.blocks.drop_windows`). Returns the blocks freed.

        Compute reads ``window_start(position)`` on. A slice sends only the final window,
        ``window_start(num_tokens)`` on (:func:`~kvplane.transfer.resharding.window_boxes`,
        and the decode side admits no block before it), which is never lower. A prefix store
        not issued yet or in flight reads its chunks (:meth:`PrefixOffload.store_reads`), so
        they stay until it ended (the worker drops again then)."""
        tables = req.tables
        if not tables:
            return 0
        hold = None
        if self.offload is not None:
            hold = self.offload.store_reads(tables[0], groups=tables[1:])
        return drop_windows(tables, self.pools.block_pools, self.layouts, position, hold=hold)

    def schedule(
        self, req: PrefillRequest, step_size: int, align: int, pipelined: bool
    ) -> tuple[tuple[TokenRange, bool], ...]:
        """Set an admitted request's steps (a loaded prefix is "step" 0: no compute, just its
        slice) and slice cutter, and return its slices' ``(range, is_last)`` in order
        (:func:`~kvplane.pipeline.slicing.slice_schedule`). Pipelined or not, and how many
        steps a slice: ``pipelined`` (the config's), or with ``auto_pipelining`` the cost
        model's answer for this request."""
        n = len(req.tokens)
        if req.loaded:
            rest = range(req.loaded, n, step_size)
            req.steps = [TokenRange(0, req.loaded)]
            req.steps += [TokenRange(s, min(s + step_size, n)) for s in rest]
        mode = Choice(pipelined)
        if self.auto is not None:
            mode = self.auto.choose(n, req.loaded, step_size)
            self.counters[f"auto_pipelined_{str(mode.pipelined).lower()}"] += 1
        req.cutter = SliceCutter(n, align, pipelined=mode.pipelined, every=mode.every)
        return slice_schedule(n, req.steps, align, pipelined=mode.pipelined, every=mode.every)

    def observe_success(self, req: PrefillRequest, rmetrics: RuntimeMetrics) -> None:
        """A request whose session succeeded: its overlap ratio and exposed tail into
        ``rmetrics``, and with ``auto_pipelining`` its link's own cost into the cost model."""
        evs = self.timeline.events(req.order.request_id)
        times = request_times(evs)
        rmetrics.overlap.observe(times.overlap_ratio)
        if self.auto is not None:  # the link's own cost, for --pipelining auto
            done = sorted((e.t, e.nbytes) for e in evs if e.mark == Mark.SLICE_DONE.value)
            self.auto.observe_link(times.slice_busy_s, [n for _, n in done])
        if req.prefill_end is not None and req.finished_at is not None:
            rmetrics.tail.observe(max(0.0, req.finished_at - req.prefill_end))
