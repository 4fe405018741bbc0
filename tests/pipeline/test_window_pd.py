"""A sliding-window model across PD workers (threads, real tcp sockets): ``tiny-swa`` (Mistral,
window 16 on every layer) prefills in pipelined slices and decodes from the received KV with
exactly ``model.generate``'s tokens, while the transfer moves only the last ``window`` prompt
positions of every layer -- the bytes the decode side's attention reads, no more (#33)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.models import PagedDecoder, PagedKVCache, StepBatch, StepRequest
from kvplane.serving.producers.model import ModelSpec

STEP = 16
NEW = 6
WINDOW = 16
TOKEN_BYTES = 2 * 2 * 2 * 32 * 4
"""One position of tiny-swa's KV: 2 layers x K,V x 2 KV heads x head_dim 32 x float32."""
TAIL_BYTES = 32
"""The request's tail record (first token, prompt length, prompt digest), in the final slice."""


@pytest.fixture
def pair(model_pair: Callable[..., Any]) -> Any:
    return model_pair(ModelSpec("tiny-swa", seed=3), step=STEP)


def test_the_window_layout_is_what_both_workers_advertise(pair: Any) -> None:
    assert pair.model.kv_layout(4, 16).sliding_window == WINDOW
    assert pair.prefill.pools.kv.layout.sliding_window == WINDOW


@pytest.mark.parametrize("length", [70, 64, 9, 17])
def test_pipelined_pd_is_token_exact_and_moves_only_the_window(pair: Any, length: int) -> None:
    tokens = [int(t) for t in np.random.default_rng(length).integers(0, 1024, length)]
    res = pair.router.generate("r", tokens, max_new_tokens=NEW)
    assert res.state == "success", res.reason
    assert res.tokens == pair.model.generate(tokens, NEW, STEP, block_size=16).tokens
    moved, logical = pair.moved()
    # the last min(window, length) positions: 70 tokens move 16 (16384 + 32 bytes, not 71712)
    assert moved == logical == min(WINDOW, length) * TOKEN_BYTES + TAIL_BYTES


def _decode_logits(model: PagedDecoder, kv: PagedKVCache, token: int, pos: int) -> torch.Tensor:
    """The logits of the one-token decode step at ``pos`` over blocks ``0, 1, ...``."""
    ids = tuple(range(pos // 16 + 1))
    batch = StepBatch.build([StepRequest(np.array([token]), pos, ids)], 16, model.device)
    with torch.no_grad():
        return model.forward_step(batch, kv)


def test_the_decode_step_reads_the_window_the_transfer_moves_and_one_position_less() -> None:
    """The received window is enough: poisoning every prompt position below
    ``window_start(n)`` leaves the first decode step's logits bit-identical. The step at ``n``
    sees ``(n - window, n]``, so position ``n - window`` (moved) is never read either; the
    next position is."""
    model = ModelSpec("tiny-swa", seed=3).load()
    n = 70
    tokens = np.random.default_rng(n).integers(0, 1024, n)
    kv = model.new_kv_cache(8, 16)
    batch = StepBatch.build([StepRequest(tokens, 0, tuple(range(5)))], 16, model.device)
    with torch.no_grad():
        first = int(model.forward_step(batch, kv).argmax(-1)[0])
    received = kv.pool.clone()
    want = _decode_logits(model, kv, first, n)
    start = kv.layout.window_start(n)
    assert start == n - WINDOW
    for keep_from, same in ((start, True), (start + 1, True), (start + 2, False)):
        kv.pool.copy_(received)
        for p in range(keep_from):  # [blocks, layers, K/V, tokens, heads, dim]
            kv.pool[p // 16, :, :, p % 16] = 1e4
        assert torch.equal(_decode_logits(model, kv, first, n), want) is same, keep_from
