"""vLLM's hybrid KV cache manager in the connector, without vLLM: reading its KV cache groups,
each group as its own pool (keys, tier places, counters), the hit every group can serve, and
per-group loads and stores over one shared block pool with the window group's null blocks.

Two groups as vLLM gives a Gemma-2 (layer ``w`` windowed, layer ``f`` full): both layers view
the same tensor slot by slot, each group's block ids are its own, from one free list. Block
size 4, chunks of 2 blocks (8 tokens), window 8 tokens: a hit ending at chunk ``e`` needs only
chunk ``e - 1`` in the window group.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm_testlib import block_content, vllm_kv_caches

from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.config import ConnectorConfig, parse_extra_config
from kvplane.integrations.vllm.engine_reads import group_pool
from kvplane.integrations.vllm.groups import (
    KVGroup,
    group_caches,
    group_offload,
    group_registries,
    group_root,
    hybrid_refusal,
    read_groups,
)
from kvplane.integrations.vllm.hybrid_scheduler import HybridScheduler
from kvplane.integrations.vllm.hybrid_worker import HybridWorker
from kvplane.integrations.vllm.messages import JobReport, StepMeta, TierIndex, WorkerReport
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest
from kvplane.integrations.vllm.tp import TPShard
from kvplane.integrations.vllm.wakeup import Wakeup, end_step
from kvplane.integrations.vllm.windows import KVWindow, first_kept_block
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.metrics import MetricsRegistry
from kvplane.offload.tiers.disk import DiskTier

BS, BPC = 4, 2
CHUNK_BYTES = BPC * 2 * BS * 8 * 2  # one layer x 2 heads x 4 tokens x K||V 8 x bf16, per block
GROUPS = (KVGroup(0, 2, ("w",), KVWindow(8, BS)), KVGroup(1, 2, ("f",)))
_rng = random.Random(53)
LONG = [_rng.randrange(1, 500) for _ in range(26)]  # 3 full chunks
NEXT = LONG[:24] + [_rng.randrange(1, 500) for _ in range(16)]  # 40 tokens, 3 chunks shared


# -- reading vLLM's groups (class names, as vLLM's kv_cache_interface) ---------------------------
@dataclass
class FullAttentionSpec:
    block_size: int = BS


@dataclass
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 8


class MambaSpec(FullAttentionSpec):
    pass


class ChunkedLocalAttentionSpec(FullAttentionSpec):
    pass


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: object


def test_each_group_is_read_with_its_layers_and_window() -> None:
    got = read_groups([Group(["w"], SlidingWindowSpec()), Group(["f"], FullAttentionSpec())])
    assert got == GROUPS and [g.kind for g in got] == ["window", "full"]
    assert read_groups([Group(["a", "b"], FullAttentionSpec())]) == (KVGroup(0, 1, ("a", "b")),)


def test_groups_the_connector_cannot_move_are_refused_in_one_line() -> None:
    full = Group(["f"], FullAttentionSpec())
    with pytest.raises(UnsupportedError, match=r"MambaSpec layers \(no kvplane path"):
        read_groups([full, Group(["m"], MambaSpec())])
    with pytest.raises(UnsupportedError, match="with --disable-hybrid-kv-cache-manager to run"):
        read_groups([full, Group(["c"], ChunkedLocalAttentionSpec())])
    with pytest.raises(UnsupportedError, match="no KV cache group"):
        read_groups([])
    with pytest.raises(UnsupportedError, match="KV events with 2 KV cache groups"):
        hybrid_refusal(GROUPS, events=True)
    hybrid_refusal(GROUPS, events=False)  # PD moves every group (test_vllm_pd_groups.py)
    hybrid_refusal(GROUPS[:1], events=True)  # one group: events as today


def test_one_group_keeps_todays_keys_places_and_counters(tmp_path: Path) -> None:
    one = KVGroup(0, 1, ("a",))
    config = parse_extra_config({"disk_path": str(tmp_path / "kv.bin")}, {}).offload
    assert group_root(b"r" * 16, one) == b"r" * 16
    assert group_offload(config, one) == config
    main = MetricsRegistry()
    assert group_registries(main, 1) == [main]
    roots = {group_root(b"r" * 16, g) for g in GROUPS}
    assert len(roots) == 2 and all(len(r) == 16 for r in roots)
    places = [group_offload(config, g) for g in GROUPS]
    assert [p.disk_path for p in places] == [tmp_path / "kv.bin.g0of2", tmp_path / "kv.bin.g1of2"]
    assert [p.remote_namespace for p in places] == ["kvplane.g0of2", "kvplane.g1of2"]


def test_group_counters_show_in_the_main_registry_under_their_prefix() -> None:
    main = MetricsRegistry()
    zero, one = group_registries(main, 2)
    zero.counter("vllm_hit_tokens", "x").inc(2)
    one.counter("vllm_hit_tokens", "x").inc(5)
    assert zero is main
    assert main.value("vllm_hit_tokens", suffix="_total") == 2
    assert main.value("g1_vllm_hit_tokens", suffix="_total") == 5


def test_a_group_missing_a_layer_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="group 1: vLLM registered no 'f'"):
        group_caches({"w": torch.zeros(1)}, GROUPS[1])


def test_a_group_whose_layers_are_not_one_pool_is_refused_naming_the_flag() -> None:
    """vLLM pads a hybrid model's pages to one size when its groups' differ: such layers are
    not one dense pool (:func:`~kvplane.integrations.vllm.kv_shapes.infer_layout`)."""
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_layout=None, cache_dtype="auto"),
        model_config=SimpleNamespace(use_mla=False),
    )
    buf = torch.zeros(2 * 16 * 2 * 4 * 8 + 64, dtype=torch.bfloat16)
    kv = {  # the second layer starts 64 elements late: not equally spaced
        "a": buf[: 16 * 64].view(16, 2, 4, 8),
        "b": buf[16 * 64 + 64 :].view(16, 2, 4, 8),
    }
    group = KVGroup(1, 2, ("a", "b"))
    with pytest.raises(UnsupportedError, match=r"group 1 of 2: .* --disable-hybrid-kv-cache"):
        group_pool(cfg, kv, group, TPShard(), vllm_version="0.32.0", cpu=False)


# -- the hit every group can serve ---------------------------------------------------------------
def scheduler(groups: tuple[KVGroup, ...] = GROUPS) -> HybridScheduler:
    config = parse_extra_config({"blocks_per_chunk": BPC, "host_slots": 16}, {})
    side = HybridScheduler(config, BS, groups, [MetricsRegistry() for _g in groups])
    side.set_index([TierIndex(bytes([g.index]) * 16, CHUNK_BYTES, ()) for g in groups])
    return side


def hold(side: HybridScheduler, group: int, view: RequestView, chunks: list[int]) -> None:
    """Put ``chunks`` of ``view``'s keys into group ``group``'s host tier (a store's
    bookkeeping: looked up, reserved, then gathered)."""
    s = side.sides[group]
    req = s.requests.state(view)
    req.keys.extend(view.token_ids)
    keys: list[ChunkKey] = req.keys.chunk_keys(view.num_tokens)
    s.book.lookup(keys)  # admission: a chunk is stored once looked up
    got = s.book.reserve_store([keys[i] for i in chunks], write_through=True)
    assert got is not None and len(got.keys) == len(chunks)
    s.book.gathered(got.keys, got.writes, [True] * len(got.keys))


ALL = [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("window", "full", "tokens"),
    [
        (ALL, ALL, 40),
        ([0, 1, 2], ALL, 24),  # the window group lacks chunks 3 and 4: the shorter hit
        (ALL, [0, 1, 2], 24),  # the full group lacks chunk 3
        ([4], ALL, 40),  # the window needs only chunk 4: the early ones may be gone
        ([4], [0, 1, 2, 3], 0),  # capped at 4, the window group lacks chunk 3, then all
        ([2, 4], [0, 1, 2, 3], 24),  # capped at 4 (no chunk 3), then 3: chunk 2 is there
        ([], ALL, 0),
    ],
)
def test_the_hit_is_the_run_every_group_can_serve(
    window: list[int], full: list[int], tokens: int
) -> None:
    side = scheduler()
    view = RequestView("r", list(range(1, 42)))  # 41 tokens: 5 chunks short of the last
    hold(side, 0, view, window)
    hold(side, 1, view, full)
    assert side.match(view, 0) == (tokens, tokens > 0)  # several groups: always async
    for s in side.sides:
        assert s.requests.state(view).match.num_computed == 0
    chunks = [s.requests.state(view).match.chunks for s in side.sides]
    assert chunks == ([1, tokens // 8] if tokens else [0, 0])
    side.check_integrity()


def test_one_group_matches_as_its_own_side() -> None:
    side = scheduler((KVGroup(0, 1, ("f",)),))
    view = RequestView("r", list(range(1, 42)))
    hold(side, 0, view, [0, 1])
    assert side.match(view, 0) == (16, False)  # load_mode auto, from host: synchronous
    with pytest.raises(InvalidArgumentError, match="2 per-group item"):
        side.allocated(view, [[1], [2]], 16)


def done(side: HybridScheduler, steps: tuple[StepMeta, ...]) -> None:
    """Every group's workers report the gathers of ``steps`` (each group its own)."""
    side.apply(
        [
            WorkerReport(
                tuple(JobReport(op.job_id, "host", (True,) * len(op.keys)) for op in m.stores)
            )
            for m in steps
        ]
    )


def test_a_block_one_group_fences_flushes_every_group_when_another_writes_it() -> None:
    """Block ids come from one vLLM pool: LONG's gathers (one per group, ids from one counter)
    still read its blocks when it finishes; a later request given one of the window group's
    freed blocks in the full group flushes both groups' gathers first."""
    side = scheduler()
    long, other = RequestView("long", LONG), RequestView("other", [7] * 26)
    tables = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    assert side.match(long, 0) == (0, False)
    side.allocated(long, tables, 0)
    first = side.build_steps([[ScheduledRequest(long, 26, t)] for t in tables])
    assert [[op.job_id for op in m.stores] for m in first] == [[1], [2]]
    assert [m.stores[0].block_ids for m in first] == [(1, 2, 3, 4, 5, 6), (8, 9, 10, 11, 12, 13)]
    side.finished("long")  # vLLM frees every block now
    assert side.fenced_blocks == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13]
    assert side.match(other, 0) == (0, False)
    fresh = [[20, 21, 22, 23, 24, 25, 26], [27, 3, 28, 29, 30, 31, 32]]
    side.allocated(other, fresh, 0)
    second = side.build_steps([[ScheduledRequest(other, 26, t)] for t in fresh])
    assert [m.flush for m in second] == [True, True]  # block 3: the window group's
    done(side, first)
    assert side.fenced_blocks == [] and side.tracked_requests() == ["other"]
    third = side.build_steps([[ScheduledRequest(other, 27, t)] for t in fresh])
    assert [m.flush for m in third] == [False, False] and not any(m.stores for m in third)
    done(side, second)
    side.finished("other")
    assert side.tracked_requests() == [] and side.jobs_in_flight == 0
    side.check_integrity()


# -- loads and stores per group over one shared pool ---------------------------------------------
class Engine:
    """Both groups' scheduler and worker sides over one vLLM-like buffer (layer ``w`` and layer
    ``f`` view the same tensor), playing vLLM's hooks: one request at a time, its whole prompt
    in one forward, the window group's table null before the window of its hit."""

    def __init__(self, **extra: object) -> None:
        config = parse_extra_config({"blocks_per_chunk": BPC, "host_slots": 16, **extra}, {})
        tensor = vllm_kv_caches(num_layers=1, num_blocks=40, block_size=BS)
        shared = next(iter(tensor.values()))
        kv = {"w": shared, "f": shared}
        self.metrics = group_registries(MetricsRegistry(), 2)
        self.wmetrics = group_registries(MetricsRegistry(), 2)
        self.sched = HybridScheduler(config, BS, GROUPS, self.metrics)
        wake = Wakeup()

        def own(g: KVGroup) -> ConnectorConfig:  # the group's disk file, as the connector's
            return dataclasses.replace(config, offload=group_offload(config.offload, g))

        self.pools = [VllmPool.from_kv_caches(group_caches(kv, g)) for g in GROUPS]
        self.work = HybridWorker(
            [
                WorkerSide(own(g), pool, group_root(b"e" * 16, g), m, wake=wake)
                for g, pool, m in zip(GROUPS, self.pools, self.wmetrics, strict=True)
            ]
        )
        self.sched.set_index(self.work.indices, [[s] for s in self.work.stores])
        self.free = list(range(1, 40))
        self.errors: set[int] = set()

    def view(self, g: int) -> torch.Tensor:
        pool = self.pools[g]
        return pool.layout.canonical_view(pool.tensor)

    def content(self, g: int, tokens: list[int], i: int) -> torch.Tensor:
        got = block_content(tokens, i, BS, tuple(self.view(g).shape[1:]))
        return got if g == 0 else -got  # the groups' layers hold different KV

    def steps(self, scheduled: list[list[ScheduledRequest]]) -> set[str]:
        steps = self.sched.build_steps(scheduled)
        self.work.begin_step(steps)
        self.work.start_loads(steps)
        self.work.wait_loads()
        self.work.submit_stores(steps)
        _sent, got = end_step([self.work], [], not any(scheduled), self.work.wake)
        self.errors |= self.work.take_load_errors()  # vLLM asks right after get_finished
        self.sched.apply(self.work.take_reports())
        return got

    def run(self, tokens: list[int], rid: str, fails: bool = False) -> tuple[int, list[list[int]]]:
        """Admit, load, compute and finish one request: (tokens loaded, its tables). With
        ``fails`` its load must end as a failed receive: it finishes without a forward."""
        view = RequestView(rid, tokens)
        matched, load_async = self.sched.match(view, 0)
        assert matched is not None and load_async == (matched > 0)
        n = -(-len(tokens) // BS)
        tables = []
        for group in GROUPS:  # vLLM allocates only the blocks it keeps once the hit is in
            kept = first_kept_block(group.window, matched)
            blocks, self.free = self.free[: n - kept], self.free[n - kept :]
            tables.append([0] * kept + blocks)
        self.sched.allocated(view, tables, matched)
        for _ in range(500):  # WAITING_FOR_REMOTE_KVS until every group's load ended
            if not load_async or rid in self.steps([[], []]):
                break
        else:
            raise AssertionError("the load never ended in every group")
        assert self.errors == set()  # never block ids with two groups
        assert self.work.take_failed() == ({rid} if fails else set())
        if fails:  # vLLM recomputes it from token 0 (here: drops it)
            self.sched.finished(rid)
            self.free += [b for t in tables for b in t if b]
            return matched, tables
        for g, table in enumerate(tables):
            for i in range(first_kept_block(GROUPS[g].window, matched), matched // BS):
                assert torch.equal(self.view(g)[table[i]], self.content(g, tokens, i)), (g, i)
            for i in range(matched // BS, n):
                self.view(g)[table[i]] = self.content(g, tokens, i)
        self.steps([[ScheduledRequest(view, len(tokens), t, matched)] for t in tables])
        self.sched.finished(rid)  # vLLM frees every group's blocks; gathers are fenced
        self.free += [b for t in tables for b in t if b]
        return matched, tables

    def settle(self) -> None:
        for _ in range(100):
            if not self.sched.jobs_in_flight:
                return
            self.work.drain()
            self.steps([[], []])
        raise AssertionError("jobs never settled")

    def counter(self, side: str, g: int, name: str, **labels: str) -> float:
        reg = (self.metrics if side == "sched" else self.wmetrics)[g]
        return reg.value(name, labels, "_total")

    def close(self) -> None:
        self.settle()
        self.sched.check_integrity()
        self.work.close()
        assert sorted(self.free) == list(range(1, 40)), "blocks leaked"


def test_each_group_stores_and_loads_its_own_blocks_the_window_only_its_window() -> None:
    e = Engine()
    assert e.run(LONG, "long")[0] == 0
    e.settle()
    # every group stored LONG's 3 chunks (the window group's blocks were all held)
    assert [e.counter("sched", g, "vllm_stored_chunks") for g in (0, 1)] == [3, 3]
    matched, tables = e.run(NEXT, "next")
    assert matched == 24 and tables[0][:4] == [0, 0, 0, 0]  # window of token 24: blocks 4..
    loaded = [e.counter("work", g, "offload_bytes", path="host_to_device") for g in (0, 1)]
    assert loaded == [1 * CHUNK_BYTES, 3 * CHUNK_BYTES]  # the window group: chunk 2 only
    assert [e.counter("sched", g, "vllm_hit_tokens") for g in (0, 1)] == [24, 24]
    assert [e.counter("sched", g, "vllm_hit_chunks", tier="host") for g in (0, 1)] == [1, 3]
    e.settle()
    # NEXT's chunks 3 and 4 are new in both; the window group never stores chunks 0 and 1
    # (null blocks), which it held already anyway
    assert [e.counter("sched", g, "vllm_stored_chunks") for g in (0, 1)] == [5, 5]
    stored = [e.counter("work", g, "offload_bytes", path="device_to_host") for g in (0, 1)]
    assert stored == [5 * CHUNK_BYTES, 5 * CHUNK_BYTES]
    assert e.sched.tracked_requests() == [] and e.sched.fenced_blocks == []
    e.close()


def test_a_load_failing_in_one_group_is_a_failed_receive_of_the_request(tmp_path: Path) -> None:
    """Engine A writes LONG through to one disk file per group; engine B, on those files with
    the window group's chunk 2 corrupted, loads NEXT: the full group's load is whole, the
    window group's fails its checksum; the request is named once, when both ended."""
    disk = {"disk_path": str(tmp_path / "kv.bin"), "disk_slots": 8, "disk_direct_io": False}
    a = Engine(**disk)
    a.run(LONG, "long")
    a.close()
    b = Engine(**disk)
    tier = b.work.sides[0].lower["disk"]
    assert isinstance(tier, DiskTier)
    assert sorted(b.work.indices[0].found("disk").values()) == [0, 1, 2]
    assert tier.path == tmp_path / "kv.bin.g0of2"
    with open(tier.path, "r+b") as fh:  # chunk 2's slot: LONG's chunks went in order
        fh.seek(2 * tier.slot_stride + 100)
        byte = fh.read(1)
        fh.seek(2 * tier.slot_stride + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert b.run(NEXT, "next", fails=True)[0] == 24
    assert [b.counter("sched", g, "vllm_load_failed_chunks") for g in (0, 1)] == [1, 0]
    assert [b.counter("sched", g, "vllm_hit_chunks", tier="disk") for g in (0, 1)] == [0, 3]
    b.close()
