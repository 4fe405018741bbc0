"""``kvplane bench attention``: MLA backends over a workload grid, against memcpy bandwidth.

Times every viable non-oracle backend, ``auto`` and ``measured`` at each grid point with one
interleaved timer, and reports bandwidth, GFLOP/s and the decode roofline. Limits and
estimator: docs/benches.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from itertools import product
from typing import Any

import torch

from kvplane.attention import (
    AUTO,
    MEASURED,
    MLAShape,
    PerfCounterTimer,
    Selector,
    Supported,
    default_registry,
)
from kvplane.attention.synthetic import make_mla_inputs, synthetic_metadata

NAME = "attention"
HELP = "MLA attention backends: time, GB/s vs memcpy, auto/measured choices."
RANK, ROPE, PAGE_SIZE = 512, 64, 16
FULL_GRID = {"batch": (1, 8, 32), "q_len": (1, 4), "kv_len": (128, 1024, 8192), "heads": (16, 128)}
QUICK_GRID = {"batch": (1, 8), "q_len": (1, 4), "kv_len": (128, 1024), "heads": (16,)}
QUICK_EXTRA = ((32, 1, 8192, 16),)  # the decode point the bandwidth target is defined at
DECODE_POINT = (32, 1, 8192)
MEMCPY = "memcpy"
"""The limit's entry among a point's timed thunks (not a backend)."""
MATMUL = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="KV/query dtype"
    )


def _memcpy(nbytes: int) -> Callable[[], object]:
    """The limit: one torch ``copy_`` of ``nbytes`` between two fresh buffers."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _memcpy_gbps(nbytes: int, timer: PerfCounterTimer) -> float:
    return nbytes / timer({MEMCPY: _memcpy(nbytes)})[MEMCPY] / 1e9


def _matmul_gflops(dtype: torch.dtype, timer: PerfCounterTimer) -> float:
    a = torch.randn(MATMUL, MATMUL).to(dtype)
    return 2 * MATMUL**3 / timer({"mm": lambda: torch.mm(a, a)})["mm"] / 1e9


def _point(
    batch: int, q_len: int, kv_len: int, heads: int, *, dtype: torch.dtype, timer: PerfCounterTimer
) -> dict[str, Any]:
    meta, pages = synthetic_metadata([q_len] * batch, [kv_len] * batch, PAGE_SIZE, shuffle_seed=0)
    inp = make_mla_inputs(
        meta, pages, MLAShape(heads, RANK, ROPE), dtype=dtype,
        sm_scale=(128 + ROPE) ** -0.5, causal=True,
    )  # fmt: skip
    registry = default_registry()
    thunks: dict[str, Any] = {}
    for backend in registry.candidates(inp.problem.kind):
        if backend.capabilities.oracle or not isinstance(backend.check(inp.problem), Supported):
            continue
        plan = backend.plan(inp.problem)

        def thunk(b: Any = backend, p: Any = plan) -> object:
            return b.run(p, inp.query, inp.cache)

        thunks[backend.name] = thunk
    kv_bytes = batch * kv_len * (RANK + ROPE) * dtype.itemsize
    if (batch, q_len, kv_len) == DECODE_POINT:  # the limit, in the backends' own rounds
        thunks[MEMCPY] = _memcpy(kv_bytes)
    times = dict(timer(thunks))
    memcpy = times.pop(MEMCPY, None)
    selector = Selector(registry, timer=timer)
    auto = selector.plan(inp.problem, AUTO).backend
    measured = selector.plan(inp.problem, MEASURED).backend
    flops = 2 * batch * q_len * heads * kv_len * (2 * RANK + ROPE)
    fastest = min(times, key=lambda n: times[n])
    row: dict[str, Any] = {
        "batch": batch,
        "q_len": q_len,
        "kv_len": kv_len,
        "heads": heads,
        "seconds": times,
        "gbps": {n: kv_bytes / t / 1e9 for n, t in times.items()},
        "fastest": fastest,
        "best_gflops": flops / times[fastest] / 1e9,
        "auto": auto,
        "measured": measured,
        "measured_within_10pct": times[measured] <= 1.1 * times[fastest],
    }
    if memcpy is not None:
        row["memcpy_gbps"] = kv_bytes / memcpy / 1e9
    return row


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    grid = QUICK_GRID if quick else FULL_GRID
    points = list(product(grid["batch"], grid["q_len"], grid["kv_len"], grid["heads"]))
    if quick:
        points.extend(QUICK_EXTRA)
    timer = PerfCounterTimer(warmup=1, rounds=3 if quick else 5, min_seconds=0.5)
    largest = max(b * k for b, _, k, _ in points) * (RANK + ROPE) * 4
    memcpy = _memcpy_gbps(min(largest, 1 << 30), timer)
    matmul = _matmul_gflops(dtype, timer)
    rows = [_point(b, q, k, h, dtype=dtype, timer=timer) for b, q, k, h in points]
    decode = [r for r in rows if (r["batch"], r["q_len"], r["kv_len"]) == DECODE_POINT]
    best = max(decode, key=lambda r: max(r["gbps"].values()), default=None)
    best_decode = max(best["gbps"].values()) if best is not None else 0.0
    decode_memcpy = best["memcpy_gbps"] if best is not None else memcpy
    heads = min((r["heads"] for r in decode), default=0)
    flop_per_byte = 2 * heads * (2 * RANK + ROPE) / ((RANK + ROPE) * dtype.itemsize)
    return {
        "grid": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "memcpy_gbps": memcpy,
        "matmul_gflops": matmul,
        "measured_within_10pct": sum(r["measured_within_10pct"] for r in rows) / len(rows),
        "best_decode_gbps": best_decode,
        "decode_memcpy_gbps": decode_memcpy,
        "best_decode_gbps_ratio": best_decode / decode_memcpy,
        "decode_roofline_ratio": matmul / flop_per_byte / decode_memcpy if heads else 0.0,
    }
