"""The connector's scheduler side: which tokens load from kvplane, what to store, when to free.

Owns :class:`SchedulerSide` (per-request key chains, side-effect-free matches, load and store
plans, block fences, hit metrics) over the :class:`~kvplane.offload.book.TierBook`, and the
:class:`RequestView` it reads. Plain data in, :class:`~.messages.StepMeta` out: no tensors, no
tier I/O but one question to a shared store (:class:`~.store_probe.StoreProbe`), no vLLM import.
The rules (keys, match, store, free, fence, discovery, per-tier sizes): ``docs/vllm.md`` ("The
scheduler side", "The shared store", "Per-tier chunk sizes").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplane.blocks.hashing import BlockHasher, ExtraKey
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.demotions import Demotions
from kvplane.integrations.vllm.fences import Fences
from kvplane.integrations.vllm.keys import RequestKeys
from kvplane.integrations.vllm.messages import (
    JobReport,
    LoadOp,
    StepMeta,
    StoreOp,
    TierIndex,
    WorkerReport,
)
from kvplane.integrations.vllm.store_probe import StoreId, StoreProbe
from kvplane.integrations.vllm.tp import RankTally
from kvplane.integrations.vllm.windows import KVWindow, first_kept_block, freed_any, holds_null
from kvplane.metrics import MetricsRegistry
from kvplane.offload.book import TierBook


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the scheduler side reads of a vLLM request.

    ``token_ids`` are the request's known tokens (prompt + output so far); ``eligible`` is
    False for requests whose tokens do not identify their KV (prompt embeddings, multimodal
    inputs): those are never matched nor stored. ``readable`` is False for requests that must
    compute every token themselves (vLLM's ``skip_reading_prefix_cache``, set for prompt
    logprobs): they are never matched (0 tokens), but their KV is still stored. Built from a
    vLLM request by :func:`~.views.request_view`.
    """

    req_id: str
    token_ids: Sequence[int]
    extra_keys: tuple[ExtraKey, ...] = ()
    eligible: bool = True
    readable: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a step: KV of tokens ``[0, computed_end)`` exists after the step, in
    ``block_ids`` (the request's whole block table, in order); the step writes the KV of
    tokens ``[computed_start, computed_end)`` (0: assume the whole table is written)."""

    view: RequestView
    computed_end: int
    block_ids: Sequence[int]
    computed_start: int = 0


@dataclass(frozen=True, slots=True)
class _LoadJob:
    """A load in flight, as the scheduler side keeps it: ``op`` (what the worker is sent) and
    the tokens ``[num_computed, end)`` promised to vLLM for it, which the worker never needs.
    One record per job, so the op and its promise cannot disagree or outlive each other."""

    op: LoadOp
    num_computed: int
    end: int


@dataclass(slots=True)
class _Req:
    keys: RequestKeys
    looked_up: bool = False
    discovered: bool = False  # the shared store was asked about its chunks
    offered: int = 0  # chunks offered for storing so far
    gathers: dict[int, tuple[int, ...]] = field(default_factory=dict)  # in flight: table slots
    finished: bool = False
    match: tuple[int, int, bool] = (0, 0, False)  # (num_computed, chunks, async) of the last


class SchedulerSide:
    """Scheduler half of the connector; see the module docstring. Not thread-safe.

    With ``tp_size`` > 1 one decision serves every rank's worker: a job part is applied only
    once every rank reported it, its chunks good only where every rank's were
    (:class:`~.tp.RankTally`). ``window``: vLLM's sliding window (:class:`~.windows.KVWindow`),
    whose freed blocks loads skip, stores never read and in-flight gathers fence."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        metrics: MetricsRegistry,
        tp_size: int = 1,
        window: KVWindow | None = None,
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
        # tiers of larger chunks: written down after the gather, loads from whole groups
        self._write_through = all(span == 1 for span in spans.values())
        self._align = math.lcm(1, *spans.values())
        self._probe: StoreProbe | None = None
        self.metrics = metrics
        self._hasher: BlockHasher | None = None
        self._reqs: dict[str, _Req] = {}
        self._jobs: dict[int, StoreOp | _LoadJob] = {}
        self._gather_ok: dict[int, tuple[bool, ...]] = {}
        self._writes_left: dict[int, int] = {}
        self._loads: list[LoadOp] = []
        self._fences = Fences()  # freed blocks in-flight gathers still read
        self._flush_next = False
        self._ids = itertools.count(1)
        self.demotions = Demotions(book, self._ids)
        self._asked: dict[int, tuple[ChunkKey, ...]] = {}  # store job -> keys from chunk 0
        m = metrics
        self._m_query = m.counter("vllm_query_tokens", "Tokens asked for beyond local hits")
        self._m_hit = m.counter("vllm_hit_tokens", "Tokens loaded into vLLM from kvplane")
        self._m_hit_chunks = m.counter("vllm_hit_chunks", "Chunks loaded, by source", ("tier",))
        self._m_stored = m.counter("vllm_stored_chunks", "Chunks stored into host")
        self._m_no_room = m.counter("vllm_store_no_room", "Chunks not stored: no host room")
        self._m_failed = m.counter(
            "vllm_load_failed_chunks", "Chunks not loaded: read back bad, or after one that did"
        )
        self._m_fenced = m.counter(
            "vllm_fenced_frees", "Finished requests freed while a gather still read their blocks"
        )
        self._m_retry = m.counter("vllm_ask_again", "Lookups answered 'ask again'")
        self._m_loads = m.counter("vllm_loads", "Loads planned, by mode", ("mode",))
        self._m_found = m.counter(
            "vllm_discovered_chunks", "Chunks other engines published, found in the shared store"
        )

    # -- start-up -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once the worker's handshake (fingerprint and tier re-index) arrived."""
        return self._hasher is not None

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
            self._probe = StoreProbe(ids, self.config.offload.remote_timeout_s)
        self._hasher = BlockHasher(self.config.hashing.seed, index.fingerprint)

    def _req(self, view: RequestView) -> _Req:
        req = self._reqs.get(view.req_id)
        if req is None:
            if self._hasher is None:  # pragma: no cover - callers check ready first
                raise InvalidArgumentError("no worker handshake yet")
            req = _Req(RequestKeys(self._hasher, self.spec, view.extra_keys))
            self._reqs[view.req_id] = req
        return req

    # -- lookups ---------------------------------------------------------------------------------
    def _loadable(self, view: RequestView, num_computed: int) -> tuple[int, int | None]:
        """``(first chunk, loadable chunks from it)``, the count ``None`` for "ask again"
        (:meth:`~kvplane.offload.book.TierBook.loadable`: only as far as host can promote now,
        so :meth:`allocated` keeps the promise). The first chunk is the one holding token
        ``num_computed``, rounded down to whole chunks of every lower tier (:meth:`_first`).
        A request's first call first asks the shared store about the chunks past the known
        hit run and adopts what it holds (:meth:`~kvplane.offload.book.TierBook.to_discover`,
        ``discovered``)."""
        limit = view.num_tokens - 1
        req = self._req(view)
        req.keys.extend(view.token_ids, max(limit, 0))
        keys = req.keys.chunk_keys(max(limit, 0))
        if self._probe is not None and not req.discovered:
            req.discovered = True  # once per request: a waiting request is matched each step
            asked = self.book.to_discover(keys)
            if asked:
                self._m_found.inc(len(self.book.discovered(asked, self._probe.held(asked))))
        first = self._first(num_computed)
        return first, self.book.loadable(keys[first:])

    def _first(self, num_computed: int) -> int:
        """The chunk a load after ``num_computed`` local tokens starts at: the one holding that
        token, rounded down to a whole chunk of every lower tier, so the book sees whole groups
        (the chunks before ``num_computed`` are reserved but never written into vLLM)."""
        first = num_computed // self.spec.tokens_per_chunk
        return first - first % self._align

    def matched_tokens(self, view: RequestView, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` (block aligned) that kvplane can load now, or ``None``
        to be asked again later; always 0 for a view that is not ``eligible`` or not
        ``readable``. Changes no tier state (only memoises the request's hashes) but for the
        shared store's chunks a request's first call discovers (:meth:`_loadable`)."""
        return self.match(view, num_computed)[0]

    def match(self, view: RequestView, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: :meth:`matched_tokens` and whether that load
        runs asynchronously (``load_mode``: ``sync`` never, ``async`` always, ``auto`` when
        a chunk of it comes from a tier below host). False with no tokens."""
        if (
            not self.ready
            or not view.eligible
            or not view.readable
            or num_computed % self.spec.block_size
        ):
            return 0, False
        first, run = self._loadable(view, num_computed)
        if run is None:
            self._m_retry.inc()
            return None, False
        tokens = max((first + run) * self.spec.tokens_per_chunk - num_computed, 0)
        load_async = tokens > 0 and self._load_async(view, first, run)
        self._reqs[view.req_id].match = (num_computed, run, load_async)
        return tokens, load_async

    def _load_async(self, view: RequestView, first: int, run: int) -> bool:
        mode = self.config.load_mode
        if mode != "auto":
            return mode == "async"
        keys = self._reqs[view.req_id].keys.chunk_keys(max(view.num_tokens - 1, 0))
        return any(src != "host" for src in self.book.sources(keys[first:])[:run])

    def allocated(
        self, view: RequestView, block_ids: Sequence[int], num_external: int
    ) -> LoadOp | None:
        """vLLM allocated ``block_ids`` for the request and will take ``num_external`` tokens
        from kvplane after its local hit: plan that load (emitted by the next step),
        asynchronous when the request's last :meth:`match` said so; never into the blocks
        before a sliding window, which vLLM does not hold."""
        if not self.ready or not view.eligible:
            return None
        req = self._req(view)
        if not req.looked_up:
            req.keys.extend(view.token_ids)
            self.book.lookup(req.keys.chunk_keys(view.num_tokens))
            req.looked_up = True
            self._m_query.inc(max(view.num_tokens - req.match[0], 0))
        if num_external <= 0:
            return None
        num_computed = req.match[0]
        bs, tpc = self.spec.block_size, self.spec.tokens_per_chunk
        end = num_computed + num_external
        first_block = max(num_computed // bs, first_kept_block(self.window, end))
        first, last = self._first(first_block * bs), -(-end // tpc)
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
            skip_blocks=first_block - first * self.spec.blocks_per_chunk,
            promotions=got.promotions,
            doomed_from=None if planned == len(keys) else planned,
            first_chunk=first,
            load_async=req.match[2],
        )
        self._m_loads.labels(mode="async" if op.load_async else "sync").inc()
        self._jobs[op.job_id] = _LoadJob(op, num_computed, end)
        self._loads.append(op)
        return op

    # -- steps ----------------------------------------------------------------------------------
    def build_step(
        self, scheduled: Sequence[ScheduledRequest], preempted: Sequence[str] = ()
    ) -> StepMeta:
        """The worker's instructions for this step (resets the pending loads). ``flush`` when
        a preempted request has gathers in flight or the step writes a fenced block (by its
        forward, by a load, or by :meth:`will_write`)."""
        for s in scheduled if self.window is not None else ():  # else vLLM frees no block early
            self._fence_freed(s)
        flush = self._flush_next or any(self._reqs[r].gathers for r in preempted if r in self._reqs)
        if self._fences and not flush:
            bs = self.spec.block_size
            written = [op.block_ids for op in self._loads] + [
                s.block_ids[s.computed_start // bs : -(-s.computed_end // bs)] for s in scheduled
            ]
            flush = any(self._fences.hit(ids) for ids in written)
        stores = [op for s in scheduled if (op := self._plan_store(s)) is not None]
        meta = StepMeta(tuple(self._loads), tuple(stores), flush, demotes=self.demotions.take())
        self._loads.clear()
        self._flush_next = False
        return meta

    def will_write(self, block_ids: Sequence[int]) -> None:
        """Something other than this side's steps (a PD receive) will write ``block_ids``
        after the next step begins: that step flushes if any of them is fenced."""
        if self._fences.hit(block_ids):
            self._flush_next = True

    def _plan_store(self, s: ScheduledRequest) -> StoreOp | None:
        view = s.view
        if not self.ready or not view.eligible:
            return None
        req = self._req(view)
        end = min(s.computed_end, view.num_tokens)
        req.keys.extend(view.token_ids, end)
        keys = req.keys.chunk_keys(end)
        fresh = keys[req.offered :]
        if not fresh:
            return None
        base, bpc = req.offered, self.spec.blocks_per_chunk
        req.offered = len(keys)
        pos = {k: base + i for i, k in enumerate(fresh)}
        # a chunk holding a block vLLM freed (the null block: outside a window) is never stored
        held = [k for k in fresh if not holds_null(s.block_ids[pos[k] * bpc : (pos[k] + 1) * bpc])]
        got = self.book.reserve_store(held, write_through=self._write_through) if held else None
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
        if not self._write_through:  # the write-down after its gather takes whole groups
            self._asked[op.job_id] = tuple(keys)
        self._writes_left[op.job_id] = len(op.writes)
        req.gathers[op.job_id] = at
        return op

    def finished(self, req_id: str) -> None:
        """The request finished and vLLM frees its blocks now (never delayed). The blocks its
        in-flight gathers read are fenced until the worker reports those gathers: a step that
        writes a fenced block first flushes the gathers (:meth:`build_step`). A request whose
        asynchronous load still runs needs no fence: vLLM keeps its blocks until the worker
        names it finished receiving, once the load ended on every rank."""
        req = self._reqs.get(req_id)
        if req is None:
            return
        if not req.gathers:
            del self._reqs[req_id]
            return
        req.finished = True
        self._m_fenced.inc()
        for job_id in req.gathers:
            if isinstance(op := self._jobs[job_id], StoreOp):
                self._fences.fence(job_id, op.block_ids)

    def _fence_freed(self, s: ScheduledRequest) -> None:
        """Fence the running request's gathers reading a block vLLM freed (it left the window;
        its table slot is the null block now, and the block may be reused anywhere)."""
        req = self._reqs.get(s.view.req_id)
        table = s.block_ids
        for job_id, at in req.gathers.items() if req is not None else ():
            op = self._jobs[job_id]
            if isinstance(op, StoreOp) and freed_any(table, at, op.block_ids):
                self._fences.fence(job_id, op.block_ids)

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
            return
        op = self._jobs.get(job.job_id)
        if op is None:
            raise InvalidArgumentError(f"worker reported unknown job {job.job_id}")
        if isinstance(op, _LoadJob):
            self._apply_load(op, job)
            return
        if job.tier == "host":
            self.book.gathered(op.keys, op.writes, job.ok)
            good = [k for k, f in zip(op.keys, job.ok, strict=True) if f]
            if op.job_id in self._asked:
                self.demotions.gathered(self._asked.pop(op.job_id), good)
            self._m_stored.inc(len(good))
            self._gather_ok[op.job_id] = job.ok
            self._fences.release(op.job_id, op.block_ids)
            req = self._reqs.get(op.req_id)
            if req is not None:
                req.gathers.pop(op.job_id, None)
                if req.finished and not req.gathers:
                    del self._reqs[op.req_id]
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

    def _apply_load(self, load: _LoadJob, job: JobReport) -> None:
        op = load.op
        self.book.loaded(op.keys[: op.num_planned], op.promotions, job.ok[: op.num_planned])
        bad = next((i for i, f in enumerate(job.ok) if not f), None)
        self._count_loaded(load, len(job.ok) if bad is None else bad)
        req = self._reqs.get(op.req_id)
        if bad is not None and req is not None:
            # vLLM recomputes from the first failed chunk: offer it for storing again.
            req.offered = min(req.offered, op.first_chunk + bad)
        self._m_failed.inc(0 if bad is None else len(job.ok) - bad)
        del self._jobs[job.job_id]

    def _count_loaded(self, load: _LoadJob, good: int) -> None:
        """Hit metrics of a reported load whose first ``good`` chunks arrived intact: vLLM
        uses its KV up to the first failed chunk and recomputes the rest."""
        op = load.op
        tpc = self.spec.tokens_per_chunk
        got = (op.first_chunk + good) * tpc
        tokens = min(load.end, got) - load.num_computed
        self._m_hit.inc(max(tokens, 0))
        promoted = {p.index: p.tier for p in op.promotions}
        for i in range(good):  # not the chunks vLLM held (a load from a whole lower-tier chunk)
            if (op.first_chunk + i + 1) * tpc > load.num_computed:
                self._m_hit_chunks.labels(tier=promoted.get(i, "host")).inc()

    # -- state ----------------------------------------------------------------------------------
    @property
    def jobs_in_flight(self) -> int:
        """Store, load and demotion jobs planned and not yet reported by every rank."""
        return len(self._jobs) + self.demotions.in_flight

    @property
    def fenced_blocks(self) -> list[int]:
        """Freed blocks that in-flight gathers still read, sorted."""
        return self._fences.blocks

    def tracked_requests(self) -> list[str]:
        return sorted(self._reqs)

    def forget(self, req_id: str) -> None:
        """Drop a request that never ran (aborted while waiting); keeps in-flight jobs."""
        req = self._reqs.get(req_id)
        if req is not None and not req.gathers:
            del self._reqs[req_id]

    @property
    def probe(self) -> StoreProbe | None:
        """The shared store's probe lookups ask (:meth:`set_index`), or ``None``."""
        return self._probe

    def close(self) -> None:
        """Close the shared store probe's connections; idempotent."""
        if self._probe is not None:
            self._probe.close()

    def check_integrity(self) -> None:
        """Tier invariants; with no job in flight, no busy slot and no request held back."""
        idle = not self.jobs_in_flight
        self.book.check_integrity(idle)
        if idle and (
            self.tally.waiting or self._fences or any(r.gathers for r in self._reqs.values())
        ):
            raise InvalidArgumentError("a request or a fence waits for a gather not in flight")
