"""ChunkPlans: a gather or scatter between a pool and chunk slots is a validated plan with one
op per chunk carrying its key, byte-exact against the canonical reference (every memory order,
padded slots, a windowed layout), cached per move; bad moves are refused before any plan."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey, RegionId, TokenRange
from kvplane.layout import HEAD_MAJOR, LAYER_MAJOR, KVLayout
from kvplane.transfer.chunk_plans import ChunkMove, ChunkPlans, SlotBuffer
from kvplane.transfer.plan import ValidatedPlan
from kvplane.transports.base import DescriptorList


def key(i: int) -> ChunkKey:
    return ChunkKey(hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest())


def _gqa(order: tuple, **kw: object) -> KVLayout:
    return KVLayout.gqa(num_blocks=32, block_size=4, num_layers=2, kv_heads=2, head_dim=8,
                        dtype=torch.float32, order=order, **kw)  # type: ignore[arg-type]  # fmt: skip


LAYOUTS = {
    "block-major": _gqa(KVLayout.gqa.__kwdefaults__["order"]),
    "layer-major": _gqa(LAYER_MAJOR),
    "head-major-tp": _gqa(HEAD_MAJOR, head_range=(1, 2)),
    "windowed": _gqa(LAYER_MAJOR, sliding_window=3),
    "mla-bf16": KVLayout.mla(num_blocks=32, block_size=2, num_layers=2, latent_dim=8, rope_dim=4),
}
POOL, SLOTS = RegionId(1), RegionId(2)
BPC, NUM_SLOTS = 2, 6
IDS = [7, 3, 4, 5, 0, 31, 10, 11]
TARGET = [5, 0, 2, 3]  # two runs of slots, out of order
KEYS = [key(i) for i in range(4)]


def _setup(
    layout: KVLayout, padded: bool, kvref: Any = None
) -> tuple[ChunkPlans, dict[RegionId, torch.Tensor], torch.Tensor, int]:
    chunk = BPC * layout.bytes_per_block
    stride = chunk + (40 if padded else 0)
    region = torch.zeros(layout.pool_bytes, dtype=torch.uint8)
    pool = region.view(layout.dtype).view(layout.shape)
    if kvref is not None:
        region, pool = kvref.region_with_pool(layout, 0, seed=3, slack=0)
    host = torch.randint(0, 256, (NUM_SLOTS * stride,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(4))  # fmt: skip
    plans = ChunkPlans(layout, POOL, SLOTS, SlotBuffer(NUM_SLOTS, chunk, stride), BPC)
    return plans, {POOL: region, SLOTS: host}, pool, stride


def _run(move: ChunkMove, regions: dict[RegionId, torch.Tensor], kvref: Any) -> None:
    """The reference executor (every descriptor copied on its own) over each plan."""
    for plan in move.plan.plans:
        kvref.memcpy(plan, regions)


def _b(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t`` (random bytes read as floats hold NaNs, which never compare equal)."""
    return t.contiguous().view(torch.uint8)


def _chunk(layout: KVLayout, pool: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The stored form of a chunk: its blocks in canonical order, as bytes."""
    return layout.canonical_view(pool)[ids].contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "padded"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gather_and_scatter_are_one_op_per_chunk_and_byte_exact(
    name: str, padded: bool, kvref: Any
) -> None:
    layout = LAYOUTS[name]
    plans, regions, pool, stride = _setup(layout, padded, kvref)
    original, host_before = pool.clone(), regions[SLOTS].clone()
    move = plans.gather(np.array(IDS), np.array(TARGET), KEYS)
    validated = move.plan
    ops = [op for plan in validated.plans for op in plan.ops]
    assert isinstance(validated, ValidatedPlan) and len(validated.plans) == (4 if padded else 1)
    assert [op.chunk_keys for op in ops] == [(k,) for k in KEYS]
    tpc = BPC * layout.block_size
    want_tokens = (
        [TokenRange(0, tpc)] * 4
        if padded
        else [TokenRange(i * tpc, (i + 1) * tpc) for i in range(4)]
    )
    assert [op.tokens for op in ops] == want_tokens
    assert validated.num_bytes == validated.logical_bytes == 4 * BPC * layout.bytes_per_block
    assert move.src.total_bytes == validated.num_bytes  # the one batch moves exactly those
    _run(move, regions, kvref)
    host, chunk = regions[SLOTS], BPC * layout.bytes_per_block
    for i, s in enumerate(TARGET):
        got = host[s * stride : s * stride + chunk]
        assert torch.equal(got, _chunk(layout, original, IDS[2 * i : 2 * i + 2]))
    untouched = torch.ones(len(host), dtype=torch.bool)
    for s in TARGET:
        untouched[s * stride : s * stride + chunk] = False
    assert torch.equal(host[untouched], host_before[untouched])  # padding and other slots
    assert torch.equal(_b(pool), _b(original))  # a gather only reads the pool
    pool.zero_()
    back = [12, 13, 14, 15, 20, 21, 1, 2]
    _run(plans.scatter(np.array(TARGET), np.array(back), KEYS), regions, kvref)
    canon, orig = layout.canonical_view(pool), layout.canonical_view(original)
    assert torch.equal(_b(canon[back]), _b(orig[IDS]))
    rest = sorted(set(range(32)) - set(back))
    assert not canon[rest].view(torch.uint8).any()


def test_a_move_of_the_same_blocks_and_slots_reuses_the_cached_batch() -> None:
    """The batch is cached per (direction, blocks, slots), whatever the keys (fresh in every
    store): the keys annotate only the move's plan."""
    plans, _, _, _ = _setup(LAYOUTS["block-major"], False)
    ids, slots = np.array(IDS), np.array(TARGET)
    first = plans.gather(ids, slots, KEYS)
    again = plans.gather(ids.copy(), slots.copy(), [key(9), key(8), key(7), key(6)])
    assert (again.src, again.dst) == (first.src, first.dst)  # the same lists: vouched once
    assert [op.chunk_keys for op in again.plan.plan.ops] == [(key(i),) for i in (9, 8, 7, 6)]
    assert [op.chunk_keys for op in first.plan.plan.ops] == [(k,) for k in KEYS]
    assert plans.gather(ids, slots).plan.plan.ops[0].chunk_keys == ()
    assert plans.scatter(slots, ids, KEYS).src is not first.src  # the other direction
    layout = LAYOUTS["block-major"]
    buffer = SlotBuffer(NUM_SLOTS, BPC * layout.bytes_per_block, BPC * layout.bytes_per_block)
    small = ChunkPlans(layout, POOL, SLOTS, buffer, BPC, cache_descriptors=6)
    a = small.gather(ids, slots)
    assert len(a.src) == 8  # a run per block (merging 4, 5 and 10, 11 would not halve them)
    b = small.gather(ids[:2], slots[:1])  # 8 + 2 descriptors > 6: the oldest goes
    assert small.gather(ids[:2], slots[:1]).src is b.src
    assert small.gather(ids, slots).src is not a.src


def test_a_move_keeps_its_own_copy_of_the_callers_arrays() -> None:
    """Changing the caller's ids, slots or keys after a move was made (its plan not built
    yet) changes neither the move's batch nor its plan."""
    plans, _, _, _ = _setup(LAYOUTS["layer-major"], True)
    ids, slots, keys = np.array(IDS), np.array(TARGET), list(KEYS)
    move = plans.gather(ids, slots, keys)
    want = plans.gather(np.array(IDS), np.array(TARGET), KEYS).plan
    ids[:] = np.arange(8) + 20
    slots[:] = [1, 4, 3, 2]
    keys.reverse()
    got = move.plan
    assert np.array_equal(_byte_map(got.whole.src, got.whole.dst),
                          _byte_map(want.whole.src, want.whole.dst))  # fmt: skip
    assert np.array_equal(_byte_map(move.src, move.dst), _byte_map(got.whole.src, got.whole.dst))
    assert [op.chunk_keys for p in got.plans for op in p.ops] == [(k,) for k in KEYS]


def test_bad_moves_are_refused_before_any_plan() -> None:
    layout = LAYOUTS["block-major"]
    plans, _, _, _ = _setup(layout, False)
    with pytest.raises(InvalidArgumentError, match="need 4 block ids"):
        plans.gather(np.array([0, 1, 2]), np.array([0, 1]))
    with pytest.raises(InvalidArgumentError, match="2 keys"):
        plans.gather(np.array([0, 1, 2, 3]), np.array([0, 1]), KEYS[:1])
    with pytest.raises(InvalidArgumentError, match="block ids repeat 3"):
        plans.gather(np.array([3, 4, 5, 3]), np.array([0, 1]))
    with pytest.raises(InvalidArgumentError, match="slots repeat 1"):
        plans.scatter(np.array([1, 1]), np.array([0, 1, 2, 3]))
    chunk = BPC * layout.bytes_per_block
    with pytest.raises(InvalidArgumentError, match=f"hold {chunk - 1} bytes but a chunk of 2"):
        ChunkPlans(layout, POOL, SLOTS, SlotBuffer(4, chunk - 1, chunk), BPC)


def test_a_slot_buffer_names_each_slots_one_run_and_refuses_bad_geometry() -> None:
    buffer = SlotBuffer(3, 1000, 4096)
    assert (buffer.padded, buffer.nbytes) == (True, 3 * 4096)
    assert [buffer.run(s) for s in (0, np.int64(2))] == [(0, 1000), (8192, 1000)]
    assert not SlotBuffer(2, 64, 64).padded
    with pytest.raises(InvalidArgumentError, match=r"a slot must be an int in \[0, 3\), got 3"):
        buffer.run(3)
    with pytest.raises(InvalidArgumentError, match="a slot must be"):
        buffer.run(True)
    with pytest.raises(InvalidArgumentError, match=r"slot_stride must be a byte count in \[64,"):
        SlotBuffer(2, 64, 63)
    with pytest.raises(InvalidArgumentError, match="num_slots must be a positive int"):
        SlotBuffer(0, 64, 64)
    with pytest.raises(InvalidArgumentError, match="chunk_bytes must be a byte count"):
        SlotBuffer(2, 0, 64)


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "padded"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_chunks_slot_side_runs_tile_its_slots_one_run(name: str, padded: bool) -> None:
    """What the disk and remote tiers take as a chunk's bytes (the host slot view,
    :meth:`SlotBuffer.run`) is exactly what the chunk's op of the CHUNK plan writes: its
    slot-side runs, sorted, follow on from the slot's offset to its chunk's end."""
    plans, _, _, _ = _setup(LAYOUTS[name], padded)
    move = plans.gather(np.array(IDS), np.array(TARGET), KEYS)
    ops = [op for plan in move.plan.plans for op in plan.ops]
    for op, slot in zip(ops, TARGET, strict=True):
        dst = op.dst
        assert set(dst.regions.tolist()) == {int(SLOTS)}
        order = np.argsort(dst.offsets)
        starts, ends = dst.offsets[order], dst.offsets[order] + dst.lengths[order]
        assert np.array_equal(starts[1:], ends[:-1])  # no gap, no overlap
        offset, length = plans.slots.run(slot)
        assert (int(starts[0]), int(ends[-1] - starts[0])) == (offset, length)


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "padded"])
def test_no_chunk_is_an_empty_validated_plan(padded: bool) -> None:
    plans, _, _, _ = _setup(LAYOUTS["mla-bf16"], padded)
    none = np.zeros(0, dtype=np.int64)
    move = plans.gather(none, none)
    assert move.plan.empty and move.plan.num_bytes == 0 and len(move.src) == 0
    assert plans.scatter(none, none).plan.empty


def _byte_map(src: DescriptorList, dst: DescriptorList) -> np.ndarray:
    """Every byte a batch moves as (source key, destination key) rows, sorted: equal for two
    batches exactly when they move the same bytes to the same places."""
    within = np.arange(int(src.lengths.sum())) - np.repeat(
        np.cumsum(src.lengths) - src.lengths, src.lengths
    )
    s = np.repeat(src.regions << 40 | src.offsets, src.lengths) + within
    d = np.repeat(dst.regions << 40 | dst.offsets, dst.lengths) + within
    rows = np.stack([s, d], axis=1)
    return rows[np.lexsort((rows[:, 1], rows[:, 0]))]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(LAYOUTS)),
    padded=st.booleans(),
    to_slots=st.booleans(),
    picks=st.data(),
)
def test_the_batch_moves_exactly_the_bytes_of_its_chunk_plan(
    name: str, padded: bool, to_slots: bool, picks: st.DataObject
) -> None:
    """The batch a move runs (the one-block template shifted) and the planner's CHUNK plan of
    the same move map every byte identically, for any distinct blocks and slots."""
    layout = LAYOUTS[name]
    plans, _, _, _ = _setup(layout, padded)
    n = picks.draw(st.integers(0, NUM_SLOTS))
    slots = picks.draw(st.permutations(range(NUM_SLOTS)))[:n]
    ids = picks.draw(st.permutations(range(layout.num_blocks)))[: n * BPC]
    keys = [key(i) for i in range(n)]
    args = (np.array(ids, dtype=np.int64), np.array(slots, dtype=np.int64), keys)
    move = plans.gather(*args) if to_slots else plans.scatter(args[1], args[0], keys)
    whole = move.plan.whole
    assert np.array_equal(_byte_map(move.src, move.dst), _byte_map(whole.src, whole.dst))
    assert [op.chunk_keys for p in move.plan.plans for op in p.ops] == [(k,) for k in keys]


def test_maximal_runs_ignore_how_runs_are_cut_but_not_where_bytes_go() -> None:
    from kvplane.transfer.chunk_plans import _maximal_runs

    def dl(*rows: tuple[int, int, int]) -> DescriptorList:
        regions, offsets, lengths = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
        return DescriptorList(regions, offsets, lengths)

    one = _maximal_runs(dl((1, 0, 8), (1, 64, 4)), dl((2, 100, 8), (2, 0, 4)))
    cut = _maximal_runs(
        dl((1, 64, 4), (1, 4, 4), (1, 0, 4)), dl((2, 0, 4), (2, 104, 4), (2, 100, 4))
    )
    moved = _maximal_runs(dl((1, 0, 8), (1, 64, 4)), dl((2, 100, 8), (2, 1, 4)))
    assert one.tolist() == cut.tolist() == [[1, 0, 2, 100, 8], [1, 64, 2, 0, 4]]
    assert moved.tolist() != one.tolist()


def test_a_tiled_batch_that_strays_from_its_chunk_plan_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The construction-time proof runs the planner's CHUNK plan next to the tiled batch: a
    batch one byte off (as a wrong lattice would give) is a PlanError before any move."""
    from kvplane.errors import PlanError

    layout = LAYOUTS["layer-major"]
    chunk = BPC * layout.bytes_per_block
    ChunkPlans(
        layout, POOL, SLOTS, SlotBuffer(NUM_SLOTS, chunk, chunk), BPC
    )  # the true batch passes
    true_batch = ChunkPlans._batch

    def off_by_one(self: ChunkPlans, *args: Any) -> tuple[DescriptorList, DescriptorList]:
        src, dst = true_batch(self, *args)
        return src, DescriptorList(dst.regions, dst.offsets + 1, dst.lengths)

    monkeypatch.setattr(ChunkPlans, "_batch", off_by_one)
    with pytest.raises(PlanError, match="differs from its CHUNK plan on this layout"):
        ChunkPlans(layout, POOL, SLOTS, SlotBuffer(NUM_SLOTS, chunk, chunk), BPC)
