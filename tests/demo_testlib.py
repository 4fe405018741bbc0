"""``kvplane demo`` of a hybrid (attention + Mamba2) checkpoint in its own processes, and the
greedy tokens of its transformers twin on the demo's prompts: shared by the hybrid demo tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch

from kvplane.apps.demo import demo_prompts

NEW = 6
STEP = 32  # the demo's default --step-size


def hybrid_demo(model: str) -> dict[str, Any]:
    """``kvplane demo --model MODEL --json`` (pipelined, ``NEW`` tokens) in a subprocess: its
    JSON, checked for parity, no failure, prefix hits from host (5) and disk (3),
    amplification 1.0 and both workers' integrity."""
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


def hf_greedy(hf: Any, count: int = 7) -> list[tuple[str, list[int], list[int]]]:
    """``(request id, prompt, transformers' NEW greedy tokens)`` of the first ``count`` demo
    prompts of 128 tokens."""
    out = []
    for p in demo_prompts(128)[:count]:
        ids = torch.tensor([p.tokens])
        with torch.no_grad():
            want = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        out.append((p.request_id, list(p.tokens), want))
    return out
