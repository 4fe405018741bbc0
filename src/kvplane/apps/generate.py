"""``kvplane generate``: greedy generation with one model in one process.

Prints the new tokens (``--json``: one object ``{"tokens": [...]}``); bad input is
``kvplane: error: ...`` with exit 1. Flags: docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvplane.errors import InvalidArgumentError
from kvplane.models import TINY_MODELS, load_model

NAME = "generate"
HELP = "Greedy generation with a tiny embedded model or an HF checkpoint, in one process."

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=TINY_MODELS[0],
        help=f"checkpoint directory or an embedded model ({', '.join(TINY_MODELS)})",
    )
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--step-size", type=int, default=None, help="chunked prefill step size")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--seed", type=int, default=0, help="weights seed of embedded models")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--json", action="store_true", help='print {"tokens": [...]} only')


def parse_prompt_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; ``InvalidArgumentError`` naming the first bad entry."""
    parts = [p.strip() for p in text.split(",")]
    out: list[int] = []
    for i, part in enumerate(parts):
        try:
            out.append(int(part))
        except ValueError:
            raise InvalidArgumentError(
                f"--prompt-ids entry {i} ({part!r}) is not an integer token id"
            ) from None
    return out


def run(args: argparse.Namespace) -> int:
    prompt = parse_prompt_ids(args.prompt_ids)
    started = time.perf_counter()
    model = load_model(args.model, dtype=_DTYPES[args.dtype], seed=args.seed)
    result = model.generate(prompt, args.max_new_tokens, args.step_size, block_size=args.block_size)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({"tokens": list(result.tokens)}))
        return 0
    arch = model.config.architecture
    print(f"model: {args.model} ({arch}, {model.config.num_layers} layers, {args.dtype})")
    print(f"prompt: {len(prompt)} tokens; steps: {len(result.steps)}; {elapsed:.2f} s")
    print("tokens: " + " ".join(str(t) for t in result.tokens))
    return 0
