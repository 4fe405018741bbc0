"""A worker's pools and request book with KV cache groups: a 4-layer Qwen2 (sliding, full,
sliding, full; window 8) served with ``kv_groups`` gets one paged pool, allocator and hasher per
group; a request gets one table per group (a receiver's window group only its window), the
prefix every group holds, and destination ids group after group (#33)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest

from kvplane.blocks import BlockTable
from kvplane.ids import SessionId
from kvplane.models import build_model
from kvplane.models.config import LlamaConfig
from kvplane.models.weights import RandomTensors
from kvplane.pipeline.advert import decode_advert
from kvplane.serving import worker_requests as book
from kvplane.serving.pools import WorkerPools
from kvplane.serving.producers.model import ModelDecoder
from kvplane.transports.local import LocalTransport
from qwen2_testlib import WINDOW, mixed_layer_types

CONFIG = LlamaConfig(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=8, architecture="Qwen2ForCausalLM", sliding_window=WINDOW,
    layer_types=mixed_layer_types(4),
)  # fmt: skip
MODEL = build_model(CONFIG, RandomTensors(5))
BS, BLOCKS = 4, 8
PROMPT = np.arange(20, dtype=np.int64)
SID = SessionId("s")


@dataclass(eq=False)
class _Order:
    request_id: str


@dataclass(eq=False)
class _Req:
    """A request record as the workers keep one (:class:`~book.HeldRequest`)."""

    order: _Order
    tokens: np.ndarray
    sid: SessionId = SID
    table: BlockTable | None = None
    group_tables: tuple[BlockTable, ...] = ()
    slot: int | None = None
    failed_at: float | None = None


@contextmanager
def _pools(groups: bool) -> Iterator[WorkerPools]:
    transport = LocalTransport()
    try:
        yield WorkerPools(ModelDecoder(MODEL, "m", kv_groups=groups), transport,
                          num_blocks=BLOCKS, block_size=BS, num_slots=2)  # fmt: skip
    finally:
        transport.close()


@pytest.fixture
def pools() -> Iterator[WorkerPools]:
    with _pools(True) as made:
        yield made


def _release(pools: WorkerPools, req: _Req) -> None:
    assert req.table is not None and req.slot is not None
    for table, pool in zip((req.table, *req.group_tables), pools.block_pools, strict=True):
        table.release(pool)
    pools.free_slot(req.slot)


def test_one_paged_pool_allocator_and_hasher_per_group(pools: WorkerPools) -> None:
    assert pools.num_kv_pools == 2
    assert [p.layout.layer_ids for p in pools.kv.pools] == [(0, 2), (1, 3)]
    assert [p.capacity for p in pools.block_pools] == [BLOCKS - 1, BLOCKS]  # window: null block
    assert len({h.fingerprint for h in pools.hashers}) == 2
    assert pools.layer_ids == (0, 1, 2, 3)
    _, remote = decode_advert(pools.advert(), pools.profile())
    assert [r.layout for r in remote] == pools.layouts
    assert [r.layout.whole_only for r in remote] == [False, False, True]  # paged first, the tail
    pools.kv.groups[0].tensor.fill_(1.0)
    slot = pools.take_slot()  # zeroes the tail row, never a KV pool
    assert slot is not None and float(pools.kv.groups[0].tensor.min()) == 1.0
    pools.free_slot(slot)
    pools.check_idle()


def test_without_kv_groups_one_pool_of_every_layer_as_before() -> None:
    with _pools(False) as pools:
        assert pools.num_kv_pools == 1 and pools.kv.groups == () and pools.group_blocks == ()
        assert pools.kv.layout == MODEL.kv_layout(BLOCKS, BS)
        assert pools.blocks.null_block is not None  # a windowed pool, as always
        assert len(pools.layouts) == 2


def test_a_receiver_holds_only_its_window_groups_window(pools: WorkerPools) -> None:
    req = _Req(_Order("r"), PROMPT)
    assert book.admit_memory(pools, BS, req, received=True) is not None
    assert req.table is not None and req.slot is not None
    null = pools.blocks.null_block
    # the step at 20 reads (12, 20]: blocks 0-2 (positions 0-11) of the window group are none
    assert req.table.block_ids[:3] == (null, null, null)
    assert [pool.num_used_blocks for pool in pools.block_pools] == [2, 5]
    ids = book.destination_ids(pools, req)
    window, full = (req.table, *req.group_tables)
    assert ids == (*window.block_ids, *full.block_ids, req.slot)
    assert book.received_need(pools, len(PROMPT), 5) == 6  # the full group: 24 positions
    _release(pools, req)
    pools.check_idle()


def _cache(pools: WorkerPools) -> None:
    """Compute and release a request of ``PROMPT``: its full blocks stay cached per group."""
    req = _Req(_Order("first"), PROMPT)
    assert book.admit_memory(pools, BS, req) is not None
    for table, pool in zip((req.table, *req.group_tables), pools.block_pools, strict=True):
        assert table is not None
        table.mark_computed(pool, len(PROMPT))
    _release(pools, req)


def _evict(pools: WorkerPools, group: int) -> None:
    """Reuse every free block of one group's pool (its cached blocks lose their hashes)."""
    pool = pools.block_pools[group]
    got = pool.allocate(pool.num_free_blocks)
    assert got is not None
    pool.free(list(got))


@pytest.mark.parametrize("evicted, cached", [(None, 16), (0, 0), (1, 0)])
def test_a_prefix_is_shared_only_as_far_as_every_group_holds_it(
    pools: WorkerPools, evicted: int | None, cached: int
) -> None:
    _cache(pools)
    if evicted is not None:
        _evict(pools, evicted)
    req = _Req(_Order("again"), PROMPT)
    assert book.admit_memory(pools, BS, req) is not None
    assert req.table is not None
    assert [t.num_cached_tokens for t in (req.table, *req.group_tables)] == [cached, cached]
    _release(pools, req)
    pools.check_idle()
