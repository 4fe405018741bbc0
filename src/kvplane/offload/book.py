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

from kvplane.errors import ConfigError, IllegalTransitionError, InvalidArgumentError
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
from kvplane.offload.discovery import adopt_held, ask_keys
from kvplane.offload.manager import CascadeLookup, OffloadManager
from kvplane.offload.slots import SlotStatus, check_chunk_keys
from kvplane.offload.spans import check_span, cover, groups, lookup_spans
from kvplane.validators import require_int


def tier_manager(
    config: OffloadConfig, name: str, slots: int, metrics: MetricsRegistry | None = None
) -> OffloadManager:
    """The manager of tier ``name`` with ``slots`` slots: the configured policy and admission."""
    admission = AdmissionFilter(config.admission_min_lookups)
    return OffloadManager(name, slots, config.policy, admission, metrics)


class TierBook:
    """Managers of the host tier and of each lower tier, and the cascade's decisions.

    ``spans`` (default 1 each): host chunks per chunk of each lower tier
    (:mod:`~kvplane.offload.spans`). A lower tier of span > 1 is keyed by tier keys; the book
    re-chunks in its reservations: a write-down writes whole groups of host chunks, a
    promotion reads one tier chunk into its host chunks. Keys passed to :meth:`lookup`,
    :meth:`loadable` and :meth:`reserve_load` start at their sequence's first chunk.
    ``shared``: the lower tier that is a store other engines write to as well (asked before a
    lookup: :meth:`to_discover`), or ``None``.
    """

    def __init__(
        self,
        host: OffloadManager,
        lower: Sequence[OffloadManager] = (),
        spans: Mapping[str, int] | None = None,
        *,
        shared: str | None = None,
    ) -> None:
        names = [mgr.tier for mgr in lower]
        if "host" in names or len(set(names)) != len(names):
            raise InvalidArgumentError(f"lower tiers need distinct names but 'host', got {names}")
        if shared is not None and shared not in names:
            raise InvalidArgumentError(f"shared tier {shared!r} is none of the lower {names}")
        self.shared = shared
        given = dict(spans or {})
        if set(given) - set(names):
            raise InvalidArgumentError(f"spans name tiers {sorted(given)} beyond {names}")
        self.spans = {name: check_span(given.get(name, 1)) for name in names}
        self.host = host
        self.lower: dict[str, OffloadManager] = {mgr.tier: mgr for mgr in lower}
        # per lower tier, tier keys whose write-down waits for a doomed copy there to be
        # dropped, with the host keys that make each
        self._deferred: dict[str, dict[ChunkKey, tuple[ChunkKey, ...]]] = {
            name: {} for name in self.lower
        }
        # host key of a promotion in flight -> (its tier, the tier key it is read from)
        self._promoting: dict[ChunkKey, tuple[str, ChunkKey]] = {}

    @classmethod
    def build(
        cls,
        config: OffloadConfig,
        lower: Sequence[tuple[str, int]] = (),
        metrics: MetricsRegistry | None = None,
        spans: Mapping[str, int] | None = None,
    ) -> TierBook:
        """A host manager of ``config.host_slots`` and one per ``(name, slots)`` of ``lower``.

        Without ``spans`` every tier moves the host's chunk size, and a config that sets a
        per-tier size is refused (``ConfigError``): that executor cannot re-chunk."""
        if spans is None and (config.disk_blocks_per_chunk or config.remote_blocks_per_chunk):
            raise ConfigError(
                "disk_blocks_per_chunk/remote_blocks_per_chunk need an executor that re-chunks "
                "(the tier cascade); this one moves one chunk size: leave them 0"
            )
        host = tier_manager(config, "host", config.host_slots, metrics)
        return cls(host, [tier_manager(config, n, s, metrics) for n, s in lower], spans)

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
        """The fastest tier a load of ``key`` alone can read now (a lower tier of span > 1
        never: one key makes no group of it), or ``None`` (a host store of it in flight makes
        it not loadable yet). :meth:`sources` answers for a prefix."""
        return self.sources([key])[0]

    def sources(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        """Per key of ``keys`` (host chunks from a sequence's start), the fastest tier a load
        could read it from now, or ``None``."""
        return [None if w is None else w[0] for w in self._where(check_chunk_keys(keys))]

    def _where(self, ks: Sequence[ChunkKey]) -> list[tuple[str, ChunkKey] | None]:
        """Per key, ``(tier, key in that tier)`` of the fastest readable copy, or ``None``."""
        covers = {name: cover(ks, self.spans[name]) for name in self.lower}
        out: list[tuple[str, ChunkKey] | None] = []
        for i, key in enumerate(ks):
            st = self.host.status(key)
            if st in (SlotStatus.READY, SlotStatus.LOADING):
                out.append(("host", key) if self.host.is_hit(key) else None)
                continue
            found: tuple[str, ChunkKey] | None = None
            if st is SlotStatus.EMPTY:
                for name, mgr in self.lower.items():
                    tier_key = covers[name][i]
                    if tier_key is not None and mgr.is_hit(tier_key):
                        found = (name, tier_key)
                        break
            out.append(found)
        return out

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
        for key, src in zip(keys, self.sources(keys), strict=True):
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

    # -- discovery in a shared store --------------------------------------------------------------
    def to_discover(self, keys: Sequence[ChunkKey]) -> tuple[ChunkKey, ...]:
        """The shared tier's keys an executor should ask the store about (one batch) before
        :meth:`lookup` of ``keys``: those of the chunks past the last one some tier serves
        (:func:`~kvplane.offload.discovery.ask_keys`); empty without a shared tier. Changes
        nothing."""
        if self.shared is None:
            return ()
        ks = check_chunk_keys(keys)
        where = self._where(ks)
        return ask_keys(self.host, self.lower[self.shared], self.spans[self.shared], ks, where)

    def discovered(self, asked: Sequence[ChunkKey], held: Sequence[bool]) -> tuple[ChunkKey, ...]:
        """The store's answer to :meth:`to_discover`'s ``asked``: adopt the leading run it
        holds into the shared tier's manager (:func:`~kvplane.offload.discovery.adopt_held`),
        so the lookup that follows finds them there; returns the adopted keys."""
        if self.shared is None:
            raise IllegalTransitionError("discovered: this book has no shared tier")
        return adopt_held(self.lower[self.shared], asked, held)

    # -- admission -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> CascadeLookup:
        """Ask every tier (each counts the lookup toward its admission filter); each key of the
        leading hit run is an access only in ``where[i]``, the tier a load reads it from
        (:func:`~kvplane.offload.spans.lookup_spans`; a lower tier of span > 1 is asked about
        the tier keys of the whole groups ``keys`` make)."""
        lower = [(mgr, self.spans[name]) for name, mgr in self.lower.items()]
        return lookup_spans(self.host, lower, keys)

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
        if write_through and any(span > 1 for span in self.spans.values()):
            raise InvalidArgumentError("write-through stores need every lower tier at span 1")
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
            good = [ks[i] for j in range(len(write.indices)) for i in write.members(j) if ok[i]]
            if good:  # the write-through's own pin is no use of the chunk (ARC keeps it in T1)
                self.host.pin_for_copy(good)

    def write_down(
        self,
        keys: Sequence[ChunkKey],
        *,
        first: int = 0,
        fresh: Sequence[ChunkKey] | None = None,
    ) -> WriteDown:
        """Reserve ``keys`` (``keys[i]`` is host chunk ``first + i`` of its sequence) in every
        lower tier that admits and lacks them, pinning host once per write (no access).

        Only chunks that hold a ``fresh`` key (default: every key; each must be a published
        host chunk) are written: at span 1 the fresh keys, at span ``r`` each whole group of
        ``keys`` with a fresh member whose ``r`` host chunks host all holds. A chunk whose copy
        in a tier is doomed is remembered for :meth:`retry_deferred`."""
        ks = check_chunk_keys(keys)
        require_int("first", first, min=0)
        new = set(ks if fresh is None else check_chunk_keys(fresh))
        lost = [k for k in new if not self.host.is_hit(k)]
        if lost or not new <= set(ks):
            bad = lost[0] if lost else next(iter(new - set(ks)))
            raise IllegalTransitionError(
                f"cannot write down chunk {bad.hex()}: host holds no good copy of it among keys"
            )
        return self._write_down(ks, self.lower, first, new)

    def retry_deferred(self) -> tuple[WriteDown, ...]:
        """Write-downs of deferred keys whose doomed lower-tier copy has been dropped (its last
        reader unpinned) while host still holds a good copy; forgets those host lost."""
        out: list[WriteDown] = []
        for name, mgr in self.lower.items():
            waiting = self._deferred[name]
            gone = [k for k in waiting if mgr.status(k) is SlotStatus.EMPTY]
            for key in gone:
                group = waiting.pop(key)
                if all(self.host.is_hit(k) for k in group):
                    down = self._write_down(group, (name,), 0, set(group))
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
        units = [write.members(j) for j in range(len(write.indices))]
        if any(m.start < 0 or m.stop > len(ks) for m in units):
            raise InvalidArgumentError(f"write {write} reaches past its {len(ks)} keys")
        mine = [ks[m[-1]] for m in units]
        _check_flags(ok, len(mine))
        mgr = self._tier(write.tier)
        flags = [bool(f) and all(gather_ok[i] for i in m) for f, m in zip(ok, units, strict=True)]
        mgr.complete_store(mine, flags)
        pinned = [ks[i] for m in units for i in m if gather_ok[i]]
        if pinned:
            self.host.complete_load(pinned)

    # -- loads ---------------------------------------------------------------------------------
    def reserve_load(self, keys: Sequence[ChunkKey], limit: int | None = None) -> LoadReservation:
        """Pin (host) or reserve and pin (promotion) the longest loadable prefix of ``keys``,
        at most ``limit`` chunks (keys past it still name the larger tier chunks that cover
        the prefix); its ``keys`` are empty when the first key is not loadable."""
        ks = check_chunk_keys(keys)
        cap = len(ks) if limit is None else require_int("limit", limit, min=0)
        where: list[tuple[str, ChunkKey]] = []
        for found in self._where(ks)[:cap]:
            if found is None:
                break
            where.append(found)
        sources = [name for name, _k in where]
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
                promotions += self._pin_sources(name, mgr, run, [(i, where[i][1]) for i in mine])
        slots = tuple(self.host_slot(k) for k in run)
        promotions.sort(key=lambda p: p.index)
        return LoadReservation(tuple(run), slots, tuple(promotions))

    def _pin_sources(
        self,
        name: str,
        mgr: OffloadManager,
        run: Sequence[ChunkKey],
        pieces: Sequence[tuple[int, ChunkKey]],
    ) -> list[Promotion]:
        """Pin each tier chunk that ``pieces`` (run position, tier key) read: one load (an
        access) per tier chunk, one more pin per further piece of it, so each piece unpins
        on its own in :meth:`promoted`."""
        tier_keys = list(dict.fromkeys(k for _i, k in pieces))
        slots = dict(zip(tier_keys, mgr.prepare_load(tier_keys).slots, strict=True))
        seen: set[ChunkKey] = set()
        span, out = self.spans[name], []
        for i, tier_key in pieces:
            if tier_key in seen:
                mgr.pin_for_copy([tier_key])
            seen.add(tier_key)
            self._promoting[run[i]] = (name, tier_key)
            if span == 1:
                out.append(Promotion(i, name, int(slots[tier_key])))
            else:
                out.append(Promotion(i, name, int(slots[tier_key]), tier_key, i % span))
        return out

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
        src = [self._promoting.get(k) for k in ks]
        stray = [k for k, e in zip(ks, src, strict=True) if e is None or e[0] != tier]
        if stray:
            raise IllegalTransitionError(f"chunk {stray[0].hex()} is no promotion from {tier!r}")
        left = [(e[1], f) for e, f in zip(src, flags, strict=True) if e is not None]
        while left:  # one unpin per piece; a tier chunk with several pieces goes round again
            batch: dict[ChunkKey, bool] = {}
            rest: list[tuple[ChunkKey, bool]] = []
            for tier_key, f in left:
                if tier_key in batch:
                    rest.append((tier_key, f))
                else:
                    batch[tier_key] = f
            mgr.complete_load(list(batch), list(batch.values()))
            left = rest
        for k in ks:
            del self._promoting[k]
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
        self,
        keys: Sequence[ChunkKey],
        tiers: Iterable[str],
        remember: bool,
        first: int = 0,
        fresh: set[ChunkKey] | None = None,
    ) -> tuple[TierWrite, ...]:
        """Reserve, per tier of ``tiers``, its chunks of ``keys`` (see :meth:`write_down`)."""
        writes: list[TierWrite] = []
        for name in tiers if keys else ():
            span = self.spans[name]
            units = [
                (i, k)
                for i, k in (enumerate(keys) if span == 1 else groups(keys, span, first))
                if (fresh is None or not fresh.isdisjoint(keys[i : i + span]))
                and (span == 1 or all(self.host.is_hit(m) for m in keys[i : i + span]))
            ]
            pos = {k: i for i, k in units}
            plan = self.lower[name].prepare_store([k for _i, k in units]) if units else None
            if plan is None:
                continue
            if remember:
                self._deferred[name].update(
                    {k: tuple(keys[pos[k] : pos[k] + span]) for k in plan.deferred}
                )
            if plan.keys:
                writes.append(TierWrite(name, tuple(pos[k] for k in plan.keys), plan.slots, span))
        return tuple(writes)

    def _write_down(
        self, keys: Sequence[ChunkKey], tiers: Iterable[str], first: int, fresh: set[ChunkKey]
    ) -> WriteDown:
        writes = self._reserve_writes(keys, tiers, True, first, fresh)
        for write in writes:  # a write-down pin is no use of the chunk (ARC keeps it in T1)
            pins = [keys[i] for j in range(len(write.indices)) for i in write.members(j)]
            self.host.pin_for_copy(pins)
        return WriteDown(tuple(keys), writes)

    def _tier(self, name: str) -> OffloadManager:
        mgr = self.lower.get(name)
        if mgr is None:
            raise InvalidArgumentError(f"no lower tier named {name!r}; have {list(self.lower)}")
        return mgr

    def check_integrity(self, idle: bool) -> None:
        """Every manager's invariants; when ``idle`` (no job in flight) no slot is busy and no
        promotion is in flight."""
        if idle and self._promoting:
            raise IllegalTransitionError(f"{len(self._promoting)} promotion(s) with no job")
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
