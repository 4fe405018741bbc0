"""Lossy codecs on a tiny Llama with realistic logit margins: the HF-parity tiny Llama trained
for seconds on real text (:mod:`kvplane.testing.trained`), prompts from held-out text.

Its greedy tokens equal transformers'; its raw continuations are peaked (median top-2 margin
above 1, unlike the random-weight model's 0.2); fp8 and int8 prompt KV agree with raw on
>= 99% of teacher-forced tokens and of whole free-running 32-token continuations (issue #32).
Figures: docs/offload.md ("Codecs").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from parity_testlib import NEW_TOKENS, RawRun, agreement, prompt_lengths, raw_runs

from kvplane.models import greedy_generate
from kvplane.models.base import CausalLM
from kvplane.models.loader import load_model

PROMPTS = 32
TARGET = 0.99


@pytest.fixture(scope="module")
def model(trained_llama: tuple[Any, Any]) -> CausalLM:
    return load_model(trained_llama[0].path)


@pytest.fixture(scope="module")
def runs(trained_llama: tuple[Any, Any], model: CausalLM) -> list[RawRun]:
    trained = trained_llama[0]
    return raw_runs(model, trained.prompts(prompt_lengths(PROMPTS, 33, 95, seed=0), seed=0))


def test_greedy_tokens_match_transformers(trained_llama: tuple[Any, Any], model: CausalLM) -> None:
    trained, hf = trained_llama
    for prompt in trained.prompts([20, 45, 70], seed=1):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert list(greedy_generate(model, prompt, NEW_TOKENS).tokens) == want


def test_trained_logits_are_peaked(trained_llama: tuple[Any, Any], runs: list[RawRun]) -> None:
    margins = torch.cat([r.margins for r in runs])
    assert trained_llama[0].final_loss < 2.5
    assert float(margins.median()) > 1.0


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_lossy_codecs_agree_with_raw(model: CausalLM, runs: list[RawRun], codec: str) -> None:
    got = agreement(model, runs, codec)
    assert got.token_share >= TARGET
    assert got.continuation_share >= TARGET
