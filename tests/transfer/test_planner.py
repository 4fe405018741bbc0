"""The planner: exact descriptors and coalescing for hand-computed cases, every feature checked
byte-for-byte against the reference scatter, and bad input refused before anything is built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.chunks import ChunkSpec
from kvplane.errors import LayoutError, PlanError
from kvplane.ids import ChunkKey, RegionId, SliceId, TokenRange
from kvplane.layout import BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR, KVLayout
from kvplane.transfer.plan import TransferPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide


def gqa(**kw: object) -> KVLayout:
    """Block-major fp16, 3 layers, 2 heads × 4 dims: row 8 B, token 16 B, comp 64 B, layer
    128 B, block 384 B (with the default block size 4)."""
    args: dict[str, object] = dict(
        num_blocks=8, block_size=4, num_layers=3, kv_heads=2, head_dim=4, dtype=torch.float16
    )
    args.update(kw)
    return KVLayout.gqa(**args)  # type: ignore[arg-type]


def mla(**kw: object) -> KVLayout:
    args: dict[str, object] = dict(
        num_blocks=6, block_size=4, num_layers=2, latent_dim=6, rope_dim=2, dtype=torch.bfloat16
    )
    args.update(kw)
    return KVLayout.mla(**args)  # type: ignore[arg-type]


def triples(plan: TransferPlan) -> list[tuple[int, int, int]]:
    """(src offset, dst offset, length) of every descriptor, in plan order."""
    src, dst = plan.src_descriptors(), plan.dst_descriptors()
    return list(zip(src.offsets.tolist(), dst.offsets.tolist(), src.lengths.tolist(), strict=True))


def side(layout: KVLayout, ids: list[int], region: int = 0, offset: int = 0) -> PlanSide:
    return PlanSide(layout, np.array(ids), RegionId(region), offset)


# -- coalescing: exact descriptors ----------------------------------------------------------------
def test_block_major_consecutive_ids_is_one_descriptor(kvref) -> None:
    plan = kvref.plan_and_check((gqa(), [2, 3, 4]), (gqa(), [5, 6, 7]), TokenRange(0, 12))
    assert triples(plan) == [(2 * 384, 5 * 384, 3 * 384)]
    assert plan.src_descriptors().regions.tolist() == [0]
    assert plan.dst_descriptors().regions.tolist() == [1]
    stats = plan.stats()
    assert (stats.ops, stats.descriptors, stats.contiguous_runs) == (1, 1, 1)
    assert stats.num_bytes == stats.logical_bytes == 1152
    assert stats.amplification == 1.0


def test_block_major_shuffled_ids_coalesce_runs_consecutive_on_both_sides(kvref) -> None:
    plan = kvref.plan_and_check((gqa(), [3, 1, 2]), (gqa(), [0, 5, 6]), TokenRange(0, 12))
    # logical blocks 1, 2 are consecutive on both sides (1,2 → 5,6); block 0 stands alone
    assert triples(plan) == [(384, 5 * 384, 768), (3 * 384, 0, 384)]
    assert plan.stats().contiguous_runs == 2


def test_range_ending_mid_block(kvref) -> None:
    plan = kvref.plan_and_check((gqa(), [0, 1, 2]), (gqa(), [4, 5, 6]), TokenRange(0, 10))
    # two full blocks, then tokens 8, 9 (2 × 16 B) of each (layer, comp) of block 2; the first
    # of those continues the full-block run on both sides
    assert triples(plan) == [
        (0, 4 * 384, 768 + 32),
        (768 + 64, 6 * 384 + 64, 32),
        (768 + 128, 6 * 384 + 128, 32),
        (768 + 192, 6 * 384 + 192, 32),
        (768 + 256, 6 * 384 + 256, 32),
        (768 + 320, 6 * 384 + 320, 32),
    ]
    assert plan.stats().contiguous_runs == 6


def test_unaligned_start_and_end(kvref) -> None:
    plan = kvref.plan_and_check((gqa(), [0, 1, 2]), (gqa(), [3, 4, 5]), TokenRange(3, 5))
    # token 3 (last of block 0) and token 4 (first of block 1) of each (layer, comp)
    assert len(plan.src_descriptors()) == 11  # 6 + 6 elements, one pair joins across the block
    assert plan.num_bytes == 2 * 3 * 2 * 16


def test_different_block_sizes(kvref) -> None:
    plan = kvref.plan_and_check(
        (gqa(block_size=4), [0, 1, 2, 3]), (gqa(block_size=8), [1, 0]), TokenRange(0, 16)
    )
    # a 4-token segment is contiguous across (layer, comp) in the 4-block but only per
    # (layer, comp) in the 8-block: 4 segments × 3 layers × 2 comps
    assert plan.num_descriptors == plan.stats().contiguous_runs == 24
    back = kvref.plan_and_check(
        (gqa(block_size=8), [1, 0]), (gqa(block_size=4), [0, 1, 2, 3]), TokenRange(0, 16)
    )
    assert back.num_descriptors == 24


def test_block_sizes_that_do_not_divide(kvref) -> None:
    plan = kvref.plan_and_check(
        (gqa(block_size=3, num_blocks=9), [8, 0, 7, 1]),
        (gqa(block_size=4), [2, 3, 5]),
        TokenRange(1, 11),
    )
    assert plan.num_descriptors == plan.stats().contiguous_runs


def test_tp_head_slice_exact_offsets(kvref) -> None:
    full = KVLayout.gqa(
        num_blocks=2, block_size=2, num_layers=1, kv_heads=4, head_dim=2, dtype=torch.float32
    )
    half = KVLayout.gqa(
        num_blocks=4, block_size=2, num_layers=1, kv_heads=4, head_dim=2, dtype=torch.float32,
        head_range=(2, 4),
    )  # fmt: skip
    plan = kvref.plan_and_check((full, [1]), (half, [3]), TokenRange(0, 2))
    # src: H 8, T 32, C 64, B 128 — heads 2..3 are at +16; dst: T 16, C 32, B 64
    assert triples(plan) == [(144, 192, 16), (176, 208, 16), (208, 224, 16), (240, 240, 16)]
    back = kvref.plan_and_check((half, [3]), (full, [1]), TokenRange(0, 2))
    assert triples(back) == [(192, 144, 16), (208, 176, 16), (224, 208, 16), (240, 240, 16)]


@pytest.mark.parametrize("order", [BLOCK_MAJOR, LAYER_MAJOR, HEAD_MAJOR])
def test_tp_partial_head_intersection(kvref, order) -> None:
    a = KVLayout.gqa(
        num_blocks=5, block_size=3, num_layers=2, kv_heads=6, head_dim=3, dtype=torch.float16,
        head_range=(1, 4), order=order,
    )  # fmt: skip
    b = KVLayout.gqa(
        num_blocks=4, block_size=2, num_layers=2, kv_heads=6, head_dim=3, dtype=torch.float16,
        head_range=(2, 6), order=HEAD_MAJOR,
    )  # fmt: skip
    plan = kvref.plan_and_check((a, [4, 2, 0]), (b, [1, 3, 0, 2]), TokenRange(1, 8))
    assert plan.num_bytes == 7 * 2 * 2 * 2 * 3 * 2  # heads 2, 3 only


def test_head_major_full_blocks_fold_heads(kvref) -> None:
    layout = gqa(order=HEAD_MAJOR)
    plan = kvref.plan_and_check((layout, [0, 1]), (layout, [6, 7]), TokenRange(0, 8))
    assert triples(plan) == [(0, 6 * 384, 768)]


def test_mla_block_major_and_layer_major(kvref) -> None:
    plan = kvref.plan_and_check((mla(), [0, 1, 2]), (mla(), [3, 4, 5]), TokenRange(0, 12))
    assert triples(plan) == [(0, 3 * 128, 3 * 128)]  # row 16 B, block 2 layers × 64 B
    lm = mla(order=LAYER_MAJOR)  # T 16, B 64, L 384
    consecutive = kvref.plan_and_check((lm, [0, 1, 2]), (lm, [3, 4, 5]), TokenRange(0, 12))
    assert triples(consecutive) == [(0, 192, 192), (384, 576, 192)]
    shuffled = kvref.plan_and_check((lm, [4, 0, 2]), (lm, [1, 5, 3]), TokenRange(0, 12))
    assert shuffled.num_descriptors == shuffled.stats().contiguous_runs == 6
    assert set(shuffled.src_descriptors().lengths.tolist()) == {64}
    mixed = kvref.plan_and_check((mla(), [4, 0, 2]), (lm, [1, 5, 3]), TokenRange(2, 11))
    assert mixed.num_bytes == 9 * 2 * 16


# -- request features -----------------------------------------------------------------------------
def test_prefix_reuse_skips_what_the_receiver_holds(kvref) -> None:
    opts = PlanOptions(prefix_tokens=6)
    plan = kvref.plan_and_check((gqa(), [0, 1, 2, 3]), (gqa(), [4, 5, 6, 7]), TokenRange(0, 16),
                                options=opts)  # fmt: skip
    assert plan.tokens == TokenRange(6, 16)
    assert plan.num_bytes == 10 * 96
    nothing = kvref.plan_and_check(
        (gqa(), [0, 1]), (gqa(), [4, 5]), TokenRange(0, 8), options=PlanOptions(prefix_tokens=9)
    )
    assert nothing.empty and nothing.tokens == TokenRange(8, 8)
    assert nothing.stats().as_dict() == {
        "num_bytes": 0, "logical_bytes": 0, "ops": 0, "descriptors": 0,
        "max_descriptors_per_op": 0, "mean_descriptors_per_op": 0.0, "amplification": 0.0,
        "contiguous_runs": 0,
    }  # fmt: skip


def test_sliding_window_moves_only_the_window(kvref) -> None:
    swa = gqa(sliding_window=5)
    plan = kvref.plan_and_check((swa, [0, 1, 2, 3]), (swa, [7, 6, 5, 4]), TokenRange(0, 16))
    assert plan.tokens == TokenRange(12, 16)  # the step at 16 reads (11, 16]
    with_prefix = kvref.plan_and_check(
        (swa, [0, 1, 2, 3]), (swa, [7, 6, 5, 4]), TokenRange(0, 16),
        options=PlanOptions(prefix_tokens=13),
    )  # fmt: skip
    assert with_prefix.tokens == TokenRange(13, 16)
    short = kvref.plan_and_check((swa, [0]), (swa, [1]), TokenRange(0, 3))
    assert short.tokens == TokenRange(0, 3)
    with pytest.raises(LayoutError, match="sliding_window"):
        plan_transfer(side(swa, [0]), side(gqa(), [1], 1), TokenRange(0, 3))


def test_layer_subset_in_any_order_between_different_pools(kvref) -> None:
    a = gqa(layer_ids=(0, 1, 2), num_layers=None)
    b = gqa(layer_ids=(2, 0, 5), num_layers=None, order=LAYER_MAJOR)
    plan = kvref.plan_and_check((a, [1, 2]), (b, [3, 0]), TokenRange(0, 7), layers=[2, 0])
    assert plan.layers == (2, 0)
    assert plan.num_bytes == 7 * 2 * 96 // 3


def test_pool_offsets_inside_regions(kvref) -> None:
    plan = kvref.plan_and_check(
        (gqa(), [1, 2]), (gqa(), [3, 4]), TokenRange(0, 8), offsets=(10, 38)
    )
    assert triples(plan) == [(10 + 384, 38 + 3 * 384, 768)]


def test_state_moves_whole_blocks_only(kvref) -> None:
    state = KVLayout.state(num_slots=4, num_layers=3, state_dim=5)
    plan = kvref.plan_and_check((state, [2]), (state, [0]), None)
    assert triples(plan) == [(2 * 60, 0, 60)]
    assert plan.tokens == TokenRange(0, 1)
    same = kvref.plan_and_check((state, [2, 3]), (state, [1, 0]), TokenRange(0, 2), layers=[1])
    assert same.num_bytes == 2 * 20
    for bad_tokens in (TokenRange(0, 0), TokenRange(1, 2), TokenRange(0, 3)):
        with pytest.raises(PlanError, match="whole blocks only"):
            plan_transfer(side(state, [2, 3]), side(state, [1, 0], 1), bad_tokens)
    with pytest.raises(PlanError, match="whole blocks only"):
        plan_transfer(
            side(state, [2]), side(state, [0], 1), None, options=PlanOptions(prefix_tokens=1)
        )
    chunked = PlanOptions(grouping=OpGrouping.CHUNK, chunk_spec=ChunkSpec(1))
    with pytest.raises(PlanError, match="whole blocks only"):
        plan_transfer(side(state, [2]), side(state, [0], 1), None, options=chunked)
    with pytest.raises(PlanError, match="2 source blocks but 1 destination"):
        plan_transfer(side(state, [2, 3]), side(state, [0], 1), None)


# -- op grouping and annotations ------------------------------------------------------------------
KEYS = (ChunkKey(b"k0" * 16), ChunkKey(b"k1" * 16))


def test_one_op_per_layer(kvref) -> None:
    opts = PlanOptions(grouping=OpGrouping.LAYER, slice_id=SliceId(4))
    plan = kvref.plan_and_check(
        (gqa(), [0, 1]), (gqa(order=LAYER_MAJOR), [2, 3]), TokenRange(1, 7), options=opts
    )
    assert [op.layers for op in plan.ops] == [(0,), (1,), (2,)]
    assert {op.tokens for op in plan.ops} == {TokenRange(1, 7)}
    assert {op.slice_id for op in plan.ops} == {4}
    assert [op.num_bytes for op in plan.ops] == [6 * 32] * 3


def test_one_op_per_chunk_with_keys(kvref) -> None:
    opts = PlanOptions(
        grouping=OpGrouping.CHUNK, chunk_spec=ChunkSpec(4, 2), chunk_keys=KEYS, slice_id=SliceId(1)
    )
    plan = kvref.plan_and_check(
        (gqa(), [0, 1, 2, 3, 4]), (gqa(block_size=8), [7, 1, 2]), TokenRange(3, 20), options=opts
    )
    assert [op.tokens for op in plan.ops] == [TokenRange(3, 8), TokenRange(8, 16),
                                              TokenRange(16, 20)]  # fmt: skip
    assert [op.chunk_keys for op in plan.ops] == [(KEYS[0],), (KEYS[1],), ()]
    assert [op.num_bytes for op in plan.ops] == [5 * 96, 8 * 96, 4 * 96]
    assert all(op.layers == (0, 1, 2) and op.slice_id == 1 for op in plan.ops)
    whole = kvref.plan_and_check(
        (gqa(), [0, 1, 2, 3, 4]), (gqa(), [7, 1, 2, 3, 4]), TokenRange(3, 20),
        options=PlanOptions(chunk_spec=ChunkSpec(4, 2), chunk_keys=KEYS),
    )  # fmt: skip
    assert len(whole.ops) == 1 and whole.ops[0].chunk_keys == KEYS
    rows = whole.describe()
    assert rows[0]["tokens"] == [3, 20] and rows[0]["chunk_keys"] == [k.hex() for k in KEYS]


def test_planning_is_pure_and_deterministic() -> None:
    src = side(gqa(), [3, 1, 2])
    dst = side(gqa(block_size=8), [0, 5], 1)
    first = plan_transfer(src, dst, TokenRange(0, 12))
    again = plan_transfer(src, dst, TokenRange(0, 12))
    assert first.equals(again)
    assert src.block_ids.tolist() == [3, 1, 2] and not src.block_ids.flags.writeable
    assert first.src_fingerprint == gqa().fingerprint()
    assert first.dst_fingerprint == gqa(block_size=8).fingerprint()
