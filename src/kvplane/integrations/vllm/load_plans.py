"""Load bookkeeping of the connector's scheduler side: a hit becomes a load, its report applied.

Owns :class:`LoadPlans`: the :class:`~.messages.LoadOp` planned when vLLM allocated blocks for
a hit (tier book reservation, the blocks vLLM holds, emitted by the next step), the load jobs
in flight, their reports back into the :class:`~kvplane.offload.book.TierBook` and the hit
metrics. No tensors, no vLLM import. See ``docs/vllm.md`` ("The scheduler side").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.hits import LoadGrid
from kvplane.integrations.vllm.messages import JobReport, LoadOp
from kvplane.integrations.vllm.request_state import RequestTable, RequestView
from kvplane.metrics import MetricsRegistry
from kvplane.offload.book import TierBook


@dataclass(frozen=True, slots=True)
class _LoadJob:
    """A load in flight, as the scheduler side keeps it: ``op`` (what the worker is sent) and
    the tokens ``[num_computed, end)`` promised to vLLM for it, which the worker never needs.
    One record per job, so the op and its promise cannot disagree or outlive each other."""

    op: LoadOp
    num_computed: int
    end: int


class LoadPlans:
    """Loads of ``book`` from vLLM's allocation to the workers' report; ``ids`` hands out job
    ids (the scheduler side's, shared with its stores and demotions). Not thread-safe."""

    def __init__(
        self,
        book: TierBook,
        requests: RequestTable,
        grid: LoadGrid,
        ids: Iterator[int],
        metrics: MetricsRegistry,
    ) -> None:
        self.book = book
        self.requests = requests
        self.grid = grid
        self._ids = ids
        self._jobs: dict[int, _LoadJob] = {}
        self._out: list[LoadOp] = []
        m = metrics
        self._m_query = m.counter("vllm_query_tokens", "Tokens asked for beyond local hits")
        self._m_hit = m.counter("vllm_hit_tokens", "Tokens loaded into vLLM from kvplane")
        self._m_hit_chunks = m.counter("vllm_hit_chunks", "Chunks loaded, by source", ("tier",))
        self._m_failed = m.counter(
            "vllm_load_failed_chunks", "Chunks not loaded: read back bad, or after one that did"
        )
        self._m_loads = m.counter("vllm_loads", "Loads planned, by mode", ("mode",))

    def allocated(
        self, view: RequestView, block_ids: Sequence[int], num_external: int
    ) -> LoadOp | None:
        """vLLM allocated ``block_ids`` for the (eligible) request and will take
        ``num_external`` tokens from kvplane after its local hit: plan that load (emitted by
        :meth:`take`), asynchronous when the request's last match said so; only into the
        blocks vLLM holds (:meth:`~.hits.LoadGrid.load_start`). The first call of a request
        counts its lookup in every tier's admission."""
        req = self.requests.state(view)
        if not req.looked_up:
            req.keys.extend(view.token_ids)
            self.book.lookup(req.keys.chunk_keys(view.num_tokens))
            req.looked_up = True
            self._m_query.inc(max(view.num_tokens - req.match.num_computed, 0))
        if num_external <= 0:
            return None
        num_computed = req.match.num_computed
        spec = self.grid.spec
        bs, tpc = spec.block_size, spec.tokens_per_chunk
        end = num_computed + num_external
        first_block, first = self.grid.load_start(num_computed, end)
        last = -(-end // tpc)
        end_block = -(-end // bs)
        if end_block > len(block_ids) or last * tpc > view.num_tokens:
            raise InvalidArgumentError(
                f"request {view.req_id}: {num_external} external tokens after {num_computed} "
                f"need blocks up to {end_block}, it holds {len(block_ids)}"
            )
        context = max(last * tpc, view.num_tokens - 1)  # later keys name covering tier chunks
        req.keys.extend(view.token_ids, context)
        ahead = req.keys.chunk_keys(context)[first:]
        keys = ahead[: last - first]
        got = self.book.reserve_load(ahead, last - first)
        planned = len(got.keys)
        op = LoadOp(
            job_id=next(self._ids),
            req_id=view.req_id,
            keys=tuple(keys),
            host_slots=got.host_slots,
            block_ids=tuple(int(b) for b in block_ids[first_block:end_block]),
            skip_blocks=first_block - first * spec.blocks_per_chunk,
            promotions=got.promotions,
            doomed_from=None if planned == len(keys) else planned,
            first_chunk=first,
            load_async=req.match.load_async,
        )
        self._m_loads.labels(mode="async" if op.load_async else "sync").inc()
        self._jobs[op.job_id] = _LoadJob(op, num_computed, end)
        self._out.append(op)
        return op

    @property
    def pending(self) -> tuple[LoadOp, ...]:
        """The loads planned since the last :meth:`take`."""
        return tuple(self._out)

    def take(self) -> tuple[LoadOp, ...]:
        """The loads planned since the last call, for this step; clears them."""
        out = tuple(self._out)
        self._out.clear()
        return out

    def owns(self, job_id: int) -> bool:
        """True when ``job_id`` is a load in flight."""
        return job_id in self._jobs

    @property
    def in_flight(self) -> int:
        """Loads planned and not yet reported by every rank."""
        return len(self._jobs)

    def apply(self, job: JobReport) -> None:
        """A load's report (every rank's): unpin or publish its chunks in the book, count the
        hit up to the first bad chunk, and offer that chunk for storing again (vLLM
        recomputes from it)."""
        load = self._jobs[job.job_id]
        op = load.op
        self.book.loaded(op.keys[: op.num_planned], op.promotions, job.ok[: op.num_planned])
        bad = next((i for i, f in enumerate(job.ok) if not f), None)
        self._count_loaded(load, len(job.ok) if bad is None else bad)
        req = self.requests.get(op.req_id)
        if bad is not None and req is not None:
            req.offered = min(req.offered, op.first_chunk + bad)
        self._m_failed.inc(0 if bad is None else len(job.ok) - bad)
        del self._jobs[job.job_id]

    def _count_loaded(self, load: _LoadJob, good: int) -> None:
        """Hit metrics of a reported load whose first ``good`` chunks arrived intact: vLLM
        uses its KV up to the first failed chunk and recomputes the rest."""
        op = load.op
        tpc = self.grid.spec.tokens_per_chunk
        got = (op.first_chunk + good) * tpc
        tokens = min(load.end, got) - load.num_computed
        self._m_hit.inc(max(tokens, 0))
        promoted = {p.index: p.tier for p in op.promotions}
        for i in range(good):  # not the chunks vLLM held (a load from a whole lower-tier chunk)
            if (op.first_chunk + i + 1) * tpc > load.num_computed:
                self._m_hit_chunks.labels(tier=promoted.get(i, "host")).inc()
