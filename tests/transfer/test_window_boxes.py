"""The per-window-group planner: :func:`window_boxes` splits a request by the layers' windows
and the one planner plans each group. Random per-layer windows, sequence lengths, prefixes,
block sizes and memory orders → every cell the decode side reads (a window layer: the last
``W - 1`` positions, its step at ``n`` seeing ``(n - W, n]``; a full layer: all) is moved
exactly once, and no other byte
of the destination changes. The oracle computes each layer's range from its window directly,
not through ``KVLayout.window_start`` (#33)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import LayoutError
from kvplane.ids import RegionId, TokenRange
from kvplane.layout import Axis, KVLayout
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import PlanOptions, PlanSide
from kvplane.transfer.resharding import KVBox, Parallelism, window_boxes

ORDERS = [(*perm, Axis.DIM) for perm in itertools.permutations(list(Axis)[:5])]
HEADS, HEAD_DIM = 2, 2


def _layout(windows: tuple[int | None, ...], layer_ids: tuple[int, ...], bs: int, n: int,
            order: tuple[Axis, ...]) -> KVLayout:  # fmt: skip
    return KVLayout.gqa(
        num_blocks=-(-n // bs) + 2, block_size=bs, layer_ids=layer_ids, kv_heads=HEADS,
        head_dim=HEAD_DIM, dtype=torch.float16, order=order, layer_windows=windows,
    )  # fmt: skip


def _needed(windows: tuple[int | None, ...], n: int, prefix: int) -> dict[int, TokenRange]:
    """The oracle: per layer, the positions the decode side reads and lacks."""
    out = {}
    for layer, w in enumerate(windows):
        lo = max(prefix, 0 if w is None else n + 1 - w, 0)  # the step at n reads (n - w, n]
        out[layer] = TokenRange(min(lo, n), n)
    return out


def _canon(layout: KVLayout, region: torch.Tensor) -> torch.Tensor:
    return layout.canonical_view(region.view(layout.dtype).view(layout.shape)).view(torch.uint8)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_every_read_cell_moves_once_and_nothing_else(data: st.DataObject) -> None:
    num_layers = data.draw(st.integers(1, 5))
    draw_window = st.none() | st.integers(1, 12)
    windows = tuple(data.draw(st.lists(draw_window, min_size=num_layers, max_size=num_layers)))
    n = data.draw(st.integers(1, 30))
    prefix, seed = data.draw(st.integers(0, n)), data.draw(st.integers(0, 1000))
    s_bs, d_bs = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    layers = tuple(data.draw(st.permutations(range(num_layers))))
    src = _layout(windows, layers, s_bs, n, data.draw(st.sampled_from(ORDERS)))
    dst = _layout(windows, tuple(range(num_layers)), d_bs, n, data.draw(st.sampled_from(ORDERS)))
    gen = torch.Generator().manual_seed(seed)
    s_region = torch.randint(0, 256, (src.pool_bytes,), generator=gen, dtype=torch.uint8)
    d_region = torch.randint(0, 256, (dst.pool_bytes,), generator=gen, dtype=torch.uint8)
    s_ids = np.random.default_rng(seed).permutation(src.num_blocks)
    d_ids = np.random.default_rng(n).permutation(dst.num_blocks)
    s_side, d_side = PlanSide(src, s_ids, RegionId(0)), PlanSide(dst, d_ids, RegionId(1))
    box = KVBox((0, HEADS), src.layer_ids, TokenRange(prefix, n))
    boxes = window_boxes(src, box, n)
    plans = [
        plan_transfer(s_side, d_side, b.tokens, layers=b.layers,
                      options=PlanOptions(prefix_tokens=prefix))
        for b in boxes
    ]  # fmt: skip
    # the oracle's destination: each layer's needed positions copied cell by cell
    want = d_region.clone()
    sv, wv = _canon(src, s_region), _canon(dst, want)
    needed = _needed(windows, n, prefix)
    for layer, rng in needed.items():
        for p in range(rng.start, rng.end):
            s_cell = (int(s_ids[p // s_bs]), src.layer_index(layer), slice(None), p % s_bs)
            d_cell = (int(d_ids[p // d_bs]), dst.layer_index(layer), slice(None), p % d_bs)
            wv[d_cell] = sv[s_cell]
    regions = {RegionId(0): s_region, RegionId(1): d_region}
    lengths = {rid: int(t.numel()) for rid, t in regions.items()}
    spans = []
    for plan in plans:
        plan.validate(lengths, lengths)
        for op in plan.ops:
            for s_off, d_off, k in zip(op.src.offsets.tolist(), op.dst.offsets.tolist(),
                                       op.src.lengths.tolist(), strict=True):  # fmt: skip
                d_region[d_off : d_off + k] = s_region[s_off : s_off + k]
                spans.append((d_off, d_off + k))
    assert torch.equal(d_region, want)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "a cell moved twice"
    cell = dst.bytes_per_token_per_layer
    assert sum(p.num_bytes for p in plans) == sum(len(r) for r in needed.values()) * cell
    assert sum(p.logical_bytes for p in plans) == sum(p.num_bytes for p in plans)
    assert len(boxes) == len({w for w, r in zip(windows, needed.values(), strict=True) if len(r)})


def test_groups_keep_layer_order_and_drop_empty_ones() -> None:
    layout = _layout((8, None, 8, 2), (0, 1, 2, 3), 4, 40, ORDERS[0])
    box = KVBox((0, HEADS), (0, 1, 2, 3), TokenRange(16, 40))
    assert window_boxes(layout, box, 40) == (
        KVBox((0, HEADS), (0, 2), TokenRange(33, 40)),
        KVBox((0, HEADS), (1,), TokenRange(16, 40)),
        KVBox((0, HEADS), (3,), TokenRange(39, 40)),
    )
    early = KVBox((0, HEADS), (0, 1, 2, 3), TokenRange(0, 16))  # a slice before every window
    assert window_boxes(layout, early, 40) == (KVBox((0, HEADS), (1,), TokenRange(0, 16)),)


def test_a_pipeline_stage_splits_its_own_layers() -> None:
    model = _layout((8, None, 8, 2), (0, 1, 2, 3), 4, 40, ORDERS[0])
    prefill = Parallelism.pipeline(tp_size=1, num_layers=4, pp_size=2, block_size=4)
    stage = prefill.rank_layout(model, 1, 0, num_blocks=12)
    assert stage.layer_ids == (2, 3) and stage.layer_windows == model.layer_windows
    box = KVBox((0, HEADS), (2, 3), TokenRange(0, 40))
    assert [(b.layers, b.tokens) for b in window_boxes(stage, box, 40)] == [
        ((2,), TokenRange(33, 40)),
        ((3,), TokenRange(39, 40)),
    ]
    with pytest.raises(LayoutError, match="layer 4 is not in the window map"):
        window_boxes(stage, KVBox((0, HEADS), (4,), TokenRange(0, 40)), 40)


def test_one_plan_over_mixed_layers_keeps_every_position() -> None:
    """The planner's own clip for a layer set is the smallest start of its layers: a plan that
    mixes a full layer with window layers moves every position (correct, not minimal)."""
    layout = _layout((8, None), (0, 1), 4, 20, ORDERS[0])
    side = PlanSide(layout, np.arange(layout.num_blocks), RegionId(0))
    other = PlanSide(layout, np.arange(layout.num_blocks), RegionId(1))
    assert plan_transfer(side, other, TokenRange(0, 20)).tokens == TokenRange(0, 20)
    assert plan_transfer(side, other, TokenRange(0, 20), layers=(0,)).tokens == TokenRange(13, 20)
