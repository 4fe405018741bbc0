"""Greedy parity of the random-weight tiny HF-parity Llama with its cached prompt KV
round-tripped through a codec, as a cold tier would store and load it: the flat-logit case.

Lossless codecs keep token-exact parity (free-running 32-token continuations). Lossy codecs
are held to floors on teacher-forced greedy agreement with raw (parity_testlib): this model's
logits are nearly flat (median top-2 margin 0.2), so any KV perturbation flips near-ties, and
the floors are what fp8 and int8 measure here, kept against regressions. Issue #32's 99% is
asserted on the trained model (test_trained_parity); docs/offload.md ("Codecs").
"""

from __future__ import annotations

import pytest
import torch
from parity_testlib import NEW_TOKENS, agreement, prefilled, prompt_lengths, raw_runs

from kvplane.models import greedy_generate
from kvplane.models.loader import load_model

MODEL = load_model("tiny-llama")
_g = torch.Generator().manual_seed(0)
PROMPTS = [
    torch.randint(0, MODEL.vocab_size, (n,), generator=_g).tolist()
    for n in prompt_lengths(16, 40, 120, seed=0)
]
RUNS = raw_runs(MODEL, PROMPTS)
FLOORS = {"fp8": 0.90, "int8": 0.97}


@pytest.mark.parametrize("codec", ["raw", "zstd", "lz4"])
def test_lossless_codecs_keep_token_exact_parity(codec: str) -> None:
    for run in RUNS[:2]:
        got = greedy_generate(
            MODEL, run.prompt, NEW_TOKENS, context=prefilled(MODEL, run.prompt, codec)
        )
        assert got.num_cached_tokens > 0 and got.tokens == run.tokens


def test_flat_logits_are_flat() -> None:
    assert float(torch.cat([r.margins for r in RUNS]).median()) < 0.5


@pytest.mark.parametrize("codec", sorted(FLOORS))
def test_lossy_codecs_keep_their_floors(codec: str) -> None:
    assert agreement(MODEL, RUNS, codec, free=False).token_share >= FLOORS[codec]
