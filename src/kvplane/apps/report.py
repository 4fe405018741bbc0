"""The seed's metrics of a PD run as a table and a timeline picture; ``kvplane report DIR``.

:func:`summarize` reads worker counters and merged timelines; :func:`metrics_table` and
:func:`draw_timeline` render them from ``DIR/trace.json``. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvplane.errors import InvalidArgumentError
from kvplane.metrics import PREFIX, HistogramTotals, fallback_ratio, transfer_amplification
from kvplane.pipeline.timeline import TimelineEvent, request_times
from kvplane.pipeline.trace import Span, read_trace
from kvplane.simulate.result import Percentiles

NAME = "report"
HELP = "Print the metrics table of a saved demo run and redraw its timeline picture."

TIERS = ("host", "disk", "remote")
COLORS = {
    "prefill step": "tab:blue",
    "slice transfer": "tab:orange",
    "offload load": "tab:green",
    "offload store": "tab:purple",
    "decode": "tab:red",
}


def summarize(
    counters: Mapping[str, Mapping[str, int]], events: Iterable[TimelineEvent]
) -> dict[str, float]:
    """The seed's six metrics (and the run's offload hits) from per-worker counters (by worker
    name) and timeline events: overlap ratio and exposed tail per request, exact percentiles;
    blocks per op and release latency from the workers' histograms, interpolated percentiles;
    transfer amplification and fallback ratio as cluster-wide ratios."""
    by_request: dict[str, list[TimelineEvent]] = {}
    for e in events:
        by_request.setdefault(e.request_id, []).append(e)
    overlaps: list[float] = []
    tails: list[float] = []
    for evs in by_request.values():
        t = request_times(evs)
        if t.transfer_s > 0:
            overlaps.append(t.overlap_ratio)
        if t.exposed_tail_s is not None:
            tails.append(t.exposed_tail_s * 1e3)

    def total(key: str) -> int:
        return sum(int(c.get(key, 0)) for c in counters.values())

    blocks = HistogramTotals.of(PREFIX + "pd_blocks_per_op", counters.values())
    release = HistogramTotals.of(PREFIX + "pd_release_latency_seconds", counters.values())
    overlap, tail = Percentiles.of(overlaps), Percentiles.of(tails)
    out = {
        "requests_timed": float(len(tails)),
        "transfer_amplification": transfer_amplification(
            total("pd_bytes_moved"), total("pd_logical_bytes")
        ),
        **_quantiles("blocks_per_op", blocks, 1.0),
        "transfer_ops": float(blocks.count),
        "bytes_moved": float(total("pd_bytes_moved")),
        "overlap_ratio_mean": overlap.mean,
        "overlap_ratio_min": min(overlaps, default=0.0),
        "overlap_ratio_p50": overlap.p50,
        "overlap_ratio_p90": overlap.p90,
        "exposed_tail_ms_mean": tail.mean,
        "exposed_tail_ms_p50": tail.p50,
        "exposed_tail_ms_p90": tail.p90,
        "exposed_tail_ms_p99": tail.p99,
        "exposed_tail_ms_max": tail.max,
        **_quantiles("release_latency_ms", release, 1e3),
        "releases_after_failure": float(release.count),
        "attention_plans": float(total("attention_plans")),
        "fallback_ratio": fallback_ratio(total("attention_fallbacks"), total("attention_plans")),
    }
    for tier in TIERS:
        key = f"offload_hit_chunks_{tier}"
        if any(key in c for c in counters.values()):
            out[f"chunk_hits_{tier}"] = float(total(key))
    out["offload_hit_chunks"] = float(sum(out.get(f"chunk_hits_{t}", 0.0) for t in TIERS))
    return out


def _quantiles(key: str, h: HistogramTotals, scale: float) -> dict[str, float]:
    """``KEY_mean`` and ``KEY_p50/p90/p99`` of a summed histogram, times ``scale``."""
    out = {f"{key}_mean": h.mean * scale}
    out.update({f"{key}_p{q}": h.quantile(q / 100) * scale for q in (50, 90, 99)})
    return out


_ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("transfer amplification", ("transfer_amplification",), "{:.4f}"),
    ("blocks per transfer op: mean | p50 | p90 | p99",
     ("blocks_per_op_mean", "blocks_per_op_p50", "blocks_per_op_p90", "blocks_per_op_p99"),
     "{:.2f}"),
    ("overlap ratio: mean | min | p50 | p90",
     ("overlap_ratio_mean", "overlap_ratio_min", "overlap_ratio_p50", "overlap_ratio_p90"),
     "{:.3f}"),
    ("exposed tail ms: mean | p50 | p90 | p99 | max",
     ("exposed_tail_ms_mean", "exposed_tail_ms_p50", "exposed_tail_ms_p90",
      "exposed_tail_ms_p99", "exposed_tail_ms_max"), "{:.2f}"),
    ("release latency ms: mean | p50 | p90 | p99",
     ("release_latency_ms_mean", "release_latency_ms_p50", "release_latency_ms_p90",
      "release_latency_ms_p99"), "{:.2f}"),
    ("releases after a failure", ("releases_after_failure",), "{:.0f}"),
    ("attention fallback ratio", ("fallback_ratio",), "{:.3f}"),
    ("attention plans", ("attention_plans",), "{:.0f}"),
    ("requests timed", ("requests_timed",), "{:.0f}"),
    ("transfer ops", ("transfer_ops",), "{:.0f}"),
    ("bytes moved", ("bytes_moved",), "{:,.0f}"),
    ("chunk hits: host", ("chunk_hits_host",), "{:.0f}"),
    ("chunk hits: disk", ("chunk_hits_disk",), "{:.0f}"),
    ("chunk hits: remote", ("chunk_hits_remote",), "{:.0f}"),
)  # fmt: skip
"""Table rows: label, the keys shown (``|``-separated), format; a row shows when its first
key is present."""


def metrics_table(metrics: Mapping[str, float], title: str = "kvplane PD metrics") -> Table:
    """The metrics as a two-column rich table (rows for the metrics present)."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, keys, fmt in _ROWS:
        if keys[0] in metrics:
            table.add_row(label, " | ".join(fmt.format(metrics.get(k, 0.0)) for k in keys))
    return table


def draw_timeline(spans: Sequence[Span], path: Path, title: str = "kvplane PD timeline") -> None:
    """One row per (request, worker), bars per span kind, time in ms since the first span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not spans:
        raise InvalidArgumentError("no spans to draw")
    t0 = min(s.start for s in spans)
    rows = sorted({(s.request_id, s.worker) for s in spans}, key=lambda r: (_order(r[0]), r[1]))
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, max(3.0, 0.32 * len(rows) + 1.5)))
    for s in spans:
        y = index[(s.request_id, s.worker)]
        lane = 0.2 if s.name == "slice transfer" else -0.2
        ax.broken_barh(
            [((s.start - t0) * 1e3, max((s.end - s.start) * 1e3, 0.05))],
            (y + lane - 0.18, 0.36),
            facecolors=COLORS.get(s.name, "tab:gray"),
            edgecolor="black",
            linewidth=0.3,
        )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r} @ {w}" for r, w in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(
        handles=[Patch(color=c, label=n) for n, c in COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _order(request_id: str) -> tuple[int, str]:
    digits = "".join(ch for ch in request_id if ch.isdigit())
    return (int(digits) if digits else 0, request_id)


def print_report(metrics: Mapping[str, float], console: Console, extra: Mapping[str, Any]) -> None:
    """The table, then the run's headline lines (parity, requests) when known."""
    console.print(metrics_table(metrics))
    if "parity" in extra:
        verdict = "PASS" if extra["parity"] else "FAIL"
        console.print(f"parity: {verdict} ({extra.get('requests', '?')} requests)")


# -- the command -----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a directory written by `kvplane demo --out DIR`")
    parser.add_argument(
        "--json", action="store_true",
        help="print one JSON object (the metrics and the run's headline) instead of the table",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    spans, other = read_trace(root / "trace.json")
    metrics = other.get("metrics")
    if not isinstance(metrics, dict):
        raise InvalidArgumentError(f"{root / 'trace.json'} carries no metrics summary")
    values = {str(k): float(v) for k, v in metrics.items()}
    draw_timeline(spans, root / "timeline.png")
    if args.json:
        head = {k: other[k] for k in ("parity", "requests", "concurrency") if k in other}
        print(json.dumps({**head, "metrics": values, "timeline": str(root / "timeline.png")}))
        return 0
    console = Console()
    print_report(values, console, other)
    console.print(f"timeline: {root / 'timeline.png'} ({len(spans)} spans)")
    return 0
