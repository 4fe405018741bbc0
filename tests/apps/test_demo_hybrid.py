"""``kvplane demo`` with a hybrid (attention + Mamba2) model: served across prefill, decode and
router processes, pipelined, with prefix offload; tokens identical to one-process ``generate``
(and so, for a transformers checkpoint, to ``transformers``' greedy tokens), the shared
prefix's KV and recurrent state loaded from host and disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo_testlib import NEW, STEP, hf_greedy, hybrid_demo
from kvplane.apps.demo import demo_prompts
from kvplane.models import load_model
from kvplane.testing.reference import save_tiny_bamba


@pytest.mark.slow  # the transformers-checkpoint demo below runs the same path by default
def test_demo_serves_tiny_hybrid_with_parity_and_prefix_hits() -> None:
    assert hybrid_demo("tiny-hybrid")["requests"] == len(demo_prompts(1024))


def test_demo_of_a_transformers_bamba_checkpoint_gives_transformers_tokens(
    tmp_path: Path,
) -> None:
    """The demo proves its processes' tokens equal ``generate`` in one process; here that
    one-process reference equals ``hf.generate`` on the demo's story prompts."""
    pytest.importorskip("transformers")
    hf = save_tiny_bamba(tmp_path / "ckpt", 12)
    hybrid_demo(str(tmp_path / "ckpt"))
    model = load_model(tmp_path / "ckpt")
    for rid, tokens, want in hf_greedy(hf):
        got = model.generate(tokens, NEW, STEP, block_size=16).tokens
        assert list(got) == want, rid
