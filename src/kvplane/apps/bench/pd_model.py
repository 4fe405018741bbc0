"""The real-model rows of ``kvplane bench pd``: the same pipelined/non-pipelined comparison as
the synthetic workload, with the tiny embedded DeepSeek model as producer and decoder, so the
pipelined gain is also shown where a step's compute is real (matmuls on this host's cores,
sharing them with the transfer) instead of a sleep.

Owns the model pair's flags and its result entry; the processes and the request loop are
:mod:`.pd_pair`'s, the rows :mod:`.pd_metrics`'s. See docs/benchmarks.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from kvplane.apps.bench.pd_metrics import bench_rows
from kvplane.apps.bench.pd_pair import FIXED_MODES, PairSpec, compare_modes, mode_rows
from kvplane.models import TINY_DEEPSEEK, tiny_config

MODEL = TINY_DEEPSEEK
DTYPE = "float32"
MAX_TOKENS = 2048
"""Prompt tokens at most (the tiny model's positions end at 4,096)."""
COMPUTE_MODEL = {
    "synthetic": (
        "sleep after streaming-store write: a step writes its KV (the C streaming-store kernel) "
        "then sleeps until the calibrated step time; it stands for accelerator compute that "
        "uses no host bandwidth"
    ),
    "model": (
        f"{MODEL} ({DTYPE}) on this host's CPU: real prefill compute (kvplane.models) on the "
        "cores the transfer also uses; its KV is a few hundred bytes per token, so a slice's "
        "transfer is small against its step"
    ),
}
"""What a prefill step's compute is in each kind of row (the JSON's ``compute_model``)."""


def model_spec(transport: str, tokens: int, step: int, model: str = MODEL) -> PairSpec:
    """A pair serving ``model`` (a tiny model, :data:`MAX_TOKENS` positions or more) over
    ``transport``: prompts of ``tokens`` (at most :data:`MAX_TOKENS`) in steps of ``step``."""
    tokens = min(tokens, MAX_TOKENS)
    producer = ("--model", model, "--model-dtype", DTYPE, "--seed", "0")
    return PairSpec(transport, tokens, step, 2 * -(-tokens // 16) + 8, producer)


def pair_head(spec: PairSpec, model: str = MODEL) -> dict[str, Any]:
    """The head of a model pair's result entry: ``{"model", "dtype", "transport", "tokens",
    "step"}`` of ``spec``."""
    return {
        "model": model,
        "dtype": DTYPE,
        "transport": spec.transport,
        "tokens": spec.tokens,
        "step": spec.step,
    }


def model_result(
    transport: str, tokens: int, step: int, repeats: tuple[int, int], cap_s: float
) -> dict[str, Any]:
    """Serve the same prompts through a pipelined and a non-pipelined pair of the model:
    ``{"model", "transport", "tokens", "step", "modes", "rows", "ttft_ratio",
    "tokens_equal"}`` (``tokens_equal``: both modes decoded the same first tokens)."""
    spec = model_spec(transport, tokens, step)
    vocab = tiny_config(MODEL).vocab_size
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-pd-model-") as work:
        served, times, same = compare_modes(
            Path(work), spec, repeats, cap_s, vocab, modes=FIXED_MODES
        )
    modes = mode_rows(transport, served, times)
    lines = bench_rows("model", served.ttft_ms, times["pipelined"][0], ttft_target=None)
    return {
        **pair_head(spec),
        "modes": modes,
        "rows": lines,
        "ttft_ratio": lines[0]["ratio_median"],
        "tokens_equal": same,
    }
