"""``kvplane bench all``: order, budgets, one document and one table (no bench is run)."""

from __future__ import annotations

import argparse
import io
import sys

import pytest
from rich.console import Console

from kvplane.apps.bench import all as every
from kvplane.apps.bench.all import Outcome, bench_argv, run_all, run_process, table
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
    assert [t for _, t in calls] == [30.0, 75.0, 45.0, 60.0, 60.0]  # far from the total here
    assert [r["bench"] for r in doc["rows"]] == ["protocol", "attention", "vllm_pd"]
    assert set(doc["benches"]) == {"protocol", "attention", "vllm", "vllm_pd"}
    assert doc["errors"] == {"pd": "exit 1, no JSON result: boom"}
    assert doc["seconds"]["pd"] == 2.0 and "total" in doc["seconds"]
    assert doc["quick"] is True and doc["budgets_s"]["attention"] == 75.0
    full = run_all(["protocol"], False, fake)
    assert calls[-1] == ("protocol", float(every.FULL_BUDGET_S)) and full["errors"] == {}


def test_a_spent_quick_total_starts_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(every, "QUICK_TOTAL_S", 0.5)
    doc = run_all(["protocol"], True, lambda name, t: pytest.fail("started"))
    assert doc["errors"] == {"protocol": "not started: the quick total was spent"}
    assert doc["rows"] == [] and doc["budgets_s"] == {"protocol": 0.5}


def test_a_process_gives_its_last_json_line_or_why_not() -> None:
    code = "print('log {'); print('{\"rows\": [], \"a\": 1}')"
    got = run_process([sys.executable, "-c", code], 60.0)
    assert got.result == {"rows": [], "a": 1} and got.error is None
    got = run_process([sys.executable, "-c", "import sys; sys.exit('bad input')"], 60.0)
    assert got.result is None and got.error == "exit 1, no JSON result: bad input"
    got = run_process([sys.executable, "-c", "import time; time.sleep(60)"], 0.2)
    assert got.result is None and got.error == "over its 0 s budget"
    assert bench_argv("pd", True)[1:] == ["-m", "kvplane.cli", "bench", "pd", "--json", "--quick"]
    assert bench_argv("pd", False)[1:] == ["-m", "kvplane.cli", "bench", "pd", "--json"]


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
