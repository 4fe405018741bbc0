"""TP ranks' parts of Mamba2 state rows through the planner: which elements of which row each
prefill rank sends each decode rank (exact), the descriptors of one plan (exact), and, over
random geometries, TP sizes and pipeline stages, that the senders' plans tile every decode
rank's rows exactly once (amplification 1.0, no byte written twice) with the right bytes (#33)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplane.errors import LayoutError
from kvplane.ids import RegionId
from kvplane.layout import KVLayout
from kvplane.state_split import MambaGeometry, StateSplit
from kvplane.transfer import OpGrouping, PlanOptions, PlanSide, ValidatedPlan, plan_transfer
from kvplane.transfer.resharding import moves_whole_only, stage_layers
from kvplane.transfer.state_rows import RowPiece, row_pieces, row_splits

from .conftest import KVRef

# H=8 heads of P=4, one group of N=3, K=4: x [0, 96), B [96, 105), C [105, 114), SSM [114, 210)
ONE = MambaGeometry(num_heads=8, head_dim=4, num_groups=1, state_size=3, conv_kernel=4)


def split(tp: int, rank: int, geometry: MambaGeometry = ONE) -> StateSplit:
    return StateSplit(geometry, tp, rank)


def test_tp2_to_tp1_each_rank_sends_its_heads_and_rank_0_the_one_group() -> None:
    whole = split(1, 0)
    assert row_pieces(split(2, 0), whole) == (
        RowPiece(0, 0, 0, 48), RowPiece(96, 48, 96, 9), RowPiece(105, 57, 105, 9),
        RowPiece(114, 66, 114, 48),
    )  # fmt: skip
    assert row_pieces(split(2, 1), whole) == (RowPiece(48, 0, 48, 48), RowPiece(162, 66, 162, 48))


def test_tp1_to_tp2_sends_each_rank_its_part_and_tp2_to_tp2_the_whole_local_row() -> None:
    whole = split(1, 0)
    assert row_pieces(whole, split(2, 1)) == (
        RowPiece(48, 48, 0, 48), RowPiece(96, 96, 48, 9), RowPiece(105, 105, 57, 9),
        RowPiece(162, 162, 66, 48),
    )  # fmt: skip
    # the one group is replicated on both sides: rank 1 gets it from its own replica
    assert [p.length for p in row_pieces(split(2, 1), split(2, 1))] == [48, 9, 9, 48]
    assert row_pieces(split(2, 0), split(2, 1)) == ()


def test_rows_of_another_geometry_are_refused() -> None:
    other = MambaGeometry(num_heads=8, head_dim=4, num_groups=2, state_size=3, conv_kernel=4)
    with pytest.raises(LayoutError, match="do not match"):
        row_pieces(split(2, 0), split(1, 0, other))


def state(s: StateSplit | None, layers: tuple[int, ...] = (0, 2), slots: int = 3) -> KVLayout:
    return KVLayout.state(num_slots=slots, layer_ids=layers, state_dim=ONE.row_dim, split=s)


def test_a_plan_moves_the_pieces_of_every_layer_at_the_slots() -> None:
    src, dst = state(split(2, 1)), state(None)  # a whole row with no geometry (an advert's)
    assert row_splits(src, dst) == (split(2, 1), split(1, 0))
    assert row_splits(state(split(1, 0)), dst) is None  # nothing sharded: the plain planner
    plan = plan_transfer(
        PlanSide(src, np.array([2]), RegionId(0)), PlanSide(dst, np.array([1]), RegionId(1)), None
    )
    rs, rd = 114 * 4, 210 * 4  # row bytes on each side
    src_off = [2 * 2 * rs + layer * rs + p for layer in (0, 1) for p in (0, 66 * 4)]
    dst_off = [1 * 2 * rd + layer * rd + p for layer in (0, 1) for p in (48 * 4, 162 * 4)]
    (op,) = plan.ops
    assert op.src.offsets.tolist() == src_off and op.dst.offsets.tolist() == dst_off
    assert op.src.lengths.tolist() == [192] * 4
    assert plan.stats().amplification == 1.0 and plan.num_bytes == 2 * 96 * 4
    plan.validate({RegionId(0): src.pool_bytes}, {RegionId(1): dst.pool_bytes})


def test_layer_grouping_gives_one_op_per_layer() -> None:
    src, dst = state(None), state(split(2, 0))  # TP 1 -> TP 2: rank 0's part of whole rows
    by_layer = PlanOptions(grouping=OpGrouping.LAYER)
    ends = PlanSide(src, np.array([0]), RegionId(0)), PlanSide(dst, np.array([2]), RegionId(1))
    plan = plan_transfer(*ends, None, options=by_layer)
    assert [op.layers for op in plan.ops] == [(0,), (2,)]
    assert [op.src.lengths.tolist() for op in plan.ops] == [[192, 264]] * 2  # x; B ‖ C ‖ SSM
    assert [op.dst.offsets.tolist()[0] for op in plan.ops] == [2 * 2 * 456, 2 * 2 * 456 + 456]
    plan.validate({RegionId(0): src.pool_bytes}, {RegionId(1): dst.pool_bytes})


def test_a_tp_ranks_state_pool_moves_from_every_rank_the_tail_from_the_lead() -> None:
    tail = KVLayout.state(num_slots=2, num_layers=1, state_dim=32, dtype=torch.uint8)
    assert moves_whole_only(state(split(2, 1)), state(None), lead=False)
    assert not moves_whole_only(tail, tail, lead=False)
    assert not moves_whole_only(state(split(1, 0)), state(None), lead=False)


def geometries() -> st.SearchStrategy[tuple[MambaGeometry, int, int, int, int]]:
    """A geometry, prefill TP, decode TP, layer count and pipeline stages."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[MambaGeometry, int, int, int, int]:
        groups = draw(st.sampled_from([1, 2, 4]))
        heads = groups * draw(st.sampled_from([1, 2, 4]))
        geometry = MambaGeometry(heads, draw(st.integers(1, 3)), groups, draw(st.integers(1, 3)),
                                 draw(st.integers(2, 4)))  # fmt: skip
        tps = st.sampled_from([1, 2, 4])
        layers = draw(st.integers(1, 4))
        return geometry, draw(tps), draw(tps), layers, draw(st.integers(1, min(2, layers)))

    return build()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=geometries(), seed=st.integers(0, 2**16))
def test_the_senders_tile_every_decode_rows_once_with_the_right_bytes(
    case: tuple[MambaGeometry, int, int, int, int], seed: int
) -> None:
    geometry, tp_p, tp_d, num_layers, pp = case
    try:
        for tp in {tp_p, tp_d}:
            StateSplit(geometry, tp, 0)
    except LayoutError:
        return  # a split vLLM refuses (TP not dividing the heads, or the groups of more than one)
    layers = tuple(range(0, 2 * num_layers, 2))  # a hybrid's Mamba layers: every other layer
    stages = stage_layers(layers, 2 * num_layers, pp)
    gen = torch.Generator().manual_seed(seed)
    whole = torch.randn((2, len(layers), geometry.row_dim), generator=gen)
    for d in range(tp_d):
        dst_split = StateSplit(geometry, tp_d, d)
        dst = rows_of(dst_split, layers)
        regions = {RegionId(0): torch.zeros(dst.pool_bytes, dtype=torch.uint8)}
        validated, lengths = [], {RegionId(0): dst.pool_bytes}
        for stage, held in enumerate(stages):
            for r in range(tp_p):
                src_split = StateSplit(geometry, tp_p, r)
                src = rows_of(src_split, held)
                region = RegionId(1 + stage * tp_p + r)
                rows = whole[:, [layers.index(i) for i in held]][..., _part(src_split)]
                regions[region] = rows.contiguous().view(torch.uint8).reshape(-1)
                lengths[region] = src.pool_bytes
                if not moves_whole_only(src, dst, lead=(stage, r) == (pp - 1, 0)):
                    continue
                plan = plan_transfer(PlanSide(src, np.array([1]), region),
                                     PlanSide(dst, np.array([0]), RegionId(0)), None)  # fmt: skip
                if plan.empty:
                    continue
                assert plan.stats().amplification == 1.0
                validated.append(plan.validate(lengths, {RegionId(0): dst.pool_bytes}))
                KVRef.memcpy(plan, regions)
        joint = ValidatedPlan.join(validated)  # refuses a destination byte written twice
        assert joint.num_bytes == dst.bytes_per_block  # slot 0's rows, every element once
        got = regions[RegionId(0)].view(torch.float32).view(2, len(layers), -1)
        assert torch.equal(got[0], whole[1][..., _part(dst_split)])
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def rows_of(s: StateSplit, layers: tuple[int, ...]) -> KVLayout:
    return KVLayout.state(num_slots=2, layer_ids=layers, state_dim=s.geometry.row_dim, split=s)


def _part(s: StateSplit) -> torch.Tensor:
    return torch.cat([torch.arange(p.start, p.end) for p in s.spans])
