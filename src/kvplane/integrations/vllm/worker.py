"""The connector's worker side: moves chunk bytes exactly as the scheduler side planned.

Owns the bytes: the host tier, a :class:`~kvplane.offload.copier.ChunkCopier` over
:class:`~.pool.VllmPool`, the lower tiers (re-indexed at start-up into the handshake) and a
:class:`~kvplane.offload.jobs.JobRunner`; reports per-chunk outcomes and failed blocks. Decides
nothing (no matching, no slot choice) and imports no vLLM. The per-step sequence and the
load-failure rule: ``docs/vllm.md`` ("The worker side").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.ids import ChunkKey, JobId, SlotId
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.messages import (
    IDLE_WAIT_S,
    JobReport,
    LoadOp,
    StepMeta,
    StoreOp,
    TierIndex,
    TierWrite,
    WorkerReport,
)
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.tp import TPShard
from kvplane.metrics import MetricsRegistry
from kvplane.offload.copier import ChunkCopier
from kvplane.offload.jobs import JobResult, JobRunner, Work
from kvplane.offload.tiers.base import ReadOutcome, Tier
from kvplane.offload.tiers.host import HostTier
from kvplane.offload.tiers.registry import open_lower_tiers

_Part = tuple[str, StoreOp | LoadOp, TierWrite | None]


class WorkerSide:
    """Worker half of the connector over one :class:`VllmPool`; not thread-safe (vLLM calls
    every hook from the worker's one thread; jobs run on the runner's threads).

    ``fingerprint`` roots the chunk keys (the same on every rank); ``shard`` is this worker's
    tensor-parallel rank: its pool holds the rank's head shard, its lower tiers are the rank's
    own (:meth:`TPShard.offload`, :meth:`TPShard.tier_fingerprint`) and its reports name it."""

    def __init__(
        self,
        config: ConnectorConfig,
        pool: VllmPool,
        fingerprint: bytes,
        metrics: MetricsRegistry,
        shard: TPShard | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.shard = TPShard() if shard is None else shard
        self.rank = self.shard.rank
        self.bpc = config.blocks_per_chunk
        chunk_bytes = self.bpc * pool.bytes_per_block
        off = config.offload
        self.host = HostTier(off.host_slots, chunk_bytes, pin_memory=off.pin_memory)
        self.copier = ChunkCopier(pool.layout, pool.tensor, self.host, self.bpc, off.staging_blocks)
        tier_fp = self.shard.tier_fingerprint(pool.layout.fingerprint())
        tiers = open_lower_tiers(self.shard.offload(off), chunk_bytes, tier_fp, metrics)
        self.lower: dict[str, Tier] = {t.name: t for t in tiers}
        try:
            found = tuple(
                (t.name, tuple((k, int(s)) for k, s in sorted(t.scan().items()))) for t in tiers
            )
        except BaseException:
            for t in tiers:
                t.close()
            raise
        self.index = TierIndex(fingerprint, chunk_bytes, found)
        self.jobs = JobRunner(metrics)
        self._parts: dict[JobId, _Part] = {}
        self._gathers: dict[str, set[int]] = {}  # req_id -> store jobs still gathering
        self._loads: set[JobId] = set()  # this step's load jobs
        self._seen_loads: set[int] = set()
        self._reports: list[JobReport] = []
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests with a failed load this step
        self._m_err = metrics.counter("vllm_load_error_blocks", "Blocks reported failed to vLLM")
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
        for op in meta.loads:
            if op.job_id in self._seen_loads:
                continue
            self._seen_loads.add(op.job_id)
            self._submit_load(op)

    def wait_loads(self) -> None:
        """Block until every load submitted this step is done and accounted."""
        if not self._loads:
            return
        start = time.perf_counter()
        while self._loads:
            got = self.jobs.wait(60.0)
            if not got and self._loads:
                raise OffloadError(f"{len(self._loads)} KV load job(s) still running after 60 s")
            self._harvest(got)
        self._m_wait.inc(time.perf_counter() - start)

    def submit_stores(self, meta: StepMeta) -> None:
        """After the forward: finish loads, submit the step's gathers.

        A request whose load failed this step computed its new tokens against bad context: its
        gathers are failed without reading (vLLM recomputes those blocks; the scheduler side
        offers the chunks for storing again after the recompute)."""
        self.start_loads(meta)
        self.wait_loads()
        self._seen_loads.clear()
        for op in meta.stores:
            if op.req_id in self._failed_reqs:
                fail = (False,) * len(op.keys)
                self._reports.append(JobReport(op.job_id, "host", fail, self.rank))
                self._submit_writes(op, fail)
            else:
                self._submit_gather(op)
        self._failed_reqs.clear()

    def progress(self, idle: bool = False) -> None:
        """Harvest finished jobs (their reports go out with the step; a harvested gather's
        lower-tier writes are submitted). ``idle`` (vLLM scheduled nothing, it steps only for
        kvplane's jobs): with a job in flight, wait up to :data:`IDLE_WAIT_S` for one first,
        so idle steps do not spin. vLLM's blocks are never held for a job: finished requests'
        blocks are fenced by the scheduler side instead."""
        if idle and self.busy:
            self._harvest(self.jobs.wait(IDLE_WAIT_S))
        self._harvest(self.jobs.poll())

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> WorkerReport:
        reports, self._reports = tuple(self._reports), []
        return WorkerReport(reports)

    # -- submission ------------------------------------------------------------------------------
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

        self._parts[job.job_id] = ("gather", op, None)
        self._gathers.setdefault(op.req_id, set()).add(op.job_id)
        self.jobs.submit(job, work, self.host.chunk_bytes)

    def _submit_writes(self, op: StoreOp, ok: tuple[bool, ...]) -> None:
        for write in op.writes:
            tier = self.lower.get(write.tier)
            keys = [op.keys[i] for i in write.indices]
            if tier is None or not all(ok[i] for i in write.indices):
                # Never write a chunk whose gather failed; partial batches stay simple: the
                # whole write fails and the scheduler frees its slots.
                self._reports.append(
                    JobReport(op.job_id, write.tier, (False,) * len(keys), self.rank)
                )
                continue
            payloads = [self.host.slot(SlotId(op.host_slots[i])) for i in write.indices]
            job = self.jobs.new_job(keys, "host", write.tier)
            work = _writer(tier, [SlotId(s) for s in write.tier_slots], keys, payloads)
            self._parts[job.job_id] = ("write", op, write)
            self.jobs.submit(job, work, self.host.chunk_bytes)

    def _submit_load(self, op: LoadOp) -> None:
        n = op.num_planned
        if n == 0:
            self._finish_load(op, ())
            return
        keys = op.keys[:n]
        job = self.jobs.new_job(keys, "host", "device")
        self._parts[job.job_id] = ("load", op, None)
        self._loads.add(job.job_id)
        self.jobs.submit(job, lambda: self._load_work(op), self.host.chunk_bytes)

    def _load_work(self, op: LoadOp) -> list[bool]:
        """Runs on the load thread: promote, verify, then scatter the valid leading chunks."""
        n, bpc = op.num_planned, self.bpc
        ok = [True] * n
        by_tier: dict[str, list[int]] = {}
        for p in op.promotions:
            by_tier.setdefault(p.tier, []).append(p.index)
        slot_of = {p.index: p.tier_slot for p in op.promotions}
        for name, idx in by_tier.items():
            outs = [self.host.slot(SlotId(op.host_slots[i])) for i in idx]
            got = self.lower[name].read(
                [SlotId(slot_of[i]) for i in idx], [op.keys[i] for i in idx], outs
            )
            for i, outcome in zip(idx, got, strict=True):
                ok[i] = outcome is ReadOutcome.OK
        good = next((i for i, f in enumerate(ok) if not f), n)
        spans, starts = _chunk_spans(n, bpc, op.skip_blocks, len(op.block_ids))
        whole = [i for i in range(good) if spans[i] == (0, bpc)]
        if whole:
            ids = np.asarray(op.block_ids, dtype=np.int64)
            blocks = np.concatenate([ids[starts[i] : starts[i] + bpc] for i in whole])
            self.copier.scatter(
                [SlotId(op.host_slots[i]) for i in whole], blocks, [op.keys[i] for i in whole]
            )
        for i in range(good):
            lo, hi = spans[i]
            if (lo, hi) != (0, bpc):
                self.pool.scatter_partial(
                    self.host.slot(SlotId(op.host_slots[i])),
                    lo,
                    op.block_ids[starts[i] : starts[i] + hi - lo],
                )
        return ok

    # -- results ---------------------------------------------------------------------------------
    def _harvest(self, results: Sequence[JobResult]) -> None:
        for result in results:
            kind, op, write = self._parts.pop(result.job.job_id)
            if isinstance(op, LoadOp):
                self._loads.discard(result.job.job_id)
                self._finish_load(op, result.ok)
            elif kind == "gather":
                self._reports.append(JobReport(op.job_id, "host", result.ok, self.rank))
                left = self._gathers.get(op.req_id)
                if left is not None:
                    left.discard(op.job_id)
                    if not left:
                        del self._gathers[op.req_id]
                self._submit_writes(op, result.ok)
            elif write is not None:
                self._reports.append(JobReport(op.job_id, write.tier, result.ok, self.rank))

    def _finish_load(self, op: LoadOp, ok: Sequence[bool]) -> None:
        flags = tuple(ok) + (False,) * (len(op.keys) - len(ok))
        bad = next((i for i, f in enumerate(flags) if not f), None)
        if bad is not None:
            _spans, starts = _chunk_spans(len(op.keys), self.bpc, op.skip_blocks, len(op.block_ids))
            failed = op.block_ids[starts[bad] :]
            self._errors.update(failed)
            self._failed_reqs.add(op.req_id)
            self._m_err.inc(len(failed))
        self._reports.append(JobReport(op.job_id, "device", flags, self.rank))

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
        if self.jobs.closed:
            return
        try:
            self.drain()
        finally:
            self.jobs.close()
            self.copier.close()
            for tier in self.lower.values():
                tier.close()


def _writer(tier: Tier, slots: list[SlotId], keys: list[ChunkKey], payloads: list[Any]) -> Work:
    def work() -> list[bool]:
        tier.write(slots, keys, payloads)
        return [True] * len(keys)

    return work


def _chunk_spans(
    n: int, bpc: int, skip: int, num_blocks: int
) -> tuple[list[tuple[int, int]], list[int]]:
    """Per chunk of a load: the ``[lo, hi)`` blocks of it that are written, and the position of
    its first written block in the load's ``block_ids``."""
    cut = n * bpc - skip - num_blocks
    if n and not (0 <= skip < bpc and 0 <= cut < bpc and num_blocks > 0):
        raise InvalidArgumentError(
            f"a load of {n} chunks cannot write {num_blocks} blocks after skipping {skip}"
        )
    spans = [(0, bpc)] * n
    if n:
        spans[0] = (skip, bpc)
        spans[-1] = (spans[-1][0], bpc - cut)
    starts = np.concatenate(([0], np.cumsum([hi - lo for lo, hi in spans]))).tolist()
    return spans, [int(x) for x in starts]
