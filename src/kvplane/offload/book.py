"""The tier book: every decision of a tier cascade, with no tensors and no I/O.

:class:`TierBook` owns one :class:`~kvplane.offload.manager.OffloadManager` per tier (host, then
the lower tiers fastest first) and decides hits, store and load slots, admission, promotions,
where a load is cut and when a deferred write-down may go, answering in plain data
(:mod:`~kvplane.offload.book_types`). Executors move exactly what it reserved and report
per-chunk results back: :class:`~kvplane.offload.cascade.TierCascade` in one process, the vLLM
connector's worker side across processes. It never touches bytes, tiers or jobs. The slot
protocol: ``docs/offload.md`` ("The tier book"). Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvplane.errors import IllegalTransitionError, InvalidArgumentError
from kvplane.ids import ChunkKey, SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.admission import AdmissionFilter
from kvplane.offload.book_types import (
    LoadReservation,
    Promotion,
    StoreReservation,
    TierIndex,
    TierWrite,
    WriteDown,
)
from kvplane.offload.config import OffloadConfig
from kvplane.offload.manager import CascadeLookup, OffloadManager, lookup_tiers
from kvplane.offload.slots import SlotStatus, check_chunk_keys


def tier_manager(
    config: OffloadConfig, name: str, slots: int, metrics: MetricsRegistry | None = None
) -> OffloadManager:
    """The manager of tier ``name`` with ``slots`` slots: the configured policy and admission."""
    admission = AdmissionFilter(config.admission_min_lookups)
    return OffloadManager(name, slots, config.policy, admission, metrics)


class TierBook:
    """Managers of the host tier and of each lower tier, and the cascade's decisions."""

    def __init__(self, host: OffloadManager, lower: Sequence[OffloadManager] = ()) -> None:
        names = [mgr.tier for mgr in lower]
        if "host" in names or len(set(names)) != len(names):
            raise InvalidArgumentError(f"lower tiers need distinct names but 'host', got {names}")
        self.host = host
        self.lower: dict[str, OffloadManager] = {mgr.tier: mgr for mgr in lower}
        # per lower tier, keys whose write-down waits for a doomed copy there to be dropped
        self._deferred: dict[str, dict[ChunkKey, None]] = {name: {} for name in self.lower}

    @classmethod
    def build(
        cls,
        config: OffloadConfig,
        lower: Sequence[tuple[str, int]] = (),
        metrics: MetricsRegistry | None = None,
    ) -> TierBook:
        """A host manager of ``config.host_slots`` and one per ``(name, slots)`` of ``lower``."""
        host = tier_manager(config, "host", config.host_slots, metrics)
        return cls(host, [tier_manager(config, n, s, metrics) for n, s in lower])

    def managers(self) -> list[OffloadManager]:
        return [self.host, *self.lower.values()]

    def adopt(self, tier: str, found: Mapping[ChunkKey, int]) -> None:
        """Take a re-index of lower tier ``tier`` (``{key: slot}`` that survived a restart)."""
        mgr = self._tier(tier)
        bad = [s for s in found.values() if not 0 <= s < mgr.num_slots]
        if bad:
            raise InvalidArgumentError(
                f"tier {tier!r} re-index names slots {bad[:4]} outside 0..{mgr.num_slots - 1}"
            )
        mgr.adopt({key: SlotId(slot) for key, slot in found.items()})

    def adopt_index(self, index: TierIndex) -> None:
        """Take a handshake's re-index of every lower tier (tiers it does not name hold none)."""
        for name in self.lower:
            self.adopt(name, index.found(name))

    # -- questions (no side effects) -----------------------------------------------------------
    def source(self, key: ChunkKey) -> str | None:
        """The fastest tier a load of ``key`` can read now, or ``None`` (a host store of it in
        flight makes it not loadable yet)."""
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
        them takes one off this room (see :meth:`loadable`)."""
        table = self.host.table
        return table.num_free + len(table.keys_in(SlotStatus.READY))

    def loadable(self, keys: Sequence[ChunkKey]) -> int | None:
        """Leading chunks of ``keys`` a load could take now; ``None``: "ask again" (the first
        chunk no tier holds is being stored into host).

        The run stops at the first chunk no tier holds, and before the first lower-tier chunk
        host has no room to promote into now (:meth:`promotion_room` less the run's own READY
        host hits), so a reservation made right after keeps the promise. A host too small for
        the run is not "ask again": it may never have the room, so the shorter run is final.
        """
        host = self.host
        run = promoted = pinned = 0
        room: int | None = None
        for key in keys:
            src = self.source(key)
            if src is None:
                if host.status(key) is SlotStatus.STORING:
                    return None
                break
            if src == "host":
                pinned += int(host.status(key) is SlotStatus.READY)
            else:
                room = self.promotion_room() if room is None else room
                promoted += 1
            if promoted and room is not None and promoted + pinned > room:
                break
            run += 1
        return run

    def host_slot(self, key: ChunkKey) -> SlotId:
        """The host slot ``key`` holds (pinned or reserved by a reservation)."""
        slot = self.host.table.slot_of(key)
        if slot is None:
            raise IllegalTransitionError(f"chunk {key.hex()} holds no host slot")
        return slot

    # -- admission -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> CascadeLookup:
        """Ask every tier (each counts the lookup toward its admission filter); each key of the
        leading hit run is an access only in ``where[i]``, the tier a load reads it from
        (:func:`~kvplane.offload.manager.lookup_tiers`)."""
        return lookup_tiers(self.managers(), keys)

    # -- stores --------------------------------------------------------------------------------
    def reserve_store(
        self, keys: Sequence[ChunkKey], *, write_through: bool
    ) -> StoreReservation | None:
        """Reserve host slots for the keys host does not hold yet; ``None`` when host has no
        room (nothing changed), an empty reservation when it holds or refuses them all. Keys
        whose host copy is doomed come back ``deferred``.

        ``write_through``: also reserve, in every lower tier, the reserved keys it admits and
        lacks (the reservation's ``writes``; a doomed copy there just drops that write, as no
        later write-down is run for it). Otherwise call :meth:`write_down` after the gather.
        """
        ks = check_chunk_keys(keys)
        plan = self.host.prepare_store(ks)
        if plan is None:
            return None
        writes = self._reserve_writes(plan.keys, self.lower, False) if write_through else ()
        return StoreReservation(plan.keys, plan.slots, writes, plan.deferred)

    def gathered(
        self, keys: Sequence[ChunkKey], writes: Sequence[TierWrite], ok: Sequence[bool]
    ) -> None:
        """A store's gather finished: publish or free host slots; pin the published chunks
        once per write-through write still to come."""
        ks = check_chunk_keys(keys)
        _check_flags(ok, len(ks))
        self.host.complete_store(ks, [bool(f) for f in ok])
        for write in writes:
            good = [ks[i] for i in write.indices if ok[i]]
            if good:  # the write-through's own pin is no use of the chunk (ARC keeps it in T1)
                self.host.pin_for_copy(good)

    def write_down(self, keys: Sequence[ChunkKey]) -> WriteDown:
        """Reserve the published host ``keys`` in every lower tier that admits and lacks them,
        pinning host once per write (no access). A key whose copy in a tier is doomed is
        remembered for :meth:`retry_deferred`."""
        ks = check_chunk_keys(keys)
        return self._write_down(ks, self.lower)

    def retry_deferred(self) -> tuple[WriteDown, ...]:
        """Write-downs of deferred keys whose doomed lower-tier copy has been dropped (its last
        reader unpinned) while host still holds a good copy; forgets those host lost."""
        out: list[WriteDown] = []
        for name, mgr in self.lower.items():
            waiting = self._deferred[name]
            gone = [k for k in waiting if mgr.status(k) is SlotStatus.EMPTY]
            for key in gone:
                del waiting[key]
            ready = [k for k in gone if self.host.is_hit(k)]
            if ready:
                down = self._write_down(ready, (name,))
                if down.writes:
                    out.append(down)
        return tuple(out)

    def written(
        self,
        keys: Sequence[ChunkKey],
        write: TierWrite,
        gather_ok: Sequence[bool],
        ok: Sequence[bool],
    ) -> None:
        """Write ``write`` of a store or write-down of ``keys`` finished: publish or free its
        tier slots (a chunk whose gather failed is freed) and unpin the host copies pinned
        for it."""
        ks = check_chunk_keys(keys)
        _check_flags(gather_ok, len(ks))
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
        """Pin (host) or reserve and pin (promotion) the longest loadable prefix of ``keys``;
        its ``keys`` are empty when the first key is not loadable."""
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
        slots = tuple(self.host_slot(k) for k in run)
        promotions.sort(key=lambda p: p.index)
        return LoadReservation(tuple(run), slots, tuple(promotions))

    def promoted(
        self, tier: str, keys: Sequence[ChunkKey], ok: Sequence[bool], *, pin: bool
    ) -> tuple[ChunkKey, ...]:
        """Promotions of ``keys`` from ``tier`` finished (``ok[i]``: read back valid): unpin
        the sources (dooming bad ones), publish or free the host copies; returns the good
        keys, pinned again in host when ``pin`` (for a scatter still to come)."""
        mgr = self._tier(tier)
        ks = check_chunk_keys(keys)
        _check_flags(ok, len(ks))
        flags = [bool(f) for f in ok]
        mgr.complete_load(ks, flags)
        self.host.complete_store(ks, flags)
        good = tuple(k for k, f in zip(ks, flags, strict=True) if f)
        if pin and good:  # the load was the access (counted in the lower tier); insert is enough
            self.host.pin_for_copy(good)
        return good

    def scattered(self, keys: Sequence[ChunkKey], ok: bool | Sequence[bool] = True) -> None:
        """Host copies of ``keys`` were read for a load: unpin; a false ``ok`` dooms one."""
        self.host.complete_load(check_chunk_keys(keys), ok)

    def loaded(
        self, keys: Sequence[ChunkKey], promotions: Sequence[Promotion], ok: Sequence[bool]
    ) -> None:
        """A whole reserved load finished at once (promotions and scatter in one job);
        ``ok[i]``: chunk ``i``'s bytes were valid. :meth:`scattered` for the host-sourced
        chunks, then :meth:`promoted` (no pin) per lower tier."""
        ks = check_chunk_keys(keys)
        _check_flags(ok, len(ks))
        promoted = {p.index for p in promotions}
        host_at = [i for i in range(len(ks)) if i not in promoted]
        if host_at:
            self.scattered([ks[i] for i in host_at], [bool(ok[i]) for i in host_at])
        for name in self.lower:
            mine = [p.index for p in promotions if p.tier == name]
            if mine:
                self.promoted(name, [ks[i] for i in mine], [ok[i] for i in mine], pin=False)

    # -- helpers -------------------------------------------------------------------------------
    def _reserve_writes(
        self, keys: Sequence[ChunkKey], tiers: Iterable[str], remember: bool
    ) -> tuple[TierWrite, ...]:
        pos = {k: i for i, k in enumerate(keys)}
        writes: list[TierWrite] = []
        for name in tiers if keys else ():
            plan = self.lower[name].prepare_store(keys)
            if plan is None:
                continue
            if remember:
                self._deferred[name].update(dict.fromkeys(plan.deferred))
            if plan.keys:
                writes.append(TierWrite(name, tuple(pos[k] for k in plan.keys), plan.slots))
        return tuple(writes)

    def _write_down(self, keys: Sequence[ChunkKey], tiers: Iterable[str]) -> WriteDown:
        lost = [k for k in keys if not self.host.is_hit(k)]
        if lost:
            raise IllegalTransitionError(
                f"cannot write down chunk {lost[0].hex()}: host holds no good copy of it"
            )
        writes = self._reserve_writes(keys, tiers, True)
        for write in writes:  # a write-down pin is no use of the chunk (ARC keeps it in T1)
            self.host.pin_for_copy([keys[i] for i in write.indices])
        return WriteDown(tuple(keys), writes)

    def _tier(self, name: str) -> OffloadManager:
        mgr = self.lower.get(name)
        if mgr is None:
            raise InvalidArgumentError(f"no lower tier named {name!r}; have {list(self.lower)}")
        return mgr

    def check_integrity(self, idle: bool) -> None:
        """Every manager's invariants; when ``idle`` (no job in flight) no slot is busy."""
        for mgr in self.managers():
            mgr.check_integrity()
            if idle:
                busy = mgr.table.keys_in(SlotStatus.STORING, SlotStatus.LOADING)
                if busy:
                    raise IllegalTransitionError(
                        f"tier {mgr.tier!r}: {len(busy)} chunk(s) busy with no job in flight"
                    )


def _check_flags(ok: Sequence[bool], n: int) -> None:
    if len(ok) != n:
        raise InvalidArgumentError(f"expected {n} ok flags, got {len(ok)}")
