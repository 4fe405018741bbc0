"""``kvplane demo`` with a hybrid (attention + Mamba2) model: served across prefill, decode and
router processes, pipelined, with prefix offload; tokens identical to one-process ``generate``
(and so, for a transformers checkpoint, to ``transformers``' greedy tokens), the shared
prefix's KV and recurrent state loaded from host and disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvplane.apps.demo import demo_prompts
from kvplane.models import load_model
from kvplane.testing.reference import save_tiny_bamba

NEW = 6
STEP = 32  # the demo's default --step-size


def _demo(model: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["demo", "--model", model, "--json", "--pipelining", "on", "--max-new-tokens", str(NEW)]
    done = subprocess.run(
        [sys.executable, "-m", "kvplane", *args],
        check=False, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["parity"] is True and got["failures"] == []
    m = got["metrics"]
    assert (m["chunk_hits_host"], m["chunk_hits_disk"]) == (5.0, 3.0)
    assert m["transfer_amplification"] == 1.0
    assert got["integrity"] == {"prefill": "", "decode": ""}
    return got


@pytest.mark.slow  # the transformers-checkpoint demo below runs the same path by default
def test_demo_serves_tiny_hybrid_with_parity_and_prefix_hits() -> None:
    assert _demo("tiny-hybrid")["requests"] == len(demo_prompts(1024))


def test_demo_of_a_transformers_bamba_checkpoint_gives_transformers_tokens(
    tmp_path: Path,
) -> None:
    """The demo proves its processes' tokens equal ``generate`` in one process; here that
    one-process reference equals ``hf.generate`` on the demo's story prompts."""
    pytest.importorskip("transformers")
    hf = save_tiny_bamba(tmp_path / "ckpt", 12)
    _demo(str(tmp_path / "ckpt"))
    model = load_model(tmp_path / "ckpt")
    for p in demo_prompts(128)[:7]:
        ids = torch.tensor([p.tokens])
        with torch.no_grad():
            want = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        got = model.generate(p.tokens, NEW, STEP, block_size=16).tokens
        assert list(got) == want, p.request_id
