"""Prefix offload of a model's KV cache groups: one store per group's pool (its own host
slots, disk file and namespace), keyed by that group's block hashes; a hit is the prefix every
group holds, a window group loading only the chunks its window reads. The rule
(:func:`common_run`), one load per group joined into one result, hits from host, disk and
Redis, and the PD run of a Qwen2 (sliding, full, sliding, full; window 8) served with
``kv_groups``: token-exact with the second prompt's prefix loaded from the host (#33)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.blocks import BlockTable
from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId
from kvplane.models import build_model
from kvplane.models.config import LlamaConfig
from kvplane.models.loader import save_checkpoint
from kvplane.models.weights import RandomTensors
from kvplane.offload import OffloadConfig
from kvplane.serving.pools import WorkerPools
from kvplane.serving.prefix_groups import LoadJoin, common_run
from kvplane.serving.prefix_offload import LoadFinished, PrefixOffload, PrefixSettings
from kvplane.serving.producers.model import ModelDecoder, ModelSpec
from kvplane.transports.local import LocalTransport

S, F = "sliding_attention", "full_attention"
CONFIG = LlamaConfig(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=8, architecture="Qwen2ForCausalLM", sliding_window=8,
    layer_types=(S, F, S, F), max_position_embeddings=512,
)  # fmt: skip
BS, BPC = 4, 2
TPC = BS * BPC
HOST = OffloadConfig(host_slots=8, admission_min_lookups=0, pin_memory=False)
Chunks = list[list[torch.Tensor]]
"""Per group, a prompt's chunks' bytes."""


def test_common_run_is_the_prefix_every_group_holds_each_from_its_window() -> None:
    full, window = (lambda run: 0), (lambda run: max(run - 1, 0))
    held = [True] * 5
    assert common_run([held, held], [window, full], 6) == 5
    assert common_run([held, held], [window, full], 3) == 3  # the last chunk is never loaded
    # the window group lost chunks 0-3: it needs only chunk 4 of a 5-chunk run
    assert common_run([[False] * 4 + [True], held], [window, full], 6) == 5
    # the full group lost chunk 2: the run stops before it; the window group then needs chunk 1
    assert common_run([[False, True] + [True] * 3, [True, True, False, True, True]],
                      [window, full], 6) == 2  # fmt: skip
    assert common_run([held, [False] * 5], [window, full], 6) == 0
    with pytest.raises(InvalidArgumentError, match="2 groups' hits but 1 skip rules"):
        common_run([held, held], [full], 6)


def test_a_join_reports_the_fewest_tokens_once_every_group_ended() -> None:
    join = LoadJoin()
    join.expect(RequestId("r"), 2, 40)
    assert join.finished(RequestId("r"), 40, 1, 0) is None and len(join) == 1
    done = join.finished(RequestId("r"), 32, 4, 1)
    assert done is not None and (done.tokens, done.chunks, done.failed) == (32, 5, 1)
    assert len(join) == 0
    with pytest.raises(InvalidArgumentError, match="loads no prefix"):
        join.finished(RequestId("r"), 0, 0, 0)


@pytest.fixture
def pools() -> Iterator[WorkerPools]:
    transport = LocalTransport()
    decoder = ModelDecoder(build_model(CONFIG, RandomTensors(5)), "m", kv_groups=True)
    try:
        yield WorkerPools(decoder, transport, num_blocks=32, block_size=BS, num_slots=2)
    finally:
        transport.close()


def _tables(pools: WorkerPools, rid: str, tokens: list[int]) -> list[BlockTable]:
    tables = []
    for pool, hasher in zip(pools.block_pools, pools.hashers, strict=True):
        table = BlockTable(RequestId(rid), BS, hasher)
        assert table.admit(pool, tokens) is not None
        tables.append(table)
    return tables


def _chunk(kv: torch.Tensor, table: BlockTable, c: int) -> torch.Tensor:
    return kv[list(table.block_ids[c * BPC : (c + 1) * BPC])].clone()


def _drain(off: PrefixOffload) -> list[object]:
    events: list[object] = []
    while off.busy or off.loading:
        events += off.wait(1.0)
    return events


def _store(
    off: PrefixOffload, pools: WorkerPools, rid: str, prompt: list[int]
) -> list[list[torch.Tensor]]:
    """Store ``prompt``'s 5 chunks from every group and release it; its chunks' bytes."""
    tables = _tables(pools, rid, prompt)
    want = [[_chunk(kv.tensor, t, c) for c in range(5)]
            for kv, t in zip(pools.kv.pools, tables, strict=True)]  # fmt: skip
    assert off.store(RequestId(rid), tables[0], groups=tables[1:]) == 5
    _drain(off)
    for table, pool in zip(tables, pools.block_pools, strict=True):
        table.release(pool)
    return want


def _load(off: PrefixOffload, pools: WorkerPools, prompt: list[int]) -> list[BlockTable]:
    """Wipe the pools and load ``prompt`` + 9 tokens: 40 tokens, 1 + 5 chunks."""
    for kv in pools.kv.pools:
        kv.tensor.zero_()
    again = _tables(pools, "b", [*prompt, *range(1, 10)])
    started = off.begin_load(RequestId("b"), again[0], groups=again[1:])
    assert started is not None and started.chunks == 1 + 5
    (done,) = [e for e in _drain(off) if isinstance(e, LoadFinished)]
    assert (done.request_id, done.tokens, done.chunks) == ("b", 40, 6)
    return again


def _check_loaded(
    pools: WorkerPools, again: list[BlockTable], want: list[list[torch.Tensor]]
) -> None:
    window, full = ([_chunk(kv.tensor, t, c) for c in range(5)]
                    for kv, t in zip(pools.kv.pools, again, strict=True))  # fmt: skip
    assert all(not w.any() for w in window[:4]) and torch.equal(window[4], want[0][4])
    assert all(torch.equal(g, w) for g, w in zip(full, want[1], strict=True))
    for table, pool in zip(again, pools.block_pools, strict=True):
        table.release(pool)


def _random(pools: WorkerPools, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for kv in pools.kv.pools:
        kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=gen))


def test_each_group_loads_its_part_of_the_common_prefix(pools: WorkerPools) -> None:
    """40 stored tokens (5 chunks of 8) and a 49-token prompt: the full group loads all 5
    chunks, the window group (window 8: the step at 40 reads from 33 on) only chunk 4."""
    off = PrefixOffload(PrefixSettings(HOST, BPC), pools.kv, pools.blocks,
                        group_pools=pools.group_blocks)  # fmt: skip
    _random(pools, 0)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 97, 40)]
    want = _store(off, pools, "a", prompt)
    again = _load(off, pools, prompt)
    # its store will read the window group's chunks from 4 on (0-3 unfilled), the full group's
    # all: until it is issued those blocks are the request's (``PrefillSteps.drop_window``)
    assert off.store_reads(again[0], groups=again[1:]) == (4 * TPC, 0)
    short = _tables(pools, "c", list(range(TPC - 1)))  # no full chunk: it stores nothing
    assert off.store_reads(short[0], groups=short[1:]) == (None, None)
    with pytest.raises(InvalidArgumentError, match="0 group tables for 1"):
        off.store_reads(short[0])
    for table, pool in zip(short, pools.block_pools, strict=True):
        table.release(pool)
    _check_loaded(pools, again, want)
    assert off.counts["chunks_skipped_window"] == 4  # group 0, the window group's
    assert off.members[0].counts.get("chunks_skipped_window", 0) == 0
    assert (dict(off.hits), dict(off.members[0].hits)) == ({"host": 1}, {"host": 5})
    off.check_integrity()
    off.close()
    pools.check_idle()


def _two_prompts(off: PrefixOffload, pools: WorkerPools) -> None:
    """Two 5-chunk prompts through 8 host slots, then the first again: its two oldest chunks
    come from the group's own lower tier (the window group needs only chunk 4, on the host)."""
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 97, 40)] for _ in range(2)]
    _random(pools, 1)
    want = _store(off, pools, "a", prompts[0])
    _random(pools, 2)
    _store(off, pools, "a2", prompts[1])
    _check_loaded(pools, _load(off, pools, prompts[0]), want)
    lower = off.tiers[1]
    assert (dict(off.hits), dict(off.members[0].hits)) == ({"host": 1}, {lower: 2, "host": 3})
    off.check_integrity()
    off.close()
    pools.check_idle()


def test_each_group_has_its_own_disk_file(pools: WorkerPools, tmp_path: Path) -> None:
    disk = dataclasses.replace(HOST, disk_path=tmp_path / "disk", disk_slots=16,
                               disk_direct_io=False)  # fmt: skip
    off = PrefixOffload(PrefixSettings(disk, BPC), pools.kv, pools.blocks,
                        group_pools=pools.group_blocks)  # fmt: skip
    assert off.tiers == ("host", "disk")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "disk.group1"]
    _two_prompts(off, pools)


def test_each_group_has_its_own_redis_namespace(
    pools: WorkerPools, redis_url: str, redis_namespace: str
) -> None:
    import redis

    remote = dataclasses.replace(HOST, remote_url=redis_url, remote_namespace=redis_namespace,
                                 remote_slots=16)  # fmt: skip
    off = PrefixOffload(PrefixSettings(remote, BPC), pools.kv, pools.blocks,
                        group_pools=pools.group_blocks)  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    try:
        _two_prompts(off, pools)
        theirs = list(client.scan_iter(match=f"{redis_namespace}.group1:*"))
        assert theirs and list(client.scan_iter(match=f"{redis_namespace}:*"))
    finally:
        names = list(client.scan_iter(match=f"{redis_namespace}.group1:*"))
        if names:
            client.delete(*names)
        client.close()


def test_groups_need_their_block_pools(pools: WorkerPools) -> None:
    with pytest.raises(InvalidArgumentError, match=r"1 groups 1\.\. but 0 pools"):
        PrefixOffload(PrefixSettings(HOST, BPC), pools.kv, pools.blocks)


@pytest.fixture
def cluster(tmp_path: Path, offload_cluster: Callable[..., Any]) -> Any:
    """The mixed Qwen2 served with KV cache groups, prefill with host prefix offload."""
    spec = ModelSpec(str(save_checkpoint(CONFIG, tmp_path / "qwen2", seed=3)), kv_groups=True)
    return offload_cluster(spec)


def test_pd_with_groups_hits_the_prefix_on_the_host_and_is_token_exact(cluster: Any) -> None:
    """A 101-token prompt after a 98-token one sharing 96 tokens (3 chunks of 32): every group
    hits all 3; the full group loads them, the window group (the step at 96 reads from 89 on)
    only the last; the tokens are the one-process model's."""
    counters = cluster.shared_prefix(vocab=97)
    # group 0 is the window group (layers 0, 2): 1 chunk loaded, 2 skipped; group 1 loads 3
    assert counters["offload_hit_chunks_host"] == 1
    assert counters["offload_chunks_skipped_window"] == 2
    assert counters["offload_group1_hit_chunks_host"] == 3
    assert counters["offload_group1_chunks_stored"] == counters["offload_chunks_stored"] == 3
    prefill = cluster.prefill
    assert prefill.metrics.value("prefill_prefix_tokens", suffix="_total") == 96
    prefill.pools.check_idle()
