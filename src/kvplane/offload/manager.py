"""The offload manager: chunk bookkeeping for one tier, with no tensors and no I/O.

Lookup, store and load reservations with atomic eviction and doomed chunks. Every method
validates its whole batch first; only the owner thread calls it. See docs/offload.md.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvplane.errors import IllegalTransitionError, InvalidArgumentError, UnknownChunkError
from kvplane.ids import ChunkKey, SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.admission import AdmissionFilter
from kvplane.offload.policies import EvictionPolicy, make_policy
from kvplane.offload.slots import SlotStatus, SlotTable, check_chunk_keys


class ChunkLookup(enum.Enum):
    """What a tier can say about one chunk key."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Per-key answers in input order; ``hit_run`` leading HITs, ``pending_run`` leading
    HIT-or-HIT_PENDING (what will be a hit once in-flight stores complete)."""

    results: tuple[ChunkLookup, ...]
    hit_run: int
    pending_run: int


@dataclass(frozen=True, slots=True)
class CascadeLookup:
    """``where[i]``: the fastest tier holding key ``i`` READY (``None``: miss); ``pending[i]``:
    a store of it is in flight and no tier has it yet; ``hit_run``: leading hits."""

    where: tuple[str | None, ...]
    pending: tuple[bool, ...]
    hit_run: int


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What :meth:`OffloadManager.prepare_store` reserved: write ``keys[i]`` into ``slots[i]``.

    ``evicted`` (with ``evicted_slots``) were dropped to make room; ``skipped`` were already
    held (any status but doomed); ``rejected`` were refused by the admission filter;
    ``deferred`` are doomed (a bad copy that readers still pin): not stored now, and storable
    again as soon as their last reader has unpinned, so the caller must store them again then
    (:class:`~kvplane.offload.book.TierBook` does so for its write-downs).
    """

    keys: tuple[ChunkKey, ...]
    slots: tuple[SlotId, ...]
    evicted: tuple[ChunkKey, ...] = ()
    evicted_slots: tuple[SlotId, ...] = ()
    skipped: tuple[ChunkKey, ...] = ()
    rejected: tuple[ChunkKey, ...] = ()
    deferred: tuple[ChunkKey, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Pinned chunks: read ``keys[i]`` from ``slots[i]``, then call ``complete_load``."""

    keys: tuple[ChunkKey, ...]
    slots: tuple[SlotId, ...]


class OffloadManager:
    """Bookkeeping of one tier named ``tier`` with ``num_slots`` chunk slots.

    ``policy`` is an :class:`EvictionPolicy` or a registry name (``"lru"``, ``"arc"``);
    ``admission`` defaults to ``AdmissionFilter(1)``. ``metrics`` (injected) receives, labelled
    ``tier``: counters ``kvplane_offload_chunk_queries``, ``..._chunk_hits``,
    ``..._evictions``, ``..._allocation_failures``, ``..._admission_rejects``,
    ``..._dropped_chunks`` and the gauge ``..._slot_usage`` (used / total slots).
    """

    def __init__(
        self,
        tier: str,
        num_slots: int,
        policy: EvictionPolicy | str = "lru",
        admission: AdmissionFilter | None = None,
        metrics: MetricsRegistry | None = None,
    ) -> None:
        self.tier = tier
        self.table = SlotTable(num_slots, tier)
        self.policy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        self.admission = admission if admission is not None else AdmissionFilter(1)
        self._doomed: set[ChunkKey] = set()
        self._metrics = metrics
        if metrics is not None:
            lbl = ("tier",)

            self._m_queries = metrics.counter(
                "offload_chunk_queries", "Chunk keys looked up", lbl
            ).labels(tier=tier)
            self._m_hits = metrics.counter(
                "offload_chunk_hits", "Chunk lookups answered HIT", lbl
            ).labels(tier=tier)
            self._m_evict = metrics.counter(
                "offload_evictions", "Chunks evicted to make room", lbl
            ).labels(tier=tier)
            self._m_fail = metrics.counter(
                "offload_allocation_failures", "prepare_store calls refused for lack of room", lbl
            ).labels(tier=tier)
            self._m_reject = metrics.counter(
                "offload_admission_rejects", "Stores refused by admission", lbl
            ).labels(tier=tier)
            self._m_drop = metrics.counter(
                "offload_dropped_chunks", "Chunks dropped after a bad read", lbl
            ).labels(tier=tier)
            self._m_usage = metrics.gauge(
                "offload_slot_usage", "Used slots / total slots", lbl
            ).labels(tier=tier)

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    def status(self, key: ChunkKey) -> SlotStatus:
        return self.table.status_of(key)

    def is_hit(self, key: ChunkKey) -> bool:
        """True when ``key`` is READY or LOADING and not doomed; counts nothing."""
        st = self.table.status_of(key)
        return (st is SlotStatus.READY or st is SlotStatus.LOADING) and key not in self._doomed

    def lookup(self, keys: Sequence[ChunkKey], *, access: bool = True) -> LookupResult:
        """Per-key MISS/HIT/HIT_PENDING and the leading runs; counts toward admission.

        Each key of the leading HIT run (``keys[:hit_run]``: the usable prefix) is an access
        for the eviction policy, in input order like :meth:`prepare_load`, so a chunk found by
        lookup is recently used; a HIT after the first gap is not (no load of this prefix can
        use it). ``access=False`` counts no access: :func:`~kvplane.offload.spans.lookup_spans`
        asks every tier so, then touches each key only in the tier a load reads it from.
        """
        ks = check_chunk_keys(keys)
        self.admission.record(ks)
        table, doomed = self.table, self._doomed
        out: list[ChunkLookup] = []
        for key in ks:
            st = table.status_of(key)
            if st is SlotStatus.READY or (st is SlotStatus.LOADING and key not in doomed):
                out.append(ChunkLookup.HIT)
            elif st is SlotStatus.STORING:
                out.append(ChunkLookup.HIT_PENDING)
            else:
                out.append(ChunkLookup.MISS)
        hit_run = _leading(out, (ChunkLookup.HIT,))
        pending_run = _leading(out, (ChunkLookup.HIT, ChunkLookup.HIT_PENDING))
        if access:
            for key in ks[:hit_run]:
                self.policy.access(key)
        if self._metrics is not None:
            self._m_queries.inc(len(ks))
            self._m_hits.inc(sum(r is ChunkLookup.HIT for r in out))
        return LookupResult(tuple(out), hit_run, pending_run)

    # -- stores ----------------------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[ChunkKey], *, bypass_admission: bool = False
    ) -> StorePlan | None:
        """Reserve slots (STORING) for the keys not yet held; ``None`` if there is no room.

        ``bypass_admission`` is for promotions (a chunk loaded from a lower tier). Never evicts
        one of ``keys``; evicts only READY chunks; changes nothing when it returns ``None``.
        A doomed key is neither stored nor skipped but ``deferred`` (see :class:`StorePlan`).
        """
        ks = check_chunk_keys(keys)
        table, admission, doomed = self.table, self.admission, self._doomed
        new: list[ChunkKey] = []
        skipped: list[ChunkKey] = []
        rejected: list[ChunkKey] = []
        deferred: list[ChunkKey] = []
        for key in ks:
            if table.slot_of(key) is not None:
                (deferred if key in doomed else skipped).append(key)
            elif bypass_admission or admission.admits(key):
                new.append(key)
            else:
                rejected.append(key)
        need = len(new) - table.num_free
        victims: list[ChunkKey] = []
        if need > 0:
            inputs = set(ks)
            ready = SlotStatus.READY
            found = self.policy.select_victims(
                need, lambda k: k not in inputs and table.status_of(k) is ready
            )
            if found is None:
                if self._metrics is not None:
                    self._m_fail.inc()
                return None
            victims = found
        evicted_slots = table.evict(victims)
        for key in victims:
            self.policy.evict(key)
        slots = table.begin_store(new)
        if slots is None:  # pragma: no cover - room was made above
            raise IllegalTransitionError(f"tier {self.tier!r}: no free slot after eviction")
        if self._metrics is not None:
            if victims:
                self._m_evict.inc(len(victims))
            if rejected:
                self._m_reject.inc(len(rejected))
            self._m_usage.set(table.num_used / table.num_slots)
        return StorePlan(
            keys=tuple(new),
            slots=tuple(slots),
            evicted=tuple(victims),
            evicted_slots=tuple(evicted_slots),
            skipped=tuple(skipped),
            rejected=tuple(rejected),
            deferred=tuple(deferred),
        )

    def complete_store(self, keys: Sequence[ChunkKey], ok: bool | Sequence[bool]) -> None:
        """Publish (STORING -> READY) or, where ``ok`` is false, free the slots (-> EMPTY).

        ``ok`` is one flag for all keys or one per key. Raises ``UnknownChunkError`` for a key
        the tier does not hold and ``IllegalTransitionError`` for one that is not STORING
        (e.g. completed twice), before changing anything.
        """
        ks = check_chunk_keys(keys)
        flags = _flags(ok, len(ks))
        self._require(ks, SlotStatus.STORING, "complete_store")
        good = [k for k, f in zip(ks, flags, strict=True) if f]
        bad = [k for k, f in zip(ks, flags, strict=True) if not f]
        self.table.finish_store(good, ok=True)
        self.table.finish_store(bad, ok=False)
        for key in good:
            self.policy.insert(key)
        if self._metrics is not None and bad:
            self._m_usage.set(self.table.num_used / self.table.num_slots)

    # -- loads -----------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[ChunkKey]) -> LoadPlan:
        """Pin READY/LOADING chunks for reading (one more reader each) and count them as hits.

        Each key is an access for the eviction policy, in input order. Raises
        ``UnknownChunkError`` for a key not held, ``IllegalTransitionError`` for one that is
        STORING (not yet published) or doomed, before changing anything.
        """
        ks = check_chunk_keys(keys)
        plan = self._pin(ks)
        for key in ks:
            self.policy.access(key)
        return plan

    def pin_for_copy(self, keys: Sequence[ChunkKey]) -> LoadPlan:
        """Pin chunks as :meth:`prepare_load` does, but as no use of them: the policy is not
        told, so e.g. ARC keeps a chunk stored once in T1.

        The one step for a pin that only copies the chunk on (the tier book writing it down to
        a lower tier; a chunk just promoted being scattered): every write-down and promotion
        pin goes through here. Unpin with :meth:`complete_load`. Raises as :meth:`prepare_load`.
        """
        return self._pin(check_chunk_keys(keys))

    def _pin(self, ks: list[ChunkKey]) -> LoadPlan:
        for key in ks:
            st = self.table.status_of(key)
            if self.table.slot_of(key) is None:
                raise UnknownChunkError(f"chunk {key.hex()} is not held by tier {self.tier!r}")
            if st not in (SlotStatus.READY, SlotStatus.LOADING) or key in self._doomed:
                raise IllegalTransitionError(
                    f"tier {self.tier!r}: cannot load chunk {key.hex()} while {st.value}"
                    + (" (doomed after a bad read)" if key in self._doomed else "")
                )
        return LoadPlan(tuple(ks), tuple(self.table.pin(ks)))

    def complete_load(self, keys: Sequence[ChunkKey], ok: bool | Sequence[bool] = True) -> None:
        """Unpin; a key read with ``ok`` false is dropped once its last reader is done."""
        ks = check_chunk_keys(keys)
        flags = _flags(ok, len(ks))
        self._require(ks, SlotStatus.LOADING, "complete_load")
        self.table.unpin(ks)
        self._doomed.update(k for k, f in zip(ks, flags, strict=True) if not f)
        gone = [k for k in ks if k in self._doomed and self.table.readers(k) == 0]
        if gone:
            self.table.evict(gone)
            for key in gone:
                self.policy.remove(key)
                self._doomed.discard(key)
            if self._metrics is not None:
                self._m_drop.inc(len(gone))
                self._m_usage.set(self.table.num_used / self.table.num_slots)

    # -- other -----------------------------------------------------------------------------
    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark resident chunks as recently used; keys the tier does not hold are ignored."""
        for key in check_chunk_keys(keys):
            self.policy.access(key)

    def evict(self, keys: Sequence[ChunkKey]) -> tuple[SlotId, ...]:
        """Evict READY chunks now (the policy keeps its history); returns their freed slots.

        Raises ``UnknownChunkError`` / ``IllegalTransitionError`` (pinned or storing) first.
        """
        ks = check_chunk_keys(keys)
        self._require(ks, SlotStatus.READY, "evict")
        slots = self.table.evict(ks)
        for key in ks:
            self.policy.evict(key)
        if self._metrics is not None and ks:
            self._m_evict.inc(len(ks))
            self._m_usage.set(self.table.num_used / self.table.num_slots)
        return tuple(slots)

    def adopt(self, found: Mapping[ChunkKey, SlotId]) -> None:
        """Re-index after a restart: each valid stored chunk becomes READY in its slot.

        All or nothing: the whole batch is validated first (``InvalidArgumentError`` for a key
        that is not 1..64 bytes, a slot out of range or named twice; ``IllegalTransitionError``
        for a key already held or a slot not EMPTY), then every chunk is adopted and enters
        the policy in slot order.
        """
        if not isinstance(found, Mapping):
            raise InvalidArgumentError(f"adopt needs a mapping key -> slot, got {found!r:.80}")
        keys = list(found)
        self.table.adopt_batch(keys, [found[k] for k in keys])
        for key in sorted(keys, key=found.__getitem__):  # slots are valid ints by now
            self.policy.insert(key)
        if self._metrics is not None:
            self._m_usage.set(self.table.num_used / self.table.num_slots)

    def _require(self, keys: Sequence[ChunkKey], status: SlotStatus, what: str) -> None:
        if self.table.all_in(keys, status):
            return
        for key in keys:
            if self.table.slot_of(key) is None:
                raise UnknownChunkError(f"{what}: chunk {key.hex()} is not held by {self.tier!r}")
            st = self.table.status_of(key)
            if st is not status:
                raise IllegalTransitionError(
                    f"{what}: chunk {key.hex()} of tier {self.tier!r} is {st.value}, "
                    f"not {status.value}"
                )

    def check_integrity(self) -> None:
        """Slot table invariants, policy residents == READY+LOADING, doomed chunks pinned."""
        self.table.check_integrity()
        resident = self.table.keys_in(SlotStatus.READY, SlotStatus.LOADING)
        self.policy.check_integrity(resident)
        loading = self.table.keys_in(SlotStatus.LOADING)
        if not self._doomed <= loading:
            raise IllegalTransitionError(f"tier {self.tier!r}: a doomed chunk is not pinned")


def _leading(results: Sequence[ChunkLookup], accept: tuple[ChunkLookup, ...]) -> int:
    n = 0
    for r in results:
        if r not in accept:
            break
        n += 1
    return n


def _flags(ok: bool | Sequence[bool], n: int) -> list[bool]:
    if isinstance(ok, bool):
        return [ok] * n
    flags = list(ok)
    if len(flags) != n or not all(isinstance(f, bool) for f in flags):
        raise InvalidArgumentError(f"ok must be a bool or {n} bools, got {ok!r:.80}")
    return flags
