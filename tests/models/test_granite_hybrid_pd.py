"""A transformers Granite-4.0-H checkpoint (MoE, NoPE: the shape of ``granite-4.0-h-tiny``)
served by ``kvplane demo`` across prefill, decode and router processes, pipelined, with prefix
offload: every request's tokens equal one-process ``generate`` (the demo checks), which equal
``transformers``' greedy tokens on the demo's story prompts; the shared prefix's KV and Mamba2
state come back from host and disk; pools, ledgers and slots end balanced."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_granite_hybrid import save_granite

from demo_testlib import NEW, STEP, hf_greedy, hybrid_demo
from kvplane.apps.demo import demo_prompts
from kvplane.models import GraniteHybridModel, load_model


@pytest.mark.slow  # Bamba's serving path, which the Bamba checkpoint's demo runs by default
def test_demo_of_a_granite_checkpoint_gives_transformers_tokens(tmp_path: Path) -> None:
    hf = save_granite(tmp_path / "ckpt", 21, position_embedding_type="nope")
    got = hybrid_demo(str(tmp_path / "ckpt"))
    assert got["requests"] == len(demo_prompts(128))
    model = load_model(tmp_path / "ckpt")
    assert isinstance(model, GraniteHybridModel) and not model.granite.uses_rope
    for rid, tokens, want in hf_greedy(hf):
        assert len(set(want)) > 1, rid  # the tokens discriminate
        got_tokens = model.generate(tokens, NEW, STEP, block_size=16).tokens
        assert list(got_tokens) == want, rid
