"""One-process references that tests compare served tokens against: ``kvplane generate``'s
greedy tokens (the CLI path, run in this process) and a saved tiny transformers Bamba.

Imported by tests only; decides nothing about what it is compared with.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvplane.cli import main


def generate_tokens(
    prompt: Sequence[int], max_new_tokens: int, *, model: str = "tiny-llama", step_size: int = 0
) -> list[int]:
    """The greedy tokens ``kvplane generate --model MODEL --json`` prints for ``prompt``
    (``step_size`` > 0: prefill in steps of that many tokens). ``AssertionError`` when the
    command fails."""
    argv = ["generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", str(max_new_tokens), "--json"]  # fmt: skip
    if step_size:
        argv += ["--step-size", str(step_size)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0, argv
    tokens: list[int] = json.loads(out.getvalue())["tokens"]
    return tokens


def save_tiny_bamba(path: Path, seed: int) -> Any:
    """A random-init transformers ``BambaForCausalLM`` (3 layers, attention at layer 1, 2 KV
    heads, Mamba2 with 8 heads) made under torch seed ``seed`` and saved to ``path``; returns
    the model (eval mode). Needs ``transformers``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BambaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
        mamba_d_conv=4, mamba_chunk_size=16,
    )  # fmt: skip
    hf = transformers.BambaForCausalLM(cfg).eval()  # type: ignore[no-untyped-call]
    hf.save_pretrained(path)
    return hf
