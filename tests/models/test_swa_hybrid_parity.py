"""Parity with transformers for the sliding-window (Mistral; Qwen2 with per-layer windows) and
hybrid (Bamba) models: tiny
random-init HF models saved with ``save_pretrained`` load through kvplane's loader and give the
same logits (float32 tolerance) and the same greedy tokens for prompts longer than the window,
whatever the prefill step size; the window mask ignores keys older than the window (exact)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvplane.models import PagedDecoder, StepBatch, StepRequest, load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

NEW_TOKENS = 24
WINDOW = 16
PROMPT_LENS = (20, 64, 70)
_BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


def _mistral(**kw: Any) -> Any:
    cfg = transformers.MistralConfig(**{**_BASE, "sliding_window": WINDOW, **kw})
    return transformers.MistralForCausalLM(cfg)


def _qwen2(**kw: Any) -> Any:
    cfg = transformers.Qwen2Config(**{**_BASE, "use_sliding_window": True, **kw})
    return transformers.Qwen2ForCausalLM(cfg)


def _bamba(**kw: Any) -> Any:
    base = {
        **_BASE, "num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 8,
        "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_chunk_size": 16,
    }  # fmt: skip
    return transformers.BambaForCausalLM(transformers.BambaConfig(**{**base, **kw}))


CASES = {
    "mistral-swa16": _mistral,
    "mistral-swa8-mqa": lambda: _mistral(sliding_window=8, num_key_value_heads=1),
    "qwen2-full-then-swa8": lambda: _qwen2(
        num_hidden_layers=3, sliding_window=8, max_window_layers=1
    ),  # layer_types full, sliding, sliding
    "qwen2-swa-full-tied": lambda: _qwen2(
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    ),
    "bamba-1attn-2groups": _bamba,
    "bamba-2attn-tied-bias": lambda: _bamba(
        num_hidden_layers=4, attn_layer_indices=[0, 3], mamba_n_groups=1, mamba_conv_bias=False,
        tie_word_embeddings=True,
    ),
}  # fmt: skip


def _prompt(vocab: int, n: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n))


def _prefill(model: PagedDecoder, prompt: list[int], steps: list[int]) -> torch.Tensor:
    """Every position's logits through a chunked prefill over out-of-order pages."""
    blocks = list(range(31, -1, -1))
    kv = model.new_kv_cache(32, 4)
    out, start = [], 0
    for size in steps:
        req = StepRequest(prompt[start : start + size], start, blocks)
        out.append(model.forward_step(StepBatch.build([req], 4), kv, all_logits=True))
        start += size
    return torch.cat(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    torch.manual_seed(sum(map(ord, name)))
    hf = CASES[name]().eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.architecture == hf.config.architectures[0]
    for n in PROMPT_LENS:
        ids = _prompt(hf.config.vocab_size, n)
        with torch.no_grad():
            want_logits = hf(ids).logits[0]
            want = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, n:].tolist()  # fmt: skip
        prompt = ids[0].tolist()
        got_logits = _prefill(model, prompt, [n // 3, n // 3, n - 2 * (n // 3)])
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=2e-5)
        for step in (None, 7):
            assert list(model.generate(prompt, NEW_TOKENS, step, block_size=4).tokens) == want


@pytest.mark.parametrize("name", ["tiny-swa", "tiny-hybrid"])
def test_decode_step_equals_one_shot_prefill(name: str) -> None:
    model = load_model(name)
    prompt = _prompt(model.vocab_size, 40)[0].tolist()
    one_shot = _prefill(model, prompt, [40])[-1]
    stepwise = _prefill(model, prompt, [39, 1])[-1]
    torch.testing.assert_close(stepwise, one_shot, rtol=1e-5, atol=1e-5)
    assert int(stepwise.argmax()) == int(one_shot.argmax())


def test_window_ignores_keys_older_than_the_window() -> None:
    """Two 64-token prompts differing only at positions < 16: the last token's receptive field
    through 2 layers of window 16 starts at 63 - 2 * 15 = 33, so its logits are bit-identical
    (float32), and a difference inside the field changes them."""
    model = load_model("tiny-swa")
    assert model.config.sliding_window == WINDOW
    a = _prompt(model.vocab_size, 64)[0].tolist()
    b = [(t + 1) % model.vocab_size if i < 16 else t for i, t in enumerate(a)]
    c = [(t + 1) % model.vocab_size if i == 40 else t for i, t in enumerate(a)]
    la, lb, lc = (_prefill(model, p, [64])[-1] for p in (a, b, c))
    assert torch.equal(la, lb)
    assert not torch.equal(la, lc)
    assert {p.backend for p in model.last_plans} == {
        "gqa_torch"
    }  # the fast backend honours the window


def test_qwen2_layers_plan_their_own_windows(tmp_path: Path) -> None:
    """Qwen2's ``layer_types`` reach the problems: a step plans once for its full layer (no
    window) and once for its two sliding layers (``sliding_window``), all on the fast GQA
    backend without a fallback."""
    torch.manual_seed(0)
    _qwen2(num_hidden_layers=3, sliding_window=8, max_window_layers=1).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    _prefill(model, list(range(1, 30)), [29])
    assert [p.problem.window for p in model.last_plans] == [None, 8]
    assert {p.backend for p in model.last_plans} == {"gqa_torch"}
    assert model.selector.fallback_ratio == 0.0
