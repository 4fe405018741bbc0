"""DeepSeekModel over the paged MLA latent cache: a dense decompressed oracle, the absorbed and
decompressed paths, chunked prefill, V2/V3, MoE on/off, and bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models_testlib import dense_deepseek_logits, paged_prefill, random_model, small_deepseek

from kvplane.errors import InvalidArgumentError, UnsupportedError
from kvplane.ids import TokenRange
from kvplane.layout import KVLayout, LayoutKind
from kvplane.models import DeepSeekModel, MLAPath, PagedKVCache, StepBatch, StepRequest

TOKENS = [5, 88, 13, 40, 2, 71, 19, 60, 33, 7]
TOL = {"rtol": 1e-5, "atol": 1e-5}

CONFIGS = {
    "v3-moe": small_deepseek(),
    "v3-dense-noqlora": small_deepseek(moe=False, q_lora_rank=None),
    "v3-neox": small_deepseek(rope_interleave=False, num_heads=2),
    "v2-moe": small_deepseek(v3=False),
    "v2-dense-bias": small_deepseek(v3=False, moe=False, attention_bias=True, mlp_bias=True),
    "nope-equals-rank": small_deepseek(qk_nope_head_dim=16, kv_lora_rank=16),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("path", list(MLAPath))
def test_prefill_matches_the_dense_oracle(name: str, path: MLAPath) -> None:
    model = random_model(CONFIGS[name], mla_path=path)
    assert isinstance(model, DeepSeekModel)
    logits, table, pool, kv = paged_prefill(model, TOKENS, [len(TOKENS)])
    torch.testing.assert_close(logits, dense_deepseek_logits(model, TOKENS), **TOL)
    assert kv.layout.kind is LayoutKind.MLA and kv.layout.head_dim == 16 + 4
    table.release(pool)
    pool.check_integrity()


def test_paths_and_backends_per_step() -> None:
    model = random_model(small_deepseek())
    assert isinstance(model, DeepSeekModel)
    prefill = StepBatch.build([StepRequest(TOKENS, 0, [0, 1, 2])], 4)
    decode = StepBatch.build([StepRequest([1], 10, [0, 1, 2])], 4)
    assert not model.absorbed(prefill) and model.absorbed(decode)
    kv = model.new_kv_cache(3, 4)
    model.forward_step(prefill, kv)
    assert [p.backend for p in model.last_plans] == ["mha"]
    model.forward_step(decode, kv)
    assert [p.backend for p in model.last_plans] == ["torch"]
    # d_nope == r: both queries are [T, H, r + p]; the path is still the step's own
    same = random_model(small_deepseek(qk_nope_head_dim=16, kv_lora_rank=16))
    assert isinstance(same, DeepSeekModel)
    assert not same.absorbed(prefill) and same.absorbed(decode)
    same_kv = same.new_kv_cache(3, 4)
    same.forward_step(prefill, same_kv)
    assert [p.backend for p in same.last_plans] == ["mha"]
    same.forward_step(decode, same_kv)
    assert [p.backend for p in same.last_plans] == ["torch"]
    explicit = random_model(small_deepseek(), backend="torch")
    with pytest.raises(UnsupportedError, match="'torch' cannot run this problem"):
        explicit.forward_step(prefill, explicit.new_kv_cache(3, 4))
    absorbed = random_model(small_deepseek(), backend="torch", mla_path=MLAPath.ABSORBED)
    got = absorbed.forward_step(prefill, absorbed.new_kv_cache(3, 4), all_logits=True)
    torch.testing.assert_close(got, dense_deepseek_logits(absorbed, TOKENS), **TOL)


@pytest.mark.parametrize("name", ["v3-moe", "v2-moe"])
@pytest.mark.parametrize(("steps", "block_size"), [([3, 3, 3, 1], 4), ([1] * 10, 3), ([7, 3], 2)])
def test_chunked_prefill_matches_one_shot(name: str, steps: list[int], block_size: int) -> None:
    model = random_model(CONFIGS[name], seed=1)
    got, table, pool, kv = paged_prefill(model, TOKENS, steps, block_size=block_size, num_blocks=10)
    torch.testing.assert_close(got, dense_deepseek_logits(model, TOKENS), **TOL)
    latent = kv.layout.mla_view(kv.pool, 1).reshape(kv.num_slots, -1)
    written = torch.zeros(kv.num_slots, dtype=torch.bool)
    written[table.slot_mapping(TokenRange(0, len(TOKENS)))] = True
    assert torch.equal((latent != 0).any(dim=1), written)
    table.release(pool)
    pool.check_integrity()


def test_generation_is_independent_of_step_and_block_sizes() -> None:
    model = random_model(small_deepseek(), seed=2)
    want = model.generate(TOKENS, 12).tokens
    for step, bs in ((1, 2), (3, 4), (4, 16)):
        assert model.generate(TOKENS, 12, step, block_size=bs).tokens == want


def _refused(model: Any, kv: PagedKVCache, batch: StepBatch, words: str) -> None:
    before = kv.pool.clone()
    with pytest.raises(InvalidArgumentError, match=words):
        model.forward_step(batch, kv)
    assert torch.equal(kv.pool, before)


def test_bad_input_is_refused_before_the_pool_is_touched() -> None:
    model = random_model(small_deepseek())
    kv = model.new_kv_cache(4, 4)
    kv.pool.uniform_(generator=torch.Generator().manual_seed(0))
    _refused(model, kv, StepBatch.build([StepRequest([89], 0, [0])], 4), "token id 89")
    other = PagedKVCache(KVLayout.mla(num_blocks=4, block_size=4, num_layers=2, latent_dim=8,
                                      rope_dim=4, dtype=torch.float32))  # fmt: skip
    _refused(model, other, StepBatch.build([StepRequest([1], 0, [0])], 4), "does not fit")
    gqa = PagedKVCache(KVLayout.gqa(num_blocks=4, block_size=4, num_layers=2, kv_heads=1,
                                    head_dim=20, dtype=torch.float32))  # fmt: skip
    _refused(model, gqa, StepBatch.build([StepRequest([1], 0, [0])], 4), "does not fit")
