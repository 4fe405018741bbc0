"""TransferOp / TransferPlan: construction checks, and validate() refusing every kind of bad plan
(length mismatch, out of bounds, unknown region, double write, double read, missing, shifted or
swapped bytes) with a typed error, while a planner plan validates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.errors import InvalidArgumentError, PlanError
from kvplane.ids import ChunkKey, RegionId, SliceId, TokenRange
from kvplane.layout import LAYER_MAJOR, KVLayout
from kvplane.transfer.coverage import Coverage, coverage_of_descriptors
from kvplane.transfer.plan import TransferOp, TransferPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import PlanSide
from kvplane.transports.base import DescriptorList

SRC, DST = RegionId(0), RegionId(1)
LENGTHS = ({SRC: 100}, {DST: 100})


def op(pairs: list[tuple[int, int, int]]) -> TransferOp:
    return TransferOp(
        src=DescriptorList.of([(SRC, s, n) for s, _, n in pairs]),
        dst=DescriptorList.of([(DST, d, n) for _, d, n in pairs]),
        tokens=TokenRange(0, 1),
        layers=(0,),
    )


def plan_of(*ops: TransferOp, coverage: Coverage | None = None) -> TransferPlan:
    """A plan whose requested coverage is what the given ops move (or ``coverage``)."""
    if coverage is None:
        probe = TransferPlan(ops, TokenRange(0, 1), (0,), Coverage.zero(), SRC, DST)
        coverage = coverage_of_descriptors(probe.src_descriptors(), probe.dst_descriptors())
    return TransferPlan(ops, TokenRange(0, 1), (0,), coverage, SRC, DST)


def test_a_consistent_hand_built_plan_validates() -> None:
    plan = plan_of(op([(0, 50, 10), (10, 70, 5)]), op([(20, 0, 30)]))
    plan.validate(*LENGTHS)
    assert (plan.num_bytes, plan.logical_bytes, plan.num_descriptors) == (45, 45, 3)
    assert plan.stats().contiguous_runs == 3
    assert plan.describe()[1] == {
        "op": 1, "tokens": [0, 1], "layers": [0], "chunk_keys": [], "slice_id": None,
        "descriptors": 1, "bytes": 30, "first_src_offset": 20, "first_dst_offset": 0,
    }  # fmt: skip


def test_op_construction_checks_pairing_and_annotations() -> None:
    with pytest.raises(PlanError, match="2 source descriptors but 1 destination"):
        TransferOp(
            DescriptorList.of([(0, 0, 4), (0, 4, 4)]),
            DescriptorList.of([(1, 0, 8)]),
            TokenRange(0, 1),
            (0,),
        )
    with pytest.raises(PlanError, match="source length 4 != destination length 5"):
        TransferOp(
            DescriptorList.of([(0, 0, 4)]), DescriptorList.of([(1, 0, 5)]), TokenRange(0, 1), (0,)
        )
    good = (DescriptorList.of([(0, 0, 4)]), DescriptorList.of([(1, 0, 4)]))
    with pytest.raises(PlanError, match="layers"):
        TransferOp(*good, TokenRange(0, 1), (-1,))
    with pytest.raises(PlanError, match="tokens"):
        TransferOp(*good, (0, 1), (0,))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="chunk_keys"):
        TransferOp(*good, TokenRange(0, 1), (0,), chunk_keys=("k",))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="slice_id"):
        TransferOp(*good, TokenRange(0, 1), (0,), slice_id=SliceId(-1))
    with pytest.raises(PlanError, match="DescriptorLists"):
        TransferOp([(0, 0, 4)], good[1], TokenRange(0, 1), (0,))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="TransferOps"):
        TransferPlan(("op",), TokenRange(0, 1), (0,), Coverage.zero(), SRC, DST)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="coverage"):
        TransferPlan((), TokenRange(0, 1), (0,), (0, 0, 0, 0), SRC, DST)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="TokenRange"):
        TransferPlan((), (0, 1), (0,), Coverage.zero(), SRC, DST)  # type: ignore[arg-type]
    keyed = TransferOp(*good, TokenRange(0, 1), [2], chunk_keys=[ChunkKey(b"x")])  # type: ignore[arg-type]
    assert keyed.layers == (2,) and keyed.chunk_keys == (b"x",)


def test_bounds_and_regions_are_checked() -> None:
    plan = plan_of(op([(90, 0, 20)]))
    with pytest.raises(PlanError, match=r"source descriptor 0 .* runs past the region end 100"):
        plan.validate(*LENGTHS)
    with pytest.raises(PlanError, match=r"destination descriptors name unknown region\(s\) \[1\]"):
        plan_of(op([(0, 0, 20)])).validate({SRC: 100}, {RegionId(7): 100})


def test_double_write_and_double_read_are_refused() -> None:
    twice = plan_of(op([(0, 10, 10)]), op([(50, 15, 10)]))
    with pytest.raises(PlanError, match="destination descriptors 0 and 1 overlap"):
        twice.validate(*LENGTHS)
    reread = plan_of(op([(0, 0, 10), (5, 40, 10)]))
    with pytest.raises(PlanError, match="source descriptors 0 and 1 overlap"):
        reread.validate(*LENGTHS)


def test_missing_extra_shifted_and_swapped_bytes_are_refused() -> None:
    want = coverage_of_descriptors(
        DescriptorList.of([(SRC, 0, 10), (SRC, 10, 10)]),
        DescriptorList.of([(DST, 50, 10), (DST, 70, 10)]),
    )
    exact = plan_of(op([(0, 50, 10), (10, 70, 10)]), coverage=want)
    exact.validate(*LENGTHS)
    short = plan_of(op([(0, 50, 10)]), coverage=want)
    with pytest.raises(PlanError, match="moves 10 bytes but the request needs 20"):
        short.validate(*LENGTHS)
    shifted = plan_of(op([(0, 51, 10), (10, 70, 10)]), coverage=want)
    with pytest.raises(PlanError, match="do not cover the requested bytes"):
        shifted.validate(*LENGTHS)
    swapped = plan_of(op([(0, 70, 10), (10, 50, 10)]), coverage=want)
    with pytest.raises(PlanError, match="do not cover the requested bytes"):
        swapped.validate(*LENGTHS)


def planned() -> tuple[TransferPlan, dict[RegionId, int], dict[RegionId, int]]:
    layout = KVLayout.gqa(
        num_blocks=6, block_size=4, num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float16,
        order=LAYER_MAJOR,
    )  # fmt: skip
    plan = plan_transfer(
        PlanSide(layout, np.array([5, 0, 3]), SRC),
        PlanSide(layout, np.array([1, 2, 4]), DST),
        TokenRange(1, 11),
    )
    return plan, {SRC: layout.pool_bytes}, {DST: layout.pool_bytes}


def test_a_tampered_planner_plan_is_refused_and_validate_mutates_nothing() -> None:
    plan, src_len, dst_len = planned()
    plan.validate(src_len, dst_len)
    before = (plan.src_descriptors().offsets.copy(), plan.dst_descriptors().offsets.copy())
    (only,) = plan.ops
    lengths = only.dst.lengths.tolist()
    i, j = next((i, j) for i in range(len(lengths)) for j in range(i) if lengths[i] == lengths[j])
    offsets = only.dst.offsets.copy()
    offsets[[i, j]] = offsets[[j, i]]  # swap two same-length destinations: in bounds, no overlap
    bad_dst = DescriptorList(only.dst.regions, offsets, only.dst.lengths)
    tampered = TransferPlan(
        (TransferOp(only.src, bad_dst, only.tokens, only.layers),),
        plan.tokens, plan.layers, plan.coverage, plan.src_region, plan.dst_region,
    )  # fmt: skip
    with pytest.raises(PlanError, match="do not cover the requested bytes"):
        tampered.validate(src_len, dst_len)
    last_byte = int((only.dst.offsets + only.dst.lengths).max())
    plan.validate(src_len, {DST: last_byte})
    with pytest.raises(PlanError, match="runs past the region end"):
        plan.validate(src_len, {DST: last_byte - 1})
    assert np.array_equal(before[0], plan.src_descriptors().offsets)
    assert np.array_equal(before[1], plan.dst_descriptors().offsets)
    plan.validate(src_len, dst_len)


def test_a_plan_aimed_at_another_region_of_the_peer_is_refused() -> None:
    """The moments see offsets only: a plan retargeted, wholly or half, to another registered
    region of the same size moves the right offsets into the wrong pool. It names regions the
    plan was not built for, so validate refuses it before any byte moves."""
    plan, src_len, dst_len = planned()
    (only,) = plan.ops
    other = RegionId(7)
    n = len(only.dst)
    for regions in ([other] * n, [DST] * (n // 2) + [other] * (n - n // 2)):
        moved = DescriptorList(
            np.array(regions, dtype=np.int64), only.dst.offsets, only.dst.lengths
        )
        bad = TransferPlan(
            (TransferOp(only.src, moved, only.tokens, only.layers),),
            plan.tokens, plan.layers, plan.coverage, plan.src_region, plan.dst_region,
        )  # fmt: skip
        with pytest.raises(PlanError, match="names region 7, but the plan was built for region 1"):
            bad.validate(src_len, {**dst_len, other: dst_len[DST]})
    stray_src = DescriptorList(np.full(len(only.src), 5), only.src.offsets, only.src.lengths)
    bad = TransferPlan(
        (TransferOp(stray_src, only.dst, only.tokens, only.layers),),
        plan.tokens, plan.layers, plan.coverage, plan.src_region, plan.dst_region,
    )  # fmt: skip
    with pytest.raises(PlanError, match="source descriptor 0 names region 5"):
        bad.validate({**src_len, RegionId(5): src_len[SRC]}, dst_len)


def test_permuted_destination_blocks_whose_cross_sums_cancel_are_refused() -> None:
    """Source blocks 0..3 go to destination blocks 0,1,3,2. Swapping the destinations of 0↔1
    and of 2↔3 keeps the byte count, Σs, Σd and Σs·d; a third-degree moment differs."""
    layout = KVLayout.mla(num_blocks=8, block_size=4, num_layers=1, latent_dim=3, rope_dim=1,
                          dtype=torch.float16)  # fmt: skip
    plan = plan_transfer(
        PlanSide(layout, np.array([0, 1, 2, 3]), SRC),
        PlanSide(layout, np.array([0, 1, 3, 2]), DST),
        TokenRange(0, 16),
    )
    lengths = ({SRC: layout.pool_bytes}, {DST: layout.pool_bytes})
    plan.validate(*lengths)
    b = layout.bytes_per_block

    def per_block(dst_blocks: list[int]) -> TransferPlan:
        src = DescriptorList.of([(SRC, k * b, b) for k in range(4)])
        dst = DescriptorList.of([(DST, t * b, b) for t in dst_blocks])
        ops = (TransferOp(src, dst, plan.tokens, plan.layers),)
        return TransferPlan(ops, plan.tokens, plan.layers, plan.coverage, SRC, DST)

    per_block([0, 1, 3, 2]).validate(*lengths)
    with pytest.raises(PlanError, match="do not cover the requested bytes"):
        per_block([1, 0, 2, 3]).validate(*lengths)


def test_empty_plan_and_equality() -> None:
    empty = TransferPlan((), TokenRange(4, 4), (0, 1), Coverage.zero(), SRC, DST)
    empty.validate({}, {})
    assert empty.empty and empty.num_bytes == 0 and empty.describe() == []
    a, _, _ = planned()
    b, _, _ = planned()
    assert a.equals(b)
    assert not a.equals(empty)
    other = TransferPlan(
        a.ops, a.tokens, a.layers, a.coverage, a.src_region, a.dst_region, src_fingerprint=b"other"
    )
    assert not a.equals(other)
    with pytest.raises(InvalidArgumentError):
        TransferPlan((), TokenRange(4, 3), (0,), Coverage.zero(), SRC, DST)  # type: ignore[misc]
