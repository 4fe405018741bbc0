"""Scheduler-side bookkeeping of every tier: the tensor-free half of a tier cascade.

Theory of operation
-------------------
:class:`~kvplane.offload.cascade.TierCascade` keeps the managers and moves the bytes on one
owner thread. vLLM splits a connector into a scheduler side and a worker side (possibly two
processes) that talk only in per-step messages, so the connector splits the cascade the same
way: :class:`TierBook` holds one :class:`~kvplane.offload.manager.OffloadManager` per tier and
makes every decision (which chunks are hits, which slots a store or load uses, what a lower
tier admits); the worker side moves bytes exactly as told and reports per-chunk results, which
:class:`TierBook` applies. The slot protocol is the cascade's:

- store: host slots STORING (``prepare_store``), and at the same time slots STORING in every
  lower tier that admits the chunks (write-through: the worker writes them down right after its
  gather, without another scheduler round trip). When the gather is reported, host chunks are
  published (or freed) and, for each pending lower-tier write, pinned (LOADING) until that
  write is reported; a chunk whose gather failed is never written down.
- load: the longest prefix of chunks some tier holds READY. Host hits are pinned; chunks only
  found lower get a host slot (promotion, past admission) and a pinned lower-tier source. The
  report publishes promoted chunks in host (or frees them), unpins everything, and dooms chunks
  that read back corrupt so they are never served again.

Every method validates before it changes anything; the methods that answer questions
(:meth:`TierBook.source`, :meth:`TierBook.pending`) change nothing (not even admission counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey, SlotId
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.messages import Promotion, TierIndex, TierWrite
from kvplane.metrics import MetricsRegistry
from kvplane.offload.admission import AdmissionFilter
from kvplane.offload.manager import OffloadManager, lookup_tiers
from kvplane.offload.slots import SlotStatus, check_chunk_keys


@dataclass(frozen=True, slots=True)
class StoreReservation:
    """Slots reserved for a store: host ``slots[i]`` for ``keys[i]``, plus lower-tier writes.

    ``deferred``: asked keys whose host copy is doomed (read back bad, other readers still pin
    it) and so not stored now; they are storable once those readers are done, so the caller
    should offer them again later (the scheduler does on the request's next step).
    """

    keys: tuple[ChunkKey, ...]
    slots: tuple[int, ...]
    writes: tuple[TierWrite, ...]
    deferred: tuple[ChunkKey, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadReservation:
    """Pinned/reserved slots for loading ``keys`` (a prefix of what was asked)."""

    keys: tuple[ChunkKey, ...]
    host_slots: tuple[int, ...]
    promotions: tuple[Promotion, ...]


class TierBook:
    """Managers of the host tier and of each lower tier the configuration enables."""

    def __init__(self, config: ConnectorConfig, metrics: MetricsRegistry | None = None) -> None:
        def manager(name: str) -> OffloadManager:
            admission = AdmissionFilter(config.offload.admission_min_lookups)
            return OffloadManager(
                name, config.tier_slots(name), config.offload.policy, admission, metrics
            )

        self.host = manager("host")
        self.lower: dict[str, OffloadManager] = {n: manager(n) for n in config.lower_tiers}

    def managers(self) -> list[OffloadManager]:
        return [self.host, *self.lower.values()]

    def adopt(self, index: TierIndex) -> None:
        """Take the worker's re-index of the lower tiers (chunks that survived a restart)."""
        for name, mgr in self.lower.items():
            found = index.found(name)
            bad = [s for s in found.values() if not 0 <= s < mgr.num_slots]
            if bad:
                raise InvalidArgumentError(
                    f"tier {name!r} re-index names slots {bad[:4]} outside 0..{mgr.num_slots - 1}"
                )
            mgr.adopt({key: SlotId(slot) for key, slot in found.items()})

    # -- questions (no side effects) -----------------------------------------------------------
    def source(self, key: ChunkKey) -> str | None:
        """The fastest tier a load of ``key`` can read now, or ``None``."""
        st = self.host.status(key)
        if st in (SlotStatus.READY, SlotStatus.LOADING):
            return "host" if self.host.is_hit(key) else None
        if st is not SlotStatus.EMPTY:
            return None
        for name, mgr in self.lower.items():
            if mgr.is_hit(key):
                return name
        return None

    def promotion_room(self) -> int:
        """Host slots a load could promote into now: free ones plus READY (unpinned) chunks it
        may evict. A load's own host hits are pinned before it evicts, so each READY one of
        them takes one off this room (see :meth:`reserve_load`)."""
        table = self.host.table
        return table.num_free + len(table.keys_in(SlotStatus.READY))

    def is_ready_in_host(self, key: ChunkKey) -> bool:
        """True when host holds ``key`` READY (unpinned)."""
        return self.host.status(key) is SlotStatus.READY

    def pending(self, key: ChunkKey) -> bool:
        """True while a store of ``key`` into host is in flight (a hit soon, not yet)."""
        return self.host.status(key) is SlotStatus.STORING

    # -- admission -----------------------------------------------------------------------------
    def record_lookup(self, keys: Sequence[ChunkKey]) -> None:
        """Count one lookup of ``keys`` in every tier (admission and hit metrics); each key of
        the leading hit run is an access only in the fastest tier holding it
        (:func:`~kvplane.offload.manager.lookup_tiers`, as the cascade counts)."""
        lookup_tiers(self.managers(), keys)

    # -- stores --------------------------------------------------------------------------------
    def reserve_store(self, keys: Sequence[ChunkKey]) -> StoreReservation | None:
        """Reserve host slots for the keys host does not hold yet, and lower-tier slots for
        those each lower tier admits and lacks. ``None`` when host has no room (nothing
        changed); an empty reservation when host holds or refuses them all. Keys whose host
        copy is doomed come back as ``deferred`` (see :class:`StoreReservation`)."""
        ks = check_chunk_keys(keys)
        plan = self.host.prepare_store(ks)
        if plan is None:
            return None
        writes: list[TierWrite] = []
        if plan.keys:
            pos = {k: i for i, k in enumerate(plan.keys)}
            for name, mgr in self.lower.items():
                down = mgr.prepare_store(plan.keys)
                if down is not None and down.keys:
                    writes.append(
                        TierWrite(name, tuple(pos[k] for k in down.keys), tuple(down.slots))
                    )
        return StoreReservation(tuple(plan.keys), tuple(plan.slots), tuple(writes), plan.deferred)

    def gathered(
        self, keys: Sequence[ChunkKey], writes: Sequence[TierWrite], ok: Sequence[bool]
    ) -> None:
        """A store's gather finished: publish or free host slots; pin the published chunks
        once per lower-tier write still to come."""
        ks = check_chunk_keys(keys)
        _check_flags(ok, len(ks))
        self.host.complete_store(ks, list(ok))
        for write in writes:
            good = [ks[i] for i in write.indices if ok[i]]
            if good:  # the write-through's own pin is no use of the chunk (ARC keeps it in T1)
                self.host.pin_for_copy(good)

    def written(
        self,
        keys: Sequence[ChunkKey],
        write: TierWrite,
        gather_ok: Sequence[bool],
        ok: Sequence[bool],
    ) -> None:
        """Lower-tier write ``write`` of a store finished: publish or free its tier slots and
        unpin the host copies that :meth:`gathered` pinned for it."""
        ks = check_chunk_keys(keys)
        mine = [ks[i] for i in write.indices]
        _check_flags(ok, len(mine))
        mgr = self._tier(write.tier)
        flags = [bool(f) and bool(gather_ok[i]) for f, i in zip(ok, write.indices, strict=True)]
        mgr.complete_store(mine, flags)
        pinned = [ks[i] for i in write.indices if gather_ok[i]]
        if pinned:
            self.host.complete_load(pinned)

    # -- loads ---------------------------------------------------------------------------------
    def reserve_load(self, keys: Sequence[ChunkKey]) -> LoadReservation:
        """Pin (host) or reserve and pin (promotion) the longest loadable prefix of ``keys``."""
        ks = check_chunk_keys(keys)
        sources: list[str] = []
        for key in ks:
            src = self.source(key)
            if src is None:
                break
            sources.append(src)
        run = ks[: len(sources)]
        # Pin host hits first: the promotion's eviction below must not pick one of them.
        host_keys = [k for k, s in zip(run, sources, strict=True) if s == "host"]
        self.host.prepare_load(host_keys)
        promote = [k for k, s in zip(run, sources, strict=True) if s != "host"]
        if promote and self.host.prepare_store(promote, bypass_admission=True) is None:
            # No host room to promote into: keep the host-resident part before the first
            # chunk that needed promotion and unpin the host hits after it.
            cut = next(i for i, s in enumerate(sources) if s != "host")
            after = set(run[cut:])
            self.host.complete_load([k for k in host_keys if k in after])
            run, sources = run[:cut], sources[:cut]
        promotions: list[Promotion] = []
        for name, mgr in self.lower.items():
            mine = [i for i, s in enumerate(sources) if s == name]
            if mine:
                plan = mgr.prepare_load([run[i] for i in mine])
                promotions += [
                    Promotion(i, name, int(slot)) for i, slot in zip(mine, plan.slots, strict=True)
                ]
        slots = tuple(int(self._host_slot(k)) for k in run)
        promotions.sort(key=lambda p: p.index)
        return LoadReservation(tuple(run), slots, tuple(promotions))

    def loaded(
        self, keys: Sequence[ChunkKey], promotions: Sequence[Promotion], ok: Sequence[bool]
    ) -> None:
        """A load finished; ``ok[i]``: chunk ``i``'s bytes were valid. Publishes or frees the
        promoted host copies, unpins everything, dooms the sources that read back bad."""
        ks = check_chunk_keys(keys)
        _check_flags(ok, len(ks))
        promoted = {p.index: p for p in promotions}
        host_keys = [k for i, k in enumerate(ks) if i not in promoted]
        host_ok = [bool(ok[i]) for i in range(len(ks)) if i not in promoted]
        if host_keys:
            self.host.complete_load(host_keys, host_ok)
        for name, mgr in self.lower.items():
            mine = [p.index for p in promotions if p.tier == name]
            if mine:
                flags = [bool(ok[i]) for i in mine]
                mgr.complete_load([ks[i] for i in mine], flags)
                self.host.complete_store([ks[i] for i in mine], flags)

    # -- helpers -------------------------------------------------------------------------------
    def _tier(self, name: str) -> OffloadManager:
        mgr = self.lower.get(name)
        if mgr is None:
            raise InvalidArgumentError(f"no lower tier named {name!r}; have {list(self.lower)}")
        return mgr

    def _host_slot(self, key: ChunkKey) -> SlotId:
        slot = self.host.table.slot_of(key)
        if slot is None:  # pragma: no cover - reserve_load pins or reserves every key first
            raise InvalidArgumentError(f"chunk {key.hex()} holds no host slot")
        return slot

    def check_integrity(self, idle: bool) -> None:
        """Every manager's invariants; when ``idle`` (no job in flight) no slot is busy."""
        for mgr in self.managers():
            mgr.check_integrity()
            if idle:
                busy = mgr.table.keys_in(SlotStatus.STORING, SlotStatus.LOADING)
                if busy:
                    raise InvalidArgumentError(
                        f"tier {mgr.tier!r}: {len(busy)} chunk(s) busy with no job in flight"
                    )


def _check_flags(ok: Sequence[bool], n: int) -> None:
    if len(ok) != n:
        raise InvalidArgumentError(f"expected {n} ok flags, got {len(ok)}")
