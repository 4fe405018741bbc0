"""The connector's worker side: moves chunk bytes exactly as the scheduler side planned.

Owns the bytes: the host tier, a :class:`~kvplane.offload.copier.ChunkCopier` over
:class:`~.pool.VllmPool`, the lower tiers (each at its own chunk size, re-indexed at start-up
into the handshake), a :class:`~kvplane.offload.jobs.JobRunner` and the stores (tier writes by
the cascade's :func:`~kvplane.offload.rechunk.demoter`); loads are :class:`~.loads.Loads`'s.
Reports per-chunk outcomes, failed blocks and finished asynchronous loads. Decides nothing (no
matching, no slot choice) and imports no vLLM. The per-step sequence: ``docs/vllm.md`` ("The
worker side").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.ids import JobId, SlotId
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.loads import Loads
from kvplane.integrations.vllm.messages import (
    DemoteOp,
    JobReport,
    StepMeta,
    StoreOp,
    TierIndex,
    WorkerReport,
)
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.store_probe import store_id
from kvplane.integrations.vllm.tp import TPShard
from kvplane.integrations.vllm.wakeup import Wakeup
from kvplane.metrics import MetricsRegistry
from kvplane.offload.cascade import close_after_drain
from kvplane.offload.copier import ChunkCopier
from kvplane.offload.jobs import JobResult, JobRunner, TransferJob, Work
from kvplane.offload.rechunk import Staging, Unit, demote_units, demoter
from kvplane.offload.tiers.base import Tier
from kvplane.offload.tiers.host import HostTier
from kvplane.offload.tiers.registry import open_lower_tiers

_Part = tuple[StoreOp | DemoteOp, str]
"""A runner job's op and part: ``""`` for a store's gather, else the tier it writes."""


class WorkerSide:
    """Worker half of the connector over one :class:`VllmPool`; not thread-safe (vLLM calls
    every hook from the worker's one thread; jobs run on the runner's threads).

    ``fingerprint`` roots the chunk keys (the same on every rank); ``shard`` is this worker's
    tensor-parallel rank: its pool holds the rank's head shard, its lower tiers are the rank's
    own (:meth:`TPShard.offload`, :meth:`TPShard.tier_fingerprint`) and its reports name it.
    Every job's end notifies ``wake`` (shared with the PD side: :func:`~.wakeup.end_step`)."""

    def __init__(
        self,
        config: ConnectorConfig,
        pool: VllmPool,
        fingerprint: bytes,
        metrics: MetricsRegistry,
        shard: TPShard | None = None,
        *,
        wake: Wakeup | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.shard = TPShard() if shard is None else shard
        self.rank = self.shard.rank
        self.wake = Wakeup() if wake is None else wake
        self.bpc = config.blocks_per_chunk
        chunk_bytes = self.bpc * pool.bytes_per_block
        off = config.offload
        self.host = HostTier(off.host_slots, chunk_bytes, pin_memory=off.pin_memory)
        self.copier = ChunkCopier(pool.layout, pool.tensor, self.host, self.bpc, off.staging_blocks)
        tier_fp = self.shard.tier_fingerprint(pool.layout.fingerprint())
        tiers = open_lower_tiers(
            self.shard.offload(off),
            chunk_bytes,
            tier_fp,
            metrics,
            layout=pool.layout,
            spans=config.spans,
        )
        self.lower: dict[str, Tier] = {t.name: t for t in tiers}
        self._staging = {t.name: Staging() for t in tiers}  # one write path per tier
        try:
            found = tuple(
                (t.name, tuple((k, int(s)) for k, s in sorted(t.scan().items()))) for t in tiers
            )
        except BaseException:
            for t in tiers:
                t.close()
            raise
        self.index = TierIndex(fingerprint, chunk_bytes, found)
        self.store = store_id(self.lower)  # the handshake's: the scheduler side asks it too
        self.jobs = JobRunner(metrics)
        self.loads = Loads(
            self.jobs,
            self._submit,
            host=self.host,
            lower=self.lower,
            copier=self.copier,
            pool=pool,
            metrics=metrics,
            rank=self.rank,
        )
        self._parts: dict[JobId, _Part] = {}
        self._gathers: dict[str, set[int]] = {}  # req_id -> store jobs still gathering
        self._reports: list[JobReport] = []
        self._ended = 0  # jobs whose work returned (counted on the runner's threads)
        self._ended_lock = threading.Lock()
        self._harvested = 0
        self._m_wait = metrics.counter("vllm_load_wait_seconds", "Forward time spent on loads")

    # -- step hooks ------------------------------------------------------------------------------
    def begin_step(self, meta: StepMeta) -> None:
        """Flush in-flight gathers when the step may write blocks they read (blocks of a
        preempted or finished request that vLLM reallocated)."""
        if meta.flush:
            while any(self._gathers.values()):
                self._harvest(self.jobs.wait(60.0))

    def start_loads(self, meta: StepMeta) -> None:
        """Submit this step's loads (idempotent: a load already submitted is skipped)."""
        self.loads.submit(meta.loads)

    def wait_loads(self) -> None:
        """Block until every synchronous load submitted this step is done and accounted
        (asynchronous ones go on: :meth:`finished` names their requests when they end)."""
        if not self.loads.waiting:
            return
        start = time.perf_counter()
        while self.loads.waiting:
            got = self.jobs.wait(60.0)
            if not got and self.loads.waiting:
                raise OffloadError(f"{self.loads.waiting} KV load(s) still running after 60 s")
            self._harvest(got)
        self._m_wait.inc(time.perf_counter() - start)

    def submit_stores(self, meta: StepMeta) -> None:
        """After the forward: finish synchronous loads, submit the step's gathers and
        demotions.

        A request whose synchronous load failed this step computed its new tokens against bad
        context: its gathers are failed without reading (vLLM recomputes those blocks; the
        scheduler side offers the chunks for storing again after the recompute)."""
        self.start_loads(meta)
        self.wait_loads()
        failed = self.loads.end_forward()
        for op in meta.stores:
            if op.req_id in failed:
                fail = (False,) * len(op.keys)
                self._reports.append(JobReport(op.job_id, "host", fail, self.rank))
                self._submit_writes(op, fail)
            else:
                self._submit_gather(op)
        for demote in meta.demotes:
            units = [
                (SlotId(slot), key, [SlotId(h) for h in hosts])
                for slot, key, hosts in zip(
                    demote.tier_slots, demote.tier_keys, demote.host_slots, strict=True
                )
            ]
            self._submit_write(demote, demote.tier, units)

    def progress(self) -> None:
        """Harvest every job whose work has returned, even one whose result is still on its
        way to the runner (their reports go out with the step; a harvested gather's lower-tier
        writes and a harvested read's scatter are submitted). vLLM's blocks are never held for a
        store: finished requests' blocks are fenced by the scheduler side instead."""
        got = self.jobs.poll()
        while self._ended_count() > self._harvested + len(got):
            got += self.jobs.wait(60.0)
        self._harvest(got)

    def finished(self, finished_req_ids: Sequence[str] = ()) -> tuple[set[str], set[str]]:
        """vLLM's ``get_finished`` for offload: harvest, then (nothing: offload never delays a
        free, requests whose asynchronous load ended), each request once."""
        self.progress()
        return set(), self.loads.take_arrived()

    @property
    def has_news(self) -> bool:
        """Reports, load errors or finished loads not yet handed to vLLM."""
        return bool(self._reports) or self.loads.has_news

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors()

    def take_failed_loads(self) -> set[str]:
        """:meth:`~.loads.Loads.take_failed_async`."""
        return self.loads.take_failed_async()

    def take_report(self) -> WorkerReport:
        reports, self._reports = tuple(self._reports), []
        return WorkerReport(reports + tuple(self.loads.take_reports()))

    # -- submission ------------------------------------------------------------------------------
    def _submit(self, job: TransferJob, work: Work, chunk_bytes: int | None = None) -> None:
        """Queue ``work`` (``chunk_bytes``: of each of its chunks, default the host's); its end
        is counted (:meth:`progress`) and wakes an idle step."""

        def run() -> Sequence[bool]:
            try:
                return work()
            finally:
                with self._ended_lock:
                    self._ended += 1
                self.wake.notify()

        self.jobs.submit(job, run, self.host.chunk_bytes if chunk_bytes is None else chunk_bytes)

    def _ended_count(self) -> int:
        with self._ended_lock:
            return self._ended

    def _submit_gather(self, op: StoreOp) -> None:
        blocks = np.asarray(op.block_ids, dtype=np.int64)
        slots = [SlotId(s) for s in op.host_slots]
        if blocks.size != len(slots) * self.bpc:
            raise InvalidArgumentError(f"store {op.job_id}: {blocks.size} blocks for {len(slots)}")
        job = self.jobs.new_job(op.keys, "device", "host")
        copier = self.copier

        def work() -> list[bool]:
            copier.gather(blocks, slots, op.keys)
            return [True] * len(slots)

        self._parts[job.job_id] = (op, "")
        self._gathers.setdefault(op.req_id, set()).add(op.job_id)
        self._submit(job, work)

    def _submit_writes(self, op: StoreOp, ok: tuple[bool, ...]) -> None:
        for write in op.writes:
            if not all(ok[i] for i in write.indices):
                # Never write a chunk whose gather failed; partial batches stay simple: the
                # whole write fails and the scheduler frees its slots.
                fail = (False,) * len(write.indices)
                self._reports.append(JobReport(op.job_id, write.tier, fail, self.rank))
                continue
            units = demote_units(write, op.keys, lambda i: SlotId(op.host_slots[i]))
            self._submit_write(op, write.tier, units)

    def _submit_write(self, op: StoreOp | DemoteOp, name: str, units: list[Unit]) -> None:
        """Write ``units`` (tier chunks from pinned host slots) to tier ``name``, by the
        cascade's :func:`~kvplane.offload.rechunk.demoter`; reported as ``op``'s part."""
        tier = self.lower.get(name)
        if tier is None:
            self._reports.append(JobReport(op.job_id, name, (False,) * len(units), self.rank))
            return
        job = self.jobs.new_job([key for _s, key, _h in units], "host", name)
        self._parts[job.job_id] = (op, name)
        self._submit(job, demoter(tier, self.host, units, self._staging[name]), tier.chunk_bytes)

    # -- results ---------------------------------------------------------------------------------
    def _harvest(self, results: Sequence[JobResult]) -> None:
        self._harvested += len(results)
        for result in results:
            if self.loads.owns(result.job.job_id):
                self.loads.harvested(result)
                continue
            op, part = self._parts.pop(result.job.job_id)
            if not part and isinstance(op, StoreOp):
                self._reports.append(JobReport(op.job_id, "host", result.ok, self.rank))
                left = self._gathers.get(op.req_id)
                if left is not None:
                    left.discard(op.job_id)
                    if not left:
                        del self._gathers[op.req_id]
                self._submit_writes(op, result.ok)
            else:
                self._reports.append(JobReport(op.job_id, part, result.ok, self.rank))

    # -- shutdown --------------------------------------------------------------------------------
    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a job to finish and account what finished."""
        self._harvest(self.jobs.wait(timeout))

    @property
    def busy(self) -> bool:
        return self.jobs.in_flight > 0

    def drain(self, timeout: float = 120.0) -> None:
        """Finish every job, write-through jobs included (so lower tiers are complete)."""
        deadline = time.monotonic() + timeout
        while self.jobs.in_flight:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OffloadError(f"{self.jobs.in_flight} offload job(s) still running")
            self._harvest(self.jobs.wait(left))

    def close(self) -> None:
        """Drain, stop the job threads and close the lower tiers; idempotent."""
        if not self.jobs.closed:
            close_after_drain(self.drain, self.jobs, self.copier, self.lower.values())
