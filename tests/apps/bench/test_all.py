"""``kvplane bench all``: order, budgets, one document and one table (no bench is run)."""

from __future__ import annotations

import argparse
import io
import sys
import time

import pytest
from rich.console import Console

from kvplane.apps.bench import all as every
from kvplane.apps.bench import pd
from kvplane.apps.bench.all import Outcome, bench_work, run_all, run_forked, table
from kvplane.apps.bench.command import BENCHES
from kvplane.cli import main

ROW = {
    "bench": "attention", "row": "decode_gbps_vs_readonly", "figure": 1.5, "unit": "GB/s",
    "limit": 6.0, "limit_name": "read-only pass", "repeats": 7, "ratio_min": 0.2,
    "ratio_median": 0.25, "ratio_max": 0.3, "stable": False, "target": None, "met": None,
}  # fmt: skip


def test_every_bench_runs_in_order_within_its_budget() -> None:
    calls: list[tuple[str, float]] = []

    def fake(name: str, timeout_s: float) -> Outcome:
        calls.append((name, timeout_s))
        if name == "pd":
            return Outcome(None, 2.0, "exit 1, no JSON result: boom")
        return Outcome({"rows": [dict(ROW, bench=name)] if name != "vllm" else [], "x": 1}, 1.0)

    doc = run_all(["vllm_pd", "vllm", "pd", "protocol", "attention"], True, fake)
    assert [name for name, _ in calls] == ["protocol", "attention", "pd", "vllm", "vllm_pd"]
    assert [t for _, t in calls] == [20.0, 50.0, 80.0, 100.0, 110.0]  # far from the total here
    assert [r["bench"] for r in doc["rows"]] == ["protocol", "attention", "vllm_pd"]
    assert set(doc["benches"]) == {"protocol", "attention", "vllm", "vllm_pd"}
    assert doc["errors"] == {"pd": "exit 1, no JSON result: boom"}
    assert doc["seconds"]["pd"] == 2.0 and "total" in doc["seconds"]
    assert doc["quick"] is True and doc["budgets_s"]["attention"] == 50.0
    full = run_all(["protocol"], False, fake)
    assert calls[-1] == ("protocol", float(every.FULL_BUDGET_S)) and full["errors"] == {}


def test_a_spent_quick_total_starts_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(every, "QUICK_TOTAL_S", 0.5)
    doc = run_all(["protocol"], True, lambda name, t: pytest.fail("started"))
    assert doc["errors"] == {"protocol": "not started: the quick total was spent"}
    assert doc["rows"] == [] and doc["budgets_s"] == {"protocol": 0.5}


def _sleep() -> dict[str, object]:
    time.sleep(60)
    return {}


def _crash() -> dict[str, object]:
    print("some log line")
    raise RuntimeError("bad input")


def test_a_forked_bench_gives_its_result_or_why_not() -> None:
    got = run_forked(lambda: {"rows": [], "a": 1}, 60.0)
    assert got.result == {"rows": [], "a": 1} and got.error is None
    got = run_forked(_crash, 60.0)
    assert got.result is None and got.error is not None
    assert got.error.startswith("exit 1, no JSON result: ")
    assert got.error.endswith("RuntimeError: bad input")
    got = run_forked(lambda: sys.exit("refused"), 60.0)
    assert got.result is None and got.error == "exit 1, no JSON result: refused"
    got = run_forked(_sleep, 0.2)
    assert got.result is None and got.error == "over its 0 s budget"


def test_a_bench_runs_with_its_options_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bool, argparse.Namespace]] = []

    def run(quick: bool, args: argparse.Namespace) -> dict[str, int]:
        seen.append((quick, args))
        return {"x": 1}

    monkeypatch.setattr(pd, "run", run)
    assert bench_work("pd", True)() == {"x": 1}
    quick, args = seen[0]
    assert quick is True and (args.quick, args.json) == (True, True)
    assert (args.transports, args.requests, args.no_model) == (None, None, False)


def test_the_table_shows_ratio_spread_and_missing_benches() -> None:
    doc = {"rows": [ROW, dict(ROW, row="r2", stable=True, target=0.8, met=True)],
           "errors": {"vllm": "over its 60 s budget"}, "quick": True}  # fmt: skip
    console = Console(file=io.StringIO(), width=200)
    console.print(table(doc))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "kvplane bench all --quick" in text
    assert "0.25 [0.2-0.3] 7 ~" in text and "0.25 [0.2-0.3] 7 " in text
    assert "1.5 GB/s" in text and "6 (read-only pass)" in text
    assert "yes" in text and "over its 60 s budget" in text


def test_the_cli_refuses_unknown_benches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "all", "--benches", "nope"]) == 2
    assert "unknown benches ['nope']" in capsys.readouterr().out
    args = argparse.Namespace(benches=[], quick=True, json=True)
    assert every.run(args, ()) == 0  # nothing to run: an empty document
    assert '"rows": []' in capsys.readouterr().out
    assert "all" not in BENCHES
