"""Progress and results of a plan run: per-op states, the run's outcome, and their metrics.

An op is WAITING until submitted, PENDING while its batch is in flight, and ends DONE, FAILED,
IN_DOUBT (the transport cannot tell whether its bytes landed) or NOT_SUBMITTED (the run stopped
first: none of its bytes moved). A run's :class:`PlanResult` is DONE only if every op is DONE,
IN_DOUBT if any op is IN_DOUBT, else FAILED.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplane.metrics import COUNT_BUCKETS, MetricsRegistry
from kvplane.transports.base import FailureKind


class OpState(enum.Enum):
    WAITING = "waiting"
    """Not submitted yet (the run is still going)."""
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    IN_DOUBT = "in_doubt"
    NOT_SUBMITTED = "not_submitted"
    """The run stopped before this op was submitted: none of its bytes moved."""


class PlanOutcome(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    IN_DOUBT = "in_doubt"


@dataclass(frozen=True, slots=True)
class OpProgress:
    """State of one op: bytes known landed of ``num_bytes``, and why it failed if it did."""

    op_index: int
    state: OpState
    bytes_done: int
    num_bytes: int
    failure: FailureKind | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PlanResult:
    """How a run ended: the outcome, every op's final progress and the first failure."""

    outcome: PlanOutcome
    ops: tuple[OpProgress, ...]
    bytes_done: int
    num_bytes: int
    elapsed_s: float
    failure: FailureKind | None = None
    reason: str = ""
    ended_at: float | None = field(default=None, compare=False)
    """For a DONE run: when its transport saw the last op end (``Poll.ended_at``, the
    transport's ``time.monotonic()``), which a caller stepping the run later learns only then.
    None when the run did not end DONE or a transport did not say."""

    @property
    def ok(self) -> bool:
        return self.outcome is PlanOutcome.DONE


def latest_end(ends: Sequence[float | None]) -> float | None:
    """The latest of several end times; None if any is unknown, or there are none."""
    known = [t for t in ends if t is not None]
    return max(known) if known and len(known) == len(ends) else None


class ExecMetrics:
    """The executor's metrics in an injected registry (``kvplane_plan_*``)."""

    def __init__(self, registry: MetricsRegistry, transport: str) -> None:
        self.transport = transport
        self.bytes = registry.counter(
            "plan_exec_bytes", "Bytes of plan ops that completed", ["transport"]
        )
        self.ops = registry.counter(
            "plan_exec_ops", "Plan ops by final state", ["transport", "state"]
        )
        self.descriptors = registry.histogram(
            "plan_descriptors_per_op", "Descriptors per submitted plan op", buckets=COUNT_BUCKETS
        )
        self.seconds = registry.histogram(
            "plan_exec_seconds", "Wall time of plan runs", ["transport", "outcome"]
        )

    def record(self, result: PlanResult) -> None:
        for op in result.ops:
            self.ops.labels(self.transport, op.state.value).inc()
        self.bytes.labels(self.transport).inc(
            sum(op.num_bytes for op in result.ops if op.state is OpState.DONE)
        )
        self.seconds.labels(self.transport, result.outcome.value).observe(result.elapsed_s)
