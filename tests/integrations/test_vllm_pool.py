"""vLLM's per-layer KV views wrapped as one pool; whole blocks move through the ChunkCopier."""

from __future__ import annotations

import pytest
import torch
from vllm_testlib import vllm_kv_caches

from kvplane.errors import UnsupportedError
from kvplane.ids import SlotId
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.offload.copier import ChunkCopier
from kvplane.offload.tiers.host import HostTier


def test_wraps_the_shared_buffer_without_copying() -> None:
    kv = vllm_kv_caches(num_layers=3, num_blocks=8, heads=2, block_size=4, head_dim=4)
    pool = VllmPool.from_kv_caches(dict(reversed(list(kv.items()))))  # any dict order
    assert pool.layer_names == tuple(kv)
    assert pool.tensor.data_ptr() == kv["model.layers.0.self_attn.attn"].data_ptr()
    assert tuple(pool.tensor.shape) == (3, 8, 2, 4, 2, 4)
    assert pool.bytes_per_block == 3 * 2 * 4 * 8 * 2
    kv["model.layers.2.self_attn.attn"][5, 1, 3, 7] = 9.0
    assert pool.tensor[2, 5].reshape(-1)[1 * 32 + 3 * 8 + 7] == 9.0
    assert pool.layout.num_blocks == 8 and pool.layout.block_size == 4


def test_whole_blocks_round_trip_through_host_slots() -> None:
    kv = vllm_kv_caches(num_layers=2, num_blocks=10, heads=2, block_size=4, head_dim=4)
    for i, t in enumerate(kv.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t) + 1000 * i)
    pool = VllmPool.from_kv_caches(kv)
    host = HostTier(4, 2 * pool.bytes_per_block, pin_memory=False)
    copier = ChunkCopier(pool.layout, pool.tensor, host, 2)
    before = {n: t.clone() for n, t in kv.items()}
    copier.gather([3, 4, 7, 1], [SlotId(0), SlotId(1)])
    copier.scatter([SlotId(1), SlotId(0)], [8, 9, 5, 6])
    for name, t in kv.items():
        b = before[name]
        assert torch.equal(t[8], b[7]) and torch.equal(t[9], b[1])
        assert torch.equal(t[5], b[3]) and torch.equal(t[6], b[4])
        assert torch.equal(t[:5], b[:5]) and torch.equal(t[7], b[7])
    copier.close()


def test_scatter_partial_writes_only_the_named_blocks() -> None:
    kv = vllm_kv_caches(num_layers=2, num_blocks=10, heads=1, block_size=4, head_dim=4)
    for t in kv.values():
        t.copy_(torch.randn(t.shape))
    pool = VllmPool.from_kv_caches(kv)
    host = HostTier(2, 3 * pool.bytes_per_block, pin_memory=False)
    copier = ChunkCopier(pool.layout, pool.tensor, host, 3)
    before = {n: t.clone() for n, t in kv.items()}
    copier.gather([1, 2, 3], [SlotId(0)])
    pool.scatter_partial(host.slot(SlotId(0)), 1, [8, 9])  # blocks 1..2 of the chunk
    for name, t in kv.items():
        b = before[name]
        assert torch.equal(t[8], b[2]) and torch.equal(t[9], b[3])
        assert torch.equal(t[:8], b[:8])
    pool.scatter_partial(host.slot(SlotId(0)), 0, [])  # nothing to write
    assert all(torch.equal(t[:8], before[n][:8]) for n, t in kv.items())
    copier.close()


def test_refuses_what_it_cannot_copy_whole() -> None:
    with pytest.raises(UnsupportedError, match="no KV cache"):
        VllmPool.from_kv_caches({})
    with pytest.raises(UnsupportedError, match="shape"):
        VllmPool.from_kv_caches({"a": torch.zeros(4, 2, 8)})
    separate = {f"l{i}": torch.zeros(4, 2, 4, 8, dtype=torch.bfloat16) for i in range(2)}
    with pytest.raises(UnsupportedError, match="shared KV buffer"):
        VllmPool.from_kv_caches(separate)
    buf = torch.zeros(2 * 4 * 64 + 64, dtype=torch.bfloat16)
    gappy = {"l0": buf[:256].view(4, 2, 4, 8), "l1": buf[320:576].view(4, 2, 4, 8)}
    with pytest.raises(UnsupportedError, match="dense buffer"):
        VllmPool.from_kv_caches(gappy)
    mixed = {"l0": buf[:256].view(4, 2, 4, 8), "l1": buf[256:512].view(4, 4, 2, 8)}
    with pytest.raises(UnsupportedError, match="differs"):
        VllmPool.from_kv_caches(mixed)
