"""``kvplane generate``: greedy generation with one model in one process.

Prints the new tokens (``--json``: one object ``{"tokens": [...]}``); bad input is
``kvplane: error: ...`` with exit 1. Flags: docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvplane.attention import default_registry
from kvplane.attention.selection import AUTO, check_backend
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
    add_attention_flag(parser)
    parser.add_argument("--json", action="store_true", help='print {"tokens": [...]} only')


def add_attention_flag(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--attention auto|measured|NAME[,NAME]`` (default ``auto``), as generate, serve and demo
    take it; names are checked against the built-in backends."""
    group.add_argument(
        "--attention", default=AUTO, type=_attention, metavar="auto|measured|NAME[,NAME]",
        help="attention backend selection: auto (the first candidate that runs here and "
        "supports the problem), measured (the fastest, timed once per workload bucket) or "
        "backend names, one per attention kind the model plans (e.g. torch,mha)",
    )  # fmt: skip


def _attention(text: str) -> str:
    try:
        return check_backend(default_registry(), text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    model = load_model(
        args.model, dtype=_DTYPES[args.dtype], seed=args.seed, backend=args.attention
    )
    result = model.generate(prompt, args.max_new_tokens, args.step_size, block_size=args.block_size)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({"tokens": list(result.tokens)}))
        return 0
    arch = model.config.architecture
    print(f"model: {args.model} ({arch}, {model.config.num_layers} layers, {args.dtype})")
    backends = sorted({p.backend for p in model.last_plans})
    print(f"attention: {args.attention} -> {', '.join(backends) or 'none'}")
    print(f"prompt: {len(prompt)} tokens; steps: {len(result.steps)}; {elapsed:.2f} s")
    print("tokens: " + " ".join(str(t) for t in result.tokens))
    return 0
