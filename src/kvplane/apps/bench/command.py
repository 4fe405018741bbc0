"""``kvplane bench NAME [--quick] [--json]``: run one benchmark module of ``apps/bench``;
``kvplane bench all`` runs every one (:mod:`~kvplane.apps.bench.all`).

A bench module exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` (optional extra flags) and
``run(quick: bool, args) -> dict[str, object]``. Every bench measures kvplane against the physical
limit (memcpy, raw socket, raw file I/O, the raw third-party engine) in the same run and reports
ratios; ``--quick`` is small (``kvplane bench all --quick`` runs them all in under 5 minutes);
``--json`` prints the result dict as one JSON object.
Its ``rows`` (:class:`~kvplane.apps.bench.spread.Row` dicts) are its lines in ``bench all``.
"""

from __future__ import annotations

import argparse
import importlib
import json
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.table import Table

NAME = "bench"
HELP = "Run a benchmark (ratios against the physical limit measured in the same run)."

BENCHES: tuple[str, ...] = (
    "attention", "offload", "protocol", "transport", "pd", "windows", "vllm", "vllm_pd",
)  # fmt: skip
"""Module names under ``kvplane.apps.bench.common``; each engineer appends their bench here."""
ON_REQUEST: tuple[str, ...] = ("vllm_offload", "routing")
"""Benches with a command of their own that ``bench all`` leaves out: their ``--quick`` does
not fit its budget (``vllm_offload``: five engine starts, 2-4 min alone on 2 cores;
``routing``: six worker processes and two trace replays)."""


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"kvplane.apps.bench.{name}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    every = _load("all")
    p = sub.add_parser("all", help="every bench: one table, one JSON document")
    every.add_arguments(p)
    p.set_defaults(_all=every)
    for name in BENCHES + ON_REQUEST:
        module = _load(name)
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        p.add_argument("--quick", action="store_true", help="small sizes (see docs/benchmarks.md)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        extra = getattr(module, "add_arguments", None)
        if extra is not None:
            extra(p)
        p.set_defaults(_bench=module)


def _print_table(name: str, result: dict[str, Any]) -> None:
    table = Table(title=f"kvplane bench {name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        shown = f"{value:.4g}" if isinstance(value, float) else json.dumps(value, default=str)
        table.add_row(key, shown if len(shown) < 120 else shown[:117] + "...")
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    every: ModuleType | None = getattr(args, "_all", None)
    if every is not None:
        status: int = every.run(args, BENCHES)
        return status
    module: ModuleType | None = getattr(args, "_bench", None)
    if module is None:
        names = ", ".join(BENCHES + ON_REQUEST) or "(none yet)"
        print(f"usage: kvplane bench BENCH|all [--quick] [--json]; benches: {names}")
        return 2
    result: dict[str, Any] = module.run(args.quick, args)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        _print_table(module.NAME, result)
    return 0
