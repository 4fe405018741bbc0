"""``python -m kvplane.testing.chaos_serve``: serve's flags plus the fault flags, and their plan."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvplane.testing.chaos_serve import REORDER_S, build_parser, fault_plan, main
from kvplane.testing.cluster import child_env
from kvplane.testing.faults import FaultPlan, FrameFaults, TransferFaults


def test_the_chaos_flags_name_one_plan_and_serve_flags_still_parse() -> None:
    args = build_parser().parse_args(
        ["prefill", "--block-size", "8", "--chaos-seed", "5", "--chaos-fail", "0.25",
         "--chaos-late", "0.5", "--chaos-drop", "0.1", "--chaos-reorder", "0.2"]
    )  # fmt: skip
    assert args.block_size == 8
    assert fault_plan(args) == FaultPlan(
        seed=5,
        frames=FrameFaults(drop=0.1, reorder=0.2, reorder_s=REORDER_S),
        transfers=TransferFaults(fail=0.25, late=0.5),
    )
    clean = fault_plan(build_parser().parse_args(["decode"]))
    assert not clean.frames.any and not clean.transfers.any


def test_the_router_is_not_a_chaos_role() -> None:
    assert main(["router"]) == 2


def test_a_bad_flag_is_one_line_and_exit_1_not_a_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvplane.testing.chaos_serve", "decode", "--num-blocks", "0",
         "--insecure"],
        check=False, capture_output=True, text=True, timeout=120, env=child_env(None),
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("chaos_serve: error: "), proc.stderr
    assert "num_blocks" in lines[0]


def test_a_bad_fault_probability_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prefill", "--insecure", "--chaos-fail", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("chaos_serve: error: ") and "fail" in err[0]
