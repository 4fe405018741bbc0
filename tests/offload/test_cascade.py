"""TierCascade end to end: stores cascade down, loads promote up with identical bytes; restart,
corruption, a Redis server that dies mid-run, load racing eviction, the fence, admission."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from offload_testlib import BAD_IDS, filled_pool, key, keys, tiny_layout

from kvplane.blocks import BlockPool
from kvplane.errors import BlockStateError, InvalidArgumentError, OffloadError
from kvplane.ids import BlockId, ChunkKey, JobId
from kvplane.metrics import MetricsRegistry
from kvplane.offload import (
    CascadeDone,
    LoadDone,
    OffloadConfig,
    SlotStatus,
    StoreDone,
    TierCascade,
    build_cascade,
)
from kvplane.offload.jobs import JobResult
from kvplane.offload.policies.arc import ARCPolicy
from kvplane.offload.tiers import DiskTier, RemoteTier, Tier
from kvplane.testing.redis_server import LocalRedisServer

BPC = 2
LAYOUT = tiny_layout(num_blocks=32)
CHUNK = BPC * LAYOUT.bytes_per_block


def blocks(*chunks: int) -> list[BlockId]:
    """Device blocks of chunk positions: chunk c lives in blocks 2c, 2c+1."""
    return [BlockId(BPC * c + j) for c in chunks for j in range(BPC)]


def canon(pool: torch.Tensor) -> torch.Tensor:
    return LAYOUT.canonical_view(pool)


def make(
    lower: list[Tier] | None = None,
    host_slots: int = 4,
    m: MetricsRegistry | None = None,
    **kw: object,
) -> tuple[TierCascade, torch.Tensor, MetricsRegistry]:
    m = m if m is not None else MetricsRegistry()
    pool = filled_pool(LAYOUT, seed=3)
    cfg = OffloadConfig(host_slots=host_slots, **kw)  # type: ignore[arg-type]
    return build_cascade(cfg, LAYOUT, BPC, pool, metrics=m, lower=lower), pool, m


def disk(tmp_path: Path, m: MetricsRegistry | None = None, slots: int = 8) -> DiskTier:
    return DiskTier(tmp_path / "slots", slots, CHUNK, LAYOUT.fingerprint(), metrics=m)


def store(c: TierCascade, ks: list[ChunkKey], bl: list[BlockId]) -> list[object]:
    c.lookup(ks)
    assert c.store(ks, bl) is not None
    return c.drain()


def load_ok(c: TierCascade, pool: torch.Tensor, ks: list[ChunkKey], dst: list[BlockId]) -> LoadDone:
    ticket = c.load(ks, dst)
    assert ticket is not None and list(ticket.keys) == ks
    done = [e for e in c.drain() if isinstance(e, LoadDone)]
    assert len(done) == 1 and done[0].ticket_id == ticket.ticket_id
    return done[0]


def test_host_round_trip_gives_identical_bytes() -> None:
    c, pool, m = make()
    original = pool.clone()
    events = store(c, keys(0, 1, 2), blocks(0, 1, 2))
    assert events == [StoreDone(1, tuple(keys(0, 1, 2)), (True, True, True))]
    assert c.lookup(keys(0, 1, 2, 3)).where == ("host", "host", "host", None)
    done = load_ok(c, pool, keys(0, 1, 2), blocks(10, 11, 12))
    assert done.ok == (True, True, True) and done.usable == 3
    assert torch.equal(canon(pool)[20:26], canon(original)[0:6])
    assert m.value("offload_bytes", {"path": "device_to_host"}, "_total") == 3 * CHUNK
    assert m.value("offload_bytes", {"path": "host_to_device"}, "_total") == 3 * CHUNK
    c.check_integrity()
    c.close()


def test_chunk_moves_are_plans_with_one_op_per_chunk_carrying_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, pool, _ = make()
    moves: list[tuple[str, object]] = []
    for name in ("gather", "scatter"):
        real = getattr(c.copier.plans, name)

        def spy(*args: object, _real: object = real, _name: str = name) -> object:
            move = _real(*args)  # type: ignore[operator]
            moves.append((_name, move))
            return move

        monkeypatch.setattr(c.copier.plans, name, spy)
    store(c, keys(0, 1, 2), blocks(0, 1, 2))
    load_ok(c, pool, keys(1, 2), blocks(10, 11))
    got = [
        (n, [op.chunk_keys for p in m.plan.plans for op in p.ops])  # type: ignore[attr-defined]
        for n, m in moves
    ]
    assert got == [
        ("gather", [(k,) for k in keys(0, 1, 2)]),
        ("scatter", [(k,) for k in keys(1, 2)]),
    ]
    c.check_integrity()
    c.close()


def test_cascade_down_and_promotion_up_through_disk_and_remote(
    tmp_path: Path, redis_url: str, redis_namespace: str
) -> None:
    m = MetricsRegistry()
    remote = RemoteTier(
        redis_url, 8, CHUNK, LAYOUT.fingerprint(), namespace=redis_namespace, metrics=m
    )
    c, pool, _ = make(lower=[disk(tmp_path, m), remote], m=m)
    original = pool.clone()
    events = store(c, keys(0, 1), blocks(0, 1))
    tiers_done = sorted((e.tier, e.ok) for e in events if isinstance(e, CascadeDone))
    assert tiers_done == [("disk", (True, True)), ("remote", (True, True))]
    host, disk_mgr, _remote_mgr = c.managers()
    host.evict(keys(0, 1))
    disk_mgr.evict(keys(1))  # chunk 1 now lives only in Redis
    assert c.lookup(keys(0, 1)).where == ("disk", "remote")
    pool.zero_()
    ticket = c.load(keys(0, 1), blocks(5, 6))
    assert ticket is not None and ticket.sources == ("disk", "remote")
    done = [e for e in c.drain() if isinstance(e, LoadDone)]
    assert done[0].ok == (True, True)
    assert torch.equal(canon(pool)[10:14], canon(original)[0:4])  # identical bytes
    assert c.lookup(keys(0, 1)).where == ("host", "host")  # promoted back up
    assert host.status(key(1)) is SlotStatus.READY
    for path in ("disk_to_host", "remote_to_host", "host_to_disk", "host_to_remote"):
        assert m.value("offload_bytes", {"path": path}, "_total") > 0, path
    c.check_integrity()
    c.close()


def test_restart_reindexes_the_disk_tier(tmp_path: Path) -> None:
    c, pool, _ = make(lower=[disk(tmp_path)])
    original = pool.clone()
    store(c, keys(0, 1, 2), blocks(0, 1, 2))
    c.close()
    c2, pool2, _ = make(lower=[disk(tmp_path)])  # a new process, same file
    assert c2.lookup(keys(0, 1, 2)).where == ("disk", "disk", "disk")
    pool2.zero_()
    assert load_ok(c2, pool2, keys(0, 1, 2), blocks(3, 4, 5)).ok == (True,) * 3
    assert torch.equal(canon(pool2)[6:12], canon(original)[0:6])
    c2.check_integrity()
    c2.close()


def test_corrupt_disk_chunk_is_a_miss_never_wrong_kv(tmp_path: Path) -> None:
    m = MetricsRegistry()
    d = disk(tmp_path, m)
    c, pool, _ = make(lower=[d])
    store(c, keys(0, 1, 2), blocks(0, 1, 2))
    host, disk_mgr = c.managers()
    host.evict(keys(0, 1, 2))
    slot = disk_mgr.table.slot_of(key(1))
    assert slot is not None
    with (tmp_path / "slots").open("r+b") as f:  # flip one bit of chunk 1's payload
        f.seek(slot * d.slot_stride + 100)
        b = f.read(1)
        f.seek(slot * d.slot_stride + 100)
        f.write(bytes([b[0] ^ 0x80]))
    pool.zero_()
    done = load_ok(c, pool, keys(0, 1, 2), blocks(8, 9, 10))
    assert done.ok == (True, False, True) and done.usable == 1
    assert m.value("offload_corrupt_chunks", {"tier": "disk", "reason": "checksum"}, "_total") == 1
    assert not canon(pool)[18:20].view(torch.uint8).any()  # the bad chunk was never scattered
    assert c.lookup(keys(0, 1, 2)).where == ("host", None, "host")  # dropped from disk
    assert disk_mgr.status(key(1)) is SlotStatus.EMPTY
    c.check_integrity()
    c.close()


def test_redis_server_going_away_mid_run(tmp_path: Path) -> None:
    m = MetricsRegistry()
    with LocalRedisServer() as server:  # stopped even if an assertion fails
        remote = RemoteTier(server.url, 8, CHUNK, LAYOUT.fingerprint(), timeout_s=2.0, metrics=m)
        c, _pool, _ = make(lower=[remote], m=m)
        store(c, keys(0), blocks(0))
        host, remote_mgr = c.managers()
        host.evict(keys(0))
        server.kill()
        events = store(c, keys(1), blocks(1))  # the host store works; its cascade fails
        assert next(e for e in events if isinstance(e, CascadeDone)).ok == (False,)
        assert remote_mgr.status(key(1)) is SlotStatus.EMPTY  # the failed store freed its slot
        ticket = c.load(keys(0), blocks(4))
        assert ticket is not None and ticket.sources == ("remote",)
        done = next(e for e in c.drain() if isinstance(e, LoadDone))
        assert done.ok == (False,) and done.usable == 0
        assert c.lookup(keys(0, 1)).where == (None, "host")
        assert m.value("offload_tier_errors", {"tier": "remote"}, "_total") == 2
        assert m.value("offload_failed_chunks", {"path": "remote_to_host"}, "_total") == 1
        c.check_integrity()
        c.close()


def test_load_racing_eviction() -> None:
    c, _pool, _ = make(host_slots=2)
    store(c, keys(0, 1), blocks(0, 1))
    ticket = c.load(keys(0), blocks(6))  # pins chunk 0 until the owner harvests the load
    assert ticket is not None
    c.lookup(keys(2, 3))
    assert c.store(keys(2, 3), blocks(2, 3)) is None  # needs 2 victims; only 1 is evictable
    assert c.store(keys(2), blocks(2)) is not None  # evicts 1, never the chunk being loaded
    events = c.drain()
    assert any(isinstance(e, LoadDone) and e.ok == (True,) for e in events)
    assert c.lookup(keys(0, 1, 2)).where == ("host", None, "host")
    c.check_integrity()
    c.close()


def test_fence_holds_device_blocks_until_the_store_is_harvested() -> None:
    bp = BlockPool(LAYOUT.num_blocks, LAYOUT.block_size)
    pool = filled_pool(LAYOUT)
    c = build_cascade(OffloadConfig(host_slots=4), LAYOUT, BPC, pool, block_pool=bp)
    mine = bp.allocate(4)
    assert mine is not None
    c.lookup(keys(0, 1))
    job = c.store(keys(0, 1), mine)
    assert job is not None
    bp.free(mine)  # the request is done; its blocks must not be reused before the copy
    assert c.fence.fenced_blocks() == set(mine) and bp.num_free_blocks == LAYOUT.num_blocks - 4
    c.drain()
    assert not c.fence.fenced_blocks() and bp.num_free_blocks == LAYOUT.num_blocks
    bp.check_integrity()
    c.check_integrity()
    c.close()


def test_admission_counts_lookups_in_every_tier(tmp_path: Path) -> None:
    c, _pool, _ = make(lower=[disk(tmp_path)], admission_min_lookups=2)
    c.lookup(keys(0))
    assert c.store(keys(0), blocks(0)) is None  # looked up once: not admitted yet
    c.lookup(keys(0))
    assert c.store(keys(0), blocks(0)) is not None
    c.drain()
    assert c.lookup(keys(0)).where == ("host",)
    assert c.managers()[1].status(key(0)) is SlotStatus.READY  # disk admitted it too
    c.check_integrity()
    c.close()


def test_load_stops_where_the_host_has_no_room_to_promote(tmp_path: Path) -> None:
    c, pool, _ = make(lower=[disk(tmp_path)], host_slots=2)
    original = pool.clone()
    store(c, keys(0, 1), blocks(0, 1))
    store(c, keys(2), blocks(2))  # host evicts 0 (LRU); disk holds 0, 1, 2
    assert c.lookup(keys(1, 2, 0)).where == ("host", "host", "disk")
    pool.zero_()
    ticket = c.load(keys(1, 2, 0), blocks(5, 6, 7))  # 1, 2 pinned fill the host: 0 cannot come
    assert ticket is not None and ticket.keys == tuple(keys(1, 2))
    done = next(e for e in c.drain() if isinstance(e, LoadDone))
    assert done.ok == (True, True)
    assert torch.equal(canon(pool)[10:14], canon(original)[2:6])
    assert not canon(pool)[14:16].view(torch.uint8).any()
    assert load_ok(c, pool, keys(0), blocks(7)).ok == (True,)  # alone it fits (evicts LRU 1)
    assert torch.equal(canon(pool)[14:16], canon(original)[0:2])
    c.check_integrity()
    c.close()


def test_bad_input_changes_nothing() -> None:
    c, _pool, _ = make()
    store(c, keys(0), blocks(0))
    before = [(mgr.table.keys(), mgr.table.num_free) for mgr in c.managers()]
    c.lookup(keys(5))
    with pytest.raises(InvalidArgumentError):
        c.store(keys(5), blocks(5, 6))  # two chunks of blocks for one key
    with pytest.raises(InvalidArgumentError):
        c.load(keys(0), [BlockId(40), BlockId(41)])  # outside the pool
    with pytest.raises(InvalidArgumentError):
        c.store([key(5), key(5)], blocks(5, 6))
    assert c.load(keys(7, 0), blocks(7, 8)) is None  # a miss at the first key loads nothing
    assert [(mgr.table.keys(), mgr.table.num_free) for mgr in c.managers()] == before
    c.check_integrity()
    c.close()
    with pytest.raises(OffloadError, match="closed"):
        c.store(keys(5), blocks(5))
    with pytest.raises(OffloadError, match="closed"):
        c.load(keys(0), blocks(5))
    assert [(mgr.table.keys(), mgr.table.num_free) for mgr in c.managers()] == before
    c.check_integrity()


def test_arc_counts_neither_the_write_down_nor_a_promotion_as_a_hit(tmp_path: Path) -> None:
    c, pool, _ = make(lower=[disk(tmp_path)], policy="arc")
    arc = c.host_manager.policy
    assert isinstance(arc, ARCPolicy)
    store(c, keys(0, 1), blocks(0, 1))  # host pins both to write them down to disk
    assert (arc.t1, arc.t2) == (keys(0, 1), [])  # stored once, never requested: T1
    load_ok(c, pool, keys(0), blocks(5))
    assert (arc.t1, arc.t2) == (keys(1), keys(0))  # a requested load is a hit
    c.close()
    c2, pool2, _ = make(lower=[disk(tmp_path)], policy="arc")  # restart: host empty, no ghosts
    arc2 = c2.host_manager.policy
    assert isinstance(arc2, ARCPolicy)
    assert load_ok(c2, pool2, keys(1), blocks(6)).ok == (True,)  # promoted from disk
    assert (arc2.t1, arc2.t2) == (keys(1), [])  # one request: one reference
    c2.check_integrity()
    c2.close()


def test_a_store_refused_by_the_fence_evicts_nothing() -> None:
    bp = BlockPool(LAYOUT.num_blocks, LAYOUT.block_size)
    c = build_cascade(OffloadConfig(host_slots=2), LAYOUT, BPC, filled_pool(LAYOUT), block_pool=bp)
    held = bp.allocate(4)
    assert held is not None
    store(c, keys(0, 1), held)  # the host is full
    c.lookup(keys(2))
    host = c.host_manager
    before = (host.table.keys(), host.policy.order(), bp.free_queue_order(), len(c.fence))
    with pytest.raises(BlockStateError, match="free and not cached"):
        c.store(keys(2), blocks(10))  # blocks 20, 21 are free and hold no KV
    assert (host.table.keys(), host.policy.order(), bp.free_queue_order(), len(c.fence)) == before
    assert c.jobs.in_flight == 0
    bp.free(held)
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_block_ids_must_be_integers(bad: object) -> None:
    c, _pool, _ = make()
    store(c, keys(0), blocks(0))
    c.lookup(keys(1))
    before = [(mgr.table.keys(), mgr.table.num_free) for mgr in c.managers()]
    with pytest.raises(InvalidArgumentError, match="block ids"):
        c.store(keys(1), bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="block ids"):
        c.load(keys(0), bad)  # type: ignore[arg-type]
    assert [(mgr.table.keys(), mgr.table.num_free) for mgr in c.managers()] == before
    assert c.jobs.in_flight == 0
    assert c.store(keys(1), np.array([2, 3], dtype=np.int32)) is not None  # any int dtype
    c.drain()
    c.check_integrity()
    c.close()


def test_a_result_that_raises_does_not_strand_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    c, _pool, _ = make()
    c.lookup(keys(0, 1))
    j1, j2 = c.store(keys(0), blocks(0)), c.store(keys(1), blocks(1))
    assert j1 is not None and j2 is not None
    got: list[JobResult] = []
    while len(got) < 2:  # harvest both results unapplied, then hand them over in one batch
        got += c.jobs.wait(10)
    real = c.fence.release

    def release(job_id: JobId) -> None:
        if job_id == j1:
            raise OffloadError("boom")
        real(job_id)

    monkeypatch.setattr(c.jobs, "poll", lambda: got)
    monkeypatch.setattr(c.fence, "release", release)
    with pytest.raises(OffloadError, match="boom"):
        c.poll()
    monkeypatch.undo()
    host = c.host_manager
    assert host.status(key(1)) is SlotStatus.READY  # job 2 was applied anyway
    assert len(c.fence) == 1 and c.jobs.in_flight == 0  # only job 1's fence is left
    assert c.wait(10) == [StoreDone(j2, (key(1),), (True,))]  # its event comes next, at once
    assert c.poll() == []
    c.fence.release(j1)  # settle the job whose application failed
    host.complete_store(keys(0), False)
    c.check_integrity()
    c.close()


class _TwoRounds:
    """Job results handed over in two rounds: ``first`` by poll, ``second`` by wait."""

    closed = False

    def __init__(self, first: JobResult, second: JobResult) -> None:
        self.rounds = [[first], [second]]

    @property
    def in_flight(self) -> int:
        return len(self.rounds)

    def poll(self) -> list[JobResult]:
        return self.rounds.pop(0) if len(self.rounds) == 2 else []

    def wait(self, timeout: float | None = None) -> list[JobResult]:
        return self.rounds.pop(0)


def test_drain_keeps_the_events_of_earlier_rounds_when_a_later_one_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, _pool, _ = make()
    c.lookup(keys(0, 1))
    j1, j2 = c.store(keys(0), blocks(0)), c.store(keys(1), blocks(1))
    assert j1 is not None and j2 is not None
    got: list[JobResult] = []
    while len(got) < 2:
        got += c.jobs.wait(10)
    r1, r2 = sorted(got, key=lambda r: r.job.job_id)
    real = c.fence.release

    def release(job_id: JobId) -> None:
        if job_id == j2:
            raise OffloadError("boom")
        real(job_id)

    runner = c.jobs
    monkeypatch.setattr(c, "jobs", _TwoRounds(r1, r2))  # job 1 applied by poll, job 2 by wait
    monkeypatch.setattr(c.fence, "release", release)
    with pytest.raises(OffloadError, match="boom"):
        c.drain()
    monkeypatch.undo()
    assert c.jobs is runner
    assert c.host_manager.status(key(0)) is SlotStatus.READY  # job 1 was applied...
    assert c.poll() == [StoreDone(j1, (key(0),), (True,))]  # ...and its event is delivered
    c.fence.release(j2)  # settle the job whose application failed
    c.host_manager.complete_store(keys(1), False)
    c.check_integrity()
    c.close()


def test_lookup_counts_an_access_only_in_the_tier_a_load_reads(tmp_path: Path) -> None:
    c, _pool, _ = make(lower=[disk(tmp_path)], policy="arc")
    store(c, keys(0, 1), blocks(0, 1))  # in host and, written down, on disk
    host, low = c.host_manager, c.lower[0][1]
    assert isinstance(host.policy, ARCPolicy) and isinstance(low.policy, ARCPolicy)
    assert c.lookup(keys(0, 1)).where == ("host", "host")
    assert (host.policy.t1, host.policy.t2) == ([], keys(0, 1))  # a load reads host
    assert (low.policy.t1, low.policy.t2) == (keys(0, 1), [])  # disk was not used
    assert c.lookup(keys(2, 0)).hit_run == 0  # a gap first: nothing usable, nothing used
    assert (host.policy.t2, low.policy.t1) == (keys(0, 1), keys(0, 1))
    c.check_integrity()
    c.close()


def test_a_deferred_write_down_is_written_once_the_doomed_copy_is_gone(tmp_path: Path) -> None:
    c, _pool, _ = make(lower=[disk(tmp_path)])
    store(c, keys(0), blocks(0))  # host and disk
    host, low = c.host_manager, c.lower[0][1]
    low.prepare_load(keys(0))  # two readers of the disk copy (as two concurrent loads)...
    low.prepare_load(keys(0))
    low.complete_load(keys(0), ok=False)  # ...one found it bad: doomed, the other still reads
    host.evict(keys(0))
    c.lookup(keys(0))
    assert c.store(keys(0), blocks(0)) is not None  # host stores it afresh...
    events = c.drain()
    assert [type(e) for e in events] == [StoreDone]  # ...but the doomed disk copy is busy
    low.complete_load(keys(0))  # the last reader is done: the bad copy is dropped
    assert low.status(key(0)) is SlotStatus.EMPTY
    assert [(type(e), e.keys) for e in c.drain()] == [(CascadeDone, (key(0),))]  # written down
    assert low.status(key(0)) is SlotStatus.READY and low.is_hit(key(0))
    c.check_integrity()
    c.close()
