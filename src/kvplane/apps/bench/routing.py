"""``kvplane bench routing``: the Mooncake trace replayed through round-robin and cache-aware
routing, against real worker processes, with the oracle's hit rate beside each.

One run starts 2 prefill + 2 decode tiny-model workers (:mod:`.routing_cluster`) and, per
policy, a router process; each policy replays the same scaled requests (:mod:`.routing_trace`)
at the same compressed arrival times, on caches cold for it (its tokens are salted: no chunk of
another policy's run or of any warm-up matches). Hit rates come from the workers' own counters
of loaded chunks; the oracle's from :mod:`.routing_oracle`. Definitions: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.apps.bench.routing_cluster import (
    BLOCK_SIZE,
    BLOCKS_PER_CHUNK,
    MODEL,
    ClusterSpec,
    PolicyRouter,
    RoutingCluster,
)
from kvplane.apps.bench.routing_oracle import Replay, oracle_choice, replay, router_round_robin
from kvplane.apps.bench.routing_trace import (
    TraceRequest,
    arrivals_s,
    load_trace,
    prompt_tokens,
    reused_groups,
)
from kvplane.apps.bench.spread import Row, spread_of
from kvplane.chunks import ChunkSpec
from kvplane.models import tiny_config

NAME = "routing"
HELP = "Mooncake trace replay: cache-aware vs round-robin routing (hit rate, oracle, TTFT)."
TRACE = Path(__file__).resolve().parents[4] / "examples" / "traces" / "mooncake_synthetic.jsonl"
POLICIES = ("round-robin", "cache-aware")
GROUPS = {True: 8, False: 60}
"""Prefix groups replayed, per ``--quick`` (48 and 308 requests of the shipped trace)."""
BLOCK_TOKENS = BLOCK_SIZE * BLOCKS_PER_CHUNK
"""Tokens per trace block once scaled (512 -> 32: one offload chunk per hash id)."""
MAX_BLOCKS = 64
"""Hash ids kept per prompt (2,048 tokens; the tiny model's positions end at 4,096)."""
HOST_SLOTS = {True: 128, False: 512}
"""Host-tier chunks per prefill worker, per ``--quick`` (4 MiB and 16 MiB of tiny-model KV):
both workers together hold 66% (quick) and 41% (full) of the slice's distinct chunks, so
capacity matters as it does at scale."""
LOAD = 0.7
"""Offered load: the mean gap between sends is the mean solo latency / ``LOAD`` (a request
in service 70% of the time: the two cores run all five processes, so about one prefill at a
time is what this host sustains)."""
WARMUP_QUANTILES = (0.1, 0.3, 0.5, 0.7, 0.9)
"""The warm-up prompts, by length quantile of the slice (after one uncounted request)."""
TARGET_HIT_VS_ORACLE = 0.9
TARGET_TTFT_P50_RATIO = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=TRACE, help="Mooncake JSON-lines trace")
    parser.add_argument("--groups", type=int, default=None, help="prefix groups replayed")
    parser.add_argument(
        "--host-slots", type=int, default=None, help="host-tier chunks per prefill worker"
    )
    parser.add_argument("--gap-ms", type=float, default=None, help="mean gap between sends")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` (linear between order statistics, as numpy's)."""
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def policy_row(policy: str, ttft_ms: Sequence[float], hits: int, tokens: int) -> dict[str, Any]:
    """One policy's figures: measured hit rate (``hits`` chunks loaded over ``tokens`` prompt
    tokens), TTFT quantiles and spread (ms)."""
    return {
        "policy": policy,
        "hit_rate": round(hits * BLOCK_TOKENS / tokens, 4),
        "ttft_p50_ms": round(percentile(ttft_ms, 0.5), 2),
        "ttft_p90_ms": round(percentile(ttft_ms, 0.9), 2),
        "ttft_p10_ms": round(percentile(ttft_ms, 0.1), 2),
        "ttft_max_ms": round(max(ttft_ms), 2),
        "requests": len(ttft_ms),
        "loaded_chunks": hits,
    }


def _warm(router: PolicyRouter, prompts: Sequence[Sequence[int]], salt: int) -> float:
    """Serve one uncounted solo request, then one per :data:`WARMUP_QUANTILES` length quantile
    of ``prompts``, each prompt's first token changed (no chunk shared with the replay or
    another warm-up); the mean latency of the counted ones, s (a solo service time)."""
    by_length = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    picks = [by_length[0]] + [by_length[int(q * (len(by_length) - 1))] for q in WARMUP_QUANTILES]
    solo = []
    for i, n in enumerate(picks):
        tokens = list(prompts[n])
        tokens[0] = (tokens[0] + 1 + i) % tiny_config(MODEL).vocab_size
        solo.append(router.serve_serially([tokens], f"warm{salt}.{i}.")[0].ttft_ms / 1e3)
    return statistics.mean(solo[1:])


@dataclass(frozen=True, slots=True)
class Workload:
    """What one comparison replays: trace ``requests`` with prompts cut at ``max_blocks`` hash
    ids, ``host_slots`` chunks per prefill worker, sends ``gap_ms`` apart on average (None:
    the first policy's mean solo latency / :data:`LOAD`; ``serial``: each request sent once
    the one before it was answered)."""

    requests: tuple[TraceRequest, ...]
    host_slots: int = HOST_SLOTS[True]
    max_blocks: int = MAX_BLOCKS
    gap_ms: float | None = None
    serial: bool = False

    def prompts(self, salt: int) -> list[list[int]]:
        """The scaled prompts, their blocks drawn with ``salt`` (0: the oracle's)."""
        vocab = tiny_config(MODEL).vocab_size
        return [
            prompt_tokens(r, BLOCK_TOKENS, vocab, salt=salt, max_blocks=self.max_blocks)
            for r in self.requests
        ]

    def models(self) -> tuple[Replay, Replay]:
        """The oracle's replay and the router's round-robin one, on exact cache models."""
        base, spec = self.prompts(0), ChunkSpec(BLOCK_SIZE, BLOCKS_PER_CHUNK)
        oracle = replay(base, 2, self.host_slots, spec, oracle_choice)
        return oracle, replay(base, 2, self.host_slots, spec, router_round_robin(2, 2))

    def assignment_fields(self, where: Sequence[str | None]) -> dict[str, Any]:
        """What the exact models say of a run whose request ``i`` went to prefill worker
        ``where[i]`` (``p0``/``p1``): ``assignment_model_hit_rate`` (its hit rate served one
        at a time: the measured one differs by what concurrency did) and ``off_best`` (requests
        sent to a worker that would load fewer chunks than the other); None for both when a
        request's worker is unknown; ``requests_per_prefill``: how many went to ``p0``, ``p1``."""
        per = [sum(name == f"p{i}" for name in where) for i in range(2)]
        if any(name not in ("p0", "p1") for name in where):
            return {
                "assignment_model_hit_rate": None,
                "off_best": None,
                "requests_per_prefill": per,
            }
        assigned = [int(str(name)[1:]) for name in where]
        off: list[int] = []

        def choose(n: int, loadable: Sequence[int]) -> int:
            off.append(int(loadable[assigned[n]] < max(loadable)))
            return assigned[n]

        spec = ChunkSpec(BLOCK_SIZE, BLOCKS_PER_CHUNK)
        got = replay(self.prompts(0), 2, self.host_slots, spec, choose)
        return {
            "assignment_model_hit_rate": round(got.hit_rate, 4),
            "off_best": sum(off),
            "requests_per_prefill": per,
        }


def compare(work: Path, w: Workload) -> tuple[list[dict[str, Any]], list[float]]:
    """Replay ``w`` through each policy of :data:`POLICIES` on one cluster: one row per policy
    (:func:`policy_row`, with the oracle's hit rate) and the send times used (s)."""
    oracle, _rr = w.models()
    tokens = oracle.prompt_tokens
    num_blocks = 4 * w.max_blocks * BLOCKS_PER_CHUNK + 64
    at_s = None if w.gap_ms is None else arrivals_s(w.requests, w.gap_ms / 1e3)
    out: list[dict[str, Any]] = []
    cluster = RoutingCluster(work, ClusterSpec(w.host_slots, num_blocks, step=512))
    try:
        for k, policy in enumerate(POLICIES):
            prompts = w.prompts(k + 1)  # cold: no chunk of another policy's run matches
            router = cluster.router(policy)
            try:
                solo_s = _warm(router, prompts, k + 1)
                if at_s is None:  # the first policy's solo latency sets both schedules
                    at_s = arrivals_s(w.requests, solo_s / LOAD)
                before = router.hit_chunks()
                if w.serial:
                    served = router.serve_serially(prompts, f"{policy}.")
                else:
                    served = router.replay(prompts, at_s, f"{policy}.")
                hits = router.hit_chunks() - before
                where = router.prefill_of([s.request_id for s in served])
            finally:
                router.close()
            row = policy_row(policy, [s.ttft_ms for s in served], hits, tokens)
            row["oracle_hit_rate"] = round(oracle.hit_rate, 4)
            row["solo_ms"] = round(solo_s * 1e3, 2)
            row.update(w.assignment_fields(where))
            out.append(row)
    finally:
        cluster.close()
    return out, at_s or []


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    groups = getattr(args, "groups", None) or GROUPS[quick]
    reqs = reused_groups(load_trace(getattr(args, "trace", TRACE)), groups)
    slots = getattr(args, "host_slots", None) or HOST_SLOTS[quick]
    w = Workload(tuple(reqs), slots, gap_ms=getattr(args, "gap_ms", None))
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-routing-") as work:
        rows, at_s = compare(Path(work), w)
    return result(rows, w, at_s)


def result(rows: list[dict[str, Any]], w: Workload, at_s: Sequence[float]) -> dict[str, object]:
    """The JSON document: both policies' rows, the targets (reported, not asserted) and the
    workload."""
    rr, ca = rows
    oracle = ca["oracle_hit_rate"]
    hit_vs_oracle = ca["hit_rate"] / oracle if oracle else None
    ttft_ratio = ca["ttft_p50_ms"] / rr["ttft_p50_ms"]
    lines = [
        Row("routing", "ttft_p50_cache_aware_vs_round_robin", ca["ttft_p50_ms"], "ms",
            rr["ttft_p50_ms"], "round-robin", spread_of([ttft_ratio]),
            TARGET_TTFT_P50_RATIO, False).as_dict(),
    ]  # fmt: skip
    if hit_vs_oracle:
        lines.append(
            Row("routing", "hit_rate_cache_aware_vs_oracle", ca["hit_rate"], "fraction",
                oracle, "oracle (exact caches)", spread_of([hit_vs_oracle]),
                TARGET_HIT_VS_ORACLE, True).as_dict()
        )  # fmt: skip
    gaps = [b - a for a, b in itertools.pairwise(at_s)]
    return {
        "policies": rows,
        "rows": lines,
        "round_robin_model_hit_rate": round(w.models()[1].hit_rate, 4),
        "targets": {
            "hit_rate_vs_oracle": None if hit_vs_oracle is None else round(hit_vs_oracle, 4),
            "hit_rate_vs_oracle_min": TARGET_HIT_VS_ORACLE,
            "ttft_p50_ratio": round(ttft_ratio, 4),
            "ttft_p50_ratio_max": TARGET_TTFT_P50_RATIO,
            "met": {
                "hit_rate": hit_vs_oracle is not None and hit_vs_oracle >= TARGET_HIT_VS_ORACLE,
                "ttft_p50": ttft_ratio <= TARGET_TTFT_P50_RATIO,
            },
        },
        "workload": {
            "model": MODEL,
            "requests": len(w.requests),
            "prompt_tokens": sum(len(p) for p in w.prompts(0)),
            "block_tokens": BLOCK_TOKENS,
            "max_blocks": w.max_blocks,
            "host_slots_per_prefill": w.host_slots,
            "mean_gap_ms": round(statistics.mean(gaps) * 1e3, 2) if gaps else 0.0,
            "replayed_s": round(at_s[-1], 2) if at_s else 0.0,
        },
    }
