"""Store bookkeeping of the connector's scheduler side: what each step stores, and its fences.

Owns :class:`StorePlans`: the :class:`~.messages.StoreOp` a step's computed chunks become (tier
book reservation, never a chunk holding vLLM's null block), the gathers in flight per request,
the :class:`~.fences.Fences` on blocks vLLM freed while a gather still reads them, and the
workers' gather and tier-write reports. No tensors, no vLLM import. See ``docs/vllm.md``
("The scheduler side": Store, Free; "Sliding windows and hybrids").
"""

from __future__ import annotations

from collections.abc import Iterator

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.demotions import Demotions
from kvplane.integrations.vllm.fences import Fences
from kvplane.integrations.vllm.messages import JobReport, StoreOp
from kvplane.integrations.vllm.request_state import RequestTable, ScheduledRequest
from kvplane.integrations.vllm.windows import freed_any, holds_null
from kvplane.metrics import MetricsRegistry
from kvplane.offload.book import TierBook


class StorePlans:
    """Stores of ``book`` from a step to the workers' last report; ``write_through``: every
    lower tier is written with the gather (else :class:`~.demotions.Demotions` writes whole
    groups down after it); ``ids`` hands out job ids (the scheduler side's). Not thread-safe."""

    def __init__(
        self,
        book: TierBook,
        requests: RequestTable,
        demotions: Demotions,
        ids: Iterator[int],
        metrics: MetricsRegistry,
        *,
        write_through: bool,
        fences: Fences | None = None,
    ) -> None:
        self.book = book
        self.requests = requests
        self.demotions = demotions
        self.write_through = write_through
        # freed blocks in-flight gathers still read; shared by a hybrid model's groups
        self.fences = Fences() if fences is None else fences
        self._ids = ids
        self._jobs: dict[int, StoreOp] = {}
        self._gather_ok: dict[int, tuple[bool, ...]] = {}
        self._writes_left: dict[int, int] = {}
        self._asked: dict[int, tuple[ChunkKey, ...]] = {}  # store job -> keys from chunk 0
        m = metrics
        self._m_stored = m.counter("vllm_stored_chunks", "Chunks stored into host")
        self._m_no_room = m.counter("vllm_store_no_room", "Chunks not stored: no host room")
        self._m_fenced = m.counter(
            "vllm_fenced_frees", "Finished requests freed while a gather still read their blocks"
        )

    def plan(self, s: ScheduledRequest) -> StoreOp | None:
        """The store of the (eligible) request's full chunks computed by the end of this step
        and not offered yet, as far as host has room; a chunk holding a block vLLM freed (the
        null block: outside a window) is never stored. Chunks a doomed host copy still blocks
        are offered again next step."""
        view = s.view
        req = self.requests.state(view)
        end = min(s.computed_end, view.num_tokens)
        req.keys.extend(view.token_ids, end)
        keys = req.keys.chunk_keys(end)
        fresh = keys[req.offered :]
        if not fresh:
            return None
        base, bpc = req.offered, self.requests.spec.blocks_per_chunk
        req.offered = len(keys)
        pos = {k: base + i for i, k in enumerate(fresh)}
        held = [k for k in fresh if not holds_null(s.block_ids[pos[k] * bpc : (pos[k] + 1) * bpc])]
        got = self.book.reserve_store(held, write_through=self.write_through) if held else None
        if got is None:
            self._m_no_room.inc(len(held))
            return None
        if got.deferred:  # a doomed host copy is still read: offer these again next step
            waiting = set(got.deferred)
            req.offered = base + next(i for i, k in enumerate(fresh) if k in waiting)
        if not got.keys:
            return None
        at = tuple(i for k in got.keys for i in range(pos[k] * bpc, (pos[k] + 1) * bpc))
        blocks = tuple(int(s.block_ids[i]) for i in at)
        op = StoreOp(next(self._ids), view.req_id, got.keys, got.slots, blocks, got.writes)
        self._jobs[op.job_id] = op
        if not self.write_through:  # the write-down after its gather takes whole groups
            self._asked[op.job_id] = tuple(keys)
        self._writes_left[op.job_id] = len(op.writes)
        req.gathers[op.job_id] = at
        return op

    def gathering(self, req_id: str) -> bool:
        """True when the request has a gather in flight."""
        req = self.requests.get(req_id)
        return req is not None and bool(req.gathers)

    def finished(self, req_id: str) -> None:
        """The request finished and vLLM frees its blocks now (never delayed): fence the blocks
        its in-flight gathers read until the worker reports them; untrack it when none runs."""
        req = self.requests.get(req_id)
        if req is None:
            return
        if not req.gathers:
            self.requests.drop(req_id)
            return
        req.finished = True
        self._m_fenced.inc()
        for job_id in req.gathers:
            op = self._jobs[job_id]
            self.fences.fence(job_id, op.block_ids)

    def fence_freed(self, s: ScheduledRequest) -> None:
        """Fence the running request's gathers reading a block vLLM freed (it left the window;
        its table slot is the null block now, and the block may be reused anywhere)."""
        req = self.requests.get(s.view.req_id)
        for job_id, at in req.gathers.items() if req is not None else ():
            op = self._jobs[job_id]
            if freed_any(s.block_ids, at, op.block_ids):
                self.fences.fence(job_id, op.block_ids)

    def owns(self, job_id: int) -> bool:
        """True when ``job_id`` is a store with a gather or a tier write in flight."""
        return job_id in self._jobs

    @property
    def in_flight(self) -> int:
        """Stores planned and not yet wholly reported (gather and every tier write)."""
        return len(self._jobs)

    def apply(self, job: JobReport) -> None:
        """A store job part every rank reported: the host gather (publish the good chunks,
        queue their write-downs, lift its fences, untrack a finished request with no gather
        left), or one lower-tier write, which must follow its gather."""
        op = self._jobs[job.job_id]
        if job.tier == "host":
            self.book.gathered(op.keys, op.writes, job.ok)
            good = [k for k, f in zip(op.keys, job.ok, strict=True) if f]
            if op.job_id in self._asked:
                self.demotions.gathered(self._asked.pop(op.job_id), good)
            self._m_stored.inc(len(good))
            self._gather_ok[op.job_id] = job.ok
            self.fences.release(op.job_id, op.block_ids)
            req = self.requests.get(op.req_id)
            if req is not None:
                req.gathers.pop(op.job_id, None)
                if req.finished and not req.gathers:
                    self.requests.drop(op.req_id)
        else:
            write = next((w for w in op.writes if w.tier == job.tier), None)
            if write is None or op.job_id not in self._gather_ok:
                raise InvalidArgumentError(
                    f"worker reported a {job.tier!r} write of job {job.job_id} out of order"
                )
            self.book.written(op.keys, write, self._gather_ok[op.job_id], job.ok)
            self._writes_left[op.job_id] -= 1
        if op.job_id in self._gather_ok and self._writes_left[op.job_id] == 0:
            del self._jobs[op.job_id], self._gather_ok[op.job_id], self._writes_left[op.job_id]
