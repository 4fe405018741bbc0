"""Step ranges, slice cutting (deferred partial blocks, final slice) and slice plans."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import InvalidArgumentError, PlanError, ProtocolError
from kvplane.ids import RegionId, SliceId, TokenRange
from kvplane.layout import KVLayout
from kvplane.pd.events import TransferRequest
from kvplane.pipeline.advert import RemotePool
from kvplane.pipeline.slicing import LocalPool, SliceCutter, plan_slice, slice_schedule, step_ranges


def test_step_ranges() -> None:
    assert step_ranges(10, 4) == [TokenRange(0, 4), TokenRange(4, 8), TokenRange(8, 10)]
    assert step_ranges(3, 8) == [TokenRange(0, 3)]
    with pytest.raises(InvalidArgumentError, match="step_size"):
        step_ranges(3, 0)
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        step_ranges(0, 4)


def test_cutter_defers_partial_blocks_and_always_cuts_the_final_slice() -> None:
    cut = SliceCutter(50, SliceCutter.alignment(16, 8))
    assert cut.align == 16
    assert cut.after_step(10, False) is None  # inside the first block: deferred
    assert cut.after_step(20, False) == (0, TokenRange(0, 16))
    assert cut.after_step(30, False) is None
    assert cut.after_step(40, False) == (1, TokenRange(16, 32))
    assert cut.after_step(50, True) == (2, TokenRange(32, 50))
    with pytest.raises(InvalidArgumentError, match="already cut"):
        cut.after_step(50, True)


def test_cutter_final_slice_may_be_empty() -> None:
    cut = SliceCutter(32, 16)
    assert cut.after_step(32, False) == (0, TokenRange(0, 32))
    assert cut.after_step(32, True) == (1, TokenRange(32, 32))


def test_cutter_rejects_bad_steps_before_changing_anything() -> None:
    cut = SliceCutter(40, 8)
    with pytest.raises(InvalidArgumentError, match="last step ends"):
        cut.after_step(30, True)
    with pytest.raises(InvalidArgumentError, match="outside"):
        cut.after_step(41, False)
    assert (cut.sent, cut.next_id, cut.done) == (0, 0, False)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 500),
    step=st.integers(1, 80),
    bs=st.sampled_from([1, 4, 16]),
    bd=st.sampled_from([1, 8, 16, 32]),
)
def test_slices_tile_the_prompt_with_aligned_inner_boundaries(
    n: int, step: int, bs: int, bd: int
) -> None:
    cut = SliceCutter(n, SliceCutter.alignment(bs, bd))
    steps = step_ranges(n, step)
    slices = [cut.after_step(r.end, i == len(steps) - 1) for i, r in enumerate(steps)]
    got = [s for s in slices if s is not None]
    assert [int(i) for i, _ in got] == list(range(len(got)))
    assert got[0][1].start == 0 and got[-1][1].end == n
    for (_, a), (_, b) in itertools.pairwise(got):
        assert a.end == b.start
    for _, r in got[:-1]:
        assert r.end % bs == 0 and r.end % bd == 0 and not r.empty


def _pools(window: int | None = None) -> tuple[list[LocalPool], list[RemotePool]]:
    src = KVLayout.gqa(
        num_blocks=8,
        block_size=4,
        num_layers=1,
        kv_heads=2,
        head_dim=4,
        dtype=torch.float16,
        sliding_window=window,
    )
    dst = KVLayout.gqa(
        num_blocks=8,
        block_size=8,
        num_layers=1,
        kv_heads=2,
        head_dim=4,
        dtype=torch.float16,
        sliding_window=window,
    )
    tail = KVLayout.state(num_slots=4, num_layers=1, state_dim=16, dtype=torch.uint8)
    local = [LocalPool(src, RegionId(1), (0, 1, 2, 3, 4, 5)), LocalPool(tail, RegionId(2), (3,))]
    remote = [RemotePool(dst, RegionId(7)), RemotePool(tail, RegionId(8))]
    return local, remote


def _request(n: int, prefix: int = 0) -> TransferRequest:
    ids = (*(5, 6, 7)[: -(-n // 8)], 1)
    return TransferRequest(
        session_id="s",
        epoch=1,
        request_id="r",
        dst_block_ids=ids,
        prefix_tokens=prefix,
        num_tokens=n,
    )


def test_plan_slice_kv_then_tail_only_in_the_final_slice() -> None:
    local, remote = _pools()
    mid = plan_slice(
        local, remote, _request(21), TokenRange(0, 16), slice_id=SliceId(0), is_last=False
    )
    assert mid.dst_block_sizes == (8,)
    assert mid.plans[0].tokens == TokenRange(0, 16)
    assert mid.num_bytes == 16 * 2 * 2 * 4 * 2
    last = plan_slice(
        local, remote, _request(21), TokenRange(16, 21), slice_id=SliceId(1), is_last=True
    )
    assert last.dst_block_sizes == (8, 1)
    assert last.num_bytes == 5 * 2 * 2 * 4 * 2 + 16
    empty_final = plan_slice(
        local, remote, _request(16), TokenRange(16, 16), slice_id=SliceId(1), is_last=True
    )
    assert empty_final.dst_block_sizes == (1,) and empty_final.num_bytes == 16


def test_plan_slice_applies_prefix_and_sliding_window() -> None:
    local, remote = _pools(window=6)
    first = plan_slice(
        local, remote, _request(20), TokenRange(0, 16), slice_id=SliceId(0), is_last=False
    )
    assert first.plans[0].tokens == TokenRange(15, 16)  # the step at 20 reads [15, 20]
    local, remote = _pools(window=6)
    part = plan_slice(
        local, remote, _request(24), TokenRange(0, 16), slice_id=SliceId(0), is_last=False
    )
    assert part.empty  # the step at 24 reads [19, 24], after this slice
    local, remote = _pools()
    pre = plan_slice(
        local, remote, _request(21, prefix=8), TokenRange(0, 16), slice_id=SliceId(0), is_last=False
    )
    assert pre.plans[0].tokens == TokenRange(8, 16)


def test_plan_slice_refuses_a_destination_of_the_wrong_size() -> None:
    local, remote = _pools()
    bad = TransferRequest(
        session_id="s",
        epoch=1,
        request_id="r",
        dst_block_ids=(5, 6),
        prefix_tokens=0,
        num_tokens=21,
    )
    with pytest.raises(ProtocolError, match="destination ids"):
        plan_slice(local, remote, bad, TokenRange(0, 16), slice_id=SliceId(0), is_last=False)
    assert np.array_equal(np.asarray(local[0].block_ids), np.arange(6))


def test_plan_slice_refuses_a_destination_with_heads_it_lacks() -> None:
    def pool(heads: tuple[int, int], bs: int) -> KVLayout:
        return KVLayout.gqa(
            num_blocks=8, block_size=bs, num_layers=1, kv_heads=4, head_dim=4,
            dtype=torch.float16, head_range=heads,
        )  # fmt: skip

    tail = KVLayout.state(num_slots=4, num_layers=1, state_dim=16, dtype=torch.uint8)
    for ours, theirs in [((1, 3), (0, 4)), ((0, 2), (1, 3)), ((0, 2), (2, 4))]:
        local = [LocalPool(pool(ours, 4), RegionId(1), (0, 1, 2, 3, 4, 5)),
                 LocalPool(tail, RegionId(2), (3,))]  # fmt: skip
        remote = [RemotePool(pool(theirs, 8), RegionId(7)), RemotePool(tail, RegionId(8))]
        with pytest.raises(PlanError, match="not all in our heads"):
            plan_slice(
                local, remote, _request(21), TokenRange(0, 16), slice_id=SliceId(0), is_last=False
            )
    local = [LocalPool(pool((0, 4), 4), RegionId(1), (0, 1, 2, 3, 4, 5)),
             LocalPool(tail, RegionId(2), (3,))]  # fmt: skip
    remote = [RemotePool(pool((1, 3), 8), RegionId(7)), RemotePool(tail, RegionId(8))]
    ok = plan_slice(
        local, remote, _request(21), TokenRange(0, 16), slice_id=SliceId(0), is_last=False
    )
    assert ok.num_bytes == 16 * 2 * 2 * 4 * 2  # K and V of the two heads they hold


def test_cutter_every_k_steps() -> None:
    """``every=3``: a slice after steps 3, 6 and 9 and the final one (block-aligned cuts)."""
    steps = step_ranges(1000, 100)
    got = slice_schedule(1000, steps, 16, every=3)
    assert [(r.start, r.end, last) for r, last in got] == [
        (0, 288, False),
        (288, 592, False),
        (592, 896, False),
        (896, 1000, True),
    ]
    assert slice_schedule(1000, steps, 16, every=3, pipelined=False) == (
        (TokenRange(0, 1000), True),
    )
