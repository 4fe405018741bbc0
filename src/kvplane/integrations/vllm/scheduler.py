"""The connector's scheduler side: which tokens load from kvplane, what to store, when to free.

Owns :class:`SchedulerSide` over the :class:`~kvplane.offload.book.TierBook`: the worker's
handshake, each step's :class:`~.messages.StepMeta` and the workers' reports, joining the hit
claims (:mod:`~.hits`), loads (:mod:`~.load_plans`), stores and fences (:mod:`~.store_plans`)
and write-downs (:mod:`~.demotions`) of the requests it tracks (:mod:`~.request_state`). Plain
data: no tensors, no tier I/O but one question to a shared store, no vLLM import. The rules:
``docs/vllm.md`` ("The scheduler side", "The shared store", "Per-tier chunk sizes").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.demotions import Demotions
from kvplane.integrations.vllm.fences import Fences
from kvplane.integrations.vllm.hits import Hits, LoadGrid
from kvplane.integrations.vllm.load_plans import LoadPlans
from kvplane.integrations.vllm.messages import (
    JobReport,
    LoadOp,
    StepMeta,
    StoreOp,
    TierIndex,
    WorkerReport,
)
from kvplane.integrations.vllm.request_state import RequestTable, RequestView, ScheduledRequest
from kvplane.integrations.vllm.store_plans import StorePlans
from kvplane.integrations.vllm.store_probe import StoreId, StoreProbe
from kvplane.integrations.vllm.tp import RankTally
from kvplane.integrations.vllm.windows import KVWindow
from kvplane.metrics import MetricsRegistry
from kvplane.offload.book import TierBook

__all__ = ["RequestView", "ScheduledRequest", "SchedulerSide"]


class SchedulerSide:
    """Scheduler half of the connector; see the module docstring. Not thread-safe.

    With ``tp_size`` > 1 one decision serves every rank's worker: a job part is applied only
    once every rank reported it, its chunks good only where every rank's were
    (:class:`~.tp.RankTally`). ``window``: vLLM's sliding window (:class:`~.windows.KVWindow`):
    hits need only their window's chunks, loads skip freed blocks, stores never read them and
    in-flight gathers fence them. A hybrid model's groups (one side each,
    :class:`~.hybrid_scheduler.HybridScheduler`) share ``ids`` (job ids) and ``fences``."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        metrics: MetricsRegistry,
        tp_size: int = 1,
        window: KVWindow | None = None,
        *,
        ids: Iterator[int] | None = None,
        fences: Fences | None = None,
    ) -> None:
        self.config = config
        self.window = window
        self.tally = RankTally(tp_size)
        self.spec = ChunkSpec(block_size, config.blocks_per_chunk)
        lower = [(name, config.tier_slots(name)) for name in config.lower_tiers]
        spans = config.spans
        book = TierBook.build(config.offload, lower, metrics, spans)
        if "remote" in book.lower and config.offload.remote_mode == "shared":
            book = TierBook(book.host, list(book.lower.values()), spans, shared="remote")
        self.book = book
        self.metrics = metrics
        # tiers of larger chunks: written down after the gather, loads from whole groups
        grid = LoadGrid(self.spec, math.lcm(1, *spans.values()), window)
        ids = itertools.count(1) if ids is None else ids
        self.requests = RequestTable(self.spec)
        self.demotions = Demotions(book, ids)
        self.hits = Hits(book, self.requests, grid, config.load_mode, metrics)
        self.loads = LoadPlans(book, self.requests, grid, ids, metrics)
        write_through = all(span == 1 for span in spans.values())
        self.stores = StorePlans(
            book,
            self.requests,
            self.demotions,
            ids,
            metrics,
            write_through=write_through,
            fences=fences,
        )
        self._flush_next = False

    # -- start-up -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once the worker's handshake (fingerprint and tier re-index) arrived."""
        return self.requests.started

    def set_index(self, index: TierIndex, stores: Sequence[StoreId | None] = ()) -> None:
        """Adopt the worker's handshake: the key root and the chunks lower tiers already hold;
        with a shared store, ``stores`` (each rank's :func:`~.store_probe.store_id`, rank
        order; ``None`` for a rank without one) opens the probe lookups ask about chunks
        published since (none given: only the chunks found at start-up are ever hits)."""
        if self.ready:
            raise InvalidArgumentError("the worker handshake was already applied")
        ids = [s for s in stores if s is not None]
        if self.book.shared is None and ids:
            raise InvalidArgumentError("store ids given, but no shared store is configured")
        if ids and len(ids) != len(stores):
            raise InvalidArgumentError(f"a rank without a shared store among {list(stores)}")
        self.book.adopt_index(index)
        if ids:
            self.hits.probe = StoreProbe(ids, self.config.offload.remote_timeout_s)
        self.requests.start(BlockHasher(self.config.hashing.seed, index.fingerprint))

    # -- lookups ---------------------------------------------------------------------------------
    def matched_tokens(self, view: RequestView, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` (block aligned) that kvplane can load now, or ``None``
        to be asked again later; always 0 for a view that is not ``eligible`` or not
        ``readable``. Changes no tier state (only memoises the request's hashes) but for the
        shared store's chunks a request's first call discovers (:meth:`~.hits.Hits.match`)."""
        return self.match(view, num_computed)[0]

    def match(self, view: RequestView, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: :meth:`matched_tokens` and whether that load
        runs asynchronously (``load_mode``: ``sync`` never, ``async`` always, ``auto`` when
        a chunk of it comes from a tier below host). False with no tokens. With a window, a
        hit needs only the chunks of its end's window held (:meth:`~.hits.Hits.match`)."""
        if (
            not self.ready
            or not view.eligible
            or not view.readable
            or num_computed % self.spec.block_size
        ):
            return 0, False
        return self.hits.match(view, num_computed)

    def allocated(
        self, view: RequestView, block_ids: Sequence[int], num_external: int
    ) -> LoadOp | None:
        """vLLM allocated ``block_ids`` for the request and will take ``num_external`` tokens
        from kvplane after its local hit: plan that load (emitted by the next step),
        asynchronous when the request's last :meth:`match` said so; never into the blocks
        before a sliding window, which vLLM does not hold (:class:`~.load_plans.LoadPlans`)."""
        if not self.ready or not view.eligible:
            return None
        return self.loads.allocated(view, block_ids, num_external)

    # -- steps ----------------------------------------------------------------------------------
    def build_step(
        self, scheduled: Sequence[ScheduledRequest], preempted: Sequence[str] = ()
    ) -> StepMeta:
        """The worker's instructions for this step (resets the pending loads). ``flush`` when
        a preempted request has gathers in flight or the step writes a fenced block (by its
        forward, by a load, or by :meth:`will_write`)."""
        stores = self.stores
        for s in scheduled if self.window is not None else ():  # else vLLM frees no block early
            stores.fence_freed(s)
        flush = self._flush_next or any(stores.gathering(r) for r in preempted)
        if stores.fences and not flush:
            bs = self.spec.block_size
            written = [op.block_ids for op in self.loads.pending] + [
                s.block_ids[s.computed_start // bs : -(-s.computed_end // bs)] for s in scheduled
            ]
            flush = any(stores.fences.hit(ids) for ids in written)
        ops = [op for s in scheduled if (op := self._plan_store(s)) is not None]
        meta = StepMeta(self.loads.take(), tuple(ops), flush, demotes=self.demotions.take())
        self._flush_next = False
        return meta

    def _plan_store(self, s: ScheduledRequest) -> StoreOp | None:
        return self.stores.plan(s) if self.ready and s.view.eligible else None

    def will_write(self, block_ids: Sequence[int]) -> None:
        """Something other than this side's steps (a PD receive) will write ``block_ids``
        after the next step begins: that step flushes if any of them is fenced."""
        if self.stores.fences.hit(block_ids):
            self._flush_next = True

    def finished(self, req_id: str) -> None:
        """The request finished and vLLM frees its blocks now (never delayed). The blocks its
        in-flight gathers read are fenced until the worker reports those gathers: a step that
        writes a fenced block first flushes the gathers (:meth:`build_step`). A request whose
        asynchronous load still runs needs no fence: vLLM keeps its blocks until the worker
        names it finished receiving, once the load ended on every rank."""
        self.stores.finished(req_id)

    # -- worker results -----------------------------------------------------------------------
    def apply(self, report: WorkerReport) -> None:
        """Apply the workers' finished job parts to the tier bookkeeping (each part once every
        rank reported it)."""
        for job in report.jobs:
            done = self.tally.add(job)
            if done is not None:
                self._apply(done)
        self.demotions.retry()

    def _apply(self, job: JobReport) -> None:
        if self.demotions.owns(job.job_id):
            self.demotions.apply(job)
        elif self.loads.owns(job.job_id):
            self.loads.apply(job)
        elif self.stores.owns(job.job_id):
            self.stores.apply(job)
        else:
            raise InvalidArgumentError(f"worker reported unknown job {job.job_id}")

    # -- state ----------------------------------------------------------------------------------
    @property
    def jobs_in_flight(self) -> int:
        """Store, load and demotion jobs planned and not yet reported by every rank."""
        return self.stores.in_flight + self.loads.in_flight + self.demotions.in_flight

    @property
    def fenced_blocks(self) -> list[int]:
        """Freed blocks that in-flight gathers still read, sorted."""
        return self.stores.fences.blocks

    def tracked_requests(self) -> list[str]:
        return self.requests.ids()

    def forget(self, req_id: str) -> None:
        """Drop a request that never ran (aborted while waiting); keeps in-flight jobs."""
        if not self.stores.gathering(req_id):
            self.requests.drop(req_id)

    @property
    def probe(self) -> StoreProbe | None:
        """The shared store's probe lookups ask (:meth:`set_index`), or ``None``."""
        return self.hits.probe

    def close(self) -> None:
        """Close the shared store probe's connections; idempotent."""
        if self.hits.probe is not None:
            self.hits.probe.close()

    def check_integrity(self) -> None:
        """Tier invariants; with no job in flight, no busy slot and no request held back."""
        idle = not self.jobs_in_flight
        self.book.check_integrity(idle)
        if idle and (self.tally.waiting or self.stores.fences or self.requests.any_gathers()):
            raise InvalidArgumentError("a request or a fence waits for a gather not in flight")
