"""The seed's metrics of a PD run as a table and a timeline picture; ``kvplane report DIR``.

:func:`summarize` reads worker counters and merged timelines; :func:`metrics_table` and
:func:`draw_timeline` render them from ``DIR/trace.json``. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvplane.errors import InvalidArgumentError
from kvplane.metrics import fallback_ratio, transfer_amplification
from kvplane.pipeline.timeline import TimelineEvent, request_times
from kvplane.pipeline.trace import Span, read_trace

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
    """The seed's metrics from per-worker counters (by worker name) and timeline events."""
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

    ops = total("pd_blocks_per_op_count")
    out = {
        "requests_timed": float(len(tails)),
        "overlap_ratio_mean": statistics.fmean(overlaps) if overlaps else 0.0,
        "overlap_ratio_min": min(overlaps, default=0.0),
        "exposed_tail_ms_mean": statistics.fmean(tails) if tails else 0.0,
        "exposed_tail_ms_max": max(tails, default=0.0),
        "transfer_amplification": transfer_amplification(
            total("pd_bytes_moved"), total("pd_logical_bytes")
        ),
        "blocks_per_op_mean": total("pd_blocks_per_op_sum") / ops if ops else 0.0,
        "transfer_ops": float(ops),
        "bytes_moved": float(total("pd_bytes_moved")),
        "attention_plans": float(total("attention_plans")),
        "fallback_ratio": fallback_ratio(total("attention_fallbacks"), total("attention_plans")),
    }
    for tier in TIERS:
        key = f"offload_hit_chunks_{tier}"
        if any(key in c for c in counters.values()):
            out[f"chunk_hits_{tier}"] = float(total(key))
    out["offload_hit_chunks"] = float(sum(out.get(f"chunk_hits_{t}", 0.0) for t in TIERS))
    return out


_ROWS = (
    ("overlap_ratio_mean", "overlap ratio (mean)", "{:.3f}"),
    ("overlap_ratio_min", "overlap ratio (min)", "{:.3f}"),
    ("exposed_tail_ms_mean", "exposed tail (mean)", "{:.2f} ms"),
    ("exposed_tail_ms_max", "exposed tail (max)", "{:.2f} ms"),
    ("transfer_amplification", "transfer amplification", "{:.4f}"),
    ("blocks_per_op_mean", "blocks per transfer op (mean)", "{:.2f}"),
    ("transfer_ops", "transfer ops", "{:.0f}"),
    ("bytes_moved", "bytes moved", "{:,.0f}"),
    ("chunk_hits_host", "chunk hits: host", "{:.0f}"),
    ("chunk_hits_disk", "chunk hits: disk", "{:.0f}"),
    ("chunk_hits_remote", "chunk hits: remote", "{:.0f}"),
    ("attention_plans", "attention plans", "{:.0f}"),
    ("fallback_ratio", "attention fallback ratio", "{:.3f}"),
)


def metrics_table(metrics: Mapping[str, float], title: str = "kvplane PD metrics") -> Table:
    """The metrics as a two-column rich table (rows for the metrics present)."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, label, fmt in _ROWS:
        if key in metrics:
            table.add_row(label, fmt.format(metrics[key]))
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


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    spans, other = read_trace(root / "trace.json")
    metrics = other.get("metrics")
    if not isinstance(metrics, dict):
        raise InvalidArgumentError(f"{root / 'trace.json'} carries no metrics summary")
    console = Console()
    print_report({str(k): float(v) for k, v in metrics.items()}, console, other)
    draw_timeline(spans, root / "timeline.png")
    console.print(f"timeline: {root / 'timeline.png'} ({len(spans)} spans)")
    return 0
