"""Run results and the executor's metrics, recorded exactly from a result."""

from __future__ import annotations

from kvplane.metrics import MetricsRegistry
from kvplane.transfer.progress import (
    ExecMetrics,
    OpProgress,
    OpState,
    PlanOutcome,
    PlanResult,
    latest_end,
)
from kvplane.transports.base import FailureKind


def test_result_ok_and_metrics_record() -> None:
    ops = (
        OpProgress(0, OpState.DONE, 100, 100),
        OpProgress(1, OpState.FAILED, 10, 50, FailureKind.TIMEOUT, "deadline"),
        OpProgress(2, OpState.NOT_SUBMITTED, 0, 70),
    )
    failed = PlanResult(PlanOutcome.FAILED, ops, 110, 220, 0.25, FailureKind.TIMEOUT, "deadline")
    assert not failed.ok
    assert PlanResult(PlanOutcome.DONE, ops[:1], 100, 100, 0.1).ok
    registry = MetricsRegistry()
    metrics = ExecMetrics(registry, "tcp")
    metrics.record(failed)
    labels = {"transport": "tcp"}
    assert registry.value("plan_exec_bytes", labels, "_total") == 100.0
    for state, count in (("done", 1), ("failed", 1), ("not_submitted", 1), ("in_doubt", 0)):
        got = registry.value("plan_exec_ops", {**labels, "state": state}, "_total")
        assert got == count
    assert registry.value("plan_exec_seconds", {**labels, "outcome": "failed"}, "_sum") == 0.25
    # asking again for the same metrics reuses them (one registry, many executors)
    ExecMetrics(registry, "shm").record(failed)
    assert registry.value("plan_exec_bytes", {"transport": "shm"}, "_total") == 100.0


def test_latest_end_needs_every_end() -> None:
    assert latest_end([3.0, 5.0, 4.0]) == 5.0
    assert latest_end([3.0, None]) is None  # one op's end unknown: the run's is too
    assert latest_end([]) is None
