"""Helpers shared by the models tests: small configs, seeded models, paged prefill runs (the mixed
Qwen2's layer pattern lives in ``tests/qwen2_testlib.py``, shared with the other tests)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.ids import BlockId, RequestId, TokenRange
from kvplane.models import (
    DeepSeekConfig,
    LlamaConfig,
    MoEConfig,
    PagedDecoder,
    PagedKVCache,
    StepBatch,
    build_model,
)
from kvplane.models.config import DEEPSEEK_V2, DEEPSEEK_V3
from kvplane.models.rope import RopeStyle, apply_rope, rope_tables
from kvplane.models.weights import RandomTensors
from qwen2_testlib import WINDOW, mixed_layer_types


def small_llama(**changes: Any) -> LlamaConfig:
    base = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def mixed_qwen2(**changes: Any) -> LlamaConfig:
    """A 4-layer Qwen2 mixing window and full layers: [sliding, full, sliding, full], window 8
    (``qwen2_testlib``'s pattern), on :func:`small_llama`'s dims."""
    qwen2 = dict(architecture="Qwen2ForCausalLM", num_layers=4, sliding_window=WINDOW)
    return small_llama(**{**qwen2, "layer_types": mixed_layer_types(4), **changes})


def small_moe(**changes: Any) -> MoEConfig:
    base = MoEConfig(
        num_experts=4, experts_per_token=2, intermediate_size=16, num_shared_experts=1,
        routed_scaling_factor=2.5, scoring="sigmoid", topk_method="noaux_tc", num_groups=1,
        topk_groups=1, norm_topk_prob=True, first_k_dense_replace=1,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def small_deepseek(v3: bool = True, moe: bool = True, **changes: Any) -> DeepSeekConfig:
    m = (
        small_moe()
        if v3
        else small_moe(scoring="softmax", topk_method="greedy", norm_topk_prob=False)
    )
    base = DeepSeekConfig(
        architecture=DEEPSEEK_V3 if v3 else DEEPSEEK_V2, vocab_size=89, hidden_size=32,
        intermediate_size=48, num_layers=2, num_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, moe=m if moe else None,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def random_model(config: Any, seed: int = 0, **kwargs: Any) -> PagedDecoder:
    return build_model(config, RandomTensors(seed), **kwargs)


def shuffled_pool(num_blocks: int, block_size: int, seed: int = 0) -> BlockPool:
    """A pool whose free queue hands out block ids in a seeded random order."""
    pool = BlockPool(num_blocks, block_size)
    ids = pool.allocate(num_blocks)
    assert ids is not None
    order = np.random.default_rng(seed).permutation(num_blocks)
    pool.free([BlockId(int(ids[i])) for i in order])
    return pool


def paged_prefill(
    model: PagedDecoder,
    tokens: list[int],
    steps: list[int],
    *,
    block_size: int = 4,
    num_blocks: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, BlockTable, BlockPool, PagedKVCache]:
    """Prefill ``tokens`` in steps of the given sizes; returns every token's logits ``[T, V]``,
    the (still admitted) table, its pool and the KV cache."""
    pool = shuffled_pool(num_blocks, block_size, seed)
    kv = model.new_kv_cache(num_blocks, block_size)
    table = BlockTable(RequestId("r"), block_size, BlockHasher(0, kv.layout.fingerprint()))
    assert table.admit(pool, tokens) is not None
    out, start = [], 0
    for size in steps:
        rng = TokenRange(start, start + size)
        batch = StepBatch.from_tables([(table, rng)])
        out.append(model.forward_step(batch, kv, all_logits=True))
        table.mark_computed(pool, size)
        start += size
    assert start == len(tokens)
    return torch.cat(out), table, pool, kv


def _causal_attention(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Dense causal attention: ``scores [H, T, T]``, ``values [H, T, D]`` -> ``[T, H, D]``."""
    t = scores.shape[-1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ values).transpose(0, 1)


def dense_llama_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """Every position's logits of one sequence, with plain dense attention (no pages)."""
    c = model.llama
    ids = torch.tensor(tokens)
    t, d, group = len(tokens), c.head_dim, c.num_heads // c.num_kv_heads
    cos, sin = rope_tables(c.rope, d, torch.arange(t))
    x = model.embed(ids)
    for layer in model.layers:
        h = layer.input_norm(x)
        q = apply_rope(layer.q(h).view(t, c.num_heads, d), cos, sin, RopeStyle.NEOX)
        k = apply_rope(layer.k(h).view(t, c.num_kv_heads, d), cos, sin, RopeStyle.NEOX)
        v = layer.v(h).view(t, c.num_kv_heads, d)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        out = _causal_attention(scores, v.transpose(0, 1))
        x = x + layer.o(out.reshape(t, -1))
        x = x + layer.mlp(layer.post_norm(x))
    return model.lm_head(model.final_norm(x))


def dense_deepseek_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """Every position's logits of one sequence: MLA decompressed per head, dense attention."""
    c = model.deepseek
    ids = torch.tensor(tokens)
    t, r, dn, dr = len(tokens), c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
    cos, sin = rope_tables(c.rope, dr, torch.arange(t))
    x = model.embed(ids)
    for layer in model.layers:
        a = layer.attn
        h = layer.input_norm(x)
        q = a.query(h).view(t, c.num_heads, dn + dr)
        q_pe = apply_rope(q[..., dn:], cos, sin, c.rope_style)
        ckv = a.kv_a(h)
        latent = a.kv_norm(ckv[:, :r])
        k_pe = apply_rope(ckv[:, None, r:], cos, sin, c.rope_style)[:, 0]
        k_nope = torch.einsum("tr,hrd->thd", latent, a.up.w_uk)
        v = torch.einsum("tr,hrv->htv", latent, a.up.w_uv)
        scores = torch.einsum("qhd,khd->hqk", q[..., :dn], k_nope)
        scores = (scores + torch.einsum("qhp,kp->hqk", q_pe, k_pe)) * c.sm_scale
        out = _causal_attention(scores, v)
        x = x + a.o(out.reshape(t, -1))
        x = x + layer.mlp(layer.post_norm(x))
    return model.lm_head(model.final_norm(x))
