"""A request admitted while this worker is storing (or still computing) its prefix waits for
those stores and loads the chunks, never recomputes them: it loads the stored bytes after the
store lands, computes everything after a failed store or a stopped promiser, never blocks a
full pool, and parks only when it may (#30). Exact counts and bytes; no timed assertions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.errors import InvalidArgumentError, TransportError
from kvplane.ids import ChunkKey, JobId, RequestId
from kvplane.layout import KVLayout
from kvplane.offload import OffloadConfig
from kvplane.serving.decode_worker import DecodeWorker
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import (
    LoadFinished,
    LoadStarted,
    PrefixOffload,
    PrefixSettings,
    StoreFinished,
)
from kvplane.serving.prefix_waits import Parked, PrefixWaits, check_wait_s
from kvplane.serving.producers.base import PoolTensor
from kvplane.serving.producers.synthetic import SyntheticDecoder, SyntheticProducer
from kvplane.serving.router.router import Router
from kvplane.testing.cluster import (
    MLA,
    TEST_SECRET,
    Cluster,
    base_config,
    check_balanced,
    prompt,
    wait_for,
)

BS, BPC = 4, 2
TPC = BS * BPC
SHARED = list(range(100, 116))  # two full chunks
A, B, C = RequestId("a"), RequestId("b"), RequestId("c")


def _offload(pool: BlockPool, wait_s: float = 60.0) -> tuple[PrefixOffload, torch.Tensor]:
    layout = KVLayout.gqa(num_blocks=pool.num_blocks, block_size=BS, num_layers=2, kv_heads=2,
                          head_dim=8, dtype=torch.float32)  # fmt: skip
    kv = PoolTensor(layout, torch.randn(layout.shape, generator=torch.Generator().manual_seed(0)))
    config = OffloadConfig(host_slots=8, admission_min_lookups=0, pin_memory=False)
    return PrefixOffload(PrefixSettings(config, BPC, pending_wait_s=wait_s), kv, pool), kv.tensor


def _table(pool: BlockPool, rid: str, tail: list[int]) -> BlockTable:
    table = BlockTable(RequestId(rid), BS, BlockHasher(seed=7, fingerprint=b"m"))
    assert table.admit(pool, [*SHARED, *tail]) is not None
    return table


def _drain(off: PrefixOffload) -> list[object]:
    events: list[object] = []
    while off.busy or off.loading:
        events += off.wait(1.0)
    return events


def _prefix(kv: torch.Tensor, table: BlockTable) -> torch.Tensor:
    return kv[list(table.block_ids[: 2 * BPC])].clone()


def _close(off: PrefixOffload, pool: BlockPool, *tables: BlockTable) -> None:
    for table in tables:
        table.release(pool)
    off.close()
    off.check_integrity()
    pool.check_integrity()
    assert len(off.waits) == 0 and pool.num_free_blocks == pool.num_blocks


def test_a_request_admitted_during_the_store_loads_the_stored_bytes_after_it_lands() -> None:
    pool = BlockPool(32, BS)
    off, kv = _offload(pool)
    first = _table(pool, "a", [1, 2, 3])
    assert off.begin_load(A, first) is None
    want = _prefix(kv, first)
    assert off.store(A, first) == 2  # in flight until a poll applies it
    second = _table(pool, "b", [4, 5, 6])
    assert off.begin_load(B, second) == LoadStarted(0, 0, (), waiting=2)
    assert off.loading == 1
    assert _drain(off) == [StoreFinished(A, 2), LoadFinished(B, 2 * TPC, 2, 0)]
    assert torch.equal(_prefix(kv, second), want)
    assert off.hits["host"] == 2 and off.counts["pending_waits"] == 1
    assert off.counts["pending_waits_timed_out"] == 0
    _close(off, pool, first, second)


def test_a_failed_store_is_a_miss_and_the_request_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BlockPool(32, BS)
    off, _kv = _offload(pool)

    def fail(*_args: object) -> None:
        raise TransportError("copy refused")

    monkeypatch.setattr(off.cascade.copier, "gather", fail)
    first = _table(pool, "a", [1, 2, 3])
    assert off.store(A, first) == 2
    second = _table(pool, "b", [4, 5, 6])
    assert off.begin_load(B, second) == LoadStarted(0, 0, (), waiting=2)
    assert _drain(off) == [StoreFinished(A, 0), LoadFinished(B, 0, 0, 0)]
    assert sum(off.hits.values()) == 0
    _close(off, pool, first, second)


def test_a_request_waits_for_a_computing_one_until_its_store_lands() -> None:
    pool = BlockPool(32, BS)
    off, kv = _offload(pool)
    first = _table(pool, "a", [1, 2, 3])
    off.expect(A, first)  # computing: nothing stored, nothing pending
    second = _table(pool, "b", [4, 5, 6, 7, 8, 9, 10, 11, 12])  # 3 chunks, the third its own
    assert off.begin_load(B, second) == LoadStarted(0, 0, (), waiting=2)
    assert off.poll() == [] and off.loading == 1  # still parked: a promise has no job to wait on
    want = _prefix(kv, first)
    assert off.store(A, first) == 2
    assert _drain(off) == [StoreFinished(A, 2), LoadFinished(B, 2 * TPC, 2, 0)]
    assert torch.equal(_prefix(kv, second), want)
    _close(off, pool, first, second)


def test_a_stopped_promiser_releases_its_waiters_to_compute() -> None:
    pool = BlockPool(32, BS)
    off, _kv = _offload(pool)
    first = _table(pool, "a", [1, 2, 3])
    off.expect(A, first)
    second = _table(pool, "b", [4, 5, 6])
    assert off.begin_load(B, second) == LoadStarted(0, 0, (), waiting=2)
    off.forget(A)
    off.forget(A)  # idempotent
    assert off.poll() == [LoadFinished(B, 0, 0, 0)]
    assert off.store(A, first) == 2  # a late store parks nobody
    assert _drain(off) == [StoreFinished(A, 2)]
    _close(off, pool, first, second)


def test_a_parked_request_in_a_full_pool_does_not_block_the_store_it_waits_for() -> None:
    pool = BlockPool(10, BS)  # a and b take 5 blocks each
    off, kv = _offload(pool)
    first = _table(pool, "a", [1, 2, 3])
    assert off.store(A, first) == 2
    second = _table(pool, "b", [4, 5, 6])
    assert pool.num_free_blocks == 0
    assert off.begin_load(B, second) == LoadStarted(0, 0, (), waiting=2)
    third = BlockTable(C, BS, BlockHasher(seed=7, fingerprint=b"m"))
    assert third.admit(pool, [*SHARED, 7]) is None  # c waits for memory, not for b
    assert _drain(off) == [StoreFinished(A, 2), LoadFinished(B, 2 * TPC, 2, 0)]
    assert torch.equal(_prefix(kv, second), _prefix(kv, first))
    first.release(pool)
    assert third.admit(pool, [*SHARED, 7]) is not None
    assert off.begin_load(C, third) == LoadStarted(2, 2, ("host", "host"))  # ticket 1 was b
    assert _drain(off) == [LoadFinished(C, 2 * TPC, 2, 0)]
    _close(off, pool, second, third)


def test_without_a_wait_bound_a_pending_prefix_is_a_miss_as_before() -> None:
    pool = BlockPool(32, BS)
    off, _kv = _offload(pool, wait_s=0)
    first = _table(pool, "a", [1, 2, 3])
    off.expect(A, first)
    assert off.store(A, first) == 2
    second = _table(pool, "b", [4, 5, 6])
    assert off.begin_load(B, second) is None
    assert _drain(off) == [StoreFinished(A, 2)]
    assert off.counts["pending_waits"] == 0
    _close(off, pool, first, second)


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(8, "big"))


def test_the_book_covers_tracked_chunks_only_and_unparks_on_the_deadline() -> None:
    waits = PrefixWaits(1.0)
    waits.storing(A, JobId(1), [_key(1), _key(2)])
    waits.promise(C, [_key(3), _key(4)])
    got = waits.cover([_key(0), _key(1), _key(3), _key(5)], ["host", None, None, None],
                      [False, True, False, True])  # fmt: skip
    assert (got.run, got.jobs, got.requests) == (3, frozenset({JobId(1)}), frozenset({C}))
    untracked = waits.cover([_key(1), _key(2)], [None, None], [False, True])  # not pending: gone
    assert untracked.run == 0
    table = BlockTable(B, BS, BlockHasher(seed=7, fingerprint=b"m"))
    waits.park(Parked(B, table, None, 10.0, {JobId(1)}, {C}))
    assert waits.due(9.0) == [] and len(waits) == 1
    waits.storing(C, None, ())  # c stored nothing: b now waits for job 1 only
    assert waits.due(9.0) == []
    (late,) = waits.due(10.0)  # the bound passed: unparked with job 1 still in flight
    assert late.jobs == {JobId(1)} and not late.requests and len(waits) == 0


@contextlib.contextmanager
def _slow_cluster(host_slots: int) -> Iterator[tuple[PrefillWorker, Router]]:
    """A prefill worker (synthetic MLA, 0.2 s a step, host offload of ``host_slots`` chunks of
    2 blocks, waits bounded at 60 s), a decode worker and a router, connected; closed after."""
    settings = PrefixSettings(OffloadConfig(host_slots=host_slots, pin_memory=False), 2,
                              pending_wait_s=60.0)  # fmt: skip
    spec = replace(MLA, compute_s_per_step=0.2)
    p = PrefillWorker(base_config(), SyntheticProducer(spec), offload=settings)
    d = DecodeWorker(replace(base_config(), name="decode"), SyntheticDecoder(spec))
    p.start()
    d.start()
    r = Router([p.address], [d.address], timeout_s=30.0, secret=TEST_SECRET)
    with Cluster(p, d, r):
        r.connect()
        yield p, r


def test_pd_of_a_prefix_whose_first_request_is_computing_waits_and_loads_it() -> None:
    """Prefill worker (synthetic MLA, 0.2 s a step, host offload, chunks of 2 blocks of 16):
    b, sharing a's 192-token prefix, arrives while a computes, waits, loads all 6 chunks."""
    with _slow_cluster(host_slots=16) as (p, r):
        a = prompt(np.random.default_rng(0), 200)
        fut = r.submit("a", a, step_size=32)
        wait_for(lambda: "a" in p._requests, what="a on prefill")
        res_b = r.generate("b", [*a[:192], *range(1, 9)], step_size=32)
        res_a = fut.result(timeout=30)
        for res in (res_a, res_b):
            assert (res.state, res.mismatches) == ("success", 0)
        counters = check_balanced(r)["prefill"].counters
    assert counters["offload_pending_waits"] == 1
    assert counters["offload_hit_chunks_host"] == 6
    assert counters.get("offload_pending_waits_timed_out", 0) == 0


def test_a_dropped_request_is_never_due_and_the_wait_bound_is_a_duration() -> None:
    waits = PrefixWaits(0)
    table = BlockTable(B, BS, BlockHasher(seed=7, fingerprint=b"m"))
    parked = Parked(B, table, None, 10.0, {JobId(1)}, set())
    waits.park(parked)
    assert waits.drop(B) is parked and len(waits) == 0
    assert waits.drop(B) is None  # idempotent
    waits.stored(JobId(1))
    assert waits.due(11.0) == []
    assert (check_wait_s("w", 0), check_wait_s("w", 2), check_wait_s("w", 1e6)) == (0, 2, 1e6)
    for bad in (-1, 1e6 + 1, float("nan"), float("inf"), True, "2"):
        with pytest.raises(
            InvalidArgumentError,
            match=r"^w must be a finite number >= 0 and at most 1e\+06 s, got ",
        ):
            check_wait_s("w", bad)
    with pytest.raises(InvalidArgumentError, match=r"PrefixWaits\.wait_s"):
        PrefixWaits(-0.5)


def test_a_parked_request_that_is_cancelled_frees_its_blocks_at_once() -> None:
    """b parks on a's prefix (a computes 20 steps of 0.2 s); cancelling b frees its blocks and
    slot while a still computes, and a's store later wakes nobody: nothing loads into b's
    freed blocks. Then a is cancelled too; every pool and ledger ends balanced."""
    with _slow_cluster(host_slots=64) as (p, r):
        a = prompt(np.random.default_rng(0), 640)  # 40 blocks of 16
        fut_a = r.submit("a", a, step_size=32)
        wait_for(lambda: "a" in p._requests, what="a on prefill")
        fut_b = r.submit("b", [*a[:192], *range(1, 9)], step_size=32)
        assert p.offload is not None
        waits = p.offload.waits
        wait_for(lambda: len(waits) == 1, what="b parked")
        assert r.cancel("b", side="prefill", reason="client gone")
        assert fut_b.result(timeout=30).state != "success"
        wait_for(lambda: r.stats()["prefill"].used_slots == 1, what="b's slot freed")
        held = r.stats()["prefill"]
        assert not fut_a.done()  # b was freed while a computes, not when a's store landed
        assert (held.used_blocks, held.used_slots, len(waits)) == (40, 1, 0)
        assert held.counters["worker_pending_waits_cancelled"] == 1
        assert r.cancel("a", side="prefill", reason="done")
        assert fut_a.result(timeout=30).state != "success"
        counters = check_balanced(r)["prefill"].counters
    assert counters["offload_pending_waits"] == 1
    assert counters.get("offload_hit_chunks_host", 0) == 0
    assert counters.get("offload_pending_waits_timed_out", 0) == 0
