"""Tensor parallelism without vLLM: one scheduler side, one worker side per rank.

The ranks' reports reach the scheduler merged per step as vLLM's ``KVOutputAggregator`` merges
them (``WorkerReport.merge``), each rank's part in whatever step that rank finished it; a chunk
is stored (or loaded) only once every rank's shard is. Per-rank identities and places: exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from pathlib import Path

import pytest
import torch
from vllm_testlib import disk_extra, vllm_kv_caches

from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.fingerprint import EngineFingerprint
from kvplane.integrations.vllm.messages import JobReport, StepMeta, TierIndex, WorkerReport
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest, SchedulerSide
from kvplane.integrations.vllm.tp import RankTally, TPShard, combine_indices
from kvplane.integrations.vllm.wakeup import end_step
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.metrics import MetricsRegistry
from kvplane.offload.config import OffloadConfig

FP = EngineFingerprint(
    vllm_version="0.32.0",
    isa="x86_64:vec",
    kv_layout="LBHNC",
    dtype="float32/auto",
    block_size=4,
    block_shape=(1, 4, 8),
    num_layers=2,
    model="/m",
    weights="abc",
    tp_size=2,
)
K = [ChunkKey(bytes([i]) * 16) for i in range(4)]


# -- identities and places ----------------------------------------------------------------------
def test_every_rank_roots_keys_in_one_digest_apart_from_tp1() -> None:
    r0, r1 = TPShard(0, 2), TPShard(1, 2)
    rank1 = dataclasses.replace(FP, tp_rank=1)
    assert r0.key_root(FP) == r1.key_root(rank1) == FP.digest()
    assert r0.key_root(FP) != dataclasses.replace(FP, tp_size=1).digest()
    shared = TPShard(1, 2, shared=True)  # MLA: the TP=1 engine's key space
    assert shared.key_root(rank1) == dataclasses.replace(FP, tp_size=1).digest()


def test_each_rank_has_its_own_tier_identity() -> None:
    layout_fp = bytes(range(16))
    want = hashlib.blake2b(
        b"kvplane/vllm-tp-shard/v1\0" + layout_fp + b"1/2", digest_size=16
    ).digest()
    assert TPShard(1, 2).tier_fingerprint(layout_fp) == want
    assert TPShard(0, 2).tier_fingerprint(layout_fp) != want
    assert TPShard(0, 1).tier_fingerprint(layout_fp) == layout_fp
    assert TPShard(1, 2, shared=True).tier_fingerprint(layout_fp) == layout_fp


def test_each_rank_has_its_own_disk_file_and_redis_namespace() -> None:
    off = OffloadConfig(disk_path=Path("/c/kv.bin"), remote_namespace="ns")
    assert TPShard().offload(off) == off
    one = TPShard(1, 2).offload(off)
    assert (one.disk_path, one.remote_namespace) == (Path("/c/kv.bin.tp1of2"), "ns.tp1of2")
    zero = TPShard(0, 2).offload(off)
    assert (zero.disk_path, zero.remote_namespace) == (Path("/c/kv.bin.tp0of2"), "ns.tp0of2")
    assert TPShard(0, 2, shared=True).offload(off) == off  # a TP=1 engine finds rank 0's
    assert TPShard(1, 2, shared=True).offload(off).disk_path == Path("/c/kv.bin.tp1of2")
    assert TPShard(1, 2).offload(OffloadConfig()).disk_path is None


@pytest.mark.parametrize(("rank", "size"), [(2, 2), (-1, 1), (0, 0)])
def test_a_rank_outside_its_group_is_refused(rank: int, size: int) -> None:
    with pytest.raises(InvalidArgumentError):
        TPShard(rank, size)


def test_a_lower_tier_chunk_counts_only_where_every_rank_holds_it_in_the_same_slot() -> None:
    a = TierIndex(b"f" * 16, 64, (("disk", ((K[0], 0), (K[1], 1), (K[2], 2))),))
    b = TierIndex(b"f" * 16, 64, (("disk", ((K[0], 0), (K[1], 5))),))
    got = combine_indices([a, b])
    assert got == TierIndex(b"f" * 16, 64, (("disk", ((K[0], 0),)),))
    assert combine_indices([a]) == a
    with pytest.raises(UnsupportedError, match="disagree"):
        combine_indices([a, dataclasses.replace(b, chunk_bytes=32)])


# -- joining the ranks' reports -------------------------------------------------------------------
def test_a_job_part_is_done_when_every_rank_reported_it_and_good_where_all_were() -> None:
    tally = RankTally(2)
    assert tally.add(JobReport(7, "host", (True, True, False), rank=1)) is None
    assert tally.add(JobReport(7, "disk", (True,), rank=1)) is None
    assert tally.waiting == 2
    assert tally.add(JobReport(7, "host", (True, False, True), rank=0)) == JobReport(
        7, "host", (True, False, False)
    )
    assert tally.add(JobReport(7, "disk", (True,), rank=0)) == JobReport(7, "disk", (True,))
    assert tally.waiting == 0
    assert RankTally(1).add(JobReport(3, "device", (True,))) == JobReport(3, "device", (True,))


def test_a_rank_reporting_twice_or_out_of_the_group_is_refused() -> None:
    tally = RankTally(2)
    tally.add(JobReport(1, "host", (True,), rank=0))
    with pytest.raises(InvalidArgumentError, match="twice"):
        tally.add(JobReport(1, "host", (True,), rank=0))
    with pytest.raises(InvalidArgumentError, match="chunks"):
        tally.add(JobReport(1, "host", (True, True), rank=1))
    with pytest.raises(InvalidArgumentError):
        tally.add(JobReport(2, "host", (True,), rank=2))


# -- one scheduler side, two worker sides ---------------------------------------------------------
class TwoRanks:
    """One scheduler side and a worker side per rank, each rank's pool its own head shard."""

    def __init__(self, tmp: Path, extra: dict[str, object] | None = None) -> None:
        self.config = parse_extra_config(extra or disk_extra(tmp), {})
        self.metrics = MetricsRegistry()
        self.sched = SchedulerSide(self.config, 4, self.metrics, tp_size=2)
        self.kv = [vllm_kv_caches(num_blocks=16, heads=1) for _ in range(2)]
        self.pools = [VllmPool.from_kv_caches(kv) for kv in self.kv]
        self.workers = [
            WorkerSide(self.config, p, bytes(16), MetricsRegistry(), TPShard(r, 2))
            for r, p in enumerate(self.pools)
        ]
        self.sched.set_index(combine_indices([w.index for w in self.workers]))

    def view(self, rank: int) -> torch.Tensor:
        return self.pools[rank].layout.canonical_view(self.pools[rank].tensor)

    def forward(self, meta: StepMeta) -> None:
        for w in self.workers:
            w.begin_step(meta)
            w.start_loads(meta)
            w.wait_loads()

    def after(self, meta: StepMeta) -> list[WorkerReport]:
        """Each rank finishes the step's stores; returns each rank's report (not applied)."""
        reports = []
        for w in self.workers:
            w.submit_stores(meta)
            w.drain()
            reports.append(w.take_report())
        return reports

    def compute(self, view: RequestView, blocks: list[int]) -> StepMeta:
        """vLLM computes ``view``'s whole prompt into ``blocks`` in one step (each rank's
        ``_content``); returns the step (its stores not yet submitted)."""
        self.sched.allocated(view, blocks, 0)
        meta = self.sched.build_step([ScheduledRequest(view, view.num_tokens, blocks)])
        self.forward(meta)
        shape = tuple(self.view(0).shape[1:])
        for r in range(2):
            for b in blocks:
                self.view(r)[b] = _content(r, b, shape)
        return meta

    def stored(self) -> float:
        return self.metrics.value("vllm_stored_chunks", suffix="_total")

    def close(self) -> None:
        for w in self.workers:
            w.close()


def _content(rank: int, block: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float(100 * rank + block))


def test_two_ranks_store_their_own_shards_and_load_them_back(tmp_path: Path) -> None:
    eng = TwoRanks(tmp_path)
    tokens = list(range(1, 18))  # 17 tokens: 2 chunks of 2 x 4-token blocks
    view = RequestView("a", tokens)
    assert eng.sched.matched_tokens(view, 0) == 0
    meta = eng.compute(view, [1, 2, 3, 4, 5])
    shape = tuple(eng.view(0).shape[1:])
    rank0, rank1 = eng.after(meta)
    eng.sched.apply(rank0)  # rank 1's report comes a step later
    assert eng.stored() == 0 and eng.sched.jobs_in_flight == 1
    assert eng.sched.matched_tokens(RequestView("b", tokens), 0) is None  # still storing
    eng.sched.apply(rank1)
    assert eng.stored() == 2 and eng.sched.jobs_in_flight == 0
    eng.sched.finished("a")

    view_b = RequestView("b", tokens)
    assert eng.sched.matched_tokens(view_b, 0) == 16
    eng.sched.allocated(view_b, [6, 7, 8, 9, 10], 16)
    meta = eng.sched.build_step([ScheduledRequest(view_b, 17, [6, 7, 8, 9, 10], 16)])
    eng.forward(meta)
    for r in range(2):  # each rank got its own shard back
        for i, b in enumerate([6, 7, 8, 9]):
            assert torch.equal(eng.view(r)[b], _content(r, i + 1, shape)), (r, b)
    merged = eng.after(meta)
    eng.sched.apply(merged[0].merge(merged[1]))  # both ranks in one step, as vLLM merges them
    hits = eng.metrics.value("vllm_hit_tokens", suffix="_total")
    assert hits == 16
    eng.sched.finished("b")
    eng.sched.check_integrity()
    eng.close()
    assert sorted(p.name for p in tmp_path.glob("chunks.bin*")) == [
        "chunks.bin.tp0of2",
        "chunks.bin.tp1of2",
    ]

    again = TwoRanks(tmp_path)  # a restart: both ranks re-index their own files
    assert again.sched.matched_tokens(RequestView("c", tokens), 0) == 16
    again.close()
    (tmp_path / "chunks.bin.tp1of2").unlink()  # rank 1's shards are gone: no chunk counts
    third = TwoRanks(tmp_path)
    assert third.sched.matched_tokens(RequestView("d", tokens), 0) == 0
    third.close()


def test_a_chunk_one_rank_failed_to_store_is_not_stored(tmp_path: Path) -> None:
    eng = TwoRanks(tmp_path)
    tokens = list(range(1, 18))
    view = RequestView("a", tokens)
    eng.sched.matched_tokens(view, 0)
    eng.sched.allocated(view, [1, 2, 3, 4, 5], 0)
    meta = eng.sched.build_step([ScheduledRequest(view, 17, [1, 2, 3, 4, 5])])
    eng.forward(meta)
    (store,) = meta.stores
    rank0, _ = eng.after(meta)  # rank 1's report replaced: its chunk 1 failed
    bad_host = JobReport(store.job_id, "host", (True, False), rank=1)
    bad_disk = JobReport(store.job_id, "disk", (True, False), rank=1)
    eng.sched.apply(rank0.merge(WorkerReport((bad_host, bad_disk))))
    assert eng.stored() == 1 and eng.sched.jobs_in_flight == 0
    assert eng.sched.matched_tokens(RequestView("b", tokens), 0) == 8  # chunk 0 only
    eng.sched.finished("a")
    eng.sched.check_integrity()
    eng.close()


class FinishedCount:
    """vLLM's ``KVOutputAggregator`` for ``finished_recving``: a request is finished once each
    of ``ranks`` workers named it (in any steps)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.left: dict[str, int] = {}

    def add(self, named: list[set[str]]) -> set[str]:
        done = set()
        for names in named:
            for rid in names:
                self.left[rid] = self.left.get(rid, self.ranks) - 1
                if self.left[rid] == 0:
                    done.add(rid)
                    del self.left[rid]
        return done


def test_an_async_load_is_received_once_both_ranks_named_it(tmp_path: Path) -> None:
    eng = TwoRanks(tmp_path, {**disk_extra(tmp_path), "load_mode": "async"})
    tokens = list(range(1, 18))
    view = RequestView("a", tokens)
    rank0, rank1 = eng.after(eng.compute(view, [1, 2, 3, 4, 5]))
    eng.sched.apply(rank0.merge(rank1))
    shape = tuple(eng.view(0).shape[1:])
    eng.sched.finished("a")

    view_b = RequestView("b", tokens)
    assert eng.sched.match(view_b, 0) == (16, True)
    op = eng.sched.allocated(view_b, [6, 7, 8, 9, 10], 16)
    assert op is not None and op.load_async
    meta = eng.sched.build_step([])  # b waits for its KV: not scheduled
    scatter = eng.workers[1].copier.scatter
    release = threading.Event()

    def held(*args: object) -> None:
        assert release.wait(30.0)
        scatter(*args)  # type: ignore[arg-type]

    eng.workers[1].copier.scatter = held  # type: ignore[method-assign]
    eng.forward(meta)
    for w in eng.workers:
        w.submit_stores(meta)
    count = FinishedCount(2)
    eng.workers[0].drain()  # rank 0's copy is done, rank 1's is held
    named = [end_step([w], [], True, w.wake)[1] for w in eng.workers]
    assert named == [{"b"}, set()] and count.add(named) == set()
    eng.sched.apply(eng.workers[0].take_report().merge(eng.workers[1].take_report()))
    assert eng.metrics.value("vllm_hit_tokens", suffix="_total") == 0
    assert (eng.sched.jobs_in_flight, eng.sched.tally.waiting) == (1, 1)
    release.set()
    eng.workers[1].drain()
    named = [end_step([w], [], True, w.wake)[1] for w in eng.workers]
    assert named == [set(), {"b"}] and count.add(named) == {"b"}  # vLLM: b finished receiving
    eng.sched.apply(eng.workers[0].take_report().merge(eng.workers[1].take_report()))
    assert eng.metrics.value("vllm_hit_tokens", suffix="_total") == 16
    assert (eng.sched.jobs_in_flight, eng.sched.tally.waiting) == (0, 0)
    for r in range(2):  # each rank got its own shard back
        for i, b in enumerate([6, 7, 8, 9]):
            assert torch.equal(eng.view(r)[b], _content(r, i + 1, shape)), (r, b)
    assert [w.take_load_errors() for w in eng.workers] == [set(), set()]
    eng.sched.finished("b")
    eng.sched.check_integrity()
    eng.close()
