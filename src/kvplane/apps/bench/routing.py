"""``kvplane bench routing``: the Mooncake trace replayed through round-robin and cache-aware
routing, against real worker processes, with the oracle's hit rate beside each.

One run starts 2 prefill + 2 decode tiny-model workers (:mod:`.routing_cluster`) and one router
process per policy; the policies take turns in paired rounds (:mod:`.routing_rounds`: each
round a disjoint part of the prefix groups, replayed by both in alternating order at the same
compressed arrival times, on caches cold for each: its tokens are salted). The TTFT ratio is
the median of the rounds' ratios, with their spread; hit rates come from the workers' own
counters of loaded chunks, the oracle's from :mod:`.routing_oracle`; a line fitted to the
warm-ups' solo latencies says how much of one is prefill compute. Definitions:
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvplane.apps.bench.routing_cluster import MODEL
from kvplane.apps.bench.routing_oracle import Replay
from kvplane.apps.bench.routing_rounds import (
    BLOCK_TOKENS,
    HOST_SLOTS,
    POLICIES,
    ROUNDS,
    Replayed,
    Solo,
    Workload,
    play,
    round_orders,
)
from kvplane.apps.bench.routing_trace import load_trace, reused_groups
from kvplane.apps.bench.spread import Row, spread_of

NAME = "routing"
HELP = "Mooncake trace replay: cache-aware vs round-robin routing (hit rate, oracle, TTFT)."
TRACE = Path(__file__).resolve().parents[4] / "examples" / "traces" / "mooncake_synthetic.jsonl"
GROUPS = {True: 8, False: 60}
"""Prefix groups replayed, per ``--quick`` (48 and 308 requests of the shipped trace)."""
TARGET_HIT_VS_ORACLE = 0.9
TARGET_TTFT_P50_RATIO = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=TRACE, help="Mooncake JSON-lines trace")
    parser.add_argument("--groups", type=int, default=None, help="prefix groups replayed")
    parser.add_argument(
        "--host-slots", type=int, default=None, help="host-tier chunks per prefill worker"
    )
    parser.add_argument("--gap-ms", type=float, default=None, help="mean gap between sends")
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="paired rounds (policies alternate first)"
    )


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


def solo_fit(solos: Sequence[Solo], mean_tokens: float) -> dict[str, Any]:
    """The least-squares line ``latency = fixed + per_token x tokens`` through every warm-up's
    solo requests (cold: all computed; ``points``: their tokens and ms), and the share of a
    ``mean_tokens``-token prompt's solo latency that is prefill compute by that line
    (``compute_share``, a fixed cost below 0 counted as 0; near 0: fixed costs dominate and a
    cache hit cannot save much time)."""
    xs = [float(t) for s in solos for t in s.tokens]
    ys = [lat for s in solos for lat in s.latency_s]
    slope, fixed = statistics.linear_regression(xs, ys) if len(set(xs)) > 1 else (0.0, ys[0])
    compute = max(0.0, slope) * mean_tokens
    total = max(0.0, fixed) + compute
    return {
        "fixed_ms": round(fixed * 1e3, 2),
        "us_per_token": round(slope * 1e6, 2),
        "mean_prompt_tokens": round(mean_tokens, 1),
        "compute_share": round(compute / total, 4) if total > 0 else 0.0,
        "points": [[int(x), round(y * 1e3, 1)] for x, y in zip(xs, ys, strict=True)],
    }


def _rate(models: Sequence[Replay]) -> float:
    """The hit rate of several rounds' replays together (loaded tokens / prompt tokens)."""
    loaded = sum(sum(m.loaded) for m in models)
    return round(loaded * BLOCK_TOKENS / sum(m.prompt_tokens for m in models), 4)


def _pooled(
    policy: str, runs: Sequence[Replayed], parts: Sequence[Workload], oracles: Sequence[Replay]
) -> dict[str, Any]:
    """One policy's row over every round (:func:`policy_row`), with the oracle's hit rate and
    its assignment's replay on the exact models (None when a request's worker is unknown)."""
    mine = [r for r in runs if r.policy == policy]
    tokens = sum(o.prompt_tokens for o in oracles)
    ttft = [t for r in mine for t in r.ttft_ms]
    row = policy_row(policy, ttft, sum(r.hits for r in mine), tokens)
    row["oracle_hit_rate"] = _rate(oracles)
    row["round_ttft_p50_ms"] = [round(percentile(r.ttft_ms, 0.5), 2) for r in mine]
    models = [parts[r.round].assignment(r.where) for r in mine]
    where = [w for r in mine for w in r.where]
    row["requests_per_prefill"] = [sum(name == f"p{i}" for name in where) for i in range(2)]
    row["assignment_model_hit_rate"] = row["off_best"] = None
    if all(m is not None for m in models):
        got = [m for m in models if m is not None]
        row["assignment_model_hit_rate"] = _rate([m[0] for m in got])
        row["off_best"] = sum(m[1] for m in got)
    return row


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    groups = getattr(args, "groups", None) or GROUPS[quick]
    reqs = reused_groups(load_trace(getattr(args, "trace", TRACE)), groups)
    slots = getattr(args, "host_slots", None) or HOST_SLOTS[quick]
    rounds = getattr(args, "rounds", None) or ROUNDS
    w = Workload(tuple(reqs), slots, gap_ms=getattr(args, "gap_ms", None))
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-routing-") as work:
        solos, runs, at_s = play(Path(work), w, rounds)
    return result(solos, runs, w, at_s)


def result(
    solos: Sequence[Solo], runs: Sequence[Replayed], w: Workload, at_s: Sequence[Sequence[float]]
) -> dict[str, object]:
    """The JSON document: both policies' rows over every round, each round's TTFT p50 ratio,
    the targets (reported, not asserted; the TTFT one by the rounds' median ratio), the solo
    fit and the workload."""
    parts = w.split(len(at_s))
    models = [part.models() for part in parts]
    oracles = [m[0] for m in models]
    rr, ca = (_pooled(p, runs, parts, oracles) for p in POLICIES)
    for row in (rr, ca):  # every warm-up of the policy
        lat = [x for solo in solos if solo.policy == row["policy"] for x in solo.latency_s]
        row["solo_ms"] = round(statistics.mean(lat) * 1e3, 2)
    p50 = {(r.round, r.policy): percentile(r.ttft_ms, 0.5) for r in runs}
    ratios = [p50[r, POLICIES[1]] / p50[r, POLICIES[0]] for r in range(len(parts))]
    per_round = [
        {"round": r, "order": list(order), "requests": len(parts[r].requests),
         "ttft_p50_ratio": round(ratios[r], 4)}
        for r, order in enumerate(round_orders(len(parts)))
    ]  # fmt: skip
    ttft = spread_of(ratios)
    oracle = ca["oracle_hit_rate"]
    hit_vs_oracle = ca["hit_rate"] / oracle if oracle else None
    lines = [
        Row("routing", "ttft_p50_cache_aware_vs_round_robin", ca["ttft_p50_ms"], "ms",
            rr["ttft_p50_ms"], "round-robin", ttft, TARGET_TTFT_P50_RATIO, False).as_dict(),
    ]  # fmt: skip
    if hit_vs_oracle:
        lines.append(
            Row("routing", "hit_rate_cache_aware_vs_oracle", ca["hit_rate"], "fraction",
                oracle, "oracle (exact caches)", spread_of([hit_vs_oracle]),
                TARGET_HIT_VS_ORACLE, True).as_dict()
        )  # fmt: skip
    gaps = [b - a for times in at_s for a, b in itertools.pairwise(times)]
    prompts = w.prompts(0)
    return {
        "policies": [rr, ca],
        "rounds": per_round,
        "rows": lines,
        "round_robin_model_hit_rate": _rate([m[1] for m in models]),
        "solo_fit": solo_fit(solos, statistics.mean(len(p) for p in prompts)),
        "targets": {
            "hit_rate_vs_oracle": None if hit_vs_oracle is None else round(hit_vs_oracle, 4),
            "hit_rate_vs_oracle_min": TARGET_HIT_VS_ORACLE,
            "ttft_p50_ratio": round(ttft.ratio_median, 4),
            "ttft_p50_ratio_spread": ttft.fields(),
            "ttft_p50_ratio_pooled": round(ca["ttft_p50_ms"] / rr["ttft_p50_ms"], 4),
            "ttft_p50_ratio_max": TARGET_TTFT_P50_RATIO,
            "met": {
                "hit_rate": hit_vs_oracle is not None and hit_vs_oracle >= TARGET_HIT_VS_ORACLE,
                "ttft_p50": ttft.ratio_median <= TARGET_TTFT_P50_RATIO,
            },
        },
        "workload": {
            "model": MODEL,
            "requests": len(w.requests),
            "rounds": len(parts),
            "prompt_tokens": sum(len(p) for p in prompts),
            "block_tokens": BLOCK_TOKENS,
            "max_blocks": w.max_blocks,
            "host_slots_per_prefill": w.host_slots,
            "mean_gap_ms": round(statistics.mean(gaps) * 1e3, 2) if gaps else 0.0,
            "replayed_s": round(sum(t[-1] for t in at_s if t), 2),
        },
    }
