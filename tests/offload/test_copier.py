"""ChunkCopier: gather/scatter move exactly the right bytes for every pool order, dtype,
slot run shape and block-id pattern, by the C run copier and by the torch paths of the local
transport that runs their plans; bad input is rejected before anything moves."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from offload_testlib import filled_pool, keys, tiny_layout

from kvplane.errors import InvalidArgumentError
from kvplane.ids import BlockId, SlotId
from kvplane.layout import HEAD_MAJOR, LAYER_MAJOR, KVLayout
from kvplane.native import KernelBuild
from kvplane.offload.copier import ChunkCopier
from kvplane.offload.tiers import HostTier
from kvplane.transports import native_copy
from kvplane.transports.native_copy import SPLIT_MIN, kernel
from kvplane.transports.staging import stage_rows


def chunk_bytes_of(layout: KVLayout, pool: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The stored form of one chunk: its blocks in canonical order, as bytes."""
    return layout.canonical_view(pool)[ids].contiguous().view(torch.uint8).flatten()


LAYOUTS = {
    "gqa-block-major": tiny_layout(),
    "gqa-layer-major": KVLayout.gqa(
        num_blocks=32, block_size=4, num_layers=2, kv_heads=2, head_dim=16,
        dtype=torch.float32, order=LAYER_MAJOR,
    ),
    "mla-bf16-padded": KVLayout.mla(
        num_blocks=32, block_size=2, num_layers=1, latent_dim=8, rope_dim=4, dtype=torch.bfloat16
    ),
    "gqa-fp8": KVLayout.gqa(
        num_blocks=32, block_size=4, num_layers=2, kv_heads=1, head_dim=16,
        dtype=torch.float8_e4m3fn,
    ),
    "gqa-head-major": KVLayout.gqa(
        num_blocks=32, block_size=4, num_layers=2, kv_heads=2, head_dim=16,
        dtype=torch.float32, order=HEAD_MAJOR,
    ),
}  # fmt: skip


BACK_TO_BACK = {"gqa-block-major", "mla-bf16-padded", "gqa-fp8"}
"""Layouts whose blocks lie back to back in the pool: the C run copier takes them."""


@pytest.fixture(params=["native", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which copy path the test runs: the C run copier or (kernel disabled) torch."""
    if request.param == "torch":
        monkeypatch.setattr(native_copy, "kernel", lambda: KernelBuild(None, "disabled"))
    elif kernel().library is None:
        pytest.skip("needs a C compiler to build the run copier")
    return str(request.param)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gather_then_scatter_moves_exact_bytes(name: str, path: str) -> None:
    layout = LAYOUTS[name]
    bpc = 2
    pool = filled_pool(layout, seed=1)
    original = pool.clone()
    host = HostTier(8, bpc * layout.bytes_per_block)
    copier = ChunkCopier(layout, pool, host, bpc)
    ids = [[7, 3], [4, 5], [0, 31], [10, 11]]
    slots = [SlotId(s) for s in (0, 1, 3, 4)]  # runs [0, 1] and [3, 4]
    move = copier.plans.gather(np.array(ids).ravel(), np.array(slots))
    whole = not (move.plan.whole.src.lengths % layout.bytes_per_block).any()
    assert whole == (name in BACK_TO_BACK)  # runs of whole blocks: blocks lie back to back
    copier.gather([BlockId(b) for c in ids for b in c], slots)
    for s, c in zip(slots, ids, strict=True):
        assert torch.equal(host.slot(s), chunk_bytes_of(layout, original, c))
    assert torch.equal(pool, original)  # gather only reads the pool
    copier.gather([BlockId(b) for b in range(20, 24)], [SlotId(6), SlotId(7)])  # slice copies
    assert torch.equal(host.slot(SlotId(6)), chunk_bytes_of(layout, original, [20, 21]))
    assert torch.equal(host.slot(SlotId(7)), chunk_bytes_of(layout, original, [22, 23]))
    pool.zero_()
    consecutive = [BlockId(b) for b in range(12, 20)]  # one run: slice copies
    copier.scatter(slots, consecutive)
    canon, orig = layout.canonical_view(pool), layout.canonical_view(original)
    flat = [b for c in ids for b in c]
    assert torch.equal(canon[12:20], orig[flat])
    scattered = [BlockId(b) for b in (30, 2, 25, 9, 17, 6, 21, 13)]  # no runs: index_copy_
    copier.scatter(slots, scattered)
    assert torch.equal(canon[scattered], orig[flat])
    untouched = sorted(set(range(32)) - set(range(12, 20)) - set(scattered))
    assert not canon[untouched].view(torch.uint8).any()
    copier.close()
    copier.gather([BlockId(b) for b in (30, 2)], [SlotId(2)])  # closed: the caller's thread only
    assert torch.equal(host.slot(SlotId(2)), chunk_bytes_of(layout, pool, [30, 2]))
    assert host.slot(SlotId(2)).any()


def test_native_moves_split_among_copy_threads_until_closed() -> None:
    """A move of >= 2 x SPLIT_MIN bytes is cut among the copier's threads; ``close`` stops
    them and later moves run (exactly) on the calling thread alone."""
    if kernel().library is None:
        pytest.skip("needs a C compiler to build the run copier")
    layout, bpc = tiny_layout(num_blocks=1024), 64  # 2 KiB blocks, 128 KiB chunks
    pool = filled_pool(layout, seed=3)
    host = HostTier(16, bpc * layout.bytes_per_block)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        copier = ChunkCopier(layout, pool, host, bpc)
    finally:
        torch.set_num_threads(threads)
    assert 16 * host.chunk_bytes >= 2 * SPLIT_MIN

    def helpers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("kvplane-local-copy")]

    order = torch.randperm(1024, generator=torch.Generator().manual_seed(5)).tolist()
    slots = [SlotId(s) for s in range(16)]
    copier.gather([BlockId(b) for b in order], slots)
    assert len(helpers()) == 1
    for i, s in enumerate(slots):
        assert torch.equal(
            host.slot(s), chunk_bytes_of(layout, pool, order[i * bpc : (i + 1) * bpc])
        )
    copier.close()
    assert not helpers()
    copier.scatter(slots[::-1], [BlockId(b) for b in range(1024)])
    assert not helpers()
    canon = layout.canonical_view(pool)
    want = [b for i in range(15, -1, -1) for b in order[i * bpc : (i + 1) * bpc]]
    original = layout.canonical_view(filled_pool(layout, seed=3))
    assert torch.equal(canon, original[want])


def test_bad_input_moves_nothing(path: str) -> None:
    layout = tiny_layout()
    pool = filled_pool(layout)
    host = HostTier(2, 2 * layout.bytes_per_block)
    copier = ChunkCopier(layout, pool, host, 2)
    host.buffer.fill_(9)
    bad = (([0, 1, 2], [0]), ([0, 32], [0]), ([-1, 0], [0]), ([0, 1], [2]), ([3, 3], [0]),
           ([0, 1, 2, 3], [1, 1]))  # fmt: skip
    for ids, slots in bad:
        with pytest.raises(InvalidArgumentError):
            copier.gather(ids, slots)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            copier.scatter(slots, ids)  # type: ignore[arg-type]
    assert bool((host.buffer == 9).all()) and torch.equal(pool, filled_pool(layout))
    with pytest.raises(InvalidArgumentError, match="chunk of 3 blocks"):
        ChunkCopier(layout, pool, host, 3)
    state = KVLayout.state(num_slots=4, num_layers=1, state_dim=8)
    with pytest.raises(InvalidArgumentError, match="whole"):
        ChunkCopier(state, state.allocate(), HostTier(2, state.bytes_per_block), 1)


def test_non_integer_ids_and_slots_are_refused_before_any_copy() -> None:
    layout = tiny_layout()
    pool = filled_pool(layout)
    host = HostTier(2, 2 * layout.bytes_per_block)
    copier = ChunkCopier(layout, pool, host, 2)
    host.buffer.fill_(9)
    for ids, slots, match in (
        ([2.9, 3.9], [0], "block ids"),  # would have been truncated to blocks 2, 3
        ([True, False], [0], "block ids"),
        ([0, 1], [0.0], "host slots"),
        ([0, 1], [True], "host slots"),
        (5, [0], "block ids"),
        (None, [0], "block ids"),
        ([0, 1], 0, "host slots"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            copier.gather(ids, slots)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=match):
            copier.scatter(slots, ids)  # type: ignore[arg-type]
    assert bool((host.buffer == 9).all()) and torch.equal(pool, filled_pool(layout))
    copier.close()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_copy_is_one_batch_of_its_validated_plan_on_the_local_transport(name: str) -> None:
    """A gather with keys runs the plan whose ops are its chunks (keys attached), as one
    batch of the copier's own local transport, which ends with no batch or pin left."""
    layout = LAYOUTS[name]
    pool = filled_pool(layout, seed=2)
    host = HostTier(4, 2 * layout.bytes_per_block)
    copier = ChunkCopier(layout, pool, host, 2)
    ids, slots, ks = [9, 8, 30, 31, 2, 5], [SlotId(3), SlotId(1), SlotId(2)], keys(1, 2, 3)
    done: list[int] = []
    submit = copier.transport.submit

    def counted(*args: object, **kw: object) -> object:
        done.append(1)
        return submit(*args, **kw)  # type: ignore[arg-type]

    copier.transport.submit = counted  # type: ignore[method-assign]
    copier.gather([BlockId(b) for b in ids], slots, ks)
    move = copier.plans.gather(np.array(ids), np.array(slots), ks)
    ops = [op for plan in move.plan.plans for op in plan.ops]  # padded: one plan per chunk
    assert [op.chunk_keys for op in ops] == [(k,) for k in ks]
    for i, s in enumerate(slots):
        assert torch.equal(host.slot(s), chunk_bytes_of(layout, pool, ids[2 * i : 2 * i + 2]))
    copier.scatter(slots, [BlockId(b) for b in (0, 1, 3, 4, 6, 7)], ks)
    canon = layout.canonical_view(pool)
    assert torch.equal(canon[[0, 1, 3, 4, 6, 7]].view(torch.uint8),
                       canon[ids].view(torch.uint8))  # fmt: skip
    assert done == [1, 1]  # one transport batch per copy
    assert copier.transport.live_batches() == 0 and copier.transport.pinned_regions() == 0
    copier.close()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_device_staging_runs_a_chunk_plan_exactly(name: str) -> None:
    """What a GPU pool's copies do (the local transport's device staging, over the plan's
    runs), with the CPU standing in for the device: byte-exact both ways, in several steps."""
    layout = LAYOUTS[name]
    pool = filled_pool(layout, seed=4)
    original = pool.clone()
    host = HostTier(4, 2 * layout.bytes_per_block)
    copier = ChunkCopier(layout, pool, host, 2)
    flat = pool.reshape(-1).view(torch.uint8)
    ids, slots = [21, 22, 3, 9, 30, 31], [SlotId(2), SlotId(0), SlotId(3)]
    out = copier.plans.gather(np.array(ids), np.array(slots))  # the batch the transport gets
    step = 3 * layout.bytes_per_block // 2
    assert stage_rows(flat, out.src.offsets, host.buffer, out.dst.offsets, out.src.lengths,
                      to_host=True, stage_bytes=step)  # fmt: skip
    for i, s in enumerate(slots):
        assert torch.equal(host.slot(s), chunk_bytes_of(layout, original, ids[2 * i : 2 * i + 2]))
    pool.zero_()
    back = [0, 1, 5, 4, 12, 13]
    into = copier.plans.scatter(np.array(slots), np.array(back))
    assert stage_rows(flat, into.dst.offsets, host.buffer, into.src.offsets, into.src.lengths,
                      to_host=False, stage_bytes=step)  # fmt: skip
    canon, orig = layout.canonical_view(pool), layout.canonical_view(original)
    assert torch.equal(canon[back].view(torch.uint8), orig[ids].view(torch.uint8))
    rest = sorted(set(range(32)) - set(back))
    assert not canon[rest].view(torch.uint8).any()
    copier.close()
