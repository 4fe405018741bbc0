"""The executor: runs a validated plan over any transport, reporting per-op progress.

:class:`PlanExecutor` validates plain plans once against both sides' regions (a
:class:`~kvplane.transfer.plan.ValidatedPlan` runs as it is), starts a
:class:`~kvplane.transfer.run.PlanRun` and drives it to a typed ``PlanResult``: FAILED and
IN_DOUBT are results, not exceptions (:class:`PlanRunAbortedError` when a progress callback
raises). It decides nothing about what moves. See docs/transports.md ("Running a plan").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvplane.errors import InvalidArgumentError, KVPlaneError, PlanError
from kvplane.ids import RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transfer.plan import TransferPlan, ValidatedPlan
from kvplane.transfer.progress import ExecMetrics, OpProgress, PlanResult
from kvplane.transfer.run import PlanRun
from kvplane.transports.base import Peer, Transport, XferKind
from kvplane.validators import require_int, require_number

_MIN_IDLE_S = 1e-5
"""The first back-off of :meth:`PlanExecutor.execute` after a step that changed nothing."""


class PlanRunAbortedError(KVPlaneError):
    """The ``on_progress`` callback of :meth:`PlanExecutor.execute` raised (the exception is
    this error's ``__cause__``). The run was cancelled and stepped until it ended; ``result``
    is how it ended: IN_DOUBT when a batch was still PENDING ``CANCEL_GRACE_S`` after the
    cancel -- a transport may then still be reading or writing the plan's memory, which must not
    be reused until that batch is known to have ended -- else FAILED (or DONE, when the callback
    raised on the events of the step that finished the run)."""

    def __init__(self, result: PlanResult) -> None:
        super().__init__(
            f"the progress callback raised; the run was cancelled and ended "
            f"{result.outcome.value} ({result.reason or 'no reason given'})"
        )
        self.result = result


class PlanExecutor:
    """Runs plans on one transport. ``metrics`` (injected) records ops, bytes, descriptors per op
    and run times; ``clock``/``sleep`` are injectable for deterministic tests."""

    def __init__(
        self,
        transport: Transport,
        *,
        metrics: MetricsRegistry | None = None,
        max_inflight: int = 8,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        max_idle_s: float = 1e-3,
    ) -> None:
        require_int("max_inflight", max_inflight, min=1)
        require_number("max_idle_s", max_idle_s, above=0)
        self.transport = transport
        self._metrics = ExecMetrics(metrics, transport.name) if metrics is not None else None
        self._max_inflight = max_inflight
        self._clock, self._sleep, self._max_idle_s = clock, sleep, max_idle_s

    def start(
        self,
        plans: TransferPlan | Sequence[TransferPlan] | ValidatedPlan,
        peer: Peer,
        *,
        local_regions: Mapping[RegionId, int] | None = None,
        kind: XferKind = XferKind.WRITE,
        deadline_s: float = 30.0,
        notify: bytes | None = None,
    ) -> PlanRun:
        """A run of ``plans`` that has submitted nothing yet.

        A :class:`~kvplane.transfer.plan.ValidatedPlan` runs as it is (``local_regions`` is
        not needed): it was validated once and nothing checks it again. Plain plans are
        validated here first (WRITE: sources against ``local_regions``, destinations against
        the peer's regions; READ: the reverse), ``PlanError`` if one is invalid. Several plans
        run as one (:meth:`~kvplane.transfer.plan.ValidatedPlan.join`): batch ``k`` moves op
        ``k`` of every plan, one result for all; no two may write the same destination byte or
        read the same source byte."""
        if not isinstance(kind, XferKind):
            raise InvalidArgumentError(f"kind must be an XferKind, got {kind!r}")
        if (
            isinstance(deadline_s, bool)
            or not isinstance(deadline_s, int | float)
            or not deadline_s > 0
        ):
            raise InvalidArgumentError(f"deadline_s must be a positive number, got {deadline_s!r}")
        if isinstance(plans, ValidatedPlan):
            validated = plans
        else:
            validated = self._validate(plans, peer, local_regions, kind)
        if notify is not None and validated.empty:
            raise PlanError("an empty plan has no op to carry the notification")
        return PlanRun(
            self.transport, validated, peer,
            kind=kind, deadline_s=float(deadline_s), max_inflight=self._max_inflight,
            notify=notify, clock=self._clock, metrics=self._metrics,
        )  # fmt: skip

    @staticmethod
    def _validate(
        plans: TransferPlan | Sequence[TransferPlan],
        peer: Peer,
        local_regions: Mapping[RegionId, int] | None,
        kind: XferKind,
    ) -> ValidatedPlan:
        """``plans`` validated for a run of ``kind`` and joined (see :meth:`start`)."""
        plans = (plans,) if isinstance(plans, TransferPlan) else tuple(plans)
        if not plans or any(not isinstance(p, TransferPlan) for p in plans):
            raise InvalidArgumentError("start needs a TransferPlan or a sequence of them")
        if local_regions is None:
            raise InvalidArgumentError("plans not validated yet need local_regions")
        sides = (local_regions, peer.regions)
        src, dst = sides if kind is XferKind.WRITE else sides[::-1]
        return ValidatedPlan.join([plan.validate(src, dst) for plan in plans])

    def execute(
        self,
        plan: TransferPlan | ValidatedPlan,
        peer: Peer,
        *,
        local_regions: Mapping[RegionId, int] | None = None,
        kind: XferKind = XferKind.WRITE,
        deadline_s: float = 30.0,
        notify: bytes | None = None,
        on_progress: Callable[[OpProgress], None] | None = None,
    ) -> PlanResult:
        """Run ``plan`` to completion (see :meth:`start`), reporting each op change.

        Returns the run's :class:`PlanResult` (DONE, FAILED or IN_DOUBT). If ``on_progress``
        raises, the run is cancelled and stepped until :class:`PlanRun` ends it -- every batch
        ended, or recorded IN_DOUBT once it stayed PENDING ``CANCEL_GRACE_S`` past the cancel --
        and :class:`PlanRunAbortedError` carrying that result is raised from the callback's
        exception. A ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``...)
        cancels and ends the run the same way and then propagates unchanged."""
        run = self.start(
            plan, peer, local_regions=local_regions, kind=kind, deadline_s=deadline_s, notify=notify
        )
        idle = _MIN_IDLE_S
        while True:
            events, idle = self._advance(run, idle)
            try:
                if on_progress is not None:
                    for event in events:
                        on_progress(event)
            except Exception as exc:
                raise PlanRunAbortedError(self._abort(run, idle)) from exc
            except BaseException:
                self._abort(run, idle)
                raise
            if run.done:
                return run.result()

    def _abort(self, run: PlanRun, idle: float) -> PlanResult:
        """Cancel ``run`` and step it (with the same back-off) until it has ended."""
        run.cancel("the progress callback raised")
        while not run.done:
            _, idle = self._advance(run, idle)
        return run.result()

    def _advance(self, run: PlanRun, idle: float) -> tuple[list[OpProgress], float]:
        """One step of ``run`` and the back-off before the next: when nothing changed, sleeps
        ``idle`` and returns it doubled (up to ``max_idle_s``); a change resets it."""
        events = run.step()
        if events or run.done:
            return events, _MIN_IDLE_S
        self._sleep(idle)
        return events, min(idle * 2, self._max_idle_s)
