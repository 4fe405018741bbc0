"""The connector on the shared Redis store, without vLLM: discovery and one MLA copy for all ranks.

Scheduler and worker sides run in one process as vLLM's would (the scheduler side asks the
store itself, through the ids the workers' handshakes name); a real redis-server. Engine B
finds a prefix engine A published after B started, and loads it byte-identical; at TP 2 with
``mla_shared_keys`` every rank publishes in one namespace, one copy is kept, and rank 1 (and a
TP 1 engine) loads rank 0's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from vllm_testlib import FINGERPRINT, MiniEngine, vllm_kv_caches

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.kv_shapes import LayerShape
from kvplane.integrations.vllm.messages import StepMeta
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest, SchedulerSide
from kvplane.integrations.vllm.store_probe import StoreId, StoreProbe
from kvplane.integrations.vllm.tp import TPShard, combine_indices
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.metrics import MetricsRegistry
from kvplane.offload.config import OffloadConfig

PROMPT = list(range(1, 26))  # 25 tokens: 3 whole chunks of 2 x 4-token blocks (+ 1 token)
L, BS, D, ROPE = 2, 4, 8, 4  # MLA: latent D - ROPE, rope ROPE


def shared_extra(url: str, ns: str, **more: object) -> dict[str, object]:
    return {
        "blocks_per_chunk": 2,
        "host_slots": 8,
        "remote_url": url,
        "remote_namespace": ns,
        "remote_mode": "shared",
        "remote_slots": 16,
        **more,
    }


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def engine(extra: dict[str, object], discover: bool = True) -> MiniEngine:
    """A :class:`MiniEngine` whose scheduler side is given its worker's store id, as the
    connector's handshake gives it (``discover=False``: only start-up chunks, as before)."""
    eng = MiniEngine(extra)
    eng.metrics = MetricsRegistry()
    eng.sched = SchedulerSide(eng.config, eng.block_size, eng.metrics)
    eng.sched.set_index(eng.worker.index, [eng.worker.store] if discover else [])
    return eng


def close(*engines: MiniEngine) -> None:
    for eng in engines:
        eng.close()
        eng.sched.close()


# -- discovery ------------------------------------------------------------------------------------
def test_an_engine_finds_a_prefix_another_published_after_it_started(
    redis_url: str, redis_namespace: str
) -> None:
    extra = shared_extra(redis_url, redis_namespace)
    a, b, blind = engine(extra), engine(extra), engine(extra, discover=False)
    assert b.run(PROMPT).loaded == 0  # nothing published yet: asked, nothing held
    b.settle()
    assert b.metrics.value("vllm_discovered_chunks", suffix="_total") == 0
    c = engine(extra)  # started before A publishes too
    got_a = a.run([7, *PROMPT[1:]])
    a.settle()
    assert got_a.loaded == 0
    got = c.run([7, *PROMPT[1:]])  # A's prefix, published after C started
    assert got.loaded == 24 and got.failed_blocks == set()  # byte-exact: checked by run()
    assert c.metrics.value("vllm_discovered_chunks", suffix="_total") == 3
    assert c.metrics.value("vllm_hit_chunks", {"tier": "remote"}, "_total") == 3
    assert c.metrics.value("vllm_hit_tokens", suffix="_total") == 24
    for mine, theirs in zip(got.blocks[:6], got_a.blocks[:6], strict=True):  # A's very bytes
        assert torch.equal(c.layout_view()[mine], a.layout_view()[theirs])
    assert blind.run([7, *PROMPT[1:]]).loaded == 0  # no store id: start-up chunks only
    close(a, b, c, blind)


def test_store_ids_need_a_shared_store(redis_url: str, redis_namespace: str) -> None:
    private = MiniEngine({"blocks_per_chunk": 2, "host_slots": 8})
    fresh = SchedulerSide(private.config, 4, MetricsRegistry())
    sid = StoreId((redis_url,), redis_namespace, bytes(16), 64)
    with pytest.raises(InvalidArgumentError, match="no shared store is configured"):
        fresh.set_index(private.worker.index, [sid])
    with pytest.raises(InvalidArgumentError, match="at least one rank"):
        StoreProbe([], 1.0)
    with pytest.raises(InvalidArgumentError, match="needs urls, namespace"):
        StoreId((), redis_namespace, bytes(16), 64)
    shared = engine(shared_extra(redis_url, redis_namespace))
    again = SchedulerSide(shared.config, 4, MetricsRegistry(), tp_size=2)
    with pytest.raises(InvalidArgumentError, match="a rank without a shared store"):
        again.set_index(shared.worker.index, [shared.worker.store, None])
    close(private, shared)


# -- MLA at TP 2: one namespace, one copy ---------------------------------------------------------
def test_mla_ranks_share_the_namespace_only_of_a_shared_store() -> None:
    private = OffloadConfig(remote_url="redis://127.0.0.1:1/0", remote_namespace="ns")
    shared = OffloadConfig(
        remote_url="redis://127.0.0.1:1/0", remote_namespace="ns", remote_mode="shared"
    )
    assert TPShard(1, 2, shared=True).offload(private).remote_namespace == "ns.tp1of2"
    assert TPShard(1, 2, shared=True).offload(shared).remote_namespace == "ns"
    assert TPShard(1, 2).offload(shared).remote_namespace == "ns.tp1of2"  # heads differ


def mla_kv(num_blocks: int = 16) -> dict[str, torch.Tensor]:
    """Per-layer ``[N, B, latent + rope]`` views of one buffer: vLLM's MLA layout."""
    per = num_blocks * BS * D
    buf = torch.zeros(L * per, dtype=torch.bfloat16)
    return {
        f"model.layers.{i}.attn": buf[i * per : (i + 1) * per].view(-1, BS, D) for i in range(L)
    }


class RankEngine:
    """One scheduler side and ``tp`` worker sides: MLA pools with ``mla_shared_keys``, or
    (``mla=False``) each rank's own head shard."""

    def __init__(self, extra: dict[str, object], tp: int, mla: bool = True) -> None:
        more = {"mla_shared_keys": True} if mla else {}
        config = parse_extra_config({**extra, **more, "load_mode": "sync"}, {})
        self.metrics = MetricsRegistry()
        self.sched = SchedulerSide(config, BS, self.metrics, tp_size=tp)
        self.wmetrics = [MetricsRegistry() for _ in range(tp)]
        self.pools = [
            VllmPool.from_kv_caches(mla_kv(), LayerShape.MLA, mla_rope_dim=ROPE)
            if mla
            else VllmPool.from_kv_caches(vllm_kv_caches(num_blocks=16, heads=1))
            for _ in range(tp)
        ]
        self.workers = [
            WorkerSide(config, p, FINGERPRINT, m, TPShard(r, tp, shared=mla))
            for r, (p, m) in enumerate(zip(self.pools, self.wmetrics, strict=True))
        ]
        self.sched.set_index(
            combine_indices([w.index for w in self.workers]), [w.store for w in self.workers]
        )

    def view(self, rank: int) -> torch.Tensor:
        return self.pools[rank].layout.canonical_view(self.pools[rank].tensor)

    def step(self, view: RequestView, blocks: list[int], external: int) -> StepMeta:
        self.sched.allocated(view, blocks, external)
        meta = self.sched.build_step([ScheduledRequest(view, view.num_tokens, blocks, external)])
        for w in self.workers:
            w.begin_step(meta)
            w.start_loads(meta)
            w.wait_loads()
        return meta

    def after(self, meta: StepMeta) -> None:
        """Each rank in turn (rank 0 first) finishes the step's stores; all reports applied."""
        reports = []
        for w in self.workers:
            w.submit_stores(meta)
            w.drain()
            reports.append(w.take_report())
        merged = reports[0]
        for r in reports[1:]:
            merged = merged.merge(r)
        self.sched.apply(merged)

    def close(self) -> None:
        self.sched.check_integrity()
        for w in self.workers:
            w.close()
        self.sched.close()


def latent(rank: int, block: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float(100 * rank + block), dtype=torch.bfloat16)


def test_mla_ranks_keep_one_copy_and_every_rank_and_tp1_load_rank0s(
    redis_url: str, redis_namespace: str, raw: redis.Redis
) -> None:
    extra = shared_extra(redis_url, redis_namespace)
    a, b, one = RankEngine(extra, 2), RankEngine(extra, 2), RankEngine(extra, 1)
    assert a.sched.probe is not None and len(a.sched.probe.ids) == 1  # one store, all ranks
    tokens = PROMPT[:17]  # 2 whole chunks
    view = RequestView("a", tokens)
    assert a.sched.matched_tokens(view, 0) == 0
    blocks = [1, 2, 3, 4, 5]
    meta = a.step(view, blocks, 0)
    shape = tuple(a.view(0).shape[1:])
    for r in range(2):  # rank 1's latent differs only so that a load can tell whose it read
        for i, blk in enumerate(blocks):
            a.view(r)[blk] = latent(r, i, shape)
    a.after(meta)  # rank 0 publishes; rank 1 finds the chunks held and writes nothing
    assert a.metrics.value("vllm_stored_chunks", suffix="_total") == 2
    heads = list(raw.scan_iter(match=f"{redis_namespace}:*:h:*"))
    assert len(heads) == 2  # one copy per chunk, in the one namespace
    pub = "offload_shared_publish"
    assert a.wmetrics[0].value(pub, {"tier": "remote", "outcome": "published"}, "_total") == 2
    assert a.wmetrics[1].value(pub, {"tier": "remote", "outcome": "deduped"}, "_total") == 2
    a.sched.finished("a")

    for eng in (b, one):  # both started before A published: found by discovery
        got = RequestView("b", tokens)
        assert eng.sched.matched_tokens(got, 0) == 16
        assert eng.metrics.value("vllm_discovered_chunks", suffix="_total") == 2
        meta = eng.step(got, [6, 7, 8, 9, 10], 16)
        for r in range(len(eng.workers)):  # every rank holds rank 0's latent, byte-exact
            for i, blk in enumerate([6, 7, 8, 9]):
                assert torch.equal(eng.view(r)[blk], latent(0, i, shape)), (r, blk)
        eng.after(meta)
        assert eng.metrics.value("vllm_hit_tokens", suffix="_total") == 16
        eng.sched.finished("b")
    for eng in (a, b, one):
        eng.close()


def test_a_private_store_keeps_per_rank_namespaces(tmp_path: Path, redis_url: str) -> None:
    ns = f"kvtest-private-{tmp_path.name}"
    eng = RankEngine(
        {"blocks_per_chunk": 2, "host_slots": 8, "remote_url": redis_url, "remote_namespace": ns},
        2,
    )
    assert eng.sched.probe is None and [w.store for w in eng.workers] == [None, None]
    assert eng.sched.book.shared is None
    eng.close()


def test_sharded_ranks_each_find_their_own_shard(redis_url: str, redis_namespace: str) -> None:
    extra = shared_extra(redis_url, redis_namespace)
    a, b = RankEngine(extra, 2, mla=False), RankEngine(extra, 2, mla=False)
    assert b.sched.probe is not None and len(b.sched.probe.ids) == 2  # a namespace per rank
    tokens = PROMPT[:17]
    view = RequestView("a", tokens)
    assert a.sched.matched_tokens(view, 0) == 0
    meta = a.step(view, [1, 2, 3, 4, 5], 0)
    shape = tuple(a.view(0).shape[1:])
    for r in range(2):
        for i, blk in enumerate([1, 2, 3, 4, 5]):
            a.view(r)[blk] = latent(r, i, shape)
    a.after(meta)
    a.sched.finished("a")
    got = RequestView("b", tokens)
    assert b.sched.matched_tokens(got, 0) == 16  # held only where both ranks' shards are
    meta = b.step(got, [6, 7, 8, 9, 10], 16)
    for r in range(2):
        for i, blk in enumerate([6, 7, 8, 9]):
            assert torch.equal(b.view(r)[blk], latent(r, i, shape)), (r, blk)
    b.after(meta)
    b.sched.finished("b")
    raw = redis.Redis.from_url(redis_url)
    rank1 = f"{redis_namespace}.tp1of2"
    assert len(list(raw.scan_iter(match=f"{rank1}:*:h:*"))) == 2
    for eng in (a, b):
        eng.close()
    names = list(raw.scan_iter(match=f"{rank1}:*"))
    if names:
        raw.delete(*names)  # the fixture empties only the rank 0 namespace
    raw.close()


def test_mla_ranks_share_one_copy_of_a_chunk_of_two_host_chunks(
    redis_url: str, redis_namespace: str, raw: redis.Redis
) -> None:
    """Redis chunks of 2 host chunks (``remote_blocks_per_chunk`` 4): the gather's report
    decides the write-down, the next step carries it to both ranks; one copy is kept, and a
    TP 2 and a TP 1 engine started earlier load rank 0's latent into every rank."""
    extra = shared_extra(redis_url, redis_namespace, remote_blocks_per_chunk=4)
    a, b, one = RankEngine(extra, 2), RankEngine(extra, 2), RankEngine(extra, 1)
    tokens = PROMPT[:17]  # 2 whole host chunks: one Redis chunk
    view = RequestView("a", tokens)
    assert a.sched.matched_tokens(view, 0) == 0
    blocks = [1, 2, 3, 4, 5]
    meta = a.step(view, blocks, 0)
    shape = tuple(a.view(0).shape[1:])
    for r in range(2):
        for i, blk in enumerate(blocks):
            a.view(r)[blk] = latent(r, i, shape)
    a.after(meta)  # the gathers: nothing in Redis yet
    a.sched.finished("a")
    down = a.sched.build_step([])
    assert [(d.tier, len(d.tier_keys), len(d.host_slots[0])) for d in down.demotes] == [
        ("remote", 1, 2)
    ]
    a.after(down)
    assert len(list(raw.scan_iter(match=f"{redis_namespace}:*:h:*"))) == 1
    pub = "offload_shared_publish"
    assert a.wmetrics[1].value(pub, {"tier": "remote", "outcome": "deduped"}, "_total") == 1
    for eng in (b, one):
        got = RequestView("b", tokens)
        assert eng.sched.matched_tokens(got, 0) == 16
        assert eng.metrics.value("vllm_discovered_chunks", suffix="_total") == 1
        meta = eng.step(got, [6, 7, 8, 9, 10], 16)
        for r in range(len(eng.workers)):
            for i, blk in enumerate([6, 7, 8, 9]):
                assert torch.equal(eng.view(r)[blk], latent(0, i, shape)), (r, blk)
        eng.after(meta)
        eng.sched.finished("b")
    for eng in (a, b, one):
        eng.close()
