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
from kvplane.simulate.spec import PoissonSpec
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
    spec, calibration = calibrated(load_cluster(args.cluster), args)
    requests = load_requests(args, spec.poisson)
    start = time.perf_counter()
    result, _ = simulate(spec, requests)
    wall = time.perf_counter() - start
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
