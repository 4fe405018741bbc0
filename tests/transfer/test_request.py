"""Request checks: block tables, layers, heads, layout compatibility and options are refused
with a typed error naming the value, before any plan is built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.chunks import ChunkSpec
from kvplane.errors import LayoutError, PlanError
from kvplane.ids import ChunkKey, RegionId, SliceId, TokenRange
from kvplane.layout import KVLayout
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide

KEYS = (ChunkKey(b"k0" * 16),)


def gqa(**kw: object) -> KVLayout:
    args: dict[str, object] = dict(
        num_blocks=8, block_size=4, num_layers=3, kv_heads=2, head_dim=4, dtype=torch.float16
    )
    args.update(kw)
    return KVLayout.gqa(**args)  # type: ignore[arg-type]


def side(layout: KVLayout, ids: list[int], region: int = 0, offset: int = 0) -> PlanSide:
    return PlanSide(layout, np.array(ids), RegionId(region), offset)


def test_block_tables_are_checked() -> None:
    with pytest.raises(PlanError, match=r"block id 8 \(table position 1\) is outside"):
        side(gqa(), [0, 8])
    with pytest.raises(PlanError, match="integers"):
        side(gqa(), [0.0, 1.0])  # type: ignore[list-item]
    with pytest.raises(PlanError, match="one-dimensional"):
        PlanSide(gqa(), np.zeros((2, 2), dtype=np.int64), RegionId(0))
    with pytest.raises(PlanError, match="offset"):
        side(gqa(), [0], offset=-1)
    with pytest.raises(PlanError, match="need 3"):
        plan_transfer(side(gqa(), [0, 1]), side(gqa(), [2, 3, 4], 1), TokenRange(0, 9))
    with pytest.raises(PlanError, match="destination block table repeats block id 3"):
        plan_transfer(side(gqa(), [0, 1]), side(gqa(), [3, 3], 1), TokenRange(0, 8))
    # a repeated id outside the requested tokens (e.g. a null block) is fine
    ok = plan_transfer(side(gqa(), [0, 1]), side(gqa(), [0, 3], 1), TokenRange(4, 8))
    assert ok.num_bytes == 4 * 96


def test_layers_heads_and_layouts_are_checked() -> None:
    src, dst = side(gqa(), [0]), side(gqa(num_layers=2), [1], 1)
    with pytest.raises(PlanError, match=r"destination pool does not hold layer\(s\) \[2\]"):
        plan_transfer(src, dst, TokenRange(0, 4))
    with pytest.raises(PlanError, match="duplicates"):
        plan_transfer(src, dst, TokenRange(0, 4), layers=[0, 0])
    with pytest.raises(PlanError, match="at least one layer"):
        plan_transfer(src, dst, TokenRange(0, 4), layers=[])
    left = side(gqa(kv_heads=4, head_range=(0, 2)), [0])
    right = side(gqa(kv_heads=4, head_range=(2, 4)), [0], 1)
    with pytest.raises(PlanError, match="do not intersect"):
        plan_transfer(left, right, TokenRange(0, 4))
    for other, field in (
        (gqa(dtype=torch.bfloat16), "dtype"),
        (gqa(head_dim=8), "head_dim"),
        (KVLayout.mla(num_blocks=4, block_size=4, num_layers=3, latent_dim=6, rope_dim=2), "kind"),
    ):
        with pytest.raises(LayoutError, match=field):
            plan_transfer(src, side(other, [0], 1), TokenRange(0, 4))
    with pytest.raises(PlanError, match="needs a TokenRange"):
        plan_transfer(src, src, None)
    with pytest.raises(PlanError, match="PlanOptions"):
        plan_transfer(src, src, TokenRange(0, 4), options="fast")  # type: ignore[arg-type]


def test_options_are_checked() -> None:
    with pytest.raises(PlanError, match="prefix_tokens"):
        PlanOptions(prefix_tokens=-1)
    with pytest.raises(PlanError, match="chunk_spec"):
        PlanOptions(grouping=OpGrouping.CHUNK)
    with pytest.raises(PlanError, match="chunk_spec"):
        PlanOptions(chunk_keys=KEYS)
    with pytest.raises(PlanError, match="slice_id"):
        PlanOptions(slice_id=SliceId(-2))
    with pytest.raises(PlanError, match="grouping"):
        PlanOptions(grouping="layer")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="chunk_keys must be a sequence"):
        PlanOptions(chunk_keys=None)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="layers must be a sequence of ints"):
        plan_transfer(side(gqa(), [0]), side(gqa(), [1]), TokenRange(0, 4), layers=5)  # type: ignore[arg-type]


def test_side_and_state_arguments_are_checked() -> None:
    with pytest.raises(PlanError, match="KVLayout"):
        PlanSide("gqa", np.array([0]), RegionId(0))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="region"):
        PlanSide(gqa(), np.array([0]), RegionId(-1))
    with pytest.raises(PlanError, match="PlanSide"):
        plan_transfer("src", side(gqa(), [0]), TokenRange(0, 4))  # type: ignore[arg-type]
    assert side(gqa(), [1], offset=7).pool_end == 7 + gqa().pool_bytes
    with pytest.raises(PlanError, match="ends past the 4611686018427387904-byte limit"):
        side(gqa(), [1], offset=(1 << 62) - gqa().pool_bytes + 1)  # offsets would wrap int64
    assert side(gqa(), [1], offset=(1 << 62) - gqa().pool_bytes).pool_end == 1 << 62
    chunked = PlanOptions(grouping=OpGrouping.CHUNK, chunk_spec=ChunkSpec(4))
    assert chunked.chunk_keys == ()
