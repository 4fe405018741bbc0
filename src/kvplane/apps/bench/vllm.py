"""``kvplane bench vllm``: TTFT in a real vLLM engine, prefix loaded vs recomputed.

Runs the engine harness in the vLLM environment; the recomputed prefix is the limit (target
ratio <= 0.5). See docs/benches.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from kvplane.integrations.vllm.env import run_harness, save_tiny_llama

NAME = "vllm"
HELP = "vLLM + kvplane connector: TTFT with a 2,048-token prefix loaded from host vs recomputed."

MODEL_SHAPE = {
    "vocab": 1024,
    "hidden": 512,
    "layers": 4,
    "heads": 8,
    "kv_heads": 4,
    "intermediate": 1408,
}
PREFIX_TOKENS = 2048
SUFFIX_TOKENS = 32
REPEATS = {True: 3, False: 7}
TARGET_RATIO = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--blocks-per-chunk", type=int, default=4, help="vLLM blocks (32 tokens) per chunk"
    )


def run(quick: bool, args: argparse.Namespace) -> dict[str, Any]:
    bpc = int(getattr(args, "blocks_per_chunk", 4))
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-vllm-") as tmp:
        model = Path(tmp) / "model"
        save_tiny_llama(model, MODEL_SHAPE)
        spec = {
            "model": str(model),
            "block_size": 32,
            "max_model_len": 4096,
            "prefix_caching": False,
            "connector": {"blocks_per_chunk": bpc, "host_slots": 512},
            "ttft": {
                "prefix_tokens": PREFIX_TOKENS,
                "suffix_tokens": SUFFIX_TOKENS,
                "repeats": REPEATS[quick],
                "seed": 0,
            },
        }
        got = run_harness(spec, timeout=600.0)
    hit, miss = float(got["ttft_hit_ms"]), float(got["ttft_miss_ms"])
    metrics = got.get("scheduler_metrics", {})
    return {
        "ttft_hit_ms": hit,
        "ttft_miss_ms": miss,
        "ratio": hit / miss if miss > 0 else 0.0,
        "target_ratio": TARGET_RATIO,
        "hit_samples_ms": got["hit_samples_ms"],
        "miss_samples_ms": got["miss_samples_ms"],
        "hit_tokens": metrics.get("kvplane_vllm_hit_tokens_total", 0.0),
        "ask_again": metrics.get("kvplane_vllm_ask_again_total", 0.0),
        "prefix_tokens": PREFIX_TOKENS,
        "blocks_per_chunk": bpc,
        "vllm_version": got["vllm_version"],
        "model": MODEL_SHAPE,
    }
