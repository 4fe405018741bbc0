"""The window and TP-head rules have one home (``kvplane.layout``); their former call sites --
the planner's request (``transfer/request.py``), the slice planner (``pipeline/slicing.py``)
and the PD handshake -- give exactly what the inline rules they replaced gave."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import PlanError
from kvplane.ids import RegionId, SliceId, TokenRange
from kvplane.layout import KVLayout, heads_cover, shared_heads
from kvplane.pd.events import TransferRequest
from kvplane.pd.handshake import LayoutInfo, PeerProfile, uncovered_heads
from kvplane.pipeline.advert import RemotePool
from kvplane.pipeline.slicing import LocalPool, plan_slice
from kvplane.transfer.request import PlanOptions, PlanSide, resolve

MAX_TOKENS = 48
TAIL = KVLayout.state(num_slots=4, num_layers=1, state_dim=16, dtype=torch.uint8)


def _kv(bs: int, window: int | None = None, heads: tuple[int, int] = (0, 4)) -> KVLayout:
    return KVLayout.gqa(
        num_blocks=MAX_TOKENS // bs, block_size=bs, num_layers=1, kv_heads=4, head_dim=4,
        dtype=torch.float16, sliding_window=window, head_range=heads,
    )  # fmt: skip


def _final_slice(src: KVLayout, dst: KVLayout, n: int, start: int, prefix: int):  # type: ignore[no-untyped-def]
    """``plan_slice`` of the final slice ``[start, n)`` of a request of ``n`` tokens."""
    local = [LocalPool(src, RegionId(1), tuple(range(src.num_blocks))),
             LocalPool(TAIL, RegionId(2), (3,))]  # fmt: skip
    remote = [RemotePool(dst, RegionId(7)), RemotePool(TAIL, RegionId(8))]
    ids = (*range(-(-n // dst.block_size)), 1)
    request = TransferRequest(session_id="s", epoch=1, request_id="r", dst_block_ids=ids,
                              prefix_tokens=prefix, num_tokens=n)  # fmt: skip
    return plan_slice(local, remote, request, TokenRange(start, n), slice_id=SliceId(0),
                      is_last=True)  # fmt: skip


def _resolve(src: KVLayout, dst: KVLayout, tokens: TokenRange, prefix: int):  # type: ignore[no-untyped-def]
    return resolve(
        PlanSide(src, np.arange(src.num_blocks), RegionId(1)),
        PlanSide(dst, np.arange(dst.num_blocks), RegionId(7)),
        tokens, None, PlanOptions(prefix_tokens=prefix),
    )  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    window=st.one_of(st.none(), st.integers(1, 60)),
    n=st.integers(1, MAX_TOKENS),
    start=st.integers(0, MAX_TOKENS),
    prefix=st.integers(0, MAX_TOKENS),
)
def test_window_clipping_agrees_at_the_planner_and_the_slice_planner(
    window: int | None, n: int, start: int, prefix: int
) -> None:
    start, prefix = min(start, n), min(prefix, n)
    src, dst = _kv(4, window), _kv(8, window)
    assert src.window_start(n) == (0 if window is None else max(0, n + 1 - window))
    # the planner's rule: clip to what the step after the range's end reads, (n - window, n]
    old = max(start, prefix) if window is None else max(start, prefix, n + 1 - window)
    want = TokenRange(min(old, n), n)
    assert _resolve(src, dst, TokenRange(start, n), prefix).tokens == want
    # the slice planner's former rule: clip to the window of the request's last token
    planned = _final_slice(src, dst, n, start, prefix)
    kv = [p for p, bs in zip(planned.plans, planned.dst_block_sizes, strict=True) if bs == 8]
    assert [p.tokens for p in kv] == ([want] if old < n else [])


ranges = st.integers(1, 8).flatmap(
    lambda h: st.tuples(
        st.just(h),
        st.tuples(st.integers(0, h - 1), st.integers(1, h)).filter(lambda r: r[0] < r[1]),
        st.tuples(st.integers(0, h - 1), st.integers(1, h)).filter(lambda r: r[0] < r[1]),
    )
)


def _profile(total: int, heads: tuple[int, int]) -> PeerProfile:
    info = LayoutInfo(kind="gqa", dtype="float16", layer_ids=(0,), total_heads=total,
                      head_start=heads[0], head_end=heads[1], head_dim=4)  # fmt: skip
    return PeerProfile(protocol_version=1, model_id="m", layouts=(info,))


@settings(max_examples=150, deadline=None)
@given(ranges=ranges)
def test_head_rules_agree_at_the_planner_the_slice_planner_and_the_handshake(
    ranges: tuple[int, tuple[int, int], tuple[int, int]],
) -> None:
    total, held, needed = ranges
    lo, hi = max(held[0], needed[0]), min(held[1], needed[1])  # the planner's former rule
    assert shared_heads(held, needed) == ((lo, hi) if lo < hi else None)
    covered = held[0] <= needed[0] < needed[1] <= held[1]  # the handshake's former rule
    assert heads_cover(held, needed) is covered
    assert covered == (shared_heads(held, needed) == needed)
    assert (not uncovered_heads(_profile(total, held), _profile(total, needed))) is covered

    def layout(heads: tuple[int, int], bs: int) -> KVLayout:
        return KVLayout.gqa(num_blocks=4, block_size=bs, num_layers=1, kv_heads=total,
                            head_dim=4, dtype=torch.float16, head_range=heads)  # fmt: skip

    src, dst = layout(held, 4), layout(needed, 8)
    if lo < hi:
        assert _resolve(src, dst, TokenRange(0, 16), 0).heads == (lo, hi)
    else:
        with pytest.raises(PlanError, match="do not intersect"):
            _resolve(src, dst, TokenRange(0, 16), 0)
    local = [LocalPool(src, RegionId(1), (0, 1, 2, 3)), LocalPool(TAIL, RegionId(2), (3,))]
    remote = [RemotePool(dst, RegionId(7)), RemotePool(TAIL, RegionId(8))]
    request = TransferRequest(session_id="s", epoch=1, request_id="r", dst_block_ids=(0, 1, 2),
                              prefix_tokens=0, num_tokens=16)  # fmt: skip
    if covered:
        planned = plan_slice(local, remote, request, TokenRange(0, 16), slice_id=SliceId(0),
                             is_last=False)  # fmt: skip
        assert planned.num_bytes == 16 * 2 * (needed[1] - needed[0]) * 4 * 2
    else:
        with pytest.raises(PlanError, match="not all in our heads"):
            plan_slice(local, remote, request, TokenRange(0, 16), slice_id=SliceId(0),
                       is_last=False)  # fmt: skip
