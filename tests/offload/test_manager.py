"""OffloadManager: the lookup / store / load protocol, atomic eviction, faults and metrics."""

from __future__ import annotations

import pytest
from offload_testlib import key, keys

from kvplane.errors import IllegalTransitionError, InvalidArgumentError, UnknownChunkError
from kvplane.metrics import MetricsRegistry
from kvplane.offload import AdmissionFilter, ChunkLookup, OffloadManager, SlotStatus
from kvplane.offload.policies.arc import ARCPolicy

H, M, P = ChunkLookup.HIT, ChunkLookup.MISS, ChunkLookup.HIT_PENDING


def stored(mgr: OffloadManager, *idx: int) -> None:
    mgr.lookup(keys(*idx))
    plan = mgr.prepare_store(keys(*idx))
    assert plan is not None
    mgr.complete_store(plan.keys, True)


def doomed(mgr: OffloadManager, i: int) -> None:
    """Store chunk ``i``, pin it twice and let one reader find it bad: doomed, still pinned."""
    stored(mgr, i)
    mgr.prepare_load(keys(i))
    mgr.prepare_load(keys(i))
    mgr.complete_load(keys(i), ok=False)


def test_lookup_reports_hits_pending_and_the_leading_run() -> None:
    m = MetricsRegistry()
    mgr = OffloadManager("host", 4, metrics=m)
    stored(mgr, 0, 1)
    mgr.lookup(keys(2))
    assert mgr.prepare_store(keys(2)) is not None  # STORING: a write is in flight
    r = mgr.lookup(keys(0, 1, 2, 3))
    assert r.results == (H, H, P, M)
    assert (r.hit_run, r.pending_run) == (2, 3)
    r = mgr.lookup(keys(3, 0))
    assert r.results == (M, H) and (r.hit_run, r.pending_run) == (0, 0)
    assert m.value("offload_chunk_queries", {"tier": "host"}, "_total") == 2 + 1 + 4 + 2
    assert m.value("offload_chunk_hits", {"tier": "host"}, "_total") == 2 + 1
    mgr.complete_store(keys(2), False)
    mgr.check_integrity()


def test_prepare_store_skips_held_rejects_unadmitted_and_evicts_lru_atomically() -> None:
    m = MetricsRegistry()
    mgr = OffloadManager("host", 3, "lru", AdmissionFilter(1), metrics=m)
    stored(mgr, 0, 1, 2)
    mgr.touch(keys(0))  # LRU order now 1, 2, 0
    mgr.lookup(keys(3, 4))
    plan = mgr.prepare_store(keys(0, 3, 4, 5))  # 0 held, 5 never looked up
    assert plan is not None
    assert plan.skipped == (key(0),) and plan.rejected == (key(5),)
    assert plan.keys == (key(3), key(4)) and plan.evicted == (key(1), key(2))
    assert plan.slots == plan.evicted_slots == (1, 2)
    assert m.value("offload_evictions", {"tier": "host"}, "_total") == 2
    assert m.value("offload_admission_rejects", {"tier": "host"}, "_total") == 1
    assert m.value("offload_slot_usage", {"tier": "host"}) == 1.0
    mgr.complete_store(plan.keys, [True, False])  # a failed store frees its slot
    assert mgr.status(key(4)) is SlotStatus.EMPTY and mgr.table.num_free == 1
    mgr.check_integrity()


def test_never_evicts_its_own_inputs_and_returns_none_when_short() -> None:
    m = MetricsRegistry()
    mgr = OffloadManager("host", 2, metrics=m)
    stored(mgr, 0, 1)
    mgr.prepare_load(keys(1))  # pinned: not evictable
    mgr.lookup(keys(2, 3))
    before = (mgr.table.keys(), mgr.policy.order())
    assert mgr.prepare_store(keys(0, 2, 3)) is None  # needs 2 victims, 0 is an input, 1 pinned
    assert (mgr.table.keys(), mgr.policy.order()) == before  # atomic: nothing evicted
    assert m.value("offload_allocation_failures", {"tier": "host"}, "_total") == 1
    plan = mgr.prepare_store(keys(2))
    assert plan is not None and plan.evicted == (key(0),)
    empty = mgr.prepare_store(keys(1, 2))  # everything held: an empty plan, not None
    assert empty is not None and empty.keys == () and empty.skipped == (key(1), key(2))
    mgr.complete_store(keys(2), True)
    mgr.complete_load(keys(1))
    mgr.check_integrity()


def test_load_racing_eviction_pins_until_the_last_reader() -> None:
    mgr = OffloadManager("host", 2)
    stored(mgr, 0, 1)
    a = mgr.prepare_load(keys(0))
    b = mgr.prepare_load(keys(0))  # a second reader of the same chunk
    assert a.slots == b.slots == (0,) and mgr.table.readers(key(0)) == 2
    mgr.lookup(keys(2, 3))
    plan = mgr.prepare_store(keys(2))  # pressure: the pinned chunk is skipped
    assert plan is not None and plan.evicted == (key(1),)
    with pytest.raises(IllegalTransitionError):
        mgr.evict(keys(0))
    assert mgr.prepare_store(keys(3)) is None
    mgr.complete_load(keys(0))
    assert mgr.prepare_store(keys(3)) is None  # still one reader
    mgr.complete_load(keys(0))
    assert mgr.status(key(0)) is SlotStatus.READY
    mgr.complete_store(keys(2), True)
    plan = mgr.prepare_store(keys(3))
    assert plan is not None and plan.evicted == (key(0),)  # LRU: 0 was used before 2 landed
    mgr.complete_store(keys(3), True)
    mgr.check_integrity()


def test_bad_read_dooms_the_chunk_until_its_last_reader_leaves() -> None:
    m = MetricsRegistry()
    mgr = OffloadManager("disk", 2, metrics=m)
    doomed(mgr, 0)  # checksum failed for one reader
    assert mgr.lookup(keys(0)).results == (M,)
    with pytest.raises(IllegalTransitionError, match="doomed"):
        mgr.prepare_load(keys(0))
    mgr.check_integrity()
    mgr.complete_load(keys(0))
    assert mgr.status(key(0)) is SlotStatus.EMPTY and key(0) not in mgr.policy
    assert m.value("offload_dropped_chunks", {"tier": "disk"}, "_total") == 1
    mgr.check_integrity()


def test_bad_input_raises_typed_errors_and_changes_nothing() -> None:
    mgr = OffloadManager("host", 2)
    stored(mgr, 0)
    mgr.lookup(keys(1))
    mgr.prepare_store(keys(1))
    snapshot = [(mgr.status(k), mgr.table.readers(k)) for k in keys(0, 1, 2)]
    with pytest.raises(UnknownChunkError):
        mgr.complete_store(keys(1, 2), True)
    with pytest.raises(IllegalTransitionError):
        mgr.complete_store(keys(1, 0), True)  # 0 is already READY: a double complete
    with pytest.raises(IllegalTransitionError):
        mgr.prepare_load(keys(0, 1))  # 1 is not published yet
    with pytest.raises(UnknownChunkError):
        mgr.prepare_load(keys(2))
    with pytest.raises(IllegalTransitionError):
        mgr.complete_load(keys(0))  # nobody pinned it
    with pytest.raises(InvalidArgumentError):
        mgr.complete_store(keys(1), [True, True])
    with pytest.raises(InvalidArgumentError):
        mgr.lookup([b""])
    with pytest.raises(InvalidArgumentError):
        mgr.prepare_store(keys(3, 3))
    assert [(mgr.status(k), mgr.table.readers(k)) for k in keys(0, 1, 2)] == snapshot
    mgr.touch(keys(9))  # unknown keys are ignored by touch
    mgr.complete_store(keys(1), True)
    with pytest.raises(IllegalTransitionError):
        mgr.complete_store(keys(1), True)
    mgr.check_integrity()


def test_adopt_reindexes_found_chunks() -> None:
    mgr = OffloadManager("disk", 4, "arc")
    mgr.adopt({key(5): 3, key(6): 1})  # type: ignore[dict-item]
    assert mgr.status(key(5)) is SlotStatus.READY and mgr.table.slot_of(key(6)) == 1
    assert mgr.lookup(keys(6, 5)).hit_run == 2
    mgr.check_integrity()


def test_lookup_hit_is_an_access() -> None:
    mgr = OffloadManager("host", 2, "lru")
    stored(mgr, 0, 1)  # LRU order 0, 1
    assert mgr.lookup(keys(0, 2)).results == (H, M)
    assert mgr.policy.order() == keys(1, 0)  # the hit refreshed 0; the miss changed nothing
    mgr.lookup(keys(2))
    plan = mgr.prepare_store(keys(2))
    assert plan is not None and plan.evicted == (key(1),)
    mgr.complete_store(plan.keys, True)
    mgr.check_integrity()


def test_lookup_of_a_doomed_chunk_is_no_access() -> None:
    mgr = OffloadManager("disk", 2, "lru")
    doomed(mgr, 0)  # one reader left
    stored(mgr, 1)
    order = mgr.policy.order()
    assert mgr.lookup(keys(0)).results == (M,) and mgr.policy.order() == order
    mgr.complete_load(keys(0))
    mgr.check_integrity()


def test_a_pin_for_a_copy_leaves_the_policy_alone() -> None:
    mgr = OffloadManager("host", 4, "arc")
    arc = mgr.policy
    assert isinstance(arc, ARCPolicy)
    stored(mgr, 0, 1)
    mgr.pin_for_copy(keys(0))  # e.g. the cascade writing 0 down to disk
    assert (arc.t1, arc.t2) == (keys(0, 1), [])  # stored once, never used: still T1
    mgr.prepare_load(keys(1))  # a real load: seen again
    assert (arc.t1, arc.t2) == (keys(0), keys(1))
    mgr.complete_load(keys(0, 1))
    mgr.check_integrity()


def test_doomed_key_is_deferred_not_skipped_until_its_last_reader_leaves() -> None:
    mgr = OffloadManager("disk", 4)
    doomed(mgr, 0)  # a bad copy; one reader still pins it
    plan = mgr.prepare_store(keys(0))
    assert plan is not None
    assert (plan.keys, plan.skipped, plan.deferred) == ((), (), (key(0),))
    mgr.complete_load(keys(0))  # the last reader: the bad copy is dropped
    again = mgr.prepare_store(keys(0))
    assert again is not None and (again.keys, again.deferred) == ((key(0),), ())
    mgr.complete_store(again.keys, True)
    assert mgr.lookup(keys(0)).results == (H,)
    mgr.check_integrity()


@pytest.mark.parametrize(
    ("found", "exc"),
    [
        ({key(0): 1, key(1): 1}, InvalidArgumentError),  # one slot twice
        ({key(0): 1, key(1): 7}, InvalidArgumentError),  # out of range
        ({key(0): 1, key(1): True}, InvalidArgumentError),  # a bool is no slot
        ({key(0): 1, b"": 2}, InvalidArgumentError),  # empty key
        ({key(0): 1, "k" * 32: 2}, InvalidArgumentError),  # not bytes
        ([(key(0), 1)], InvalidArgumentError),  # not a mapping
        ({key(0): 1, key(9): 2}, IllegalTransitionError),  # key 9 already held
        ({key(0): 1, key(1): 0}, IllegalTransitionError),  # slot 0 holds key 9
    ],
)
def test_adopt_validates_the_whole_batch_first(found: object, exc: type[Exception]) -> None:
    mgr = OffloadManager("disk", 4, "arc")
    stored(mgr, 9)  # slot 0
    with pytest.raises(exc):
        mgr.adopt(found)  # type: ignore[arg-type]
    assert mgr.table.keys() == keys(9) and mgr.policy.order() == keys(9)
    mgr.check_integrity()


def test_lookup_counts_an_access_only_for_the_usable_leading_hits() -> None:
    mgr = OffloadManager("host", 4, "arc")
    arc = mgr.policy
    assert isinstance(arc, ARCPolicy)
    stored(mgr, 1, 2)
    r = mgr.lookup(keys(0, 1))  # 0 misses: nothing of this prefix is usable
    assert r.results == (M, H) and r.hit_run == 0
    assert (arc.t1, arc.t2) == (keys(1, 2), [])  # 1 was not used: still seen once
    assert mgr.lookup(keys(1, 3, 2)).hit_run == 1  # 1 is usable, 2 comes after the gap
    assert (arc.t1, arc.t2) == (keys(2), keys(1))
    mgr.lookup(keys(2), access=False)  # asked, not used
    assert (arc.t1, arc.t2) == (keys(2), keys(1))
    mgr.check_integrity()
