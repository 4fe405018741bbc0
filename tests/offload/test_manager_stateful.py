"""Hypothesis stateful test: OffloadManager and its slot statuses against a reference model.

The model is a plain dict of per-key (status, slot, readers, doomed) plus the LRU order, the
free-slot set and the lookup counts. With LRU the model predicts every plan exactly (which
keys are stored, skipped, rejected, evicted, into which slots); with ARC it checks the rules a
victim must obey. Bad calls (unknown keys, double completes, loads of unpublished chunks) must
raise a typed error and leave manager and model equal. Every step ends with integrity checks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from offload_testlib import key

from kvplane.errors import IllegalTransitionError, UnknownChunkError
from kvplane.ids import ChunkKey
from kvplane.offload import AdmissionFilter, ChunkLookup, OffloadManager, SlotStatus

S = SlotStatus
SLOTS = 4
UNIVERSE = [key(i) for i in range(6)]
key_sets = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=5, unique=True)


@dataclass(frozen=True)
class Entry:
    status: SlotStatus
    slot: int
    readers: int = 0
    doomed: bool = False


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.mgr = OffloadManager("host", SLOTS, self.policy, AdmissionFilter(1))
        self.model: dict[ChunkKey, Entry] = {}
        self.lru: list[ChunkKey] = []
        self.free = set(range(SLOTS))
        self.looked: set[ChunkKey] = set()

    # -- helpers -------------------------------------------------------------------------------
    def with_status(self, *statuses: SlotStatus) -> list[ChunkKey]:
        return [k for k, e in self.model.items() if e.status in statuses]

    def hit(self, k: ChunkKey) -> bool:
        e = self.model.get(k)
        return e is not None and e.status in (S.READY, S.LOADING) and not e.doomed

    def touch_lru(self, k: ChunkKey) -> None:
        if k in self.lru:
            self.lru.remove(k)
            self.lru.append(k)

    def drop(self, k: ChunkKey) -> None:
        self.free.add(self.model.pop(k).slot)
        self.lru.remove(k)

    # -- rules -----------------------------------------------------------------------------------
    @rule(ks=key_sets)
    def lookup(self, ks: list[ChunkKey]) -> None:
        r = self.mgr.lookup(ks)
        self.looked.update(ks)
        want = []
        for k in ks:
            e = self.model.get(k)
            if self.hit(k):
                want.append(ChunkLookup.HIT)
            elif e is not None and e.status is S.STORING:
                want.append(ChunkLookup.HIT_PENDING)
            else:
                want.append(ChunkLookup.MISS)
        assert list(r.results) == want
        run = next((i for i, w in enumerate(want) if w is not ChunkLookup.HIT), len(want))
        assert r.hit_run == run
        for k in ks[:run]:
            self.touch_lru(k)  # a usable lookup hit is an access; one after the first gap is not

    @rule(ks=key_sets)
    def prepare_store(self, ks: list[ChunkKey]) -> None:
        before = dict(self.model)
        plan = self.mgr.prepare_store(ks)
        skipped = [k for k in ks if k in self.model and not self.model[k].doomed]
        deferred = [k for k in ks if k in self.model and self.model[k].doomed]
        rejected = [k for k in ks if k not in self.model and k not in self.looked]
        new = [k for k in ks if k not in self.model and k in self.looked]
        need = len(new) - len(self.free)
        victims = [k for k in self.lru if self.model[k].status is S.READY and k not in ks]
        if need > len(victims):
            assert plan is None
            assert self.model == before
            return
        assert plan is not None
        assert (list(plan.skipped), list(plan.rejected), list(plan.keys)) == (
            skipped,
            rejected,
            new,
        )
        assert list(plan.deferred) == deferred
        if self.policy == "lru":
            assert list(plan.evicted) == victims[: max(need, 0)]
        else:
            assert len(plan.evicted) == max(need, 0)
            assert all(k in victims for k in plan.evicted)
        for k, slot in zip(plan.evicted, plan.evicted_slots, strict=True):
            assert self.model[k].slot == slot
            self.drop(k)
        assert list(plan.slots) == sorted(self.free)[: len(new)]  # lowest free slots first
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            self.free.remove(slot)
            self.model[k] = Entry(S.STORING, slot)

    @precondition(lambda self: self.with_status(S.STORING))
    @rule(data=st.data())
    def complete_store(self, data: st.DataObject) -> None:
        ks = data.draw(
            st.lists(st.sampled_from(self.with_status(S.STORING)), min_size=1, unique=True)
        )
        oks = data.draw(st.lists(st.booleans(), min_size=len(ks), max_size=len(ks)))
        self.mgr.complete_store(ks, oks)
        for k, ok in zip(ks, oks, strict=True):
            if ok:
                self.model[k] = replace(self.model[k], status=S.READY)
                self.lru.append(k)
            else:
                self.free.add(self.model.pop(k).slot)

    @precondition(lambda self: any(self.hit(k) for k in self.model))
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        pool = [k for k in self.model if self.hit(k)]
        ks = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique=True))
        plan = self.mgr.prepare_load(ks)
        for k, slot in zip(ks, plan.slots, strict=True):
            e = self.model[k]
            assert slot == e.slot
            self.model[k] = replace(e, status=S.LOADING, readers=e.readers + 1)
            self.touch_lru(k)

    @precondition(lambda self: self.with_status(S.LOADING))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        ks = data.draw(
            st.lists(st.sampled_from(self.with_status(S.LOADING)), min_size=1, unique=True)
        )
        oks = data.draw(st.lists(st.booleans(), min_size=len(ks), max_size=len(ks)))
        self.mgr.complete_load(ks, oks)
        for k, ok in zip(ks, oks, strict=True):
            e = self.model[k]
            readers = e.readers - 1
            doomed = e.doomed or not ok
            if doomed and readers == 0:
                self.drop(k)
            else:
                self.model[k] = replace(
                    e, status=S.LOADING if readers else S.READY, readers=readers, doomed=doomed
                )

    @rule(ks=key_sets)
    def touch(self, ks: list[ChunkKey]) -> None:
        self.mgr.touch(ks)
        for k in ks:
            self.touch_lru(k)

    @precondition(lambda self: self.with_status(S.READY))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        ks = data.draw(
            st.lists(st.sampled_from(self.with_status(S.READY)), min_size=1, unique=True)
        )
        slots = self.mgr.evict(ks)
        assert list(slots) == [self.model[k].slot for k in ks]
        for k in ks:
            self.drop(k)

    @rule(
        k=st.sampled_from(UNIVERSE),
        op=st.sampled_from(["complete_store", "complete_load", "load", "evict"]),
    )
    def misuse(self, k: ChunkKey, op: str) -> None:
        """A call the key's status does not allow raises a typed error and changes nothing."""
        e = self.model.get(k)
        allowed = {
            "complete_store": e is not None and e.status is S.STORING,
            "complete_load": e is not None and e.status is S.LOADING,
            "load": self.hit(k),
            "evict": e is not None and e.status is S.READY,
        }[op]
        if allowed:
            return
        call = {
            "complete_store": lambda: self.mgr.complete_store([k], True),
            "complete_load": lambda: self.mgr.complete_load([k]),
            "load": lambda: self.mgr.prepare_load([k]),
            "evict": lambda: self.mgr.evict([k]),
        }[op]
        with pytest.raises(UnknownChunkError if e is None else IllegalTransitionError):
            call()

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        self.mgr.check_integrity()
        for k in UNIVERSE:
            e = self.model.get(k)
            assert self.mgr.status(k) is (S.EMPTY if e is None else e.status)
            assert self.mgr.table.readers(k) == (0 if e is None else e.readers)
            assert self.mgr.table.slot_of(k) == (None if e is None else e.slot)
        assert self.mgr.table.num_free == len(self.free)
        if self.policy == "lru":
            assert self.mgr.policy.order() == self.lru


class ARCManagerMachine(ManagerMachine):
    policy = "arc"


ManagerMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
ARCManagerMachine.TestCase.settings = ManagerMachine.TestCase.settings
TestManagerLRU = ManagerMachine.TestCase
TestManagerARC = ARCManagerMachine.TestCase
