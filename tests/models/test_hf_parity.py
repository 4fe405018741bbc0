"""Parity with transformers (a test dependency; skipped when it is missing): tiny random-init
Llama, DeepSeek-V2 and DeepSeek-V3 models saved with ``save_pretrained`` load through
kvplane's loader, give the same logits within float32 tolerance, and the same greedy tokens
for 40 new tokens whatever the prefill step size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvplane.models import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

NEW_TOKENS = 40
PROMPT_LEN = 13

_MLA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
)  # fmt: skip
_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
         "mscale_all_dim": 1.0, "original_max_position_embeddings": 32}  # fmt: skip
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip


def _llama(**kw: Any) -> Any:
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    base.update(kw)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**base))


def _v3(**kw: Any) -> Any:
    base = {**_MLA, **_MOE, "q_lora_rank": 48, "n_group": 1, "topk_group": 1}
    base.update(kw)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**base))


def _v2(**kw: Any) -> Any:
    base = {**_MLA, **_MOE, "q_lora_rank": None}
    base.update(kw)
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**base))


CASES = {
    "llama-gqa": _llama,
    "llama-mha-bias": lambda: _llama(num_attention_heads=6, num_key_value_heads=6, hidden_size=48,
                                     attention_bias=True),
    "llama-mqa-headdim-llama3": lambda: _llama(num_attention_heads=8, num_key_value_heads=1,
                                               head_dim=32, rope_parameters=_LLAMA3),
    "llama-tied": lambda: _llama(tie_word_embeddings=True, num_hidden_layers=3),
    "v3-moe": _v3,
    "v3-moe-groups-neox": lambda: _v3(n_routed_experts=8, n_group=4, topk_group=2,
                                      first_k_dense_replace=0, rope_interleave=False),
    "v3-dense-yarn-noqlora": lambda: _v3(first_k_dense_replace=2, q_lora_rank=None,
                                         rope_parameters=_YARN, num_attention_heads=2),
    "v2-moe": lambda: _v2(n_shared_experts=2),
    "v2-moe-grouped-qlora": lambda: _v2(q_lora_rank=24, topk_method="group_limited_greedy",
                                        n_group=2, topk_group=1),
    "v2-dense": lambda: _v2(first_k_dense_replace=2, num_attention_heads=8),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    torch.manual_seed(sum(map(ord, name)))
    hf = CASES[name]().eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.architecture == hf.config.architectures[0]
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want_logits = hf(ids).logits[0]
        want = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=vocab - 1,
        )[0, PROMPT_LEN:].tolist()  # fmt: skip
    assert len(want) == NEW_TOKENS
    prompt = ids[0].tolist()
    # every prompt position's logits, through a shuffled-page chunked prefill
    got_logits = _prefill_logits(model, prompt, steps=[5, 5, 3])
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=2e-5)
    for step in (None, 1, 4):
        assert list(model.generate(prompt, NEW_TOKENS, step, block_size=4).tokens) == want


def _prefill_logits(model: Any, prompt: list[int], steps: list[int]) -> torch.Tensor:
    from kvplane.models import StepBatch, StepRequest

    blocks = [6, 0, 3, 5]  # deliberately out of order
    kv = model.new_kv_cache(7, 4)
    out, start = [], 0
    for size in steps:
        req = StepRequest(prompt[start : start + size], start, blocks)
        out.append(model.forward_step(StepBatch.build([req], 4), kv, all_logits=True))
        start += size
    return torch.cat(out)
