"""Shares: which heads × layers each prefill rank moves to one decode rank, and which one lead
moves the whole-only pools; and ``plan_slice`` planning one sender's share of a slice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.errors import PlanError
from kvplane.ids import RegionId, SliceId, TokenRange
from kvplane.layout import KVLayout
from kvplane.pd.events import TransferRequest
from kvplane.pipeline.advert import RemotePool
from kvplane.pipeline.shares import ANY_TOKENS, Share, shares
from kvplane.pipeline.slicing import LocalPool, plan_slice
from kvplane.transfer.codec import encode_plan
from kvplane.transfer.request import PlanOptions, PlanSide
from kvplane.transfer.resharding import KVBox, Parallelism, Piece, SenderId, plan_piece

ONE_PROCESS_TOKEN_BYTES = 2 * 4 * 4 * 2 * 4  # K and V × 4 heads × dim 4 × fp16 × 4 layers
TAIL = KVLayout.state(num_slots=4, num_layers=1, state_dim=32, dtype=torch.uint8)


def gqa(kv_heads: int = 4, **kw: object) -> KVLayout:
    return KVLayout.gqa(num_blocks=8, block_size=16, num_layers=4, kv_heads=kv_heads,
                        head_dim=4, dtype=torch.float16, **kw)  # type: ignore[arg-type]  # fmt: skip


def side(tp: int, pp: int = 1, bs: int = 16) -> Parallelism:
    return Parallelism.pipeline(tp_size=tp, num_layers=4, pp_size=pp, block_size=bs)


def share(
    stage: int, tp: int, heads: tuple[int, int], layers: tuple[int, ...], lead: bool
) -> Share:
    return Share(Piece(SenderId(stage, tp), KVBox(heads, layers, ANY_TOKENS)), lead)


def test_prefill_tp_2_into_decode_tp_1_splits_heads_and_rank_0_leads() -> None:
    got = shares(gqa(), side(2), side(1), 0)
    assert list(got.values()) == [
        share(0, 0, (0, 2), (0, 1, 2, 3), True), share(0, 1, (2, 4), (0, 1, 2, 3), False),
    ]  # fmt: skip
    assert list(got) == [SenderId(0, 0), SenderId(0, 1)]


def test_prefill_pp_2_into_decode_tp_1_splits_layers_and_the_last_stage_leads() -> None:
    got = shares(gqa(), side(1, pp=2), side(1), 0)
    assert list(got.values()) == [
        share(0, 0, (0, 4), (0, 1), False), share(1, 0, (0, 4), (2, 3), True),
    ]  # fmt: skip


def test_replicated_gqa_heads_come_from_one_replica_each() -> None:
    got = shares(gqa(kv_heads=2), side(4), side(1), 0)  # ranks 0,1 hold head 0; 2,3 head 1
    assert list(got.values()) == [
        share(0, 0, (0, 1), (0, 1, 2, 3), True), share(0, 2, (1, 2), (0, 1, 2, 3), False),
    ]  # fmt: skip
    second = shares(gqa(kv_heads=2), side(4), side(2), 1)
    assert list(second.values()) == [share(0, 3, (1, 2), (0, 1, 2, 3), True)]


def test_shares_refuse_a_rank_outside_the_decode_side_and_bad_values() -> None:
    with pytest.raises(PlanError, match=r"^decode_rank must be"):
        shares(gqa(), side(2), side(1), 1)
    with pytest.raises(PlanError, match=r"^Share.lead must be a bool, got 1$"):
        Share(Piece(SenderId(0, 0), KVBox((0, 1), (0,), ANY_TOKENS)), 1)  # type: ignore[arg-type]


# -- plan_slice with a share ------------------------------------------------------------------
def _request(n: int) -> TransferRequest:
    return TransferRequest(session_id="s/0.0", epoch=1, request_id="r", dst_block_ids=(0, 1, 2),
                           prefix_tokens=0, num_tokens=n)  # fmt: skip


def _rank(model: KVLayout, par: Parallelism, stage: int, tp: int) -> list[LocalPool]:
    layout = par.rank_layout(model, stage, tp, 8)
    return [
        LocalPool(layout, RegionId(1 + stage * 4 + tp), (5, 6)),
        LocalPool(TAIL, RegionId(9), (3,)),
    ]


def _decode(model: KVLayout) -> list[RemotePool]:
    return [RemotePool(side(1).rank_layout(model, 0, 0, 8), RegionId(20)),
            RemotePool(TAIL, RegionId(21))]  # fmt: skip


@pytest.mark.parametrize("pp", [1, 2])
def test_each_sender_plans_exactly_its_piece_and_only_the_lead_sends_the_tail(pp: int) -> None:
    model = gqa()
    prefill = side(2 // pp, pp=pp)
    remote = _decode(model)
    for sender, sh in shares(model, prefill, side(1), 0).items():
        local = _rank(model, prefill, sender.stage, sender.tp_rank)
        mid = plan_slice(local, remote, _request(21), TokenRange(0, 16), slice_id=SliceId(0),
                         is_last=False, share=sh)  # fmt: skip
        src = PlanSide(local[0].layout, np.asarray([5, 6]), local[0].region)
        dst = PlanSide(remote[0].layout, np.asarray([0, 1]), remote[0].region)
        piece = Piece(sender, KVBox(sh.piece.box.heads, sh.piece.box.layers, TokenRange(0, 16)))
        want = plan_piece(piece, src, dst, PlanOptions(slice_id=SliceId(0))).plan
        assert [encode_plan(p) for p in mid.plans] == [encode_plan(want)]
        assert mid.num_bytes == ONE_PROCESS_TOKEN_BYTES * 16 // 2  # half the heads or layers
        last = plan_slice(local, remote, _request(21), TokenRange(16, 21), slice_id=SliceId(1),
                          is_last=True, share=sh)  # fmt: skip
        assert last.dst_block_sizes == ((16, 1) if sh.lead else (16,))
        assert last.num_bytes == ONE_PROCESS_TOKEN_BYTES * 5 // 2 + (32 if sh.lead else 0)


def test_a_share_whose_heads_are_not_what_the_pools_share_is_refused() -> None:
    model = gqa()
    local = _rank(model, side(2), 0, 0)  # holds heads [0, 2)
    wrong = share(0, 0, (0, 1), (0, 1, 2, 3), True)
    with pytest.raises(PlanError, match=r"share \(0, 2\), not the piece's heads"):
        plan_slice(local, _decode(model), _request(21), TokenRange(0, 16), slice_id=SliceId(0),
                   is_last=False, share=wrong)  # fmt: skip
    with pytest.raises(PlanError, match="not all in our heads"):  # one sender: still refused
        plan_slice(local, _decode(model), _request(21), TokenRange(0, 16), slice_id=SliceId(0),
                   is_last=False)  # fmt: skip
