"""``kvplane bench all [--quick] [--json]``: every bench, one table of rows, one JSON document.

Runs each bench of :data:`~kvplane.apps.bench.command.BENCHES` in its own process, a fork of
this one (its modules already imported: no interpreter start, 5-10 s a bench on a loaded host;
a crash or a hang costs that bench only), each within its time budget and, with ``--quick``,
all within :data:`QUICK_TOTAL_S`; the vLLM benches last.
Collects every bench's ``rows`` (:class:`~kvplane.apps.bench.spread.Row` dicts) into one table.
Measures nothing itself. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

ORDER = ("protocol", "attention", "transport", "offload", "pd", "windows", "vllm", "vllm_pd")
"""Run order: the slow vLLM benches last, so a budget running out costs them, not the rest."""
QUICK_BUDGET_S = {"protocol": 20, "attention": 50, "transport": 60, "offload": 50, "pd": 80,
                  "windows": 30, "vllm": 100, "vllm_pd": 110}  # fmt: skip
"""Seconds each bench may take with ``--quick`` (its process is stopped after): about 1.5x
what each took at load 2-9 on a 2-core host (4, 32-42, 45-53, 34, 56, 12-20, 55-80, 77 s)."""
FULL_BUDGET_S = 1800
"""Seconds each bench may take without ``--quick``."""
QUICK_TOTAL_S = 288.0
"""All of ``--quick`` within this: a bench gets no more than what is left of it (this
process's own start, before the clock, stays under 5 minutes with it)."""
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


def bench_work(name: str, quick: bool) -> Callable[[], dict[str, Any]]:
    """Bench ``name``'s ``run(quick, args)`` with its options' defaults, as
    ``kvplane bench NAME [--quick] --json`` would call it; nothing runs until it is called."""
    module = importlib.import_module(f"kvplane.apps.bench.{name}")
    parser = argparse.ArgumentParser()
    extra = getattr(module, "add_arguments", None)
    if extra is not None:
        extra(parser)
    args = parser.parse_args([])
    args.quick, args.json = quick, True

    def work() -> dict[str, Any]:
        result: dict[str, Any] = module.run(quick, args)
        return result

    return work


def run_forked(work: Callable[[], dict[str, Any]], timeout_s: float) -> Outcome:
    """Call ``work`` in a forked child leading a new session, its stdout and stderr to a file;
    its return value (JSON) is the result. Past ``timeout_s`` the child's process group is
    stopped (SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`) and the outcome says it ran out
    of time; a child that raised or exited gives the last lines of its output."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-all-") as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "output"
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(work, out, log)
        status = _wait(pid, start + timeout_s)
        seconds = time.perf_counter() - start
        if status is None:
            return Outcome(None, seconds, f"over its {timeout_s:.0f} s budget")
        if status == 0 and out.exists():
            found = json.loads(out.read_text())
            if isinstance(found, dict):
                return Outcome(found, seconds)
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        tail = " | ".join(lines[-3:])
        return Outcome(None, seconds, f"exit {status}, no JSON result: {tail}")


def _child(work: Callable[[], dict[str, Any]], out: Path, log: Path) -> NoReturn:
    """The forked child of :func:`run_forked`: run ``work``, write its result to ``out``."""
    code = 1
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)  # noqa: SIM115
        text = json.dumps(work(), default=str)
        out.write_text(text)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, deadline: float) -> int | None:
    """The exit status of child ``pid`` (a signal's number negated), or None when it ran past
    ``deadline`` (then its process group is stopped)."""
    while time.perf_counter() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    _stop_group(pid)
    return None


def _stop_group(pid: int) -> None:
    """Stop the process group child ``pid`` leads, then reap it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        end = time.perf_counter() + KILL_GRACE_S
        while time.perf_counter() < end:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
            time.sleep(0.05)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def run_all(
    names: Sequence[str], quick: bool, run: Callable[[str, float], Outcome] | None = None
) -> dict[str, Any]:
    """Every bench of ``names`` in :data:`ORDER`, each within its budget (``run(name,
    timeout_s)``, a forked process by default); the document ``{"rows", "benches", "seconds",
    "budgets_s", "errors", "quick"}``. A bench with no time left is not started."""
    go = run or (lambda name, timeout: run_forked(bench_work(name, quick), timeout))
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
