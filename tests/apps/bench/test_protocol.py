"""``kvplane bench protocol`` runs end to end on a small configuration (no timing asserts)."""

from __future__ import annotations

import argparse
import json

from kvplane.apps.bench import protocol
from kvplane.cli import main


def test_protocol_bench_reports_the_issue_keys_and_holds_its_sessions() -> None:
    result = protocol.run(True, argparse.Namespace(sessions=50))
    for key in ("rtt_us", "raw_rtt_us", "ratio", "sessions_per_s"):
        assert isinstance(result[key], float) and result[key] > 0, key  # type: ignore[operator]
    assert result["concurrent_sessions"] == 50
    assert result["session_errors"] == 0
    assert result["rtt_dropped_frames"] == 0
    assert result["ratio_of_medians"] == result["rtt_us"] / result["raw_rtt_us"]  # type: ignore[operator]
    rows = result["rows"]
    assert isinstance(rows, list) and len(rows) == 1
    (row,) = rows
    assert row["ratio_median"] == round(result["ratio"], 4)  # type: ignore[call-overload]
    assert row["row"] == "rtt_us_vs_raw_zmq" and row["target"] == 1.5
    assert 5 <= row["repeats"] <= 12
    assert result["round_trips"] == row["repeats"] * 250


def test_the_cli_lists_and_runs_it(capsys: object) -> None:
    assert main(["bench", "protocol", "--quick", "--json", "--sessions", "20"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert json.loads(out)["concurrent_sessions"] == 20
