"""The tier cascade: stores flow device -> host -> disk/remote, loads promote back up.

Theory of operation
-------------------
:class:`TierCascade` ties one device pool to a host tier and any lower tiers, each with its own
:class:`~kvplane.offload.manager.OffloadManager`, and drives them with jobs:

- :meth:`~TierCascade.store` reserves host slots (STORING), fences the device blocks and
  submits a ``device_to_host`` gather. When it completes the chunks are published in host and
  *cascade*: for each lower tier that admits them, the host copies are pinned (LOADING) and a
  ``host_to_<tier>`` job writes them down; completion publishes them there and unpins host.
  A chunk whose copy in that tier is doomed (read back bad while other readers pin it; see
  :class:`~kvplane.offload.manager.StorePlan`'s ``deferred``) is written down by the first
  :meth:`~TierCascade.poll`/:meth:`~TierCascade.wait` after that copy is dropped.
- :meth:`~TierCascade.load` takes the longest prefix of the asked keys that some tier holds
  READY. Host hits are pinned first (so nothing below can evict them), then chunks only found
  lower get host slots (promotion, past admission) and a ``<tier>_to_host`` read; each verified
  chunk is published in host and joins the ``host_to_device`` scatter. A chunk that fails
  verification is dropped from its tier and reported not ok; only a fully ok prefix is usable.

All bookkeeping happens on the owner thread in :meth:`~TierCascade.poll` /
:meth:`~TierCascade.wait` / :meth:`~TierCascade.drain`, which turn job results into
:class:`StoreDone`, :class:`CascadeDone` and :class:`LoadDone` events. The caller must keep a
load's destination blocks untouched until its :class:`LoadDone`; store sources are fenced.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvplane.blocks import BlockPool
from kvplane.errors import IllegalTransitionError, InvalidArgumentError, OffloadError
from kvplane.ids import ChunkKey, JobId, SlotId
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.offload.admission import AdmissionFilter
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
from kvplane.offload.manager import CascadeLookup, OffloadManager, lookup_tiers
from kvplane.offload.slots import SlotStatus, check_chunk_keys
from kvplane.offload.tiers.base import ReadOutcome, Tier
from kvplane.offload.tiers.host import HostTier
from kvplane.offload.tiers.registry import open_lower_tiers


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


@dataclass(slots=True)
class _Ticket:
    keys: tuple[ChunkKey, ...]
    blocks: dict[ChunkKey, npt.NDArray[np.int64]]
    ok: dict[ChunkKey, bool]


class TierCascade:
    """Stores, cascades, promotes and loads chunks of one device pool (see module docstring).

    Lower tiers are re-indexed on construction: valid chunks they already hold (a restart)
    become READY in their managers. Not thread-safe: one owner thread calls every method.
    """

    def __init__(
        self,
        copier: ChunkCopier,
        host_manager: OffloadManager,
        lower: Sequence[tuple[Tier, OffloadManager]] = (),
        jobs: JobRunner | None = None,
        fence: BlockFence | None = None,
    ) -> None:
        self.copier = copier
        self.host: HostTier = copier.host
        self.host_manager = host_manager
        if host_manager.num_slots != self.host.num_slots:
            raise InvalidArgumentError("the host manager and the host tier differ in slot count")
        self.lower = tuple(lower)
        for tier, mgr in self.lower:
            if tier.chunk_bytes != self.host.chunk_bytes or mgr.num_slots != tier.num_slots:
                raise InvalidArgumentError(f"tier {tier.name!r} does not match the host chunks")
            mgr.adopt(tier.scan())
        self._by_name = {tier.name: (tier, mgr) for tier, mgr in self.lower}
        self.jobs = jobs if jobs is not None else JobRunner()
        self.fence = fence if fence is not None else BlockFence()
        self._pending: dict[JobId, _Pending] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._carried: list[Event] = []  # events of a poll/wait that raised, for the next one
        # per lower tier, keys whose write-down waits for a doomed copy there to be dropped
        self._deferred: dict[str, dict[ChunkKey, None]] = {t.name: {} for t, _m in self.lower}
        self._ticket_ids = itertools.count(1)
        self._bpc = copier.blocks_per_chunk

    # -- queries ---------------------------------------------------------------------------
    def managers(self) -> list[OffloadManager]:
        return [self.host_manager, *(mgr for _t, mgr in self.lower)]

    def lookup(self, keys: Sequence[ChunkKey]) -> CascadeLookup:
        """Ask every tier (each counts the lookup toward its admission filter); each key of
        the leading hit run is an access only in ``where[i]``, the tier a load reads it from
        (:func:`~kvplane.offload.manager.lookup_tiers`)."""
        return lookup_tiers(self.managers(), keys)

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
    def store(self, keys: Sequence[ChunkKey], block_ids: BlockIds) -> JobId | None:
        """Offload chunks ``keys`` held in device blocks ``block_ids`` (chunk-major).

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
        plan = self.host_manager.prepare_store(ks)
        if plan is None or not plan.keys:
            return None
        pos = {k: i for i, k in enumerate(ks)}
        blocks = ids[[pos[k] for k in plan.keys]].reshape(-1)
        job = self.jobs.new_job(plan.keys, "device", "host")
        try:
            self.fence.hold(job.job_id, blocks)
        except BaseException:
            self.host_manager.complete_store(plan.keys, False)
            raise
        slots, copier = plan.slots, self.copier

        def work() -> list[bool]:
            copier.gather(blocks, slots)
            return [True] * len(slots)

        self._submit(job.job_id, _Pending(_Kind.STORE, "host", plan.keys), job, work)
        return job.job_id

    def _cascade(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            for tier, mgr in self.lower:
                self._write_down(tier, mgr, keys)

    def _write_down(self, tier: Tier, mgr: OffloadManager, keys: Sequence[ChunkKey]) -> None:
        """Write host-resident ``keys`` down to ``tier`` (those it admits and lacks). A key whose
        copy there is doomed (a bad read that readers still pin) is remembered and written
        down once that copy is gone (:meth:`_retry_deferred`)."""
        plan = mgr.prepare_store(keys)
        if plan is None:
            return
        self._deferred[tier.name].update(dict.fromkeys(plan.deferred))
        if not plan.keys:
            return
        pinned = self.host_manager.pin_for_copy(plan.keys)  # no use: ARC keeps it in T1
        payloads = [self.host.slot(s) for s in pinned.slots]
        job = self.jobs.new_job(plan.keys, "host", tier.name)
        self._submit(
            job.job_id,
            _Pending(_Kind.CASCADE, tier.name, plan.keys),
            job,
            _writer(tier, plan.slots, plan.keys, payloads),
        )

    def _retry_deferred(self) -> None:
        """Write down the deferred keys whose doomed lower-tier copy has been dropped (its last
        reader unpinned) while host still holds a good copy; forget those host lost."""
        for tier, mgr in self.lower:
            waiting = self._deferred[tier.name]
            gone = [k for k in waiting if mgr.status(k) is SlotStatus.EMPTY]
            if not gone:
                continue
            for key in gone:
                del waiting[key]
            ready = [k for k in gone if self.host_manager.is_hit(k)]
            if ready:
                self._write_down(tier, mgr, ready)

    # -- load ------------------------------------------------------------------------------
    def _source(self, key: ChunkKey) -> str | None:
        host = self.host_manager
        st = host.status(key)
        if st in (SlotStatus.READY, SlotStatus.LOADING):
            return "host" if host.is_hit(key) else None
        if st is not SlotStatus.EMPTY:
            return None  # a host store is in flight: not loadable yet
        for tier, mgr in self.lower:
            if mgr.is_hit(key):
                return tier.name
        return None

    def load(self, keys: Sequence[ChunkKey], block_ids: BlockIds) -> LoadTicket | None:
        """Load the longest loadable prefix of ``keys`` into ``block_ids`` (chunk-major).

        Returns the ticket (its ``keys`` may be a prefix of ``keys``) or ``None`` when the first
        key is not loadable. Completion arrives as a :class:`LoadDone` from :meth:`poll`.
        """
        ks = check_chunk_keys(keys)
        ids = self._blocks(block_ids, len(ks))
        sources: list[str] = []
        for key in ks:
            src = self._source(key)
            if src is None:
                break
            sources.append(src)
        run = ks[: len(sources)]
        host_keys = [k for k, s in zip(run, sources, strict=True) if s == "host"]
        self.host_manager.prepare_load(host_keys)
        promote = [k for k, s in zip(run, sources, strict=True) if s != "host"]
        if promote and self.host_manager.prepare_store(promote, bypass_admission=True) is None:
            # No host room to promote into: load only the host-resident part before the first
            # chunk that needed promotion, and unpin the host chunks after it.
            cut = next(i for i, s in enumerate(sources) if s != "host")
            after = set(run[cut:])
            self.host_manager.complete_load([k for k in host_keys if k in after])
            run, sources, host_keys = run[:cut], sources[:cut], run[:cut]
        if not run:
            return None
        ticket_id = next(self._ticket_ids)
        self._tickets[ticket_id] = _Ticket(tuple(run), {k: ids[i] for i, k in enumerate(run)}, {})
        for tier, mgr in self.lower:
            mine = tuple(k for k, s in zip(run, sources, strict=True) if s == tier.name)
            if mine:
                self._promote(ticket_id, tier, mgr, mine)
        if host_keys:
            self._to_device(ticket_id, host_keys)
        return LoadTicket(ticket_id, tuple(run), tuple(sources))

    def _promote(
        self, ticket: int, tier: Tier, mgr: OffloadManager, keys: tuple[ChunkKey, ...]
    ) -> None:
        src = mgr.prepare_load(keys)
        outs = [self.host.slot(self._host_slot(k)) for k in keys]
        job = self.jobs.new_job(keys, tier.name, "host")

        def work() -> list[bool]:
            return [o is ReadOutcome.OK for o in tier.read(src.slots, keys, outs)]

        self._submit(job.job_id, _Pending(_Kind.PROMOTE, tier.name, keys, ticket), job, work)

    def _to_device(self, ticket: int, keys: Sequence[ChunkKey]) -> None:
        """Scatter host-resident, already pinned ``keys`` into the ticket's blocks."""
        host_slots = [self._host_slot(k) for k in keys]
        blocks = np.concatenate([self._tickets[ticket].blocks[k] for k in keys])
        job = self.jobs.new_job(keys, "host", "device")
        copier = self.copier

        def work() -> list[bool]:
            copier.scatter(host_slots, blocks)
            return [True] * len(host_slots)

        self._submit(job.job_id, _Pending(_Kind.LOAD, "host", tuple(keys), ticket), job, work)

    def _host_slot(self, key: ChunkKey) -> SlotId:
        slot = self.host_manager.table.slot_of(key)
        if slot is None:  # pragma: no cover - callers pin or reserve the key first
            raise IllegalTransitionError(f"chunk {key.hex()} holds no host slot")
        return slot

    # -- completion ------------------------------------------------------------------------
    def _submit(self, job_id: JobId, pending: _Pending, job: TransferJob, work: Work) -> None:
        self._pending[job_id] = pending
        self.jobs.submit(job, work, self.host.chunk_bytes)

    def _apply(self, result: JobResult) -> list[Event]:
        p = self._pending.pop(result.job.job_id)
        ok = result.ok
        if p.kind is _Kind.STORE:
            self.fence.release(result.job.job_id)
            self.host_manager.complete_store(p.keys, ok)
            self._cascade([k for k, f in zip(p.keys, ok, strict=True) if f])
            return [StoreDone(result.job.job_id, p.keys, ok)]
        if p.kind is _Kind.CASCADE:
            self._by_name[p.tier][1].complete_store(p.keys, ok)
            self.host_manager.complete_load(p.keys)
            return [CascadeDone(result.job.job_id, p.tier, p.keys, ok)]
        ticket = self._tickets[p.ticket]
        if p.kind is _Kind.PROMOTE:
            self._by_name[p.tier][1].complete_load(p.keys, ok)
            self.host_manager.complete_store(p.keys, ok)
            good = [k for k, f in zip(p.keys, ok, strict=True) if f]
            ticket.ok.update((k, False) for k, f in zip(p.keys, ok, strict=True) if not f)
            if good:  # the load was the access (counted in the lower tier); insert is enough
                self.host_manager.pin_for_copy(good)
                self._to_device(p.ticket, good)
        else:
            self.host_manager.complete_load(p.keys)
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
            self._retry_deferred()
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
        """Drain, stop the workers and close the lower tiers."""
        try:
            self.drain()
        finally:
            self.jobs.close()
            self.copier.close()
            for tier, _mgr in self.lower:
                tier.close()

    def check_integrity(self) -> None:
        """Every manager's invariants; when idle, no pins, stores, fences or tickets remain."""
        for mgr in self.managers():
            mgr.check_integrity()
        if self.jobs.in_flight:
            return
        for mgr in self.managers():
            busy = mgr.table.keys_in(SlotStatus.STORING, SlotStatus.LOADING)
            if busy:
                raise IllegalTransitionError(
                    f"tier {mgr.tier!r}: {len(busy)} chunks busy while idle"
                )
        if len(self.fence) or self._tickets or self._pending:
            raise IllegalTransitionError("idle cascade still holds fences, tickets or jobs")


def _writer(
    tier: Tier, slots: Sequence[SlotId], keys: Sequence[ChunkKey], payloads: list[torch.Tensor]
) -> Work:
    def work() -> list[bool]:
        tier.write(slots, keys, payloads)
        return [True] * len(keys)

    return work


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

    The cascade owns the lower tiers from here on (:meth:`TierCascade.close` closes them); if
    building fails (e.g. a re-index cannot reach Redis) they are closed before the error
    propagates.
    """
    chunk_bytes = blocks_per_chunk * layout.bytes_per_block
    host = HostTier(config.host_slots, chunk_bytes, pin_memory=config.pin_memory)
    copier = ChunkCopier(layout, device_pool, host, blocks_per_chunk, config.staging_blocks)

    def manager(name: str, slots: int) -> OffloadManager:
        admission = AdmissionFilter(config.admission_min_lookups)
        return OffloadManager(name, slots, config.policy, admission, metrics)

    tiers = (
        list(lower)
        if lower is not None
        else open_lower_tiers(config, chunk_bytes, layout.fingerprint(), metrics)
    )
    try:
        return TierCascade(
            copier,
            manager("host", config.host_slots),
            [(t, manager(t.name, t.num_slots)) for t in tiers],
            JobRunner(metrics),
            BlockFence(block_pool),
        )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
