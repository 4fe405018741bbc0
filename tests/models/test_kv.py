"""PagedKVCache: slot-mapped writes land exactly where the layout says, in every memory order."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention import MLAUpProjection
from kvplane.errors import InvalidArgumentError, LayoutError
from kvplane.layout import BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR, Axis, KVLayout
from kvplane.models import PagedKVCache

ORDERS = [BLOCK_MAJOR, LAYER_MAJOR, HEAD_MAJOR]


@pytest.mark.parametrize("order", ORDERS)
def test_gqa_writes_land_at_their_slots(order: tuple[Axis, ...]) -> None:
    layout = KVLayout.gqa(
        num_blocks=5, block_size=4, num_layers=3, kv_heads=2, head_dim=3, dtype=torch.float32,
        order=order,
    )  # fmt: skip
    kv = PagedKVCache(layout)
    slots = torch.tensor([17, 2, 9])  # (block 4, off 1), (0, 2), (2, 1)
    k = torch.arange(18.0).view(3, 2, 3) + 1
    v = -k
    kv.write_kv(1, slots, k, v)
    canon = layout.canonical_view(kv.pool)  # [block, layer, comp, token, head, dim]
    for row, (b, t) in enumerate([(4, 1), (0, 2), (2, 1)]):
        assert torch.equal(canon[b, 1, 0, t], k[row]) and torch.equal(canon[b, 1, 1, t], v[row])
    assert int((canon != 0).sum()) == 2 * k.numel()  # nothing else changed
    cache = kv.gqa(1)
    assert torch.equal(cache.k[4, 1], k[0]) and torch.equal(cache.v[2, 1], v[2])
    assert cache.k.untyped_storage().data_ptr() == kv.pool.untyped_storage().data_ptr()
    assert (kv.num_slots, kv.block_size, kv.num_blocks) == (20, 4, 5)


@pytest.mark.parametrize("order", ORDERS)
def test_mla_latent_writes_and_views(order: tuple[Axis, ...]) -> None:
    layout = KVLayout.mla(
        num_blocks=3, block_size=2, num_layers=2, latent_dim=4, rope_dim=2, dtype=torch.float32,
        order=order,
    )  # fmt: skip
    kv = PagedKVCache(layout)
    latent = torch.arange(12.0).view(2, 6) + 1
    kv.write_latent(0, torch.tensor([5, 0]), latent)
    up = MLAUpProjection(torch.ones(2, 4, 3), torch.ones(2, 4, 5))
    cache = kv.mla(0, up)
    assert torch.equal(cache.data[2, 1], latent[0]) and torch.equal(cache.data[0, 0], latent[1])
    assert torch.equal(cache.ckv[2, 1], latent[0, :4]) and torch.equal(
        cache.kpe[0, 0], latent[1, 4:]
    )
    assert cache.up_proj is up and kv.mla(1).up_proj is None
    assert int((layout.canonical_view(kv.pool) != 0).sum()) == latent.numel()


def test_dtype_of_writes_follows_the_pool() -> None:
    layout = KVLayout.gqa(num_blocks=2, block_size=2, num_layers=1, kv_heads=1, head_dim=2,
                          dtype=torch.bfloat16)  # fmt: skip
    kv = PagedKVCache(layout)
    kv.write_kv(0, torch.tensor([3]), torch.full((1, 1, 2), 1.5), torch.full((1, 1, 2), 2.5))
    assert kv.dtype == torch.bfloat16 and float(kv.gqa(0).v[1, 1, 0, 1]) == 2.5


def test_bad_layouts_pools_and_slots() -> None:
    with pytest.raises(InvalidArgumentError, match="state layout"):
        PagedKVCache(KVLayout.state(num_slots=2, num_layers=1, state_dim=4))
    tp = KVLayout.gqa(num_blocks=2, block_size=2, num_layers=1, kv_heads=4, head_dim=2,
                      head_range=(0, 2))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match=r"head range \(0, 2\)"):
        PagedKVCache(tp)
    layout = KVLayout.gqa(num_blocks=2, block_size=2, num_layers=1, kv_heads=1, head_dim=2)
    with pytest.raises(LayoutError, match="does not match layout"):
        PagedKVCache(layout, torch.zeros(3))
    with pytest.raises(InvalidArgumentError, match="expected a KVLayout"):
        PagedKVCache("gqa")  # type: ignore[arg-type]
    kv = PagedKVCache(layout)
    kv.check_slots(torch.tensor([0, 3]))
    with pytest.raises(
        InvalidArgumentError, match=r"slots \[0, 4\] fall outside the pool's 4 slots"
    ):
        kv.check_slots(torch.tensor([0, 4]))
    with pytest.raises(InvalidArgumentError, match=r"slots \[-1, 1\]"):
        kv.check_slots(torch.tensor([-1, 1]))
