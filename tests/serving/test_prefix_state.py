"""Prefix offload of a hybrid model (tiny-hybrid: attention + Mamba2) on a prefill pool: the
recurrent state is snapshotted at chunk boundaries under the chunk's key; a snapshot equals the
state a fresh prefill of that prefix computes (bit-exact, float32); a prefix load restores KV
and state together and the prefill resumes bit-exactly; a hit without its state is a miss. Across
a restart (real Redis): a new PrefixOffload finds KV and state on disk, on a private Redis
namespace or in the shared store and resumes bit-exactly; a corrupt state snapshot is a miss."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.ids import RequestId, TokenRange
from kvplane.offload import OffloadConfig
from kvplane.serving.prefix_offload import LoadFinished, PrefixOffload, PrefixSettings
from kvplane.serving.producers.base import PoolTensor, ProduceStep
from kvplane.serving.producers.model import ModelProducer, ModelSpec

BS, BPC, STEP = 16, 2, 16
CHUNK = BS * BPC
NUM_BLOCKS = 32


@dataclass
class Rig:
    producer: ModelProducer
    kv: PoolTensor
    state: PoolTensor
    pool: BlockPool
    hasher: BlockHasher
    off: PrefixOffload

    def admit(self, rid: str, tokens: Sequence[int]) -> BlockTable:
        table = BlockTable(RequestId(rid), BS, self.hasher)
        assert table.admit(self.pool, tokens) is not None
        return table

    def prefill(self, table: BlockTable, slot: int, step: int = STEP, start: int = 0) -> int:
        """Prefill ``table``'s prompt from ``start`` in steps, keeping the state at chunk
        boundaries as the worker does; the first token."""
        ids = np.asarray(table.token_ids, dtype=np.int64)
        n, first = len(ids), None
        for s in range(start, n, step):
            rng = TokenRange(s, min(s + step, n))
            run = ProduceStep(table.request_id, ids, table.block_ids, rng, rng.end == n, slot)
            first = self.producer.produce(run, self.kv, self.state).first_token
            self.off.keep_state(table, slot, rng.end)
        assert first is not None
        return first

    def row(self, slot: int) -> torch.Tensor:
        return self.state.layout.canonical_view(self.state.tensor)[slot].clone()

    def drain(self) -> list[object]:
        events: list[object] = []
        while self.off.busy or self.off.loading:
            events += self.off.wait(1.0)
        return events


def _rig(disk: Path | None = None, config: OffloadConfig | None = None) -> Rig:
    """A tiny-hybrid prefill pool (seed 3) with prefix offload over ``config`` (default: host
    tier of 8 chunks, the disk tier at ``disk`` if given); every rig computes the same."""
    producer = ModelProducer.from_spec(ModelSpec("tiny-hybrid", seed=3))
    kv_layout = producer.kv_layout(NUM_BLOCKS, BS)
    state_layout = producer.state_layout(4)
    assert state_layout is not None and state_layout.dtype == torch.float32
    kv = PoolTensor(kv_layout, kv_layout.allocate())
    state = PoolTensor(state_layout, state_layout.allocate())
    pool = BlockPool(NUM_BLOCKS, BS)
    if config is None:
        config = OffloadConfig(
            host_slots=8, admission_min_lookups=0, pin_memory=False, disk_path=disk,
            disk_slots=8, disk_direct_io=False,
        )  # fmt: skip
    off = PrefixOffload(PrefixSettings(config, BPC), kv, pool, state=state)
    return Rig(producer, kv, state, pool, BlockHasher(seed=0, fingerprint=b"hybrid"), off)


def _prompt(n: int, seed: int = 5) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1024, n)]


def _close(rig: Rig, *tables: BlockTable) -> None:
    for t in tables:
        t.release(rig.pool)
    rig.off.close()
    rig.off.check_integrity()
    rig.pool.check_integrity()


def test_snapshot_of_a_prefix_equals_a_fresh_prefill_of_it() -> None:
    rig = _rig()
    prompt = _prompt(100)
    full = rig.admit("full", prompt)
    rig.prefill(full, slot=0)
    keys = rig.off.chunk_keys(full)
    assert rig.off.state is not None
    assert len(keys) == 3 and all(k in rig.off.state.store for k in keys)
    for chunks in (1, 2, 3):
        prefix = rig.admit(f"p{chunks}", prompt[: chunks * CHUNK])
        rig.prefill(prefix, slot=1)
        snap = rig.off.state.store.get(keys[chunks - 1])
        assert snap is not None
        fresh = rig.row(1).contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(snap, fresh), f"prefix of {chunks} chunks"
        prefix.release(rig.pool)
    assert not torch.equal(rig.row(0), rig.row(1))  # 100 tokens vs 96: the state moved on
    _close(rig, full)


def test_a_prefix_load_restores_kv_and_state_and_resumes_bit_exact(tmp_path: Path) -> None:
    rig = _rig(tmp_path / "disk.kvc")
    prompt = _prompt(100)
    full = rig.admit("full", prompt)
    want_first = rig.prefill(full, slot=0)
    want_state = rig.row(0)
    assert rig.off.store(RequestId("full"), full) == 3
    rig.drain()
    again = rig.admit("again", prompt)
    started = rig.off.begin_load(RequestId("again"), again, 2)
    assert started is not None and started.chunks == 3  # the last token's chunk is computed
    assert rig.drain() == [LoadFinished(RequestId("again"), 3 * CHUNK, 3, 0)]
    loaded = TokenRange(0, 3 * CHUNK)
    assert torch.equal(_kv(rig, again, loaded), _kv(rig, full, loaded))
    assert rig.prefill(again, slot=2, start=3 * CHUNK) == want_first
    assert torch.equal(rig.row(2), want_state)
    assert torch.equal(_kv(rig, again, TokenRange(0, 100)), _kv(rig, full, TokenRange(0, 100)))
    _close(rig, full, again)


def test_a_hit_without_its_state_is_a_miss() -> None:
    """Steps of 24 end on no chunk boundary before 96: the KV of all 3 chunks is stored, the
    state only after chunk 3, so the leading run with state is empty."""
    rig = _rig()
    prompt = _prompt(100)
    odd = rig.admit("odd", prompt)
    rig.prefill(odd, slot=0, step=24)
    keys = rig.off.chunk_keys(odd)
    assert rig.off.state is not None
    assert [k in rig.off.state.store for k in keys] == [False, False, True]
    assert rig.off.store(RequestId("odd"), odd) == 3
    rig.drain()
    again = rig.admit("again", prompt)
    assert rig.off.cascade.lookup(keys).hit_run == 3  # the KV is there...
    assert rig.off.begin_load(RequestId("again"), again, 1) is None  # ...but not its state
    assert rig.off.counts["chunks_without_state"] == 3
    assert rig.off.snapshot()["offload_chunks_without_state"] == 3
    _close(rig, odd, again)


def _kv(rig: Rig, table: BlockTable, rng: TokenRange) -> torch.Tensor:
    """The KV of positions ``rng`` of ``table`` (``[tokens, layers, comps, heads, dim]``)."""
    layout = rig.kv.layout
    pos = torch.arange(rng.start, rng.end)
    blocks = torch.as_tensor(table.block_ids, dtype=torch.long)[pos // BS]
    view = layout.canonical_view(rig.kv.tensor).permute(0, 3, 1, 2, 4, 5)
    return view[blocks, pos % BS].clone()


TIER = {"disk": "disk", "remote": "remote", "shared": "remote"}
"""The cascade's name of the tier each kind of run stores to."""


@pytest.fixture
def namespace(redis_url: str, redis_namespace: str) -> Iterator[str]:
    """``redis_namespace``, and its state namespace ``<ns>.state`` emptied after the test."""
    yield redis_namespace
    client = redis.Redis.from_url(redis_url)
    names = list(client.scan_iter(match=f"{redis_namespace}.state:*"))
    if names:
        client.delete(*names)
    client.close()


def _config(where: str, tmp_path: Path, url: str, ns: str) -> OffloadConfig:
    """Host tier, and only the tier ``where`` below it (so a hit must come from there)."""
    if where == "disk":
        return OffloadConfig(
            host_slots=8, admission_min_lookups=0, pin_memory=False,
            disk_path=tmp_path / "disk.kvc", disk_slots=8, disk_direct_io=False,
        )  # fmt: skip
    mode = "shared" if where == "shared" else "private"
    return OffloadConfig(
        host_slots=8, admission_min_lookups=0, pin_memory=False,
        remote_url=url, remote_slots=8, remote_namespace=ns, remote_mode=mode,
        remote_timeout_s=1.0, remote_lease_s=2.0,
    )  # fmt: skip


def _stored_then_closed(config: OffloadConfig) -> tuple[list[int], int, torch.Tensor, torch.Tensor]:
    """One engine prefills a 100-token prompt (snapshots at 32, 64, 96), stores its 3 chunks
    down the tiers and closes: the prompt, its first token, final state and KV."""
    rig = _rig(config=config)
    prompt = _prompt(100)
    full = rig.admit("full", prompt)
    first = rig.prefill(full, slot=0)
    state, kv = rig.row(0), _kv(rig, full, TokenRange(0, 100))
    assert rig.off.store(RequestId("full"), full) == 3
    rig.drain()
    _close(rig, full)
    return prompt, first, state, kv


@pytest.mark.parametrize("where", ["disk", "remote", "shared"])
def test_a_restarted_engine_finds_kv_and_state_and_resumes_bit_exact(
    where: str, tmp_path: Path, redis_url: str, namespace: str
) -> None:
    config = _config(where, tmp_path, redis_url, namespace)
    prompt, want_first, want_state, want_kv = _stored_then_closed(config)
    rig = _rig(config=config)  # a new instance: fresh pools, tiers re-indexed
    again = rig.admit("again", prompt)
    started = rig.off.begin_load(RequestId("again"), again, 2)
    assert started is not None and started.sources == (TIER[where],) * 3
    assert rig.drain() == [LoadFinished(RequestId("again"), 3 * CHUNK, 3, 0)]
    assert rig.prefill(again, slot=2, start=3 * CHUNK) == want_first
    assert torch.equal(rig.row(2), want_state)
    assert torch.equal(_kv(rig, again, TokenRange(0, 100)), want_kv)
    assert rig.off.state is not None
    assert rig.off.state.store.counts[f"{TIER[where]}_hits"] == 1
    _close(rig, again)


@pytest.mark.parametrize("where", ["disk", "remote"])
def test_a_corrupt_state_snapshot_is_a_miss(
    where: str, tmp_path: Path, redis_url: str, namespace: str
) -> None:
    """Chunk 3's snapshot (slot 2) is changed at rest. Disk: the re-index drops it, so only
    2 chunks load. Redis: its header re-indexes, all 3 chunks' KV load, the read fails its
    CRC, and the state (and the hit) falls back to 2 chunks. Either way the prefill resumes
    at 64 and computes the bits of a fresh one."""
    config = _config(where, tmp_path, redis_url, namespace)
    prompt, want_first, want_state, want_kv = _stored_then_closed(config)
    if where == "disk":
        path = tmp_path / "disk.kvc.state"
        stride = path.stat().st_size // config.disk_slots  # payload span + header
        with path.open("r+b") as fh:
            fh.seek(2 * stride + 9)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))
    else:
        client = redis.Redis.from_url(redis_url)
        assert client.setrange(f"{namespace}.state:slot:2", 9, b"\xff\xfe") > 0
        client.close()
    rig = _rig(config=config)
    again = rig.admit("again", prompt)
    started = rig.off.begin_load(RequestId("again"), again, 2)
    assert started is not None and started.chunks == (2 if where == "disk" else 3)
    failed = 0 if where == "disk" else 1
    assert rig.drain() == [LoadFinished(RequestId("again"), 2 * CHUNK, 2, failed)]
    assert rig.prefill(again, slot=2, start=2 * CHUNK) == want_first
    assert torch.equal(rig.row(2), want_state)
    assert torch.equal(_kv(rig, again, TokenRange(0, 100)), want_kv)
    assert rig.off.state is not None
    counts = rig.off.state.store.counts
    assert (counts["corrupt"], counts[f"{where}_hits"]) == (failed, 1)
    _close(rig, again)
