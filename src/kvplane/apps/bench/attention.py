"""``kvplane bench attention``: MLA backends over a workload grid, against a read-only pass.

Times every viable non-oracle backend, ``auto`` and ``measured`` at each grid point with one
interleaved timer; at the decode point, times the fastest backend in paired repeats against
the fastest read-only pass over the same KV bytes (the limit), torch ``copy_`` and a matmul
(second rows). Limits and estimator: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from itertools import product
from typing import Any

import torch

from kvplane.apps.bench import read_pass
from kvplane.apps.bench.spread import SETTLE_S, Row, repeat_until_stable, spread, spread_of
from kvplane.attention import (
    AUTO,
    MEASURED,
    MLAKVCache,
    MLAShape,
    PerfCounterTimer,
    Selector,
    default_registry,
)
from kvplane.attention.synthetic import make_mla_inputs, synthetic_metadata
from kvplane.errors import InvalidArgumentError
from kvplane.verdicts import Supported

NAME = "attention"
HELP = "MLA attention backends: time, GB/s vs a read-only pass, auto/measured choices."
RANK, ROPE, PAGE_SIZE = 512, 64, 16
FULL_GRID = {"batch": (1, 8, 32), "q_len": (1, 4), "kv_len": (128, 1024, 8192), "heads": (16, 128)}
QUICK_GRID = {"batch": (1, 8), "q_len": (1, 4), "kv_len": (1024,), "heads": (16,)}
QUICK_EXTRA = ((32, 1, 8192, 16),)  # the decode point the bandwidth target is defined at
DECODE_POINT = (32, 1, 8192)
MATMUL = 1024
REPEATS = {True: (5, 10, 6.0), False: (5, 40, 20.0)}
"""Paired decode repeats by ``quick``: (min_repeats, max_repeats, cap_s)."""
MIN_SECONDS = {True: 0.2, False: 0.5}
"""Seconds each grid point's interleaved timer keeps sampling, by ``quick``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="KV/query dtype"
    )


def _memcpy(src: torch.Tensor) -> Callable[[], object]:
    """The second limit: one torch ``copy_`` of ``src`` into a fresh buffer of its size."""
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _memcpy_gbps(nbytes: int, timer: PerfCounterTimer) -> float:
    copy = _memcpy(torch.ones(nbytes // 4))
    return nbytes / timer({"copy": copy})["copy"] / 1e9


def _matmul(dtype: torch.dtype) -> Callable[[], object]:
    a = torch.randn(MATMUL, MATMUL).to(dtype)
    return lambda: torch.mm(a, a)


def _matmul_gflops(dtype: torch.dtype, timer: PerfCounterTimer) -> float:
    return 2 * MATMUL**3 / timer({"mm": _matmul(dtype)})["mm"] / 1e9


def _point(
    batch: int, q_len: int, kv_len: int, heads: int, *, dtype: torch.dtype, timer: PerfCounterTimer
) -> tuple[dict[str, Any], Callable[[], object], torch.Tensor]:
    """A grid row, the fastest backend's thunk and the KV cache's data it reads."""
    meta, pages = synthetic_metadata([q_len] * batch, [kv_len] * batch, PAGE_SIZE, shuffle_seed=0)
    inp = make_mla_inputs(
        meta, pages, MLAShape(heads, RANK, ROPE), dtype=dtype,
        sm_scale=(128 + ROPE) ** -0.5, causal=True,
    )  # fmt: skip
    registry = default_registry()
    thunks: dict[str, Callable[[], object]] = {}
    for backend in registry.candidates(inp.problem.kind):
        if backend.capabilities.oracle or not isinstance(backend.check(inp.problem), Supported):
            continue
        plan = backend.plan(inp.problem)

        def thunk(b: Any = backend, p: Any = plan) -> object:
            return b.run(p, inp.query, inp.cache)

        thunks[backend.name] = thunk
    kv_bytes = batch * kv_len * (RANK + ROPE) * dtype.itemsize
    times = dict(timer(thunks))
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
    if not isinstance(inp.cache, MLAKVCache):  # make_mla_inputs makes one; mypy needs it said
        raise InvalidArgumentError(f"expected an MLA cache, got {type(inp.cache).__name__}")
    return row, thunks[fastest], inp.cache.data


def _sample(fn: Callable[[], object]) -> float:
    time.sleep(SETTLE_S)  # no run inherits the previous one's spinning OpenMP threads
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _decode(
    row: dict[str, Any], ours: Callable[[], object], kv: torch.Tensor, *, quick: bool,
    dtype: torch.dtype, timer: PerfCounterTimer,
) -> dict[str, Any]:  # fmt: skip
    """The decode point's paired repeats: its fastest backend against the fastest read-only
    pass over the same KV bytes, torch ``copy_`` of them and a matmul, one of each per repeat
    (order rotated), until the read-only ratio is stable; the headline fields and rows."""
    kv_bytes: int = row["batch"] * row["kv_len"] * (RANK + ROPE) * dtype.itemsize
    data = kv.reshape(-1).view(torch.uint8)[:kv_bytes]
    name = read_pass.fastest(data, timer)
    limits = {"read": read_pass.passes(data)[name], "copy": _memcpy(data), "mm": _matmul(dtype)}
    seconds: dict[str, list[float]] = {"ours": [], "read": [], "copy": [], "mm": []}
    for fn in (ours, *limits.values()):
        fn()  # warm-up

    def pair() -> tuple[float, float]:
        order = [("ours", ours), *limits.items()]
        turn = len(seconds["ours"]) % len(order)
        for key, fn in order[turn:] + order[:turn]:
            seconds[key].append(_sample(fn))
        return seconds["ours"][-1], seconds["read"][-1]

    low, high, cap = REPEATS[quick]
    repeat_until_stable(pair, min_repeats=low, max_repeats=high, cap_s=cap, settle_s=0.0)
    us = seconds["ours"]
    flops = 2 * row["batch"] * row["q_len"] * row["heads"] * row["kv_len"] * (2 * RANK + ROPE)
    mm_flops = 2 * MATMUL**3

    def gbps(s: list[float]) -> float:
        return kv_bytes / statistics.median(s) / 1e9

    mm_ratios = [(flops / o) / (mm_flops / m) for o, m in zip(us, seconds["mm"], strict=True)]
    backend = f"{row['fastest']}, batch {row['batch']}, kv_len {row['kv_len']}"
    rows = [
        Row("attention", "decode_gbps_vs_readonly", gbps(us), "GB/s", gbps(seconds["read"]),
            f"read-only pass ({name})", spread(us, seconds["read"]), None, True),
        Row("attention", "decode_gbps_vs_copy", gbps(us), "GB/s", gbps(seconds["copy"]),
            "torch copy_", spread(us, seconds["copy"]), None, True),
        Row("attention", "decode_gflops_vs_matmul", flops / statistics.median(us) / 1e9,
            "GFLOP/s", mm_flops / statistics.median(seconds["mm"]) / 1e9,
            f"torch.mm {MATMUL}^3", spread_of(mm_ratios), None, True),
    ]  # fmt: skip
    return {"backend": backend, "readonly_pass": name, "seconds": seconds, "rows": rows}


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    grid = QUICK_GRID if quick else FULL_GRID
    points = list(product(grid["batch"], grid["q_len"], grid["kv_len"], grid["heads"]))
    if quick:
        points.extend(QUICK_EXTRA)
    timer = PerfCounterTimer(warmup=1, rounds=3 if quick else 5, min_seconds=MIN_SECONDS[quick])
    largest = max(b * k for b, _, k, _ in points) * (RANK + ROPE) * 4
    memcpy = _memcpy_gbps(min(largest, 1 << 30), timer)
    matmul = _matmul_gflops(dtype, timer)
    # quick's extra points: backends 10x apart (the slowest takes seconds a call), one
    # cold call each -- a warm-up would not change which is fastest
    extra = PerfCounterTimer(warmup=0, rounds=1)
    rows: list[dict[str, Any]] = []
    decode: dict[str, Any] | None = None
    for b, q, k, h in points:
        point_timer = extra if quick and (b, q, k, h) in QUICK_EXTRA else timer
        row, best, kv = _point(b, q, k, h, dtype=dtype, timer=point_timer)
        rows.append(row)
        is_decode = (b, q, k) == DECODE_POINT
        if is_decode and (decode is None or h < decode["heads"]):  # the most bandwidth-bound
            decode = {"heads": h, **_decode(row, best, kv, quick=quick, dtype=dtype, timer=timer)}
        del best, kv
    return _result(rows, decode, dtype=dtype, memcpy=memcpy, matmul=matmul)


def _result(
    rows: list[dict[str, Any]], decode: dict[str, Any] | None, *, dtype: torch.dtype,
    memcpy: float, matmul: float,
) -> dict[str, object]:  # fmt: skip
    """The JSON result: the grid, the start-of-run limits and the decode point's fields."""
    out: dict[str, object] = {
        "grid": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "memcpy_gbps": memcpy,
        "matmul_gflops": matmul,
        "measured_within_10pct": sum(r["measured_within_10pct"] for r in rows) / len(rows),
    }
    if decode is None:
        return {**out, "rows": []}
    read, copy, flops = decode["rows"]
    flop_per_byte = 2 * decode["heads"] * (2 * RANK + ROPE) / ((RANK + ROPE) * dtype.itemsize)
    return {
        **out,
        "decode_backend": decode["backend"],
        "readonly_pass": decode["readonly_pass"],
        "decode_repeats": read.spread.repeats,
        "best_decode_gbps": read.figure,
        "decode_readonly_gbps": read.limit,
        "decode_memcpy_gbps": copy.limit,
        "best_decode_gbps_ratio": read.spread.ratio_median,
        "best_decode_gbps_vs_copy": copy.spread.ratio_median,
        "decode_matmul_gflops": flops.limit,
        "decode_roofline_ratio": flops.limit / flop_per_byte / read.limit,
        "rows": [r.as_dict() for r in decode["rows"]],
    }
