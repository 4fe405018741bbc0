"""SlotTable: the transition table, batch atomicity, lowest-free allocation, integrity."""

from __future__ import annotations

import pytest
from offload_testlib import key, keys

from kvplane.errors import IllegalTransitionError, InvalidArgumentError, UnknownChunkError
from kvplane.ids import SlotId
from kvplane.offload.slots import (
    MAX_KEY_BYTES,
    TRANSITIONS,
    SlotStatus,
    SlotTable,
    check_chunk_key,
    check_chunk_keys,
)

S = SlotStatus


def snapshot(t: SlotTable) -> list[tuple[SlotStatus, object, int]]:
    return [(t.status(SlotId(i)), t.key_at(SlotId(i)), t.readers(t.key_at(SlotId(i)) or b"-"))
            for i in range(t.num_slots)]  # fmt: skip


def test_transition_table_is_the_documented_cycle() -> None:
    assert {
        (S.EMPTY, S.STORING), (S.STORING, S.READY), (S.STORING, S.EMPTY),
        (S.READY, S.LOADING), (S.LOADING, S.LOADING), (S.LOADING, S.READY),
        (S.READY, S.EVICTING), (S.EVICTING, S.EMPTY),
    } == TRANSITIONS  # fmt: skip


def test_full_life_cycle_with_readers() -> None:
    t = SlotTable(3, "host")
    assert t.begin_store(keys(0, 1)) == [0, 1]
    assert t.status_of(key(0)) is S.STORING and t.num_free == 1
    t.finish_store([key(0)], ok=True)
    t.finish_store([key(1)], ok=False)  # a failed store frees its slot
    assert t.status_of(key(1)) is S.EMPTY and t.slot_of(key(1)) is None and t.num_free == 2
    t.pin([key(0)])
    t.pin([key(0)])
    assert t.status_of(key(0)) is S.LOADING and t.readers(key(0)) == 2
    t.unpin([key(0)])
    assert t.status_of(key(0)) is S.LOADING and t.readers(key(0)) == 1
    t.unpin([key(0)])
    assert t.status_of(key(0)) is S.READY and t.readers(key(0)) == 0
    assert t.evict([key(0)]) == [0]
    assert t.status(SlotId(0)) is S.EMPTY and t.num_free == 3
    assert t.begin_store(keys(5, 6, 7)) == [0, 1, 2]  # lowest free slot first
    t.check_integrity()


@pytest.mark.parametrize(
    ("setup", "op"),
    [
        ("storing", lambda t: t.pin([key(0)])),  # load of a non-READY chunk
        ("storing", lambda t: t.evict([key(0)])),
        ("storing", lambda t: t.unpin([key(0)])),
        ("ready", lambda t: t.finish_store([key(0)], ok=True)),  # double complete
        ("ready", lambda t: t.unpin([key(0)])),
        ("ready", lambda t: t.begin_store([key(0)])),
        ("loading", lambda t: t.evict([key(0)])),  # a pinned chunk cannot be evicted
        ("loading", lambda t: t.finish_store([key(0)], ok=False)),
    ],
)
def test_illegal_transitions_raise_and_change_nothing(setup: str, op) -> None:  # type: ignore[no-untyped-def]
    t = SlotTable(2)
    t.begin_store([key(0)])
    if setup in ("ready", "loading"):
        t.finish_store([key(0)], ok=True)
    if setup == "loading":
        t.pin([key(0)])
    before = snapshot(t)
    with pytest.raises(IllegalTransitionError):
        op(t)
    assert snapshot(t) == before
    t.check_integrity()


def test_batches_are_atomic_and_unknown_keys_are_typed() -> None:
    t = SlotTable(4)
    t.begin_store(keys(0, 1))
    t.finish_store([key(0)], ok=True)
    before = snapshot(t)
    with pytest.raises(UnknownChunkError, match=key(9).hex()):
        t.finish_store([key(1), key(9)], ok=True)
    with pytest.raises(IllegalTransitionError):
        t.pin([key(0), key(1)])  # key(1) still STORING: key(0) must not be pinned either
    with pytest.raises(IllegalTransitionError):
        t.begin_store([key(2), key(0)])
    assert snapshot(t) == before
    assert t.begin_store(keys(2, 3, 4)) is None  # shortage is a None, not an error
    assert snapshot(t) == before
    t.check_integrity()


def test_adopt_marks_found_chunks_ready_in_their_slots() -> None:
    t = SlotTable(4)
    t.adopt(key(7), SlotId(2))
    assert t.status(SlotId(2)) is S.READY and t.slot_of(key(7)) == 2
    assert t.begin_store(keys(0, 1, 2)) == [0, 1, 3]
    with pytest.raises(IllegalTransitionError):
        t.adopt(key(7), SlotId(0))
    t.check_integrity()


def test_key_validation() -> None:
    assert check_chunk_key(b"x" * MAX_KEY_BYTES) == b"x" * MAX_KEY_BYTES
    for bad in (b"", b"x" * (MAX_KEY_BYTES + 1), "abc", 5, None):
        with pytest.raises(InvalidArgumentError):
            check_chunk_key(bad)
    with pytest.raises(InvalidArgumentError, match="twice"):
        check_chunk_keys([key(1), key(2), key(1)])
    with pytest.raises(InvalidArgumentError):
        check_chunk_keys(b"not-a-list")
    with pytest.raises(InvalidArgumentError):
        SlotTable(0)
    with pytest.raises(InvalidArgumentError):
        SlotTable(2).status(SlotId(2))


def _busy_table() -> SlotTable:
    """key 0 LOADING (one reader), key 1 STORING, key 2 READY; slot 3 free."""
    t = SlotTable(4)
    t.begin_store(keys(0, 1, 2))
    t.finish_store(keys(0, 2), ok=True)
    t.pin(keys(0))
    return t


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.begin_store([key(3), key(3)]),
        lambda t: t.finish_store([key(1), key(1)], ok=False),
        lambda t: t.finish_store([key(1), key(1)], ok=True),
        lambda t: t.pin([key(2), key(2)]),
        lambda t: t.unpin([key(0), key(0)]),
        lambda t: t.evict([key(2), key(2)]),
    ],
    ids=["begin_store", "finish_store-fail", "finish_store-ok", "pin", "unpin", "evict"],
)
def test_batch_methods_reject_a_key_listed_twice(call) -> None:  # type: ignore[no-untyped-def]
    t = _busy_table()
    before = snapshot(t)
    with pytest.raises(InvalidArgumentError, match="appears twice"):
        call(t)
    assert snapshot(t) == before and t.num_free == 1
    t.check_integrity()


def test_adopt_batch_is_all_or_nothing() -> None:
    t = SlotTable(4)
    t.begin_store(keys(9))  # slot 0 STORING
    before = snapshot(t)
    for ks, slots, exc in (
        (keys(1, 2), [1, 1], InvalidArgumentError),  # one slot twice
        (keys(1, 1), [1, 2], InvalidArgumentError),  # one key twice
        (keys(1, 2), [1, 4], InvalidArgumentError),  # out of range
        (keys(1, 2), [1], InvalidArgumentError),  # lengths differ
        ([key(1), b""], [1, 2], InvalidArgumentError),  # not a chunk key
        (keys(1, 2), [1, 0], IllegalTransitionError),  # slot 0 is STORING
        (keys(1, 9), [1, 2], IllegalTransitionError),  # key 9 is held
    ):
        with pytest.raises(exc):
            t.adopt_batch(ks, [SlotId(s) for s in slots])
        assert snapshot(t) == before, (ks, slots)
    t.adopt_batch(keys(1, 2), [SlotId(3), SlotId(1)])
    assert (t.slot_of(key(1)), t.slot_of(key(2)), t.status(SlotId(3))) == (3, 1, S.READY)
    assert t.begin_store(keys(4)) == [2]  # the free heap lost exactly the adopted slots
    t.check_integrity()


@pytest.mark.parametrize("ok", [True, False])
def test_finish_store_moves_only_storing_slots(ok: bool) -> None:
    """READY is also reached from LOADING (the last unpin) and EMPTY from EVICTING: neither
    makes a pinned chunk's store "finish" (that would drop its readers' slot or pin)."""
    t = SlotTable(2)
    assert t.begin_store(keys(0)) is not None
    t.finish_store(keys(0), ok=True)
    t.pin(keys(0))
    before = snapshot(t)
    with pytest.raises(IllegalTransitionError, match="loading"):
        t.finish_store(keys(0), ok=ok)
    assert snapshot(t) == before
    t.unpin(keys(0))
    t.check_integrity()
