"""The tier cascade: the executor of a :class:`~kvplane.offload.book.TierBook` in one process.

:class:`TierCascade` owns the host and lower tiers, the copier, the job runner and the device
fence. It turns the book's reservations into jobs (gather, write-down, promotion, scatter) and
the jobs' results back into book calls and :class:`StoreDone` / :class:`CascadeDone` /
:class:`LoadDone` events, on the owner thread; it decides nothing itself. The caller keeps a
load's destination blocks untouched until its :class:`LoadDone`; store sources are fenced.
Details: ``docs/offload.md`` ("The tier cascade").
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvplane.blocks import BlockPool
from kvplane.errors import ConfigError, IllegalTransitionError, InvalidArgumentError, OffloadError
from kvplane.ids import ChunkKey, JobId
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.offload.book import TierBook, tier_manager
from kvplane.offload.book_types import LoadReservation, Promotion, WriteDown
from kvplane.offload.config import OffloadConfig
from kvplane.offload.copier import ChunkCopier
from kvplane.offload.events import CascadeDone, Event, LoadDone, LoadTicket, StoreDone
from kvplane.offload.jobs import (
    BlockFence,
    BlockIds,
    JobResult,
    JobRunner,
    TransferJob,
    Work,
    check_block_ids,
)
from kvplane.offload.manager import CascadeLookup, OffloadManager
from kvplane.offload.rechunk import Staging, demote_units, demoter, promoter, tier_reads
from kvplane.offload.slots import check_chunk_keys
from kvplane.offload.spans import tier_spans
from kvplane.offload.tiers.base import Tier
from kvplane.offload.tiers.host import HostTier
from kvplane.offload.tiers.registry import open_lower_tiers
from kvplane.offload.tiers.shared import SharedTier
from kvplane.validators import require_int


class _Kind(enum.Enum):
    """What a submitted job is for, which decides how its result is applied."""

    STORE = "store"  # device -> host
    CASCADE = "cascade"  # host -> lower tier
    PROMOTE = "promote"  # lower tier -> host, for a load
    LOAD = "load"  # host -> device


@dataclass(slots=True)
class _Pending:
    kind: _Kind
    tier: str
    keys: tuple[ChunkKey, ...]
    ticket: int = 0
    down: WriteDown | None = None  # CASCADE: the write-down whose ``writes[0]`` this job is
    asked: tuple[ChunkKey, ...] = ()  # STORE: every key asked, host chunks from ``first`` on
    first: int = 0


@dataclass(slots=True)
class _Ticket:
    keys: tuple[ChunkKey, ...]
    blocks: dict[ChunkKey, npt.NDArray[np.int64]]
    ok: dict[ChunkKey, bool]


class TierCascade:
    """Stores, cascades, promotes and loads chunks of one device pool (see module docstring).

    ``host_manager`` and the managers of ``lower`` (one per tier, named as it) become the
    :attr:`book`. ``spans`` (default 1 each): host chunks per chunk of each lower tier, whose
    ``chunk_bytes`` must be that many host chunks; the cascade re-chunks between them
    (:mod:`~kvplane.offload.rechunk`). Lower tiers are re-indexed on construction: valid chunks
    they already hold (a restart) become READY in their managers. Not thread-safe: one owner
    thread calls every method.
    """

    def __init__(
        self,
        copier: ChunkCopier,
        host_manager: OffloadManager,
        lower: Sequence[tuple[Tier, OffloadManager]] = (),
        jobs: JobRunner | None = None,
        fence: BlockFence | None = None,
        *,
        spans: Mapping[str, int] | None = None,
    ) -> None:
        self.copier = copier
        self.host: HostTier = copier.host
        if host_manager.num_slots != self.host.num_slots:
            raise InvalidArgumentError("the host manager and the host tier differ in slot count")
        self.lower = tuple(lower)
        shared = [t.name for t, _m in self.lower if isinstance(t, SharedTier)]
        self.book = TierBook(
            host_manager, [mgr for _t, mgr in self.lower], spans, shared=next(iter(shared), None)
        )
        for tier, mgr in self.lower:
            want = self.book.spans[tier.name] * self.host.chunk_bytes
            if tier.chunk_bytes != want or mgr.num_slots != tier.num_slots:
                raise InvalidArgumentError(
                    f"tier {tier.name!r} does not match {self.book.spans[tier.name]} host chunks"
                )
            if mgr.tier != tier.name:
                raise InvalidArgumentError(f"tier {tier.name!r} has the manager of {mgr.tier!r}")
        self._staging = {(t.name, way): Staging() for t, _m in self.lower for way in "wr"}
        self.host_manager = host_manager
        for tier, _mgr in self.lower:
            self.book.adopt(tier.name, tier.scan())
        self._by_name = {tier.name: tier for tier, _m in self.lower}
        self.jobs = jobs if jobs is not None else JobRunner()
        self.fence = fence if fence is not None else BlockFence()
        self._pending: dict[JobId, _Pending] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._carried: list[Event] = []  # events of a poll/wait that raised, for the next one
        self._ticket_ids = itertools.count(1)
        self._bpc = copier.blocks_per_chunk

    # -- queries ---------------------------------------------------------------------------
    def managers(self) -> list[OffloadManager]:
        return self.book.managers()

    def lookup(self, keys: Sequence[ChunkKey]) -> CascadeLookup:
        """The book's :meth:`~kvplane.offload.book.TierBook.lookup` (counts admission and
        one access per key of the leading hit run, in the tier a load reads it from). With a
        shared store, chunks past the hit run are first asked of it in one batch
        (:meth:`~kvplane.offload.book.TierBook.to_discover`) and those it holds adopted: a
        prefix another engine published since this one started is a remote hit."""
        asked = self.book.to_discover(keys)
        if asked and self.book.shared is not None:
            tier = self._by_name[self.book.shared]
            if isinstance(tier, SharedTier):
                self.book.discovered(asked, tier.held(asked))
        return self.book.lookup(keys)

    def _blocks(self, block_ids: BlockIds, n_keys: int) -> npt.NDArray[np.int64]:
        """``block_ids`` as an ``[n_keys, bpc]`` array after checking type (a 1-D integer
        sequence, :func:`check_block_ids`), count and range; also refuses work once the job
        runner is closed (before anything changes)."""
        if self.jobs.closed:
            raise OffloadError("the cascade is closed")
        ids = check_block_ids(block_ids, self.copier.layout.num_blocks)
        if ids.size != n_keys * self._bpc:
            raise InvalidArgumentError(
                f"{n_keys} chunks need {n_keys * self._bpc} block ids, got {ids.size}"
            )
        return ids.reshape(n_keys, self._bpc)

    # -- store -----------------------------------------------------------------------------
    def store(
        self, keys: Sequence[ChunkKey], block_ids: BlockIds, *, first: int = 0
    ) -> JobId | None:
        """Offload chunks ``keys`` held in device blocks ``block_ids`` (chunk-major);
        ``keys[i]`` is chunk ``first + i`` of its sequence (where a lower tier's larger chunks
        begin: it takes each whole group of them host then holds, :meth:`TierBook.write_down`).

        Returns the ``device_to_host`` job, or ``None`` when nothing was submitted (all held,
        not admitted, or no host room even after eviction). A chunk whose host copy is doomed
        (read back bad while another load still pins it) is not stored now: its bytes are the
        caller's, so the caller stores it again once the loads reading it have their
        :class:`LoadDone` (it is a MISS in :meth:`lookup` until then). The blocks of submitted
        chunks are fenced until the job's :class:`StoreDone`. Every block of ``block_ids`` must
        be one the fence accepts (with a pool: in use, or free and cached), checked with the
        keys and ids before anything changes, so a raising call evicts nothing.
        """
        ks = check_chunk_keys(keys)
        ids = self._blocks(block_ids, len(ks))
        self.fence.check(ids.reshape(-1))
        res = self.book.reserve_store(ks, write_through=False)
        if res is None or not res.keys:
            return None
        pos = {k: i for i, k in enumerate(ks)}
        blocks = ids[[pos[k] for k in res.keys]].reshape(-1)
        job = self.jobs.new_job(res.keys, "device", "host")
        try:
            self.fence.hold(job.job_id, blocks)
        except BaseException:
            self.book.gathered(res.keys, (), [False] * len(res.keys))
            raise
        slots, copier = list(res.slots), self.copier

        def work() -> list[bool]:
            copier.gather(blocks, slots, res.keys)
            return [True] * len(slots)

        pending = _Pending(_Kind.STORE, "host", res.keys, asked=tuple(ks), first=first)
        self._submit(job.job_id, pending, job, work)
        return job.job_id

    def _write_down(self, down: WriteDown) -> None:
        """Submit one ``host_to_<tier>`` job per write of ``down`` (host copies pinned)."""
        for write in down.writes:
            tier = self._by_name[write.tier]
            units = demote_units(write, down.keys, lambda i: self.book.host_slot(down.keys[i]))
            keys = tuple(k for _s, k, _h in units)
            job = self.jobs.new_job(keys, "host", tier.name)
            pending = _Pending(_Kind.CASCADE, tier.name, keys, down=WriteDown(down.keys, (write,)))
            work = demoter(tier, self.host, units, self._staging[tier.name, "w"])
            self._submit(job.job_id, pending, job, work, tier.chunk_bytes)

    # -- load ------------------------------------------------------------------------------
    def load(
        self, keys: Sequence[ChunkKey], block_ids: BlockIds, *, limit: int | None = None
    ) -> LoadTicket | None:
        """Load the longest loadable prefix of ``keys`` (from its sequence's first chunk), at
        most ``limit`` chunks, into ``block_ids`` (chunk-major, for ``min(limit, len(keys))``
        chunks). Keys past ``limit`` name the larger chunks of a lower tier that cover it.

        Returns the ticket (its ``keys`` may be a prefix of ``keys``) or ``None`` when the first
        key is not loadable. Completion arrives as a :class:`LoadDone` from :meth:`poll`.
        """
        ks = check_chunk_keys(keys)
        n = len(ks) if limit is None else min(require_int("limit", limit, min=0), len(ks))
        ids = self._blocks(block_ids, n)
        res = self.book.reserve_load(ks, n)
        if not res.keys:
            return None
        ticket_id = next(self._ticket_ids)
        self._tickets[ticket_id] = _Ticket(
            res.keys, {k: ids[i] for i, k in enumerate(res.keys)}, {}
        )
        for tier, _mgr in self.lower:
            mine = [p for p in res.promotions if p.tier == tier.name]
            if mine:
                self._promote(ticket_id, tier, res, mine)
        sources = res.sources
        host_keys = [k for k, s in zip(res.keys, sources, strict=True) if s == "host"]
        if host_keys:
            self._to_device(ticket_id, host_keys)
        return LoadTicket(ticket_id, res.keys, sources)

    def _promote(
        self, ticket: int, tier: Tier, res: LoadReservation, mine: Sequence[Promotion]
    ) -> None:
        """Read the promotions ``mine`` (all from ``tier``) into their reserved host slots: one
        read per tier chunk, its pieces into their host slots."""
        reads, order = tier_reads(mine, res.keys, res.host_slots)
        keys = tuple(res.keys[i] for i in order)
        job = self.jobs.new_job(keys, tier.name, "host")
        work = promoter(tier, self.host, reads, self._staging[tier.name, "r"])
        self._submit(job.job_id, _Pending(_Kind.PROMOTE, tier.name, keys, ticket), job, work)

    def _to_device(self, ticket: int, keys: Sequence[ChunkKey]) -> None:
        """Scatter host-resident, already pinned ``keys`` into the ticket's blocks."""
        host_slots = [self.book.host_slot(k) for k in keys]
        blocks = np.concatenate([self._tickets[ticket].blocks[k] for k in keys])
        job = self.jobs.new_job(keys, "host", "device")
        copier = self.copier

        def work() -> list[bool]:
            copier.scatter(host_slots, blocks, keys)
            return [True] * len(host_slots)

        self._submit(job.job_id, _Pending(_Kind.LOAD, "host", tuple(keys), ticket), job, work)

    # -- completion ------------------------------------------------------------------------
    def _submit(
        self,
        job_id: JobId,
        pending: _Pending,
        job: TransferJob,
        work: Work,
        chunk_bytes: int | None = None,
    ) -> None:
        """Queue ``work``; ``chunk_bytes``: the bytes of each of its chunks (default host's)."""
        self._pending[job_id] = pending
        self.jobs.submit(job, work, self.host.chunk_bytes if chunk_bytes is None else chunk_bytes)

    def _apply(self, result: JobResult) -> list[Event]:
        """Tell the book how job ``result`` went and submit the follow-up jobs it decides."""
        job_id = result.job.job_id
        p = self._pending.pop(job_id)
        ok = result.ok
        if p.kind is _Kind.STORE:
            self.fence.release(job_id)
            self.book.gathered(p.keys, (), ok)
            good = [k for k, f in zip(p.keys, ok, strict=True) if f]
            if good:
                self._write_down(self.book.write_down(p.asked, first=p.first, fresh=good))
            return [StoreDone(job_id, p.keys, ok)]
        if p.kind is _Kind.CASCADE:
            if p.down is None:  # pragma: no cover - _write_down always sets it
                raise IllegalTransitionError(f"write-down job {job_id} lost its reservation")
            self.book.written(p.down.keys, p.down.writes[0], [True] * len(p.down.keys), ok)
            return [CascadeDone(job_id, p.tier, p.keys, ok)]
        ticket = self._tickets[p.ticket]
        if p.kind is _Kind.PROMOTE:
            promoted = self.book.promoted(p.tier, p.keys, ok, pin=True)
            ticket.ok.update((k, False) for k, f in zip(p.keys, ok, strict=True) if not f)
            if promoted:
                self._to_device(p.ticket, promoted)
        else:
            self.book.scattered(p.keys)
            ticket.ok.update(zip(p.keys, ok, strict=True))
        if len(ticket.ok) < len(ticket.keys):
            return []
        del self._tickets[p.ticket]
        return [LoadDone(p.ticket, ticket.keys, tuple(ticket.ok[k] for k in ticket.keys))]

    def _apply_all(self, results: Sequence[JobResult]) -> list[Event]:
        """Apply each result on its own: one that raises does not stop the others (their
        slots, pins and fences are settled). The first error is raised after all are applied,
        and the events gathered meanwhile are kept for the next poll/wait/drain."""
        events, self._carried = self._carried, []
        error: Exception | None = None
        for result in results:
            try:
                events += self._apply(result)
            except Exception as exc:  # each result must be applied, whatever the others do
                if error is None:
                    error = exc
        try:
            for down in self.book.retry_deferred():
                self._write_down(down)
        except Exception as exc:
            if error is None:
                error = exc
        if error is not None:
            self._carried = events
            raise error
        return events

    def poll(self) -> list[Event]:
        """Apply every finished job; never blocks.

        Each result is applied independently; if applying one raises, the rest are still
        applied, the first error propagates and their events come with the next call.
        """
        return self._apply_all(self.jobs.poll())

    def wait(self, timeout: float | None = None) -> list[Event]:
        """Block for at least one finished job (or ``timeout``), then apply all finished.

        Returns at once when events of an earlier raising call are pending; errors as
        :meth:`poll`.
        """
        if self._carried:
            return self._apply_all(self.jobs.poll())
        return self._apply_all(self.jobs.wait(timeout))

    def drain(self, timeout: float = 60.0) -> list[Event]:
        """Apply results until no job is in flight (follow-up jobs included).

        If applying a result raises (or the timeout passes), the events gathered so far are
        not lost: they are kept, before those of the raising call, for the next
        :meth:`poll`/:meth:`wait`/:meth:`drain`, and the error propagates.
        """
        deadline = time.monotonic() + timeout
        events: list[Event] = []
        try:
            events += self.poll()  # pending events of an earlier raising call, finished jobs
            while self.jobs.in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OffloadError(f"{self.jobs.in_flight} offload job(s) still running")
                events += self.wait(left)
        except BaseException:
            self._carried = events + self._carried
            raise
        return events

    def close(self) -> None:
        """Drain, stop the workers and close the lower tiers (:func:`close_after_drain`)."""
        close_after_drain(self.drain, self.jobs, self.copier, (t for t, _m in self.lower))

    def check_integrity(self) -> None:
        """The book's invariants; when idle, no pins, stores, fences or tickets remain."""
        idle = not self.jobs.in_flight
        self.book.check_integrity(idle)
        if idle and (len(self.fence) or self._tickets or self._pending):
            raise IllegalTransitionError("idle cascade still holds fences, tickets or jobs")


def close_after_drain(
    drain: Callable[[], object], jobs: JobRunner, copier: ChunkCopier, lower: Iterable[Tier]
) -> None:
    """The close sequence of an owner of tier jobs (the cascade, the vLLM worker side): call
    ``drain``, then, even when it raises, stop ``jobs``'s threads, close ``copier`` and each
    tier of ``lower`` in order; ``drain``'s error propagates."""
    try:
        drain()
    finally:
        jobs.close()
        copier.close()
        for tier in lower:
            tier.close()


def build_cascade(
    config: OffloadConfig,
    layout: KVLayout,
    blocks_per_chunk: int,
    device_pool: torch.Tensor,
    *,
    metrics: MetricsRegistry | None = None,
    block_pool: BlockPool | None = None,
    lower: Sequence[Tier] | None = None,
) -> TierCascade:
    """A cascade from ``config``: host tier, the configured lower tiers (or ``lower``), one
    manager each with the configured policy and admission, jobs and a fence on ``block_pool``.
    ``blocks_per_chunk`` is the host tier's; a lower tier's chunks are its configured
    ``*_blocks_per_chunk`` (``ConfigError`` unless a multiple of it; :func:`tier_spans`).

    The cascade owns the lower tiers from here on (:meth:`TierCascade.close` closes them); if
    building fails (e.g. a re-index cannot reach Redis) they are closed before the error
    propagates.
    """
    chunk_bytes = blocks_per_chunk * layout.bytes_per_block
    host = HostTier(config.host_slots, chunk_bytes, pin_memory=config.pin_memory)
    copier = ChunkCopier(layout, device_pool, host, blocks_per_chunk, config.staging_blocks)

    sizes = {"disk": config.disk_blocks_per_chunk, "remote": config.remote_blocks_per_chunk}
    spans = tier_spans(blocks_per_chunk, sizes)
    tiers = (
        list(lower)
        if lower is not None
        else open_lower_tiers(
            config, chunk_bytes, layout.fingerprint(), metrics, layout=layout, spans=spans
        )
    )
    try:
        wide = {t.name: spans[t.name] for t in tiers if spans.get(t.name, 1) > config.host_slots}
        if wide:  # a tier chunk is written from its host chunks, all held in host at once
            raise ConfigError(
                f"tier chunks of {wide} host chunks need host_slots >= that, "
                f"got {config.host_slots}"
            )
        return TierCascade(
            copier,
            tier_manager(config, "host", config.host_slots, metrics),
            [(t, tier_manager(config, t.name, t.num_slots, metrics)) for t in tiers],
            JobRunner(metrics),
            BlockFence(block_pool),
            spans={t.name: spans[t.name] for t in tiers if t.name in spans},
        )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
