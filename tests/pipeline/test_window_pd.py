"""A sliding-window model across PD workers (threads, real tcp sockets): ``tiny-swa`` (Mistral,
window 16 on every layer) prefills in pipelined slices and decodes from the received KV with
exactly ``model.generate``'s tokens, while the transfer moves only the last ``window - 1`` prompt
positions of every layer -- the bytes the decode side's attention reads, no more (#33)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvplane.models import PagedDecoder, PagedKVCache, StepBatch, StepRequest, blocks_needed
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
    # the step at `length` reads (length - 16, length]: 70 tokens move 15 prompt positions
    # (15360 + 32 bytes, not 71712)
    assert moved == logical == min(WINDOW - 1, length) * TOKEN_BYTES + TAIL_BYTES


def _decode_logits(model: PagedDecoder, kv: PagedKVCache, token: int, pos: int) -> torch.Tensor:
    """The logits of the one-token decode step at ``pos`` over blocks ``0, 1, ...``."""
    ids = tuple(range(pos // 16 + 1))
    batch = StepBatch.build([StepRequest(np.array([token]), pos, ids)], 16, model.device)
    with torch.no_grad():
        return model.forward_step(batch, kv)


def test_the_decode_step_reads_exactly_the_window_the_transfer_moves() -> None:
    """The received window is exactly enough: poisoning every prompt position below
    ``window_start(n)`` leaves the first decode step's logits bit-identical; poisoning the
    first moved one too changes them. The step at ``n`` sees ``(n - window, n]``, so position
    ``n - window`` is not moved (it was, one position too many, before #33)."""
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
    assert start == n + 1 - WINDOW
    for keep_from, same in ((start - 1, True), (start, True), (start + 1, False)):
        kv.pool.copy_(received)
        for p in range(keep_from):  # [blocks, layers, K/V, tokens, heads, dim]
            kv.pool[p // 16, :, :, p % 16] = 1e4
        assert torch.equal(_decode_logits(model, kv, first, n), want) is same, keep_from


def test_a_200_token_generation_holds_only_its_window_on_the_decode_side(pair: Any) -> None:
    """150 prompt + 51 new tokens (200 positions of KV) on a decode pool of blocks of 8: the
    receiver allocates only the blocks of the 15 positions it is sent (blocks 16-18 of 19) and
    drops each block the window slides past, so at most 3 blocks are held at once and 2 at the
    end; before #33 it held a block per 8 positions, 25. Tokens as one process's."""
    tokens = [int(t) for t in np.random.default_rng(200).integers(0, 1024, 150)]
    res = pair.router.generate("long", tokens, max_new_tokens=51)
    assert res.state == "success", res.reason
    assert res.tokens == pair.model.generate(tokens, 51, STEP, block_size=16).tokens
    moved, _ = pair.moved()  # every worker idle and balanced
    assert moved == (WINDOW - 1) * TOKEN_BYTES + TAIL_BYTES
    blocks = pair.decode.pools.blocks
    assert blocks_needed(150, 51, 8) == 25  # a block for every 8 positions
    assert blocks_needed(150, 51, 8, pair.decode.pools.kv.layout, received=True) == 3
    assert (blocks.peak_used_blocks, blocks.num_used_blocks, blocks.capacity) == (3, 0, 47)
    # the prefill side holds a step's blocks and its window's (it held all 10 before)
    assert pair.prefill.pools.blocks.peak_used_blocks == 2


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random transformers Mistral (window 8 on both layers), saved as a checkpoint."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(30)
    cfg = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=8,
    )  # fmt: skip
    hf = transformers.MistralForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("mistral-swa8")
    hf.save_pretrained(path)
    return path, hf


def test_pd_with_dropped_blocks_is_token_exact_against_transformers(
    model_pair: Callable[..., Any], mistral: tuple[Path, Any]
) -> None:
    """A window of 8 over a 45-token prompt and 30 new tokens: the decode side starts with 4 of
    its 6 prompt blocks null and drops a block every 8 steps, and its tokens are transformers'."""
    path, hf = mistral
    pair = model_pair(ModelSpec(str(path)), step=STEP)
    tokens = [int(t) for t in np.random.default_rng(45).integers(0, 128, 45)]
    res = pair.router.generate("r", tokens, max_new_tokens=30)
    assert res.state == "success", res.reason
    ids = torch.tensor([tokens])
    with torch.no_grad():
        want = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, 45:].tolist()  # fmt: skip
    assert list(res.tokens) == want
    assert res.tokens == pair.model.generate(tokens, 30, STEP, block_size=16).tokens
    pair.moved()  # balanced
    assert pair.decode.pools.blocks.peak_used_blocks == 2  # (8 - 1) // 8 + 2
