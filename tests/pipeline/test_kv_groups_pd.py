"""KV cache groups through PD workers (threads, real tcp sockets): the tiny random Qwen2 of
``test_window_groups_pd`` (``layer_types`` sliding, full, sliding; window 8) served with
``ModelSpec(kv_groups=True)`` runs one paged pool per group on both sides, gives transformers'
tokens, moves exactly what the decode side reads, and the decode side ends each request holding
at most ``ceil(W / B) + 1`` window-group blocks while its full group holds every position. The
per-group destination convention and plans, unit level (#33)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from kvplane.errors import PlanError, ProtocolError
from kvplane.ids import RegionId, SliceId, TokenRange
from kvplane.layout import KVLayout
from kvplane.models.kv_groups import KVGroups
from kvplane.pd.events import TransferRequest
from kvplane.pipeline.advert import RemotePool, split_destination
from kvplane.pipeline.slicing import LocalPool, plan_slice
from kvplane.serving.producers.base import DecodeJob, DecodeOutput, PoolTensor
from kvplane.serving.producers.model import ModelDecoder, ModelSpec
from qwen2_testlib import WINDOW

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

STEP, NEW = 16, 6
CELL = 2 * 2 * 16 * 4
"""One position of one layer: K,V x 2 KV heads x head_dim 16 x float32."""
TAIL_BYTES = 32
DECODE_BLOCK = 8


class HeldDecoder(ModelDecoder):
    """The model decoder, recording each request's held blocks per KV cache group after its
    last step (before the worker releases them)."""

    held: ClassVar[list[tuple[int, ...]]] = []

    def decode(self, job: DecodeJob, kv: PoolTensor, state: PoolTensor | None) -> DecodeOutput:
        out = super().decode(job, kv, state)
        HeldDecoder.held.append(tuple(t.num_held_blocks for t, _ in job.tables))
        return out


@pytest.fixture(params=[True, False], ids=["pipelined", "after-prefill"])
def pair(request: pytest.FixtureRequest, model_pair: Callable[..., Any], mixed_qwen2: Any) -> Any:
    HeldDecoder.held = []
    spec = ModelSpec(str(mixed_qwen2.path), kv_groups=True)
    return model_pair(spec, step=STEP, pipelined=request.param, decoder=HeldDecoder)


def test_each_side_serves_one_paged_pool_per_group(pair: Any) -> None:
    for worker, bs in ((pair.prefill, 16), (pair.decode, DECODE_BLOCK)):
        pools = worker.pools
        assert pools.num_kv_pools == 2
        assert [p.layout.layer_ids for p in pools.kv.pools] == [(0, 2), (1,)]
        assert [p.layout.block_size for p in pools.kv.pools] == [bs, bs]
        assert [p.null_block is not None for p in pools.block_pools] == [True, False]
        assert pools.hasher.fingerprint != pools.group_hashers[0].fingerprint
        assert pools.layer_ids == (0, 1, 2)
        assert len(pools.layouts) == 3  # two paged pools, the tail


@pytest.mark.parametrize("length", [70, 33, 5])
def test_groups_pd_is_token_exact_and_frees_window_blocks(
    pair: Any, mixed_qwen2: Any, length: int
) -> None:
    tokens = [int(t) for t in np.random.default_rng(length).integers(0, 128, length)]
    res = pair.router.generate("r", tokens, max_new_tokens=NEW)
    assert res.state == "success", res.reason
    assert list(res.tokens) == mixed_qwen2.greedy(tokens, NEW)
    assert res.tokens == pair.model.generate(tokens, NEW, STEP, block_size=16).tokens
    moved, logical = pair.moved()  # waits until both workers are idle and balanced
    assert moved == logical == (2 * min(WINDOW - 1, length) + length) * CELL + TAIL_BYTES
    # window group: at most ceil(8 / 8) + 1 = 2 blocks; full group: every position but the last
    full = -(-(length + NEW - 1) // DECODE_BLOCK)
    assert HeldDecoder.held == [(min(2, full), full)]
    for worker in (pair.prefill, pair.decode):
        worker.pools.check_idle()  # every group's pool balanced after the release
        assert [p.num_free_blocks for p in worker.pools.block_pools] == [47, 48]


@pytest.mark.parametrize(("prefill", "decode"), [(False, True), (True, False)],
                         ids=["one-pool-to-groups", "groups-to-one-pool"])  # fmt: skip
def test_one_side_grouped_the_other_not_is_token_exact_at_the_same_bytes(
    model_pair: Callable[..., Any], mixed_qwen2: Any, prefill: bool, decode: bool
) -> None:
    path = str(mixed_qwen2.path)
    pair = model_pair(ModelSpec(path, kv_groups=prefill), step=STEP,
                      decode_spec=ModelSpec(path, kv_groups=decode))  # fmt: skip
    assert (pair.prefill.pools.num_kv_pools, pair.decode.pools.num_kv_pools) == (
        2 if prefill else 1, 2 if decode else 1,
    )  # fmt: skip
    length = 33
    tokens = [int(t) for t in np.random.default_rng(length).integers(0, 128, length)]
    res = pair.router.generate("r", tokens, max_new_tokens=NEW)
    assert res.state == "success", res.reason
    assert list(res.tokens) == mixed_qwen2.greedy(tokens, NEW)
    moved, logical = pair.moved()
    assert moved == logical == (2 * (WINDOW - 1) + length) * CELL + TAIL_BYTES


# -- the destination convention and one slice's plans, unit level -------------------------------
N = 40
MODEL = KVLayout.gqa(
    num_blocks=8, block_size=8, num_layers=3, kv_heads=2, head_dim=16, dtype=torch.float32,
    layer_windows=(WINDOW, None, WINDOW),
)  # fmt: skip
GROUPS = KVGroups.of_layout(MODEL).layouts(MODEL)
TAIL = KVLayout.state(num_slots=4, num_layers=1, state_dim=TAIL_BYTES, dtype=torch.uint8)
NULL = 7
WINDOW_IDS = (NULL, NULL, NULL, NULL, 0)  # the window group holds only block 4 of 40 tokens
FULL_IDS = (0, 1, 2, 3, 4)


def _remote() -> list[RemotePool]:
    return [RemotePool(GROUPS[0], RegionId(7)), RemotePool(GROUPS[1], RegionId(8)),
            RemotePool(TAIL, RegionId(9))]  # fmt: skip


def _request() -> TransferRequest:
    return TransferRequest(
        session_id="s", epoch=1, request_id="r", dst_block_ids=(*WINDOW_IDS, *FULL_IDS, 2),
        prefix_tokens=0, num_tokens=N,
    )  # fmt: skip


def test_split_destination_cuts_each_groups_ids() -> None:
    assert split_destination(_request().dst_block_ids, _remote(), N) == [WINDOW_IDS, FULL_IDS, (2,)]
    with pytest.raises(ProtocolError, match="11 destination ids for 41 tokens; the pools need 13"):
        split_destination(_request().dst_block_ids, _remote(), 41)


def _plans(local: list[LocalPool], tokens: TokenRange) -> list[tuple[Any, ...]]:
    planned = plan_slice(local, _remote(), _request(), tokens, slice_id=SliceId(0), is_last=True)
    return [
        (p.layers, p.tokens, p.num_bytes, {int(r) for op in p.ops for r in op.dst.regions})
        for p in planned.plans
    ]


def test_each_groups_window_goes_to_its_own_pool() -> None:
    local = [LocalPool(GROUPS[0], RegionId(1), tuple(range(5))),
             LocalPool(GROUPS[1], RegionId(2), tuple(range(5))),
             LocalPool(TAIL, RegionId(3), (0,))]  # fmt: skip
    assert _plans(local, TokenRange(0, N)) == [
        ((0, 2), TokenRange(33, N), 2 * (WINDOW - 1) * CELL, {7}),
        ((1,), TokenRange(0, N), N * CELL, {8}),
        ((0,), TokenRange(0, 1), TAIL_BYTES, {9}),
    ]


def test_one_pool_of_every_layer_feeds_the_groups() -> None:
    """A sender of one pool (a pipeline rank keeps one) plans the same cells into the groups."""
    local = [LocalPool(MODEL, RegionId(1), tuple(range(5))), LocalPool(TAIL, RegionId(3), (0,))]
    assert _plans(local, TokenRange(0, N)) == [
        ((0, 2), TokenRange(33, N), 2 * (WINDOW - 1) * CELL, {7}),
        ((1,), TokenRange(0, N), N * CELL, {8}),
        ((0,), TokenRange(0, 1), TAIL_BYTES, {9}),
    ]


def test_a_layer_no_destination_pool_holds_is_refused() -> None:
    other = KVLayout.gqa(
        num_blocks=8, block_size=8, num_layers=4, kv_heads=2, head_dim=16, dtype=torch.float32,
    )  # fmt: skip
    local = [LocalPool(other, RegionId(1), tuple(range(5))), LocalPool(TAIL, RegionId(3), (0,))]
    with pytest.raises(PlanError, match="no destination pool holds layers"):
        _plans(local, TokenRange(0, N))
