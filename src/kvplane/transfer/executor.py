"""The executor: validates a plan, then runs it over any transport, reporting per-op progress.

:meth:`PlanExecutor.start` validates the plan against the local regions and the peer's regions
(``PlanError`` before any byte moves) and returns a :class:`~kvplane.transfer.run.PlanRun` that
has submitted nothing. Given several plans it runs them as one: a transfer unit built from plans
of several pools (a final slice's KV and its whole-only records) then costs one transport batch
per op position instead of one per plan. :meth:`PlanExecutor.execute` drives a run to its end
with a short backoff, calling ``on_progress`` for every op change, and returns the typed
:class:`~kvplane.transfer.progress.PlanResult` — FAILED and IN_DOUBT are results, not exceptions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvplane.errors import InvalidArgumentError, PlanError
from kvplane.ids import RegionId
from kvplane.metrics import MetricsRegistry
from kvplane.transfer.plan import TransferPlan, check_disjoint
from kvplane.transfer.progress import ExecMetrics, OpProgress, PlanResult
from kvplane.transfer.run import PlanRun
from kvplane.transports.base import Peer, Transport, XferKind


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
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise InvalidArgumentError(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        if not max_idle_s > 0:
            raise InvalidArgumentError(f"max_idle_s must be > 0, got {max_idle_s!r}")
        self.transport = transport
        self._metrics = ExecMetrics(metrics, transport.name) if metrics is not None else None
        self._max_inflight = max_inflight
        self._clock, self._sleep, self._max_idle_s = clock, sleep, max_idle_s

    def start(
        self,
        plans: TransferPlan | Sequence[TransferPlan],
        peer: Peer,
        *,
        local_regions: Mapping[RegionId, int],
        kind: XferKind = XferKind.WRITE,
        deadline_s: float = 30.0,
        notify: bytes | None = None,
    ) -> PlanRun:
        """Validate a plan (WRITE: sources local, destinations the peer's; READ: the reverse)
        and return a run that has submitted nothing yet; ``PlanError`` if the plan is invalid.
        Several plans run as one: batch ``k`` moves op ``k`` of every plan
        (:func:`~kvplane.transfer.plan.joint_ops`), one result for all; each plan is validated,
        and no two may write the same destination byte or read the same source byte."""
        plans = (plans,) if isinstance(plans, TransferPlan) else tuple(plans)
        if not plans or any(not isinstance(p, TransferPlan) for p in plans):
            raise InvalidArgumentError("start needs a TransferPlan or a sequence of them")
        if not isinstance(kind, XferKind):
            raise InvalidArgumentError(f"kind must be an XferKind, got {kind!r}")
        if (
            isinstance(deadline_s, bool)
            or not isinstance(deadline_s, int | float)
            or not deadline_s > 0
        ):
            raise InvalidArgumentError(f"deadline_s must be a positive number, got {deadline_s!r}")
        if notify is not None and all(p.empty for p in plans):
            raise PlanError("an empty plan has no op to carry the notification")
        for plan in plans:
            if kind is XferKind.WRITE:
                plan.validate(local_regions, peer.regions)
            else:
                plan.validate(peer.regions, local_regions)
        check_disjoint(plans)
        return PlanRun(
            self.transport, plans, peer,
            kind=kind, deadline_s=float(deadline_s), max_inflight=self._max_inflight,
            notify=notify, clock=self._clock, metrics=self._metrics,
        )  # fmt: skip

    def execute(
        self,
        plan: TransferPlan,
        peer: Peer,
        *,
        local_regions: Mapping[RegionId, int],
        kind: XferKind = XferKind.WRITE,
        deadline_s: float = 30.0,
        notify: bytes | None = None,
        on_progress: Callable[[OpProgress], None] | None = None,
    ) -> PlanResult:
        """Run ``plan`` to completion (see :meth:`start`), reporting each op change.

        If ``on_progress`` raises, the run is cancelled and stepped until every batch has ended
        (so no transfer is left touching the memory), then the exception propagates."""
        run = self.start(
            plan, peer, local_regions=local_regions, kind=kind, deadline_s=deadline_s, notify=notify
        )
        idle = [1e-5]  # the current back-off, shared by the normal and the cancelling loop
        try:
            while True:
                events = self._advance(run, idle)
                if on_progress is not None:
                    for event in events:
                        on_progress(event)
                if run.done:
                    return run.result()
        except BaseException:
            run.cancel("the progress callback raised")
            while not run.done:
                self._advance(run, idle)
            raise

    def _advance(self, run: PlanRun, idle: list[float]) -> list[OpProgress]:
        """One step of ``run``; when nothing changed, sleeps ``idle[0]`` and doubles it (up to
        ``max_idle_s``); a change resets it."""
        events = run.step()
        if events or run.done:
            idle[0] = 1e-5
        else:
            self._sleep(idle[0])
            idle[0] = min(idle[0] * 2, self._max_idle_s)
        return events
