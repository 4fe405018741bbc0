"""``kvplane simulate``: a PD cluster's KV movement simulated on a trace or Poisson arrivals.

Wiring only: flags to a :class:`~kvplane.simulate.ClusterSpec` and requests, the result as a
table or (``--json``) one JSON document. Bad input is ``kvplane: error: ...`` with exit 1.
Spec keys and the model: docs/simulate.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvplane.config import load_toml
from kvplane.errors import ConfigError
from kvplane.simulate import (
    ClusterSpec,
    Percentiles,
    Request,
    SimResult,
    load_cluster,
    poisson_requests,
    read_trace,
    simulate,
)
from kvplane.simulate.calibrate import calibrate
from kvplane.simulate.plot import draw_png, require_matplotlib
from kvplane.simulate.spec import PoissonSpec
from kvplane.simulate.sweep import (
    GOALS,
    SweepPoint,
    best_point,
    goal_of,
    parse_sweep,
    sweep_specs,
)
from kvplane.validators import require_int, require_number

NAME = "simulate"
HELP = "Simulate a PD cluster's KV movement (TTFT, tiers, transport) on a trace or Poisson load."

MAX_POISSON_REQUESTS = 10_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--trace", metavar="FILE", help="a Mooncake-format trace (JSON lines)")
    load.add_argument("--poisson", metavar="RATE,N", help="N requests arriving at RATE per second")
    parser.add_argument("--cluster", metavar="FILE", required=True, help="the cluster TOML")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--calibrate", metavar="FILE", help="`kvplane bench all --json` output: measured costs"
    )
    parser.add_argument(
        "--calibrate-transport", metavar="NAME", default=None,
        help="whose figures fill [transport] (default: the first bench pd ran)",
    )  # fmt: skip
    parser.add_argument(
        "--sweep", metavar="KEY=V1,V2,...", action="append", default=[],
        help="vary a cluster-file key (e.g. cluster.prefill_workers=4,6); repeat: cross product",
    )  # fmt: skip
    parser.add_argument(
        "--goal", default="ttft_p90", help="what --sweep minimises (default ttft_p90; "
        "ttft|tpot|queue|exposed_tail _ p50|p90|p99|mean|max)",
    )  # fmt: skip
    parser.add_argument("--png", metavar="FILE", help="draw the TTFT CDF and tier occupancy")


def parse_poisson(text: str) -> tuple[float, int]:
    """``"RATE,N"`` as ``(rate > 0, n >= 1)``; ``ConfigError`` naming the bad part."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ConfigError(f"--poisson must be RATE,N (e.g. 2.5,1000), got {text!r}")
    try:
        rate, n = float(parts[0]), int(parts[1])
    except ValueError:
        raise ConfigError(f"--poisson must be RATE,N (e.g. 2.5,1000), got {text!r}") from None
    rate = require_number("--poisson RATE", rate, above=0, error=ConfigError)
    n = require_int("--poisson N", n, min=1, max=MAX_POISSON_REQUESTS, error=ConfigError)
    return rate, n


def load_requests(args: argparse.Namespace, poisson: PoissonSpec) -> tuple[Request, ...]:
    """The requests ``--trace`` or ``--poisson`` names."""
    if args.trace is not None:
        return read_trace(args.trace)
    rate, n = parse_poisson(args.poisson)
    return poisson_requests(rate, n, poisson, args.seed)


def _ms(p: Percentiles) -> str:
    return f"{p.p50 * 1e3:,.1f} / {p.p90 * 1e3:,.1f} / {p.p99 * 1e3:,.1f}"


def result_table(result: SimResult, wall_s: float) -> Table:
    """The result as a two-column table (latencies in ms as p50 / p90 / p99)."""
    table = Table(title="kvplane simulate", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("requests completed", f"{result.completed:,} / {result.requests:,}"),
        ("makespan (simulated)", f"{result.makespan_s:,.1f} s"),
        ("TTFT ms p50/p90/p99", _ms(result.ttft_s)),
        ("TPOT ms p50/p90/p99", _ms(result.tpot_s)),
        ("prefill queue ms p50/p90/p99", _ms(result.queue_s)),
        ("exposed tail ms p50/p90/p99", _ms(result.exposed_tail_s)),
        ("overlap ratio", f"{result.overlap_ratio:.3f}"),
        ("prefix hit rate (tokens)", f"{result.prefix_hit_rate:.3f}"),
        ("transport GB", f"{result.transport_bytes / 1e9:,.2f}"),
        ("transfer amplification", f"{result.transfer_amplification:.3f}"),
        ("utilisation prefill / decode / link", f"{result.prefill_utilisation:.2f} / "
         f"{result.decode_utilisation:.2f} / {result.transport_utilisation:.2f}"),
    ]  # fmt: skip
    for t in result.tiers:
        rows.append(
            (
                f"tier {t.name} (x{t.instances}) hit / util",
                f"{t.hit_rate:.3f} / {t.utilisation:.2f}",
            )
        )
        rows.append(
            (
                f"tier {t.name} GB loaded / stored / evicted",
                f"{t.hit_bytes / 1e9:,.1f} / {t.stored_bytes / 1e9:,.1f} / "
                f"{t.evicted_bytes / 1e9:,.1f}",
            )
        )
    for f in result.failures:
        rows.append(
            (
                f"{f.role} {f.index} killed at {f.at_s:g} s",
                f"{f.rerouted} re-routed, released after {f.release_latency_s * 1e3:,.1f} ms",
            )
        )
    rows.append(("events / wall time", f"{result.events:,} / {wall_s:.2f} s"))
    for row in rows:
        table.add_row(*row)
    return table


def calibrated(spec: ClusterSpec, args: argparse.Namespace) -> tuple[ClusterSpec, dict[str, Any]]:
    """``spec`` calibrated from ``--calibrate`` (unchanged without it), and what was filled
    and what is missing (empty without it)."""
    if args.calibrate is None:
        return spec, {}
    try:
        doc = json.loads(Path(args.calibrate).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--calibrate {args.calibrate}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--calibrate {args.calibrate}: not a JSON object")
    got = calibrate(spec, doc, args.calibrate_transport)
    return got.spec, {"filled": list(got.filled), "missing": list(got.missing)}


def run(args: argparse.Namespace) -> int:
    if args.sweep:
        return run_sweep(args)
    goal_of(args.goal)
    if args.png is not None:
        require_matplotlib()
    spec, calibration = calibrated(load_cluster(args.cluster), args)
    requests = load_requests(args, spec.poisson)
    start = time.perf_counter()
    result, sim = simulate(spec, requests)
    wall = time.perf_counter() - start
    if args.png is not None:
        draw_png(sim, args.png)
    if args.json:
        doc = result.to_dict()
        if calibration:
            doc["calibration"] = calibration
        print(json.dumps(doc, indent=2))
        return 0
    console = Console()
    console.print(result_table(result, wall))
    for what in ("filled", "missing"):
        for line in calibration.get(what, ()):
            console.print(f"calibration {what}: {line}", highlight=False, markup=False)
    return 0


# -- --sweep -----------------------------------------------------------------------------------
def sweep_points(args: argparse.Namespace) -> list[SweepPoint]:
    """Every point of ``--sweep`` over ``--cluster`` simulated (all specs checked first; a
    trace is read once, Poisson requests drawn once per ``[poisson]`` shape)."""
    axes = parse_sweep(args.sweep)
    path = Path(args.cluster)
    specs = sweep_specs(load_toml(path), path.parent, axes)
    drawn: dict[PoissonSpec | None, tuple[Request, ...]] = {}
    points = []
    for setting, parsed in specs:
        spec, _ = calibrated(parsed, args)
        shape = None if args.trace is not None else spec.poisson
        if shape not in drawn:
            drawn[shape] = load_requests(args, spec.poisson)
        result, _ = simulate(spec, drawn[shape])
        points.append(SweepPoint(setting, result))
    return points


def sweep_table(points: list[SweepPoint], best: SweepPoint, goal: str) -> Table:
    """One row per point: its settings, TTFT p50/p90 (s), TPOT p90 (ms), prefix hit rate,
    prefill utilisation and the goal's figure (s), the best one marked ``*``."""
    table = Table(title=f"kvplane simulate --sweep (least {goal})")
    for key, _ in points[0].settings:
        table.add_column(key)
    for head in ("TTFT p50", "TTFT p90", "TPOT p90 ms", "hit", "util P", goal):
        table.add_column(head, justify="right")
    figure = GOALS[goal]
    for p in points:
        r = p.result
        table.add_row(
            *(str(v) for _, v in p.settings),
            f"{r.ttft_s.p50:,.3g}",
            f"{r.ttft_s.p90:,.3g}",
            f"{r.tpot_s.p90 * 1e3:,.1f}",
            f"{r.prefix_hit_rate:.3f}",
            f"{r.prefill_utilisation:.2f}",
            f"{figure(r):,.4g}" + (" *" if p is best else ""),
        )
    return table


def run_sweep(args: argparse.Namespace) -> int:
    """``--sweep``: the table of points and the best one (``--json``: points and best)."""
    if args.png is not None:
        raise ConfigError("--png draws one run: leave it out of a --sweep")
    goal_of(args.goal)
    points = sweep_points(args)
    best = best_point(points, args.goal)
    if args.json:
        doc = {"goal": args.goal, "points": [p.to_dict() for p in points], "best": best.to_dict()}
        print(json.dumps(doc, indent=2))
        return 0
    console = Console()
    console.print(sweep_table(points, best, args.goal))
    where = ", ".join(f"{k}={v}" for k, v in best.settings)
    console.print(
        f"best for {args.goal}: {where} ({GOALS[args.goal](best.result):,.4g} s)",
        highlight=False,
        markup=False,
    )
    return 0
