"""A model mixing sliding-window and full-attention layers across PD workers (threads, real tcp
sockets): a tiny random Qwen2 from transformers (``layer_types`` sliding, full, sliding;
window 8) prefills in slices (pipelined and not) and decodes from the received KV with exactly
``model.generate``'s and transformers' tokens, while each window layer moves only the last
``window - 1`` prompt positions and the full layer all of them: amplification 1.0 against the
bytes the decode side reads. The per-group plans of one slice, for one sender and for two
pipeline stages, move exactly those cells (#33)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.ids import RegionId, SliceId, TokenRange
from kvplane.layout import KVLayout
from kvplane.models import StepBatch, StepRequest
from kvplane.pd.events import TransferRequest
from kvplane.pipeline.advert import RemotePool, describe, rebuild
from kvplane.pipeline.shares import Share, shares
from kvplane.pipeline.slicing import LocalPool, plan_slice
from kvplane.serving.producers.model import ModelSpec
from kvplane.transfer.resharding import Parallelism
from qwen2_testlib import WINDOW

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

STEP, NEW = 16, 6
CELL = 2 * 2 * 16 * 4
"""One position of one layer: K,V x 2 KV heads x head_dim 16 x float32."""
TAIL_BYTES = 32
"""The request's tail record (first token, prompt length, prompt digest), in the final slice."""


def needed_bytes(n: int) -> int:
    """What the decode side reads of an ``n``-token prompt: the window layers' last
    ``WINDOW - 1`` positions (the step at ``n`` sees ``(n - WINDOW, n]``), the full layer's
    every position."""
    return (2 * min(WINDOW - 1, n) + n) * CELL


@pytest.fixture
def checkpoint(mixed_qwen2: Any) -> tuple[Path, object]:
    return mixed_qwen2.path, mixed_qwen2.hf


@pytest.fixture(params=[True, False], ids=["pipelined", "after-prefill"])
def pair(
    request: pytest.FixtureRequest, model_pair: Callable[..., Any], checkpoint: tuple[Path, object]
) -> Any:
    spec = ModelSpec(str(checkpoint[0]), kv_groups=False)  # one pool of every layer
    return model_pair(spec, step=STEP, pipelined=request.param)


def test_the_workers_pool_carries_each_layers_window(pair: Any) -> None:
    layout = pair.prefill.pools.kv.layout
    assert layout.sliding_window is None and layout.layer_windows == (WINDOW, None, WINDOW)
    assert layout == pair.model.kv_layout(48, 16)


@pytest.mark.parametrize("length", [70, 33, 5])
def test_pd_is_token_exact_and_moves_only_what_each_layer_reads(
    pair: Any, mixed_qwen2: Any, length: int
) -> None:
    tokens = [int(t) for t in np.random.default_rng(length).integers(0, 128, length)]
    res = pair.router.generate("r", tokens, max_new_tokens=NEW)
    assert res.state == "success", res.reason
    assert res.tokens == pair.model.generate(tokens, NEW, STEP, block_size=16).tokens
    assert list(res.tokens) == mixed_qwen2.greedy(tokens, NEW)
    moved, logical = pair.moved()
    # 70 tokens: (7 + 70 + 7) x 256 + 32 = 21536 bytes, not the 53792 of every position
    assert moved == logical == needed_bytes(length) + TAIL_BYTES
    # the decode side cached none of it (its window layers lack early positions): the same
    # prompt again is no prefix hit there, and moves the same bytes
    again = pair.router.generate("r2", tokens, max_new_tokens=NEW)
    assert again.state == "success" and again.tokens == res.tokens
    assert pair.moved()[0] == 2 * moved


# -- one slice's plans, unit level -------------------------------------------------------------
N = 40
MODEL = KVLayout.gqa(
    num_blocks=8, block_size=8, num_layers=3, kv_heads=2, head_dim=16, dtype=torch.float32,
    layer_windows=(WINDOW, None, WINDOW),
)  # fmt: skip
TAIL = KVLayout.state(num_slots=4, num_layers=1, state_dim=TAIL_BYTES, dtype=torch.uint8)


def _slice(
    src: KVLayout, tokens: TokenRange, is_last: bool, share: Share | None = None
) -> list[tuple[tuple[int, ...], TokenRange, int]]:
    dst = rebuild(describe(MODEL))  # the advertised layout round-trips with its windows
    local = [LocalPool(src, RegionId(1), tuple(range(5))), LocalPool(TAIL, RegionId(2), (0,))]
    remote = [RemotePool(dst, RegionId(7)), RemotePool(TAIL, RegionId(8))]
    ids = (*range(5), 1)
    request = TransferRequest(
        session_id="s", epoch=1, request_id="r", dst_block_ids=ids, prefix_tokens=0, num_tokens=N
    )
    planned = plan_slice(
        local, remote, request, tokens, slice_id=SliceId(0), is_last=is_last, share=share
    )
    return [(p.layers, p.tokens, p.num_bytes) for p in planned.plans]


def test_one_sender_plans_one_slice_per_window_group() -> None:
    assert _slice(MODEL, TokenRange(0, 16), False) == [((1,), TokenRange(0, 16), 16 * CELL)]
    assert _slice(MODEL, TokenRange(16, N), True) == [
        ((0, 2), TokenRange(33, N), 2 * (WINDOW - 1) * CELL),
        ((1,), TokenRange(16, N), 24 * CELL),
        ((0,), TokenRange(0, 1), TAIL_BYTES),
    ]


def test_pipeline_stages_each_plan_their_own_groups() -> None:
    prefill = Parallelism.pipeline(tp_size=1, num_layers=3, pp_size=2, block_size=8)
    decode = Parallelism(1, (MODEL.layer_ids,), 8)
    mine = shares(MODEL, prefill, decode, 0)
    got = []
    for sender, share in mine.items():
        stage = prefill.rank_layout(MODEL, sender.stage, sender.tp_rank, num_blocks=8)
        got.append(_slice(stage, TokenRange(0, N), True, share=share))
    assert got == [
        [((0,), TokenRange(33, N), (WINDOW - 1) * CELL), ((1,), TokenRange(0, N), N * CELL)],
        [((2,), TokenRange(33, N), (WINDOW - 1) * CELL), ((0,), TokenRange(0, 1), TAIL_BYTES)],
    ]
    assert sum(b for plans in got for _, _, b in plans) == needed_bytes(N) + TAIL_BYTES


def test_the_decode_step_never_reads_a_window_layers_unsent_cells(
    checkpoint: tuple[Path, object],
) -> None:
    """Poisoning every position a window layer does not send leaves the first decode step's
    logits bit-identical; poisoning one unsent-by-the-window position of the full layer (it is
    sent) changes them."""
    model = ModelSpec(str(checkpoint[0])).load()
    n = 40
    tokens = np.random.default_rng(n).integers(0, 128, n)
    kv = model.new_kv_cache(8, 8)
    with torch.no_grad():
        batch = StepBatch.build([StepRequest(tokens, 0, tuple(range(5)))], 8, model.device)
        first = int(model.forward_step(batch, kv).argmax(-1)[0])
        decode = StepBatch.build([StepRequest(np.array([first]), n, tuple(range(6)))], 8,
                                 model.device)  # fmt: skip
        want = model.forward_step(decode, kv)
        received = kv.pool.clone()
        for layer in (0, 2):  # [blocks, layers, K/V, tokens, heads, dim]
            for p in range(kv.layout.window_start(n, (layer,))):
                kv.pool[p // 8, layer, :, p % 8] = 1e4
        assert torch.equal(model.forward_step(decode, kv), want)
        kv.pool.copy_(received)
        kv.pool[0, 1, :, 0] = 1e4
        assert not torch.equal(model.forward_step(decode, kv), want)
