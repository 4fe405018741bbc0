"""``kvplane bench vllm``: TTFT in a real vLLM engine, prefix loaded vs recomputed, and a
hit's TTFT against its floor.

Runs the engine harness in the vLLM environment. Two rows, each paired request by request: the
hit against the recomputed prefix (target ratio <= 0.5), and the hit against its floor -- the
hit's KV bytes at memcpy speed plus one forward step of the suffix alone, both timed in the
same engine process right after the hit. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvplane.apps.bench.spread import Row, spread_of
from kvplane.integrations.vllm.env import run_harness, save_tiny_llama

NAME = "vllm"
HELP = (
    "vLLM + kvplane connector: TTFT with a 2,048-token prefix (1,024 with --quick) loaded from "
    "host vs recomputed."
)

MODEL_SHAPE = {
    "vocab": 1024,
    "hidden": 512,
    "layers": 4,
    "heads": 8,
    "kv_heads": 4,
    "intermediate": 1408,
}
PREFIX_TOKENS = {True: 1024, False: 2048}
"""The stored prefix per ``--quick``: a miss recomputes it in bf16 (emulated on this host's
AVX2 cores: 5.6-8.7 s for 2,048 tokens at load 4), which made most of a quick run."""
SUFFIX_TOKENS = 32
REPEATS = {True: 3, False: 7}
TARGET_RATIO = 0.5
KV_BYTES_PER_TOKEN = (
    2
    * MODEL_SHAPE["layers"]
    * MODEL_SHAPE["kv_heads"]
    * (MODEL_SHAPE["hidden"] // MODEL_SHAPE["heads"])
    * 2
)
"""K and V of every layer, bf16 (the saved model's dtype, which the engine's cache keeps)."""
FLOOR_DEFINITION = (
    "floor_ms = hit KV bytes / memcpy GB/s (a torch copy_ of the prefix's KV bytes, scaled to "
    "the hit tokens) + suffix_step_ms (TTFT of a fresh suffix-only prompt: one forward step of "
    "the suffix without the prefix); both timed in the engine process right after each hit"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--blocks-per-chunk", type=int, default=4, help="vLLM blocks (32 tokens) per chunk"
    )


def run(quick: bool, args: argparse.Namespace) -> dict[str, Any]:
    bpc = int(getattr(args, "blocks_per_chunk", 4))
    prefix = PREFIX_TOKENS[quick]
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
                "prefix_tokens": prefix,
                "suffix_tokens": SUFFIX_TOKENS,
                "repeats": REPEATS[quick],
                "seed": 0,
                "floor_copy_bytes": prefix * KV_BYTES_PER_TOKEN,
            },
        }
        got = run_harness(spec, timeout=600.0)
    metrics = got.get("scheduler_metrics", {})
    hit_tokens = float(metrics.get("kvplane_vllm_hit_tokens_total", 0.0))
    out = {
        "ttft_hit_ms": float(got["ttft_hit_ms"]),
        "ttft_miss_ms": float(got["ttft_miss_ms"]),
        "target_ratio": TARGET_RATIO,
        "hit_samples_ms": got["hit_samples_ms"],
        "miss_samples_ms": got["miss_samples_ms"],
        "hit_tokens": hit_tokens,
        "ask_again": metrics.get("kvplane_vllm_ask_again_total", 0.0),
        "prefix_tokens": prefix,
        "blocks_per_chunk": bpc,
        "vllm_version": got["vllm_version"],
        "model": MODEL_SHAPE,
    }
    return out | floor_fields(got, hit_tokens / REPEATS[quick], prefix)


def floor_fields(got: dict[str, Any], hit_tokens: float, prefix_tokens: int) -> dict[str, Any]:
    """The hit/miss ratio, the floor (:data:`FLOOR_DEFINITION`) and ``hit_vs_floor`` from the
    harness's per-repeat samples (medians of the per-request ratios), and the two ``bench
    all`` rows; ``hit_tokens`` is the tokens one hit loaded, ``prefix_tokens`` those whose KV
    bytes the harness's copy samples moved."""
    hit, miss = got["hit_samples_ms"], got["miss_samples_ms"]
    copy_bytes = prefix_tokens * KV_BYTES_PER_TOKEN
    hit_bytes = hit_tokens * KV_BYTES_PER_TOKEN
    load = [c * hit_bytes / copy_bytes for c in got["copy_samples_ms"]]
    floor = [a + b for a, b in zip(load, got["suffix_step_samples_ms"], strict=True)]
    vs_miss = spread_of([h / m for h, m in zip(hit, miss, strict=True)])
    vs_floor = spread_of([h / f for h, f in zip(hit, floor, strict=True)])
    med = statistics.median
    rows = [
        Row(NAME, "ttft_hit_vs_miss", med(hit), "ms", med(miss), "prefix recomputed", vs_miss,
            TARGET_RATIO, False),
        Row(NAME, "ttft_hit_vs_floor", med(hit), "ms", med(floor),
            "memcpy of the hit KV + suffix step", vs_floor, None, False),
    ]  # fmt: skip
    return {
        "ratio": round(vs_miss.ratio_median, 4),
        "floor_ms": round(med(floor), 3),
        "hit_vs_floor": round(vs_floor.ratio_median, 4),
        "suffix_step_ms": round(med(got["suffix_step_samples_ms"]), 3),
        "memcpy_gbps": round(copy_bytes / (med(got["copy_samples_ms"]) / 1e3) / 1e9, 3),
        "hit_bytes": int(hit_bytes),
        "floor_samples_ms": [round(f, 3) for f in floor],
        "floor_definition": FLOOR_DEFINITION,
        "rows": [r.as_dict() for r in rows],
    }
