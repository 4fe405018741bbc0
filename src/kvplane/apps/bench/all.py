"""``kvplane bench all [--quick] [--json]``: every bench, one table of rows, one JSON document.

Runs each bench of :data:`~kvplane.apps.bench.command.BENCHES` as its own
``kvplane bench NAME --json`` process (a crash or a hang costs that bench only), each within its
time budget and, with ``--quick``, all within :data:`QUICK_TOTAL_S`; the vLLM benches last.
Collects every bench's ``rows`` (:class:`~kvplane.apps.bench.spread.Row` dicts) into one table.
Measures nothing itself. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

ORDER = ("protocol", "attention", "transport", "offload", "pd", "vllm", "vllm_pd")
"""Run order: the slow vLLM benches last, so a budget running out costs them, not the rest."""
QUICK_BUDGET_S = {"protocol": 30, "attention": 75, "transport": 60, "offload": 40, "pd": 45,
                  "vllm": 60, "vllm_pd": 60}  # fmt: skip
"""Seconds each bench may take with ``--quick`` (its process is stopped after)."""
FULL_BUDGET_S = 1800
"""Seconds each bench may take without ``--quick``."""
QUICK_TOTAL_S = 285.0
"""All of ``--quick`` within this: a bench gets no more than what is left of it."""
KILL_GRACE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="every bench quick, under 5 min")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--benches", nargs="*", default=None, help="run only these benches")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One bench's process: its result dict (None when it failed or ran out of time), the
    seconds it took, and why it has no result."""

    result: dict[str, Any] | None
    seconds: float
    error: str | None = None


def bench_argv(name: str, quick: bool) -> list[str]:
    """The command line running bench ``name`` in its own Python process, printing JSON."""
    return [sys.executable, "-m", "kvplane.cli", "bench", name, "--json"] + ["--quick"] * quick


def run_process(argv: Sequence[str], timeout_s: float) -> Outcome:
    """Run ``argv`` in a new session; its last stdout line that parses as a JSON object is the
    result. Past ``timeout_s`` its whole process group is stopped (SIGTERM, then SIGKILL after
    :data:`KILL_GRACE_S`) and the outcome says it ran out of time."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        return Outcome(None, time.perf_counter() - start, f"over its {timeout_s:.0f} s budget")
    seconds = time.perf_counter() - start
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(found, dict):
                return Outcome(found, seconds)
    tail = " | ".join(err.strip().splitlines()[-3:])
    return Outcome(None, seconds, f"exit {proc.returncode}, no JSON result: {tail}")


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """Stop the process group ``proc`` leads (it was started in a new session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.communicate(timeout=KILL_GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue


def run_all(
    names: Sequence[str], quick: bool, run: Callable[[str, float], Outcome] | None = None
) -> dict[str, Any]:
    """Every bench of ``names`` in :data:`ORDER`, each within its budget (``run(name,
    timeout_s)``, a process by default); the document ``{"rows", "benches", "seconds",
    "budgets_s", "errors", "quick"}``. A bench with no time left is not started."""
    go = run or (lambda name, timeout: run_process(bench_argv(name, quick), timeout))
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"rows": rows, "benches": {}, "seconds": {}, "budgets_s": {},
                           "errors": {}, "quick": quick}  # fmt: skip
    for name in sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        budget = float(QUICK_BUDGET_S.get(name, 60) if quick else FULL_BUDGET_S)
        if quick:
            budget = min(budget, QUICK_TOTAL_S - (time.perf_counter() - start))
        doc["budgets_s"][name] = round(max(budget, 0.0), 1)
        if budget <= 1.0:
            doc["errors"][name] = "not started: the quick total was spent"
            continue
        outcome = go(name, budget)
        doc["seconds"][name] = round(outcome.seconds, 1)
        if outcome.result is None:
            doc["errors"][name] = outcome.error
            continue
        doc["benches"][name] = outcome.result
        rows += [r for r in outcome.result.get("rows", ()) if isinstance(r, dict)]
    doc["seconds"]["total"] = round(time.perf_counter() - start, 1)
    return doc


def _num(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def table(doc: dict[str, Any]) -> Table:
    """The document's rows as one table: bench, row, figure, limit, ratio with its spread
    (``median [min-max] n``, ``~`` when not stable), target and met."""
    out = Table(title="kvplane bench all" + (" --quick" if doc.get("quick") else ""))
    for column in ("bench", "row", "figure", "limit", "ratio [min-max] n", "target", "met"):
        out.add_column(column, justify="left" if column in ("bench", "row", "limit") else "right")
    for r in doc["rows"]:
        ratio = (f"{_num(r.get('ratio_median'))} [{_num(r.get('ratio_min'))}-"
                 f"{_num(r.get('ratio_max'))}] {r.get('repeats')}"
                 + ("" if r.get("stable") else " ~"))  # fmt: skip
        met = {True: "yes", False: "no"}.get(r.get("met"), "-")
        out.add_row(str(r.get("bench")), str(r.get("row")),
                    f"{_num(r.get('figure'))} {r.get('unit', '')}",
                    f"{_num(r.get('limit'))} ({r.get('limit_name')})", ratio,
                    _num(r.get("target")), met)  # fmt: skip
    for name, why in doc["errors"].items():
        out.add_row(name, "(no result)", "-", str(why), "-", "-", "-")
    return out


def run(args: argparse.Namespace, benches: Sequence[str]) -> int:
    """``kvplane bench all``: 0 when every bench gave a result, else 1."""
    names = list(args.benches or benches)
    unknown = sorted(set(names) - set(benches))
    if unknown:
        print(f"unknown benches {unknown}; benches: {', '.join(benches)}")
        return 2
    doc = run_all(names, args.quick)
    if args.json:
        print(json.dumps(doc, default=str))
    else:
        Console().print(table(doc))
        print(f"seconds: {doc['seconds']}")
    return 1 if doc["errors"] else 0
