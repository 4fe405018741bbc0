"""Resharding: the TP head split, parallelism values, the exact pieces per decode rank and
their plans."""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.errors import LayoutError, PlanError
from kvplane.ids import RegionId, TokenRange
from kvplane.layout import KVLayout
from kvplane.transfer.request import PlanOptions, PlanSide
from kvplane.transfer.resharding import (
    KVBox,
    Parallelism,
    Piece,
    SenderId,
    destination,
    plan_piece,
    plan_pieces,
    reshard,
    tp_head_range,
)

T = TokenRange(0, 50)
T40 = TokenRange(0, 40)


def gqa(kv_heads: int, layers: int = 4) -> KVLayout:
    return KVLayout.gqa(num_blocks=1, block_size=16, num_layers=layers, kv_heads=kv_heads,
                        head_dim=8)  # fmt: skip


def mla(layers: int = 4) -> KVLayout:
    return KVLayout.mla(num_blocks=1, block_size=16, num_layers=layers, latent_dim=12, rope_dim=4)


def side(tp: int, pp: int = 1, bs: int = 16, layers: int = 4) -> Parallelism:
    return Parallelism.pipeline(tp_size=tp, num_layers=layers, pp_size=pp, block_size=bs)


def piece(stage: int, tp: int, heads: tuple[int, int], layers: tuple[int, ...]) -> Piece:
    return Piece(SenderId(stage, tp), KVBox(heads, layers, T))


def test_tp_head_range_splits_evenly_or_replicates_consecutively() -> None:
    assert [tp_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [tp_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [tp_head_range(1, 4, r) for r in range(4)] == [(0, 1)] * 4  # MLA's latent
    assert tp_head_range(4, 1, 0) == (0, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((6, 4, 0), "6 KV heads and TP 4: one must divide the other"),
        ((4, 4, 4), "tp_rank must be an int in [0, 3], got 4"),
        ((4, 0, 0), "tp_size must be a positive int, got 0"),
    ],
)
def test_tp_head_range_refuses_uneven_splits(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(LayoutError) as info:
        tp_head_range(*args)
    assert str(info.value) == message


def test_pipeline_stages_are_consecutive_and_as_even_as_can_be() -> None:
    assert side(2, pp=2).stages == ((0, 1), (2, 3))
    assert Parallelism.pipeline(tp_size=1, num_layers=5, pp_size=3, block_size=16).stages == (
        (0, 1), (2, 3), (4,),
    )  # fmt: skip
    assert side(1, pp=2).layers == (0, 1, 2, 3)
    assert side(1, bs=32).blocks_of(TokenRange(40, 77)) == range(1, 3)


def test_parallelism_refuses_shared_or_empty_stages() -> None:
    with pytest.raises(PlanError, match=r"^Parallelism.stages share layers: \(\(0, 1\), \(1,"):
        Parallelism(1, ((0, 1), (1, 2)), 16)
    with pytest.raises(PlanError, match=r"^Parallelism.stages must name one or more stages"):
        Parallelism(1, (), 16)
    with pytest.raises(PlanError, match=r"^pp_size must be an int in \[1, 4\], got 5$"):
        side(1, pp=5)


def test_rank_layout_holds_its_heads_layers_and_block_size() -> None:
    layout = side(4, pp=2, bs=32).rank_layout(gqa(2), 1, 3, num_blocks=7)
    assert (layout.head_range, layout.layer_ids, layout.block_size, layout.num_blocks) == (
        (1, 2), (2, 3), 32, 7,
    )  # fmt: skip
    stage = KVLayout.gqa(num_blocks=1, block_size=16, layer_ids=(2, 3), kv_heads=2, head_dim=8)
    assert layout.compat_fingerprint() == stage.compat_fingerprint()
    assert side(2).rank_layout(mla(), 0, 1, num_blocks=1).head_range == (0, 1)


def test_prefill_tp_2_gathers_into_decode_tp_1() -> None:
    assert reshard(gqa(8), side(2), side(1), T) == (
        (piece(0, 0, (0, 4), (0, 1, 2, 3)), piece(0, 1, (4, 8), (0, 1, 2, 3))),
    )


def test_prefill_tp_1_feeds_every_decode_rank() -> None:
    assert reshard(gqa(8), side(1), side(4), T) == tuple(
        (piece(0, 0, (2 * r, 2 * r + 2), (0, 1, 2, 3)),) for r in range(4)
    )


def test_replicated_gqa_heads_are_sent_once_and_replicas_take_turns() -> None:
    # 2 KV heads on TP 4: ranks 0,1 hold head 0, ranks 2,3 head 1.
    assert reshard(gqa(2), side(4, pp=2), side(1), T) == (
        (
            piece(0, 0, (0, 1), (0, 1)), piece(0, 2, (1, 2), (0, 1)),
            piece(1, 0, (0, 1), (2, 3)), piece(1, 2, (1, 2), (2, 3)),
        ),
    )  # fmt: skip
    assert reshard(gqa(2), side(4), side(2), T) == (
        (piece(0, 0, (0, 1), (0, 1, 2, 3)),),
        (piece(0, 3, (1, 2), (0, 1, 2, 3)),),  # decode rank 1 takes the second replica
    )
    assert [p[0].sender.tp_rank for p in reshard(gqa(2), side(2), side(4), T)] == [0, 0, 1, 1]


def test_mla_latent_comes_from_one_sender_per_stage() -> None:
    found = reshard(mla(), side(4, pp=2), side(2), T)
    assert found == (
        (piece(0, 0, (0, 1), (0, 1)), piece(1, 0, (0, 1), (2, 3))),
        (piece(0, 1, (0, 1), (0, 1)), piece(1, 1, (0, 1), (2, 3))),
    )


def test_destination_is_the_rank_heads_every_layer_and_the_tokens() -> None:
    assert destination(gqa(8), side(4), 2, T) == KVBox((4, 6), (0, 1, 2, 3), T)
    assert destination(gqa(2), side(4), 1, T).cells == 1 * 4 * 50


def test_reshard_refuses_sides_that_do_not_hold_the_model_layers() -> None:
    with pytest.raises(PlanError) as info:
        reshard(gqa(8), side(2, layers=3), side(1), T)
    assert str(info.value) == (
        "prefill stages ((0, 1, 2),) must hold the model's layers (0, 1, 2, 3)"
    )
    with pytest.raises(PlanError, match=r"^the decode side must be one stage of the model's"):
        reshard(gqa(8), side(2), side(1, pp=2), T)
    with pytest.raises(LayoutError, match=r"^8 KV heads and TP 3: one must divide the other$"):
        reshard(gqa(8), side(3), side(1), T)


def test_box_overlap_and_containment() -> None:
    a = KVBox((0, 2), (0, 1), TokenRange(0, 10))
    assert a.overlaps(KVBox((1, 3), (1, 2), TokenRange(9, 12)))
    assert not a.overlaps(KVBox((2, 3), (0, 1), TokenRange(0, 10)))
    assert not a.overlaps(KVBox((0, 2), (2,), TokenRange(0, 10)))
    assert not a.overlaps(KVBox((0, 2), (0, 1), TokenRange(10, 12)))
    assert a.contains(KVBox((1, 2), (1,), TokenRange(3, 10)))
    assert not a.contains(KVBox((1, 2), (1, 2), TokenRange(3, 10)))
    assert str(a) == "heads [0, 2) × layers (0, 1) × [0, 10)"
    with pytest.raises(PlanError, match=r"^KVBox.heads\[1\] must be a positive int, got 0$"):
        KVBox((0, 0), (0,), T)
    with pytest.raises(PlanError, match=r"^KVBox.layers has duplicates: \(1, 1\)$"):
        KVBox((0, 1), (1, 1), T)
    with pytest.raises(PlanError, match=r"^KVBox.heads must be a \(start, end\) pair, got 3$"):
        KVBox(3, (1,), T)  # type: ignore[arg-type]
    assert KVBox([0, 2], [1], T).heads == (0, 2)  # type: ignore[arg-type]


def test_sender_ids_order_by_stage_then_rank() -> None:
    assert sorted([SenderId(1, 0), SenderId(0, 3)]) == [SenderId(0, 3), SenderId(1, 0)]
    assert str(SenderId(1, 2)) == "stage 1 tp 2"


# -- plans ---------------------------------------------------------------------------------------
PLAN_MODEL = KVLayout.gqa(num_blocks=1, block_size=16, num_layers=2, kv_heads=4, head_dim=8)


def pool(side: Parallelism, stage: int, rank: int, region: int) -> PlanSide:
    layout = side.rank_layout(PLAN_MODEL, stage, rank, num_blocks=4)
    blocks = len(side.blocks_of(T40))
    return PlanSide(layout, np.arange(blocks, dtype=np.int64)[::-1].copy(), RegionId(region))


def test_each_piece_is_planned_by_the_planner_with_its_heads_and_layers() -> None:
    prefill = Parallelism.pipeline(tp_size=2, num_layers=2, pp_size=2, block_size=16)
    decode = Parallelism.pipeline(tp_size=1, num_layers=2, block_size=32)
    (pieces,) = reshard(PLAN_MODEL, prefill, decode, T40)
    sources = {SenderId(s, r): pool(prefill, s, r, 10 + 2 * s + r) for s in (0, 1) for r in (0, 1)}
    dst = pool(decode, 0, 0, 1)
    planned = plan_pieces(pieces, sources, dst, options=PlanOptions(slice_id=3))
    assert [pp.sender for pp in planned] == [SenderId(0, 0), SenderId(0, 1), SenderId(1, 0),
                                             SenderId(1, 1)]  # fmt: skip
    row = 8 * 2  # head_dim bf16
    for pp in planned:
        assert pp.plan.layers == pp.piece.box.layers
        assert pp.plan.tokens == T40
        assert pp.plan.src_region == sources[pp.sender].region and pp.plan.dst_region == 1
        assert pp.plan.logical_bytes == pp.plan.num_bytes == 2 * 1 * 40 * 2 * row
        assert all(op.slice_id == 3 for op in pp.plan.ops)
        pp.plan.validate(
            {pp.plan.src_region: sources[pp.sender].pool_end}, {RegionId(1): dst.pool_end}
        )


def test_a_piece_whose_heads_differ_from_the_shared_heads_is_refused() -> None:
    prefill = Parallelism.pipeline(tp_size=2, num_layers=2, block_size=16)
    decode = Parallelism.pipeline(tp_size=1, num_layers=2, block_size=16)
    wrong = Piece(SenderId(0, 0), KVBox((0, 1), (0, 1), T40))
    with pytest.raises(PlanError) as info:
        plan_piece(wrong, pool(prefill, 0, 0, 0), pool(decode, 0, 0, 1), PlanOptions())
    assert str(info.value) == (
        "piece heads [0, 1) × layers (0, 1) × [0, 40) from stage 0 tp 0: the sender's heads "
        "(0, 2) and the destination's (0, 4) share (0, 2), not the piece's heads"
    )


def test_every_sender_needs_a_source_pool_before_anything_is_planned() -> None:
    prefill = Parallelism.pipeline(tp_size=2, num_layers=2, pp_size=2, block_size=16)
    decode = Parallelism.pipeline(tp_size=1, num_layers=2, block_size=16)
    (pieces,) = reshard(PLAN_MODEL, prefill, decode, T40)
    sources = {SenderId(0, 0): pool(prefill, 0, 0, 0)}
    with pytest.raises(PlanError) as info:
        plan_pieces(pieces, sources, pool(decode, 0, 0, 1))
    assert (
        str(info.value) == "no source pool for sender(s) stage 0 tp 1, stage 1 tp 0, stage 1 tp 1"
    )


def test_a_layer_the_sender_lacks_is_the_planner_error() -> None:
    prefill = Parallelism.pipeline(tp_size=1, num_layers=2, pp_size=2, block_size=16)
    decode = Parallelism.pipeline(tp_size=1, num_layers=2, block_size=16)
    wrong = Piece(SenderId(0, 0), KVBox((0, 4), (1,), T40))
    with pytest.raises(PlanError, match=r"^source pool does not hold layer\(s\) \[1\]; it holds"):
        plan_piece(wrong, pool(prefill, 0, 0, 0), pool(decode, 0, 0, 1), PlanOptions())
