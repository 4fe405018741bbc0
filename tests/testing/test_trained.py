"""The trained tiny Llama builder: deterministic (same seed, same bytes), leaves the caller's
RNG and thread count alone, holds prompts out of training, refuses impossible prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvplane.errors import InvalidArgumentError
from kvplane.testing.trained import HELD_OUT, VOCAB, corpus_tokens, train_tiny_llama

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("pydoc_data.topics")


def test_the_corpus_is_ascii_tokens() -> None:
    data = corpus_tokens()
    assert data.dtype == torch.int64 and len(data) > 400_000
    assert int(data.min()) >= 0 and int(data.max()) < VOCAB
    assert torch.equal(data, corpus_tokens())


def test_the_same_seed_gives_the_same_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(123)
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    a, _ = train_tiny_llama(tmp_path / "a", steps=3, batch=2)
    b, _ = train_tiny_llama(tmp_path / "b", steps=3, batch=2)
    c, _ = train_tiny_llama(tmp_path / "c", steps=3, batch=2, seed=1)
    assert torch.equal(torch.get_rng_state(), state) and torch.get_num_threads() == threads
    weights = [(t.path / "model.safetensors").read_bytes() for t in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    assert a.final_loss == b.final_loss and a.held_out == b.held_out
    assert len(a.held_out) == len(corpus_tokens()) - int(len(corpus_tokens()) * (1 - HELD_OUT))


def test_prompts_are_seeded_slices_of_held_out_text(tmp_path: Path) -> None:
    trained, _ = train_tiny_llama(tmp_path, steps=1, batch=1)
    prompts = trained.prompts([5, 17, 40], seed=4)
    assert [len(p) for p in prompts] == [5, 17, 40]
    assert prompts == trained.prompts([5, 17, 40], seed=4) != trained.prompts([5, 17, 40], seed=5)
    held = bytes(trained.held_out)
    assert all(bytes(p) in held for p in prompts)
    with pytest.raises(InvalidArgumentError, match="prompt length"):
        trained.prompts([len(trained.held_out) + 1], seed=0)
