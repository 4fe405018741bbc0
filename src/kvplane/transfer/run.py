"""A plan run: one plan executing on one transport, advanced by non-blocking steps.

:class:`PlanRun` owns the run's op states: :meth:`PlanRun.step` submits ops in order up to
``max_inflight``, polls each in-flight batch once and never blocks; the first failure, the
deadline or :meth:`PlanRun.cancel` stops it (a batch still pending :data:`CANCEL_GRACE_S` later
is IN_DOUBT). It never checks the plan again. See docs/transports.md ("Running a plan").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from kvplane.errors import (
    InvalidArgumentError,
    KVPlaneError,
    RemoteDisconnectError,
    TransferTimeoutError,
)
from kvplane.transfer.plan import ValidatedPlan
from kvplane.transfer.progress import (
    ExecMetrics,
    OpProgress,
    OpState,
    PlanOutcome,
    PlanResult,
    latest_end,
)
from kvplane.transports.base import FailureKind, Handle, Peer, Transport, XferKind, XferState

CANCEL_GRACE_S = 1.0
"""How long after the run stops (at the latest, its deadline) a cancelled batch may stay PENDING
before it is recorded IN_DOUBT."""


def _failure_of(exc: KVPlaneError) -> FailureKind:
    if isinstance(exc, RemoteDisconnectError):
        return FailureKind.REMOTE_DISCONNECT
    if isinstance(exc, TransferTimeoutError):
        return FailureKind.TIMEOUT
    if isinstance(exc, InvalidArgumentError):
        return FailureKind.LOCAL_ERROR
    return FailureKind.BACKEND_ERROR


class PlanRun:
    """One validated plan -- or several run jointly, op ``k`` of each in one batch -- executing
    on one transport; it trusts the plan and submits its vouched batches as they are. Created
    by :meth:`PlanExecutor.start`; advance it with
    :meth:`step` until :attr:`done`, then read :meth:`result`, whose ``ops`` are the run's
    batches. Not thread-safe."""

    def __init__(
        self,
        transport: Transport,
        validated: ValidatedPlan,
        peer: Peer,
        *,
        kind: XferKind,
        deadline_s: float,
        max_inflight: int,
        notify: bytes | None,
        clock: Callable[[], float],
        metrics: ExecMetrics | None,
    ) -> None:
        self._transport, self._peer, self._kind = transport, peer, kind
        self._ops = tuple((b.src, b.dst) for b in validated.batches)  # vouched: not re-checked
        self._num_bytes = validated.num_bytes
        self._notify, self._clock, self._metrics = notify, clock, metrics
        self._max_inflight = max_inflight
        self._started = clock()
        self._deadline = self._started + deadline_s
        n = len(self._ops)
        self._progress = [
            OpProgress(i, OpState.WAITING, 0, src.total_bytes)
            for i, (src, _) in enumerate(self._ops)
        ]
        self._handles: dict[int, Handle] = {}
        self._next = 0
        self._stop: tuple[FailureKind, str] | None = None
        self._give_up_at: float | None = None
        self._result: PlanResult | None = None
        self._num_ops = n
        self._ends: list[float | None] = []  # Poll.ended_at of every op that ended DONE

    @property
    def done(self) -> bool:
        return self._result is not None

    def progress(self) -> tuple[OpProgress, ...]:
        """Current state of every op."""
        return tuple(self._progress)

    def result(self) -> PlanResult:
        if self._result is None:
            raise InvalidArgumentError("the plan run has not finished; call step() until done")
        return self._result

    def cancel(self, reason: str = "cancelled by caller") -> None:
        """Stop submitting and cancel in-flight batches; the run finishes through ``step``."""
        self._halt(FailureKind.CANCELLED, reason)

    def step(self) -> list[OpProgress]:
        """Submit what the window allows, poll in-flight batches once; return changed ops."""
        if self._result is not None:
            return []
        events: list[OpProgress] = []
        now = self._clock()
        if self._stop is None and now >= self._deadline:
            self._halt(
                FailureKind.TIMEOUT, f"plan deadline passed after {now - self._started:.3f} s"
            )
        if self._stop is None:
            self._submit_ready(now, events)
        self._poll_inflight(events)
        if self._handles and self._give_up_at is not None and now >= self._give_up_at:
            for i in list(self._handles):
                reason = "still pending after cancel; cannot tell whether its bytes landed"
                self._set(i, OpState.IN_DOUBT, events, failure=FailureKind.TIMEOUT, reason=reason)
                del self._handles[i]
        if not self._handles and (self._stop is not None or self._next == self._num_ops):
            self._finish(now, events)
        return events

    # -- internals ---------------------------------------------------------------------------------
    def _set(
        self,
        i: int,
        state: OpState,
        events: list[OpProgress],
        *,
        bytes_done: int | None = None,
        failure: FailureKind | None = None,
        reason: str = "",
    ) -> None:
        old = self._progress[i]
        new = OpProgress(
            i,
            state,
            old.bytes_done if bytes_done is None else bytes_done,
            old.num_bytes,
            failure if failure is not None else old.failure,
            reason or old.reason,
        )
        if new != old:
            self._progress[i] = new
            events.append(new)

    def _halt(self, failure: FailureKind, reason: str) -> None:
        if self._stop is not None or self._result is not None:
            return
        self._stop = (failure, reason)
        self._give_up_at = min(self._clock(), self._deadline) + CANCEL_GRACE_S
        for handle in self._handles.values():
            with contextlib.suppress(KVPlaneError):  # best effort: polling decides the end state
                self._transport.cancel(handle)

    def _submit_ready(self, now: float, events: list[OpProgress]) -> None:
        last = self._num_ops - 1
        while self._next < self._num_ops and len(self._handles) < self._max_inflight:
            i = self._next
            notify = self._notify if i == last else None
            if notify is not None and any(p.state is not OpState.DONE for p in self._progress[:i]):
                return  # the notifying op waits until every other op has landed
            src, dst = self._ops[i]
            try:
                handle = self._transport.submit(
                    self._kind, src, dst, self._peer,
                    notify=notify, deadline_s=max(self._deadline - now, 1e-6),
                )  # fmt: skip
            except KVPlaneError as exc:
                self._set(
                    i, OpState.NOT_SUBMITTED, events, failure=_failure_of(exc), reason=str(exc)
                )
                self._next += 1
                self._halt(_failure_of(exc), f"op {i} was refused: {exc}")
                return
            if self._metrics is not None:
                self._metrics.descriptors.observe(len(src))
            self._handles[i] = handle
            self._next += 1
            self._set(i, OpState.PENDING, events)

    def _poll_inflight(self, events: list[OpProgress]) -> None:
        for i, handle in list(self._handles.items()):
            try:
                polled = self._transport.poll(handle)
            except KVPlaneError as exc:
                del self._handles[i]
                self._set(
                    i,
                    OpState.IN_DOUBT,
                    events,
                    failure=_failure_of(exc),
                    reason=f"poll failed: {exc}",
                )
                self._halt(_failure_of(exc), f"op {i}: poll failed: {exc}")
                continue
            if polled.state is XferState.PENDING:
                self._set(i, OpState.PENDING, events, bytes_done=polled.bytes_done)
                continue
            del self._handles[i]
            if polled.state is XferState.DONE:
                self._ends.append(polled.ended_at)
                self._set(i, OpState.DONE, events, bytes_done=self._progress[i].num_bytes)
                continue
            state = OpState.FAILED if polled.state is XferState.FAILED else OpState.IN_DOUBT
            failure = polled.failure or FailureKind.BACKEND_ERROR
            reason = polled.reason or state.value
            self._set(
                i, state, events, bytes_done=polled.bytes_done, failure=failure, reason=reason
            )
            self._halt(failure, f"op {i} ended {state.value}: {reason}")

    def _finish(self, now: float, events: list[OpProgress]) -> None:
        for i in range(self._next, self._num_ops):
            self._set(i, OpState.NOT_SUBMITTED, events)
        states = {p.state for p in self._progress}
        if states <= {OpState.DONE}:
            outcome = PlanOutcome.DONE
        elif OpState.IN_DOUBT in states:
            outcome = PlanOutcome.IN_DOUBT
        else:
            outcome = PlanOutcome.FAILED
        failure, reason = self._stop if self._stop is not None else (None, "")
        self._result = PlanResult(
            outcome=outcome,
            ops=tuple(self._progress),
            bytes_done=sum(p.bytes_done for p in self._progress),
            num_bytes=self._num_bytes,
            elapsed_s=now - self._started,
            failure=None if outcome is PlanOutcome.DONE else failure,
            reason="" if outcome is PlanOutcome.DONE else reason,
            ended_at=latest_end(self._ends) if outcome is PlanOutcome.DONE else None,
        )
        if self._metrics is not None:
            self._metrics.record(self._result)
