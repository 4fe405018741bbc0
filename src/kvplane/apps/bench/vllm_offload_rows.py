"""The vllm-offload bench's arithmetic: issue 34's four figures as rows, from engine samples.

Pure functions over the offload harness's phase results (plain dicts of seconds, milliseconds
and token ids): each figure against its reference in the same run, with the spread of its
paired ratios, the issue's hand-measured figure as target and ``tokens_equal``. Runs no engine
and times nothing (``apps/bench/vllm_offload`` does).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvplane.apps.bench.spread import Row, spread_of

BENCH = "vllm-offload"
CLAIMS = {"tokens_per_s": 3.7, "ttft_p90": 0.3, "host_vs_vllm_ms": 3.0, "restart": 0.13}
"""Issue 34's hand-measured figures, each row's target: tokens/s ratio (>=), TTFT p90 ratio
(<=), host hit minus vLLM hit (ms, <=), a restart hit over recompute (<=, the range's top)."""
PLAIN = "plain vLLM, same prompts and KV blocks"


def p90(values: Sequence[float]) -> float:
    """The 90th percentile, linear between the closest ranks (at least 2 values)."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def _ratios(ours: Sequence[float], limit: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(ours, limit, strict=True)]


def samples(ours: Sequence[float], limit: Sequence[float]) -> dict[str, list[float]]:
    """A row's per-repeat figures, rounded to 0.1: ``{"ours", "limit"}``."""
    return {"ours": [round(x, 1) for x in ours], "limit": [round(x, 1) for x in limit]}


def time_row(
    row: str, ours_ms: Sequence[float], limit_ms: Sequence[float], limit_name: str,
    target: float | None,
) -> Row:  # fmt: skip
    """A TTFT row from paired per-repeat samples: medians as figure and limit, the ratio the
    median of ``ours_ms[i] / limit_ms[i]`` (lower is better)."""
    return Row(bench=BENCH, row=row, figure=statistics.median(ours_ms), unit="ms",
               limit=statistics.median(limit_ms), limit_name=limit_name,
               spread=spread_of(_ratios(ours_ms, limit_ms)), target=target,
               higher_is_better=False)  # fmt: skip


def pressure_rows(
    plain: Sequence[dict[str, Any]], ours: Sequence[dict[str, Any]], warmup_rounds: int
) -> list[dict[str, Any]]:
    """Figures 1 and 2 from both engines' ``pressure`` rounds (``{"seconds", "ttft_ms",
    "tokens"}`` each, the same prompts in the same order), the first ``warmup_rounds`` left
    out: output tokens/s (pooled over the timed rounds; ratio per round, higher is better) and
    TTFT p90 (of all timed requests; ratio of each round's p90s); ``per_round`` the rounds'
    figures. ``tokens_equal``: every request of every round decoded the same tokens in both
    engines."""
    base, mine = plain[warmup_rounds:], ours[warmup_rounds:]
    equal = len(plain) == len(ours) and all(
        a["tokens"] == b["tokens"] for a, b in zip(plain, ours, strict=True)
    )

    def out_tokens(r: dict[str, Any]) -> int:
        return sum(len(t) for t in r["tokens"])

    def rate(rounds: Sequence[dict[str, Any]]) -> float:
        return sum(out_tokens(r) for r in rounds) / float(sum(r["seconds"] for r in rounds))

    rates = ([rate([r]) for r in mine], [rate([r]) for r in base])
    tails = ([p90(r["ttft_ms"]) for r in mine], [p90(r["ttft_ms"]) for r in base])
    speed = Row(bench=BENCH, row="tokens_per_s_vs_plain", figure=rate(mine), unit="tok/s",
                limit=rate(base), limit_name=PLAIN, spread=spread_of(_ratios(*rates)),
                target=CLAIMS["tokens_per_s"], higher_is_better=True)  # fmt: skip
    ttft, ttft_base = ([t for r in rs for t in r["ttft_ms"]] for rs in (mine, base))
    tail = Row(bench=BENCH, row="ttft_p90_vs_plain", figure=p90(ttft), unit="ms",
               limit=p90(ttft_base), limit_name=PLAIN, spread=spread_of(_ratios(*tails)),
               target=CLAIMS["ttft_p90"], higher_is_better=False)  # fmt: skip
    return [
        speed.as_dict() | {"tokens_equal": equal, "per_round": samples(*rates)},
        tail.as_dict() | {"tokens_equal": equal, "per_round": samples(*tails)},
    ]


def hit_row(phase: dict[str, Any]) -> dict[str, Any]:
    """Figure 3 from the kvplane engine's ``prefix_hit`` phase: a host hit's TTFT against
    vLLM's own prefix-cache hit of the same prompt (no target as a ratio); ``diff_ms`` the
    median per-repeat difference, against the claim. ``tokens_equal``: per repeat, the miss
    and both hits decoded the same tokens, and every ``reset_prefix_cache()`` succeeded."""
    ours, theirs = phase["kvplane_hit_ms"], phase["vllm_hit_ms"]
    row = time_row("ttft_host_hit_vs_vllm_hit", ours, theirs, "vLLM's own prefix-cache hit", None)
    diff = statistics.median(a - b for a, b in zip(ours, theirs, strict=True))
    equal = all(t[0] == t[1] == t[2] for t in phase["tokens"]) and all(phase["reset"])
    return row.as_dict() | {
        "tokens_equal": equal,
        "samples_ms": samples(ours, theirs),
        "diff_ms": round(diff, 3),
        "diff_target_ms": CLAIMS["host_vs_vllm_ms"],
        "diff_met": diff <= CLAIMS["host_vs_vllm_ms"],
    }


def restart_row(tier: str, stored: dict[str, Any], phase: dict[str, Any]) -> dict[str, Any]:
    """Figure 4 for ``tier`` from engine B's ``restart_hit`` phase: the hit's TTFT against a
    recompute of a new prompt as long, in the same engine B. ``tokens_equal``: each hit decoded
    what engine A (``stored``, its ``store`` phase) decoded for that prompt."""
    row = time_row(f"ttft_{tier}_hit_vs_recompute", phase["hit_ms"], phase["fresh_ms"],
                   "recompute after the restart", CLAIMS["restart"])  # fmt: skip
    equal = phase["tokens"] == stored["tokens"]
    return row.as_dict() | {
        "tokens_equal": equal,
        "samples_ms": samples(phase["hit_ms"], phase["fresh_ms"]),
    }


def hit_chunks(metrics: dict[str, float]) -> dict[str, float]:
    """``{tier: chunks}`` kvplane loaded into vLLM, from a scheduler side's metric samples."""
    head = "kvplane_vllm_hit_chunks_total{tier="
    return {k[len(head) : -1]: v for k, v in metrics.items() if k.startswith(head)}
