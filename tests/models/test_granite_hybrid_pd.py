"""A transformers Granite-4.0-H checkpoint (MoE, NoPE: the shape of ``granite-4.0-h-tiny``)
served by ``kvplane demo`` across prefill, decode and router processes, pipelined, with prefix
offload: every request's tokens equal one-process ``generate`` (the demo checks), which equal
``transformers``' greedy tokens on the demo's story prompts; the shared prefix's KV and Mamba2
state come back from host and disk; pools, ledgers and slots end balanced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from test_granite_hybrid import save_granite

from kvplane.apps.demo import demo_prompts
from kvplane.models import GraniteHybridModel, load_model

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
    return got


def test_demo_of_a_granite_checkpoint_gives_transformers_tokens(tmp_path: Path) -> None:
    hf = save_granite(tmp_path / "ckpt", 21, position_embedding_type="nope")
    got = _demo(str(tmp_path / "ckpt"))
    assert got["parity"] is True and got["failures"] == []
    assert got["requests"] == len(demo_prompts(128))
    m = got["metrics"]
    assert (m["chunk_hits_host"], m["chunk_hits_disk"]) == (5.0, 3.0)
    assert m["transfer_amplification"] == 1.0
    assert got["integrity"] == {"prefill": "", "decode": ""}
    model = load_model(tmp_path / "ckpt")
    assert isinstance(model, GraniteHybridModel) and not model.granite.uses_rope
    for p in demo_prompts(128)[:7]:
        ids = torch.tensor([p.tokens])
        with torch.no_grad():
            want = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        assert len(set(want)) > 1, p.request_id  # the tokens discriminate
        got_tokens = model.generate(p.tokens, NEW, STEP, block_size=16).tokens
        assert list(got_tokens) == want, p.request_id
