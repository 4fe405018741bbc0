"""TierBook: the cascade's decisions on their own, and one book serving both executors.

The last test drives random stores, loads and evictions through a real :class:`TierCascade`
(jobs, a disk tier whose reads of some chunks come back corrupt) and through a bare book used
the vLLM connector's way (write-through stores, loads reported in one piece): every answer and
every tier's slots, statuses, pins and policy order must match after each step.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from offload_testlib import filled_pool, key, keys, tiny_layout

from kvplane.errors import IllegalTransitionError, InvalidArgumentError
from kvplane.ids import BlockId, ChunkKey, SlotId
from kvplane.offload import (
    LoadDone,
    OffloadConfig,
    OffloadManager,
    Promotion,
    SlotStatus,
    StoreDone,
    TierBook,
    TierCascade,
    TierIndex,
    TierWrite,
    WriteDown,
    build_cascade,
)
from kvplane.offload.policies.arc import ARCPolicy
from kvplane.offload.tiers import DiskTier
from kvplane.offload.tiers.base import ReadOutcome

BPC = 2
LAYOUT = tiny_layout(num_blocks=32)
CHUNK = BPC * LAYOUT.bytes_per_block


def book(policy: str = "lru", host_slots: int = 4, lower: Sequence[str] = ("disk",)) -> TierBook:
    cfg = OffloadConfig(host_slots=host_slots, policy=policy)
    return TierBook.build(cfg, [(name, 4) for name in lower])


def state(mgrs: Sequence[OffloadManager]) -> list[object]:
    """Every tier's ``{key: (slot, status, readers)}`` and policy order."""
    out: list[object] = []
    for m in mgrs:
        held = m.table.keys()
        slots = {k: (m.table.slot_of(k), m.status(k), m.table.readers(k)) for k in held}
        out.append((m.tier, slots, m.policy.order()))
    return out


def store_through(b: TierBook, ks: list[ChunkKey]) -> None:
    """Store ``ks`` write-through, every gather and write ok (the vLLM connector's way)."""
    b.lookup(ks)
    res = b.reserve_store(ks, write_through=True)
    assert res is not None
    ok = [True] * len(res.keys)
    b.gathered(res.keys, res.writes, ok)
    for w in res.writes:
        b.written(res.keys, w, ok, [True] * len(w.indices))


def test_arc_counts_neither_the_write_through_nor_a_promotion_as_a_hit() -> None:
    b = book("arc")
    arc = b.host.policy
    assert isinstance(arc, ARCPolicy)
    b.lookup(keys(0, 1))
    res = b.reserve_store(keys(0, 1), write_through=True)
    assert res is not None and [w.tier for w in res.writes] == ["disk"]
    b.gathered(res.keys, res.writes, [True, True])  # host pins both for the disk write
    assert (arc.t1, arc.t2) == (keys(0, 1), [])  # stored once, never requested: T1
    b.written(res.keys, res.writes[0], [True, True], [True, True])
    assert (arc.t1, arc.t2) == (keys(0, 1), [])
    load = b.reserve_load(keys(0))
    b.loaded(load.keys, load.promotions, [True])
    assert (arc.t1, arc.t2) == (keys(1), keys(0))  # a requested load is a hit
    b.check_integrity(idle=True)


def test_write_down_after_the_gather_pins_host_once_per_write() -> None:
    b = book(lower=("disk", "remote"))
    b.lookup(keys(0, 1))
    res = b.reserve_store(keys(0, 1), write_through=False)
    assert res is not None and res.slots == (0, 1) and res.writes == ()
    assert b.lower["disk"].status(key(0)) is SlotStatus.EMPTY  # nothing reserved below yet
    b.gathered(res.keys, (), [True, True])
    down = b.write_down(res.keys)
    disk, remote = TierWrite("disk", (0, 1), (0, 1)), TierWrite("remote", (0, 1), (0, 1))
    assert down == WriteDown(tuple(keys(0, 1)), (disk, remote))
    assert [b.host.table.readers(k) for k in keys(0, 1)] == [2, 2]
    b.written(down.keys, disk, [True, True], [True, False])
    b.written(down.keys, remote, [True, True], [True, True])
    assert [b.lower["disk"].status(k) for k in keys(0, 1)] == [SlotStatus.READY, SlotStatus.EMPTY]
    assert [b.host.status(k) for k in keys(0, 1)] == [SlotStatus.READY] * 2
    assert b.lookup(keys(0, 1)).where == ("host", "host")
    b.check_integrity(idle=True)


def test_a_doomed_lower_copy_defers_the_write_down_until_it_is_dropped() -> None:
    b = book()
    store_through(b, keys(0))  # host and disk
    low = b.lower["disk"]
    low.prepare_load(keys(0))  # two readers of the disk copy (as two concurrent loads)...
    low.prepare_load(keys(0))
    low.complete_load(keys(0), ok=False)  # ...one found it bad: doomed, the other still reads
    b.host.evict(keys(0))
    b.lookup(keys(0))
    res = b.reserve_store(keys(0), write_through=False)
    assert res is not None and res.keys == (key(0),)
    b.gathered(res.keys, (), [True])
    assert b.write_down(res.keys) == WriteDown((key(0),), ())  # the doomed copy is busy
    assert b.retry_deferred() == ()  # still pinned by its last reader
    low.complete_load(keys(0))  # the last reader is done: the bad copy is dropped
    assert low.status(key(0)) is SlotStatus.EMPTY
    (down,) = b.retry_deferred()
    assert down == WriteDown((key(0),), (TierWrite("disk", (0,), (0,)),))
    assert b.host.table.readers(key(0)) == 1
    b.written(down.keys, down.writes[0], [True], [True])
    assert low.is_hit(key(0)) and b.retry_deferred() == ()
    b.check_integrity(idle=True)


def test_a_write_through_store_drops_the_write_a_doomed_lower_copy_refuses() -> None:
    b = book()
    store_through(b, keys(0))
    low = b.lower["disk"]
    low.prepare_load(keys(0))
    low.prepare_load(keys(0))
    low.complete_load(keys(0), ok=False)
    b.host.evict(keys(0))
    res = b.reserve_store(keys(0), write_through=True)
    assert res is not None and res.keys == (key(0),) and res.writes == ()
    b.gathered(res.keys, res.writes, [True])
    low.complete_load(keys(0))
    assert b.retry_deferred() == ()  # no executor runs a later write-down for it
    assert b.lookup(keys(0)).where == ("host",) and low.status(key(0)) is SlotStatus.EMPTY
    b.check_integrity(idle=True)


def test_a_load_is_cut_before_the_first_promotion_host_has_no_room_for() -> None:
    b = book(host_slots=2)
    store_through(b, keys(0, 1))
    store_through(b, keys(2))  # host evicts 0 (LRU); disk holds 0, 1, 2
    assert b.lookup(keys(1, 2, 0)).where == ("host", "host", "disk")
    assert b.loadable(keys(1, 2, 0)) == 2  # 1, 2 pinned fill the host: 0 cannot come
    res = b.reserve_load(keys(1, 2, 0))
    assert (res.keys, res.host_slots, res.promotions) == (tuple(keys(1, 2)), (1, 0), ())
    assert res.sources == ("host", "host")
    b.scattered(res.keys)
    assert b.loadable(keys(0)) == 1  # alone it fits (evicts LRU 1)
    res = b.reserve_load(keys(0))
    assert res.promotions == (Promotion(0, "disk", 0),) and res.sources == ("disk",)
    assert b.host.status(key(0)) is SlotStatus.STORING and b.host.status(key(1)) is SlotStatus.EMPTY
    assert b.promoted("disk", res.keys, [True], pin=True) == (key(0),)
    assert b.host.status(key(0)) is SlotStatus.LOADING  # pinned for its scatter
    b.scattered(res.keys)
    assert b.lookup(keys(0, 1, 2)).where == ("host", "disk", "host")
    b.check_integrity(idle=True)


def test_loadable_says_ask_again_while_a_host_store_is_in_flight() -> None:
    b = book()
    b.lookup(keys(0, 1))
    res = b.reserve_store(keys(0, 1), write_through=True)
    assert res is not None
    assert b.loadable(keys(0, 1)) is None and b.source(key(0)) is None
    b.gathered(res.keys, res.writes, [True, False])
    assert b.loadable(keys(0, 1)) == 1  # 1's gather failed: a miss, not "ask again"
    b.written(res.keys, res.writes[0], [True, False], [True, True])
    assert b.lower["disk"].status(key(1)) is SlotStatus.EMPTY  # never written down
    b.check_integrity(idle=True)


def test_a_bad_promotion_dooms_its_source_and_frees_its_host_slot() -> None:
    b = book()
    b.adopt_index(TierIndex(b"f" * 16, CHUNK, (("disk", ((key(0), 3), (key(1), 0))),)))
    res = b.reserve_load(keys(0, 1))
    assert res.promotions == (Promotion(0, "disk", 3), Promotion(1, "disk", 0))
    b.loaded(res.keys, res.promotions, [True, False])
    assert [b.host.status(k) for k in keys(0, 1)] == [SlotStatus.READY, SlotStatus.EMPTY]
    assert [b.lower["disk"].status(k) for k in keys(0, 1)] == [SlotStatus.READY, SlotStatus.EMPTY]
    b.check_integrity(idle=True)


def test_bad_calls_change_nothing() -> None:
    b = book()
    store_through(b, keys(0))
    before = state(b.managers())
    with pytest.raises(InvalidArgumentError, match="no lower tier named 'tape'"):
        b.written(keys(0), TierWrite("tape", (0,), (0,)), [True], [True])
    with pytest.raises(IllegalTransitionError, match="no good copy"):
        b.write_down(keys(0, 5))
    with pytest.raises(InvalidArgumentError, match=r"outside 0\.\.3"):
        b.adopt("disk", {key(7): 4})
    with pytest.raises(InvalidArgumentError, match="expected 1 ok flags"):
        b.gathered(keys(0), (), [True, True])
    with pytest.raises(InvalidArgumentError):
        b.reserve_store([key(3), key(3)], write_through=True)
    assert state(b.managers()) == before
    host = OffloadManager("host", 2)
    with pytest.raises(InvalidArgumentError, match="distinct names"):
        TierBook(host, [OffloadManager("disk", 2), OffloadManager("disk", 2)])
    with pytest.raises(InvalidArgumentError, match="distinct names"):
        TierBook(host, [OffloadManager("host", 2)])
    b.check_integrity(idle=True)


def test_the_cascade_decides_nothing_itself(tmp_path: Path) -> None:
    c = build_cascade(
        OffloadConfig(host_slots=2),
        LAYOUT,
        BPC,
        filled_pool(LAYOUT),
        lower=[DiskTier(tmp_path / "d", 4, CHUNK, LAYOUT.fingerprint())],
    )
    assert c.book.host is c.host_manager and c.book.managers() == c.managers()
    assert list(c.book.lower.values()) == [mgr for _tier, mgr in c.lower]
    c.close()


# -- one book, two executors ---------------------------------------------------------------------
class _FlakyDisk(DiskTier):
    """A disk tier whose reads of the ``bad`` chunks come back CORRUPT (as a flipped bit)."""

    bad: frozenset[ChunkKey] = frozenset()

    def read(
        self, slots: Sequence[SlotId], keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]
    ) -> list[ReadOutcome]:
        got = super().read(slots, keys, outs)
        return [ReadOutcome.CORRUPT if k in self.bad else o for k, o in zip(keys, got, strict=True)]


def _blocks(*chunks: int) -> list[BlockId]:
    return [BlockId(BPC * c + j) for c in chunks for j in range(BPC)]


def _through_cascade(c: TierCascade, op: str, idx: list[int]) -> object:
    ks = keys(*idx)
    if op == "evict":
        c.host_manager.evict([k for k in ks if c.host_manager.status(k) is SlotStatus.READY])
        return None
    c.lookup(ks)
    if op == "store":
        c.store(ks, _blocks(*idx))
        return [e.keys for e in c.drain() if isinstance(e, StoreDone)]
    ticket = c.load(ks, _blocks(*range(8, 8 + len(ks))))
    done = [(e.keys, e.ok) for e in c.drain() if isinstance(e, LoadDone)]
    return None if ticket is None else (ticket.sources, done)


def _through_book(b: TierBook, bad: frozenset[ChunkKey], op: str, idx: list[int]) -> object:
    ks = keys(*idx)
    if op == "evict":
        b.host.evict([k for k in ks if b.host.status(k) is SlotStatus.READY])
        return None
    b.lookup(ks)
    if op == "store":
        res = b.reserve_store(ks, write_through=True)
        if res is None or not res.keys:
            return []
        ok = [True] * len(res.keys)
        b.gathered(res.keys, res.writes, ok)
        for w in res.writes:
            b.written(res.keys, w, ok, [True] * len(w.indices))
        return [res.keys]
    load = b.reserve_load(ks)
    if not load.keys:
        return None
    flags = tuple(s == "host" or k not in bad for k, s in zip(load.keys, load.sources, strict=True))
    b.loaded(load.keys, load.promotions, flags)
    return (load.sources, [(load.keys, flags)])


_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "load", "evict"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True),
    ),
    min_size=4,
    max_size=14,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_ops,
    policy=st.sampled_from(["lru", "arc"]),
    host_slots=st.integers(2, 3),
    disk_slots=st.integers(2, 4),
    admission=st.integers(1, 2),
    bad=st.frozensets(st.integers(0, 3), max_size=2),
)
def test_one_book_serves_the_cascade_and_the_vllm_connector_alike(
    *,
    ops: list[tuple[str, list[int]]],
    policy: str,
    host_slots: int,
    disk_slots: int,
    admission: int,
    bad: frozenset[int],
) -> None:
    cfg = OffloadConfig(host_slots=host_slots, policy=policy, admission_min_lookups=admission)
    bad_keys = frozenset(keys(*bad))
    b = TierBook.build(cfg, [("disk", disk_slots)])
    with tempfile.TemporaryDirectory() as tmp:
        disk = _FlakyDisk(Path(tmp) / "d", disk_slots, CHUNK, LAYOUT.fingerprint())
        disk.bad = bad_keys
        c = build_cascade(cfg, LAYOUT, BPC, filled_pool(LAYOUT), lower=[disk])
        try:
            for op, idx in ops:
                assert _through_cascade(c, op, idx) == _through_book(b, bad_keys, op, idx)
                assert state(c.managers()) == state(b.managers())
                c.check_integrity()
                b.check_integrity(idle=True)
        finally:
            c.close()
