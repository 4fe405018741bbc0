"""vLLM's GPU attention layouts as one pool: gathers and scatters byte-exact against the
kernels' own indexing, for every backend shape and stride order."""

from __future__ import annotations

import math

import pytest
import torch

from kvplane.errors import UnsupportedError
from kvplane.ids import SlotId
from kvplane.integrations.vllm.kv_shapes import LayerShape, stride_order_from_name
from kvplane.integrations.vllm.pool import VllmPool
from kvplane.layout import Axis, LayoutKind
from kvplane.offload.copier import ChunkCopier
from kvplane.offload.tiers.host import HostTier

L, NB, H, BS, D = 3, 10, 2, 4, 8
ROPE = 4  # MLA: latent D - ROPE, rope ROPE


def views(logical: tuple[int, ...], order: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Per-layer views of one dense buffer whose logical ``[L, ...]`` dims lie in memory in
    ``order``, built as vLLM's ``compute_layout_strides`` + ``create_kv_cache_views`` do."""
    strides = [0] * len(logical)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= logical[dim]
    buf = torch.randint(-1000, 1000, (math.prod(logical),)).to(torch.bfloat16)
    whole = torch.as_strided(buf, logical, strides)
    return {f"model.layers.{i}.attn": whole[i] for i in range(logical[0])}


def kernel_kv(shape: LayerShape, kv: torch.Tensor, mla: bool) -> list[torch.Tensor]:
    """The components a kernel reads, each ``[blocks, tokens, heads, dim]``, indexed as vLLM's
    backends index the layer tensor."""
    if shape is LayerShape.BHNC:
        t = kv.transpose(1, 2)  # (B, H, N, C) -> (B, N, H, C)
        return [t] if mla else list(t.split(D, dim=-1))
    if shape is LayerShape.FLASH_ATTN:
        return list(kv.unbind(0))
    if shape is LayerShape.FLASHINFER:
        return [kv[:, 0], kv[:, 1]]
    return [kv.unsqueeze(2)]  # MLA: (B, N, latent + rope), one "head"


def canonical(shape: LayerShape, kv: dict[str, torch.Tensor], mla: bool) -> torch.Tensor:
    """``[blocks, layers, comps, tokens, heads, dim]`` by kernel indexing: the host format."""
    per_layer = [torch.stack(kernel_kv(shape, t, mla)) for t in kv.values()]
    return torch.stack(per_layer).permute(2, 0, 1, 3, 4, 5)


CASES = [
    *[
        (LayerShape.BHNC, (L, NB, H, BS, 2 * D), stride_order_from_name(n), False)
        for n in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
    ],
    (LayerShape.BHNC, (L, NB, 1, BS, D), stride_order_from_name("LBHNC"), True),
    (LayerShape.BHNC, (L, NB, 1, BS, D), stride_order_from_name("BLHNC"), True),
    (LayerShape.FLASH_ATTN, (L, 2, NB, BS, H, D), (0, 1, 2, 3, 4, 5), False),
    (LayerShape.FLASH_ATTN, (L, 2, NB, BS, H, D), (2, 0, 1, 3, 4, 5), False),
    (LayerShape.FLASHINFER, (L, NB, 2, BS, H, D), (0, 1, 2, 3, 4, 5), False),
    (LayerShape.FLASHINFER, (L, NB, 2, BS, H, D), (0, 1, 2, 4, 3, 5), False),  # HND
    (LayerShape.FLASHINFER, (L, NB, 2, BS, H, D), (1, 0, 2, 4, 3, 5), False),  # cross-layer
    (LayerShape.MLA, (L, NB, BS, D), (0, 1, 2, 3), True),
    (LayerShape.MLA, (L, NB, BS, D), (1, 0, 2, 3), True),
]


@pytest.mark.parametrize(("shape", "logical", "order", "mla"), CASES)
def test_gather_and_scatter_are_byte_exact_against_kernel_indexing(
    shape: LayerShape, logical: tuple[int, ...], order: tuple[int, ...], mla: bool
) -> None:
    kv = views(logical, order)
    pool = VllmPool.from_kv_caches(
        kv, shape, mla_rope_dim=ROPE if mla else None, stride_order=order
    )
    assert pool.layout.kind is (LayoutKind.MLA if mla else LayoutKind.GQA)
    assert (pool.layout.num_blocks, pool.layout.block_size, pool.layout.num_layers) == (NB, BS, L)
    assert pool.layout.head_dim == D and pool.layout.rope_dim == (ROPE if mla else 0)
    assert pool.bytes_per_block == L * (1 if mla else 2 * H) * BS * D * 2
    host = HostTier(4, 2 * pool.bytes_per_block, pin_memory=False)
    copier = ChunkCopier(pool.layout, pool.tensor, host, 2)
    before = canonical(shape, kv, mla).clone()
    copier.gather([7, 2, 0, 9], [SlotId(3), SlotId(1)])
    for slot, ids in ((3, [7, 2]), (1, [0, 9])):
        want = before[ids].contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(host.slot(SlotId(slot)), want)
    fresh = torch.randint(-1000, 1000, (2, 2, *before.shape[1:])).to(torch.bfloat16)
    for i, slot in enumerate((0, 2)):
        host.slot(SlotId(slot)).copy_(fresh[i].contiguous().view(torch.uint8).reshape(-1))
    copier.scatter([SlotId(0), SlotId(2)], [4, 1, 8, 5])
    after = canonical(shape, kv, mla)
    assert torch.equal(after[[4, 1, 8, 5]], fresh.reshape(4, *before.shape[1:]))
    untouched = [b for b in range(NB) if b not in (4, 1, 8, 5)]
    assert torch.equal(after[untouched], before[untouched])
    pool.scatter_partial(host.slot(SlotId(3)), 1, [6])  # block 2's old bytes into block 6
    assert torch.equal(canonical(shape, kv, mla)[6], before[2])
    copier.close()


def test_memory_order_is_read_from_the_strides() -> None:
    nhd = views((L, NB, H, BS, 2 * D), stride_order_from_name("LBNHC"))
    pool = VllmPool.from_kv_caches(nhd)
    a = Axis
    assert pool.layout.order == (a.LAYER, a.BLOCK, a.TOKEN, a.HEAD, a.COMP, a.DIM)
    cross = views((L, NB, 2, BS, H, D), (1, 0, 2, 4, 3, 5))
    pool = VllmPool.from_kv_caches(cross, LayerShape.FLASHINFER)
    assert pool.layout.order == (a.BLOCK, a.LAYER, a.COMP, a.HEAD, a.TOKEN, a.DIM)
    mla = views((L, NB, 1, BS, D), stride_order_from_name("BHLNC"))  # H=1: same bytes as BLHNC
    got = VllmPool.from_kv_caches(mla, mla_rope_dim=ROPE).layout
    assert got.order == (a.BLOCK, a.LAYER, a.TOKEN, a.COMP, a.HEAD, a.DIM)
    assert got.latent_dim == D - ROPE
    assert stride_order_from_name("LBNHC") == (0, 1, 3, 2, 4)


def test_a_reported_order_the_tensors_do_not_have_is_refused() -> None:
    kv = views((L, NB, H, BS, 2 * D), stride_order_from_name("LBHNC"))
    with pytest.raises(UnsupportedError, match="reports memory order"):
        VllmPool.from_kv_caches(kv, stride_order=stride_order_from_name("LBNHC"))
    with pytest.raises(UnsupportedError, match="not a permutation"):
        VllmPool.from_kv_caches(kv, stride_order=(0, 0, 1, 2, 3))
    with pytest.raises(UnsupportedError, match="unknown vLLM KV cache layout"):
        stride_order_from_name("NHD")


def test_padded_pages_and_foreign_shapes_are_refused() -> None:
    buf = torch.zeros(L * NB * 80, dtype=torch.bfloat16)
    whole = torch.as_strided(buf, (L, NB, 1, BS, 16), (NB * 80, 80, 64, 16, 1))  # 16 pad
    with pytest.raises(UnsupportedError, match="dense buffer"):
        VllmPool.from_kv_caches({f"l{i}": whole[i] for i in range(L)})
    fa = views((L, 2, NB, BS, H, D), (0, 1, 2, 3, 4, 5))
    with pytest.raises(UnsupportedError, match="has 4 dims"):
        VllmPool.from_kv_caches(fa)  # a FlashAttention tensor read as BHNC
    one_head = views((L, NB, H, BS, D), stride_order_from_name("LBHNC"))
    with pytest.raises(UnsupportedError, match="one head"):
        VllmPool.from_kv_caches(one_head, mla_rope_dim=ROPE)
