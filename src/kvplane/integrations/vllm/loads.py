"""The worker side's KV loads: lower-tier chunks read into host, then scattered into vLLM.

Owns :class:`Loads`: each :class:`~.messages.LoadOp` from submission to its report -- one read job
per lower tier its promotions come from (``<tier>_to_host``, verified; a tier of larger chunks
read whole and cut into host chunks by :func:`~kvplane.offload.rechunk.promoter`), then one
scatter job
(``host_to_device``) of the valid leading chunks -- its failed blocks, the synchronous loads a
forward waits for and the asynchronous ones ``get_finished`` names. Decides nothing; no vLLM
import. The rules: ``docs/vllm.md`` ("The worker side").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.errors import InvalidArgumentError
from kvplane.ids import JobId, SlotId
from kvplane.integrations.vllm.messages import JobReport, LoadOp
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.metrics import MetricsRegistry
from kvplane.offload.copier import ChunkCopier
from kvplane.offload.jobs import JobResult, JobRunner, TransferJob, Work
from kvplane.offload.rechunk import Staging, promoter, tier_reads
from kvplane.offload.tiers.base import Tier
from kvplane.offload.tiers.host import HostTier

Submit = Callable[[TransferJob, Work], None]
"""Queues a job's work on the worker's runner (the worker wraps it to signal its end)."""

_SCATTER = "device"


@dataclass(slots=True, eq=False)
class _Load:
    """One load in flight: ``ok[i]`` is False once planned chunk ``i`` read back bad (host
    chunks stay True); ``reads`` counts its lower-tier read jobs still running."""

    op: LoadOp
    ok: list[bool]
    reads: int = 0


class Loads:
    """Every load the worker was sent, until reported; see the module docstring. Not
    thread-safe: the worker's one thread calls it (job work runs on the runner's threads)."""

    def __init__(
        self,
        jobs: JobRunner,
        submit: Submit,
        *,
        host: HostTier,
        lower: Mapping[str, Tier],
        copier: ChunkCopier,
        pool: VllmPool,
        metrics: MetricsRegistry,
        rank: int = 0,
    ) -> None:
        self.jobs = jobs
        self._submit = submit
        self.host = host
        self.lower = lower
        self.copier = copier
        self.pool = pool
        self.bpc = copier.blocks_per_chunk
        self.rank = rank
        self._loads: dict[int, _Load] = {}  # LoadOp.job_id -> load in flight
        # runner job -> (load, tier or device, the load positions of its ok flags)
        self._parts: dict[JobId, tuple[int, str, tuple[int, ...]]] = {}
        self._staging = {name: Staging() for name in lower}  # one read path per tier
        self._seen: set[int] = set()
        self._reports: list[JobReport] = []
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # synchronous loads that failed this forward
        self._arrived: set[str] = set()  # asynchronous loads done, not yet named to vLLM
        self._failed_async: set[str] = set()  # of those, the ones with a failed chunk
        self._m_err = metrics.counter("vllm_load_error_blocks", "Blocks reported failed to vLLM")

    # -- submission ------------------------------------------------------------------------------
    def submit(self, ops: Sequence[LoadOp]) -> None:
        """Start ``ops`` (idempotent within a forward: an op already started is skipped)."""
        for op in ops:
            if op.job_id not in self._seen:
                self._seen.add(op.job_id)
                self._start(op)

    def end_forward(self) -> set[str]:
        """The forward is over: the requests whose synchronous load failed in it (their KV
        was computed against bad context); forgets which ops it started."""
        failed, self._failed_reqs = self._failed_reqs, set()
        self._seen.clear()
        return failed

    def _start(self, op: LoadOp) -> None:
        load = _Load(op, [True] * op.num_planned)
        if not load.ok:
            self._finish(load)
            return
        self._loads[op.job_id] = load
        tiers = sorted({p.tier for p in op.promotions})
        if not tiers:
            self._scatter(load)
            return
        slots = [SlotId(s) for s in op.host_slots]
        for tier in tiers:
            mine = [p for p in op.promotions if p.tier == tier]
            reads, order = tier_reads(mine, op.keys, slots)
            job = self.jobs.new_job([op.keys[i] for i in order], tier, "host")
            self._parts[job.job_id] = (op.job_id, tier, tuple(order))
            load.reads += 1
            self._submit(job, promoter(self.lower[tier], self.host, reads, self._staging[tier]))

    def _scatter(self, load: _Load) -> None:
        op = load.op
        good = next((i for i, f in enumerate(load.ok) if not f), len(load.ok))
        if good == 0:
            self._finish(load)
            return
        job = self.jobs.new_job(op.keys[:good], "host", _SCATTER)
        self._parts[job.job_id] = (op.job_id, _SCATTER, ())
        self._submit(job, self._scatterer(op, good))

    def _scatterer(self, op: LoadOp, good: int) -> Work:
        """Writes ``op``'s first ``good`` chunks from host into their vLLM blocks (a chunk the
        load starts or ends inside only in part, one vLLM already held not at all)."""
        bpc, copier, pool, host = self.bpc, self.copier, self.pool, self.host
        spans, starts = chunk_spans(len(op.keys), bpc, op.skip_blocks, len(op.block_ids))

        def work() -> list[bool]:
            whole = [i for i in range(good) if spans[i] == (0, bpc)]
            if whole:
                ids = np.asarray(op.block_ids, dtype=np.int64)
                blocks = np.concatenate([ids[starts[i] : starts[i] + bpc] for i in whole])
                slots = [SlotId(op.host_slots[i]) for i in whole]
                copier.scatter(slots, blocks, [op.keys[i] for i in whole])
            for i in range(good):
                lo, hi = spans[i]
                if lo < hi and (lo, hi) != (0, bpc):
                    slot = host.slot(SlotId(op.host_slots[i]))
                    pool.scatter_partial(slot, lo, op.block_ids[starts[i] : starts[i] + hi - lo])
            return [True] * good

        return work

    # -- results ---------------------------------------------------------------------------------
    def owns(self, job_id: JobId) -> bool:
        """True for a runner job of one of these loads."""
        return job_id in self._parts

    def harvested(self, result: JobResult) -> None:
        """Account one finished job of a load: a read marks the chunks it found bad (the load
        scatters once its last read is in); a scatter finishes the load."""
        load_id, part, order = self._parts.pop(result.job.job_id)
        load = self._loads[load_id]
        if part == _SCATTER:
            if not all(result.ok):  # the blocks may be half written: none of them counts
                load.ok[: len(result.ok)] = [False] * len(result.ok)
            self._finish(load)
            return
        for i, ok in zip(order, result.ok, strict=True):
            load.ok[i] = load.ok[i] and ok
        load.reads -= 1
        if load.reads == 0:
            self._scatter(load)

    def _finish(self, load: _Load) -> None:
        """Report the load: per-chunk validity, and every block from the first failed chunk on
        as a load error (a KV prefix is usable only up to its first gap)."""
        op = load.op
        self._loads.pop(op.job_id, None)
        flags = tuple(load.ok) + (False,) * (len(op.keys) - len(load.ok))
        bad = next((i for i, f in enumerate(flags) if not f), None)
        if bad is not None:
            _spans, starts = chunk_spans(len(op.keys), self.bpc, op.skip_blocks, len(op.block_ids))
            failed = op.block_ids[starts[bad] :]
            self._errors.update(failed)
            self._m_err.inc(len(failed))
            if not op.load_async:
                self._failed_reqs.add(op.req_id)
            else:
                self._failed_async.add(op.req_id)
        self._reports.append(JobReport(op.job_id, "device", flags, self.rank))
        if op.load_async:
            self._arrived.add(op.req_id)

    # -- what goes to vLLM -----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Synchronous loads in flight (the forward must not read their blocks yet)."""
        return sum(1 for load in self._loads.values() if not load.op.load_async)

    @property
    def in_flight(self) -> int:
        return len(self._loads)

    @property
    def has_news(self) -> bool:
        return bool(self._reports or self._errors or self._arrived)

    def take_reports(self) -> list[JobReport]:
        reports, self._reports = self._reports, []
        return reports

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_arrived(self) -> set[str]:
        """Requests whose asynchronous load ended (every chunk in place, or its failed blocks
        among the errors), each once."""
        arrived, self._arrived = self._arrived, set()
        return arrived

    def take_failed_async(self) -> set[str]:
        """Requests whose asynchronous load ended with a failed chunk (also among the arrived
        and their blocks among the errors), each once: a hybrid model reports them to vLLM
        as failed receives (:class:`~.hybrid_worker.HybridWorker`)."""
        failed, self._failed_async = self._failed_async, set()
        return failed


def chunk_spans(
    n: int, bpc: int, skip: int, num_blocks: int
) -> tuple[list[tuple[int, int]], list[int]]:
    """Per chunk of a load: the ``[lo, hi)`` blocks of it that are written (empty for a chunk
    wholly inside the ``skip`` blocks vLLM already holds), and the position of its first
    written block in the load's ``block_ids``. The blocks written are
    ``[skip, skip + num_blocks)`` of the chunks' blocks and end inside the last chunk."""
    cut = n * bpc - skip - num_blocks
    if n and not (skip >= 0 and 0 <= cut < bpc and num_blocks > 0):
        raise InvalidArgumentError(
            f"a load of {n} chunks cannot write {num_blocks} blocks after skipping {skip}"
        )
    spans = [(min(max(skip - i * bpc, 0), bpc), bpc) for i in range(n)]
    if n:
        spans[-1] = (spans[-1][0], bpc - cut)
    starts = np.concatenate(([0], np.cumsum([hi - lo for lo, hi in spans]))).tolist()
    return spans, [int(x) for x in starts]
