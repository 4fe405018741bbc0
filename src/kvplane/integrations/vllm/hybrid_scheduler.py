"""The connector's scheduler side over vLLM's KV cache groups: one :class:`SchedulerSide` each.

Owns :class:`HybridScheduler`: each group (:class:`~.groups.KVGroup`) is its own pool with its
own tier book, chunk keys and window rule; this joins them where vLLM sees one request: the hit
(the run every group can serve), the loads and stores of a step (each group's own block ids),
a flush (fences are shared: block ids come from one vLLM pool), the workers' reports (one per
group) and the integrity check. With one group every call is that side's own. No tensors, no
vLLM import. The rules: ``docs/vllm.md`` ("Sliding windows and hybrids").
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.fences import Fences
from kvplane.integrations.vllm.groups import KVGroup
from kvplane.integrations.vllm.messages import StepMeta, TierIndex, WorkerReport
from kvplane.integrations.vllm.request_state import RequestView, ScheduledRequest
from kvplane.integrations.vllm.scheduler import SchedulerSide
from kvplane.integrations.vllm.store_probe import StoreId
from kvplane.metrics import MetricsRegistry


class HybridScheduler:
    """One :class:`SchedulerSide` per group of ``groups`` (``metrics[i]``: group ``i``'s
    registry), sharing job ids and fences. Not thread-safe.

    With several groups every load runs asynchronously: vLLM maps a failed load back to a
    request only as a failed receive (block ids are per group), so a failure is reported for
    the request (:class:`~.hybrid_worker.HybridWorker`) and vLLM recomputes it."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        groups: Sequence[KVGroup],
        metrics: Sequence[MetricsRegistry],
        tp_size: int = 1,
    ) -> None:
        if not groups or len(metrics) != len(groups):
            raise InvalidArgumentError(f"{len(groups)} KV cache groups, {len(metrics)} registries")
        ids, fences = itertools.count(1), Fences()
        self.groups = tuple(groups)
        self.sides = tuple(
            SchedulerSide(config, block_size, m, tp_size, g.window, ids=ids, fences=fences)
            for g, m in zip(groups, metrics, strict=True)
        )

    @property
    def hybrid(self) -> bool:
        """True with several groups."""
        return len(self.sides) > 1

    # -- start-up -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once every group's worker handshake arrived."""
        return all(s.ready for s in self.sides)

    def set_index(
        self, indices: Sequence[TierIndex], stores: Sequence[Sequence[StoreId | None]] = ()
    ) -> None:
        """Each group's worker handshake (``indices[i]``; ``stores[i]``: its ranks' shared
        store ids, :meth:`SchedulerSide.set_index`)."""
        if len(indices) != len(self.sides) or (stores and len(stores) != len(self.sides)):
            raise InvalidArgumentError(
                f"{len(indices)} group handshake(s) for {len(self.sides)} KV cache group(s)"
            )
        for i, side in enumerate(self.sides):
            side.set_index(indices[i], stores[i] if stores else ())

    # -- lookups ---------------------------------------------------------------------------------
    def match(self, view: RequestView, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens`` (:meth:`SchedulerSide.match`). With several
        groups, the longest end every group can serve: a full group needs every chunk up to
        it, a window group its window's (:meth:`~.hits.Hits.claim`); each group's claim under
        the others' shortest caps the next round until all agree (ends only shrink). "Ask
        again" when any group says so."""
        if not self.hybrid:
            return self.sides[0].match(view, num_computed)
        first = self.sides[0]
        if not self.ready or not view.eligible or not view.readable:
            return 0, False
        if num_computed % first.spec.block_size:
            return 0, False
        cap: int | None = None
        while True:
            claims = [s.hits.claim(view, num_computed, cap) for s in self.sides]
            if any(c is None for c in claims):
                first.hits.ask_again()
                return None, False
            ends = {c[1] for c in claims if c is not None}
            if len(ends) == 1:
                break
            cap = min(ends)
        got = [
            s.hits.settle(view, num_computed, *c, force_async=True)
            for s, c in zip(self.sides, claims, strict=True)
            if c is not None
        ]
        return got[0]

    def allocated(
        self, view: RequestView, block_ids: Sequence[Sequence[int]], num_external: int
    ) -> None:
        """vLLM allocated ``block_ids[i]`` in group ``i`` (:meth:`SchedulerSide.allocated`)."""
        self._per_group(block_ids)
        for side, ids in zip(self.sides, block_ids, strict=True):
            side.allocated(view, ids, num_external)

    # -- steps ----------------------------------------------------------------------------------
    def build_steps(
        self, scheduled: Sequence[Sequence[ScheduledRequest]], preempted: Sequence[str] = ()
    ) -> tuple[StepMeta, ...]:
        """Each group's step (``scheduled[i]``: the requests with group ``i``'s block ids);
        every group flushes when one must (a fence of any group may be a block another group
        writes)."""
        self._per_group(scheduled)
        steps = tuple(
            s.build_step(sched, preempted) for s, sched in zip(self.sides, scheduled, strict=True)
        )
        if len(steps) > 1 and any(m.flush for m in steps):
            steps = tuple(dataclasses.replace(m, flush=True) for m in steps)
        return steps

    def finished(self, req_id: str) -> None:
        """:meth:`SchedulerSide.finished` in every group."""
        for side in self.sides:
            side.finished(req_id)

    def apply(self, reports: Sequence[WorkerReport]) -> None:
        """Each group's workers' report (``reports[i]``, :meth:`SchedulerSide.apply`)."""
        self._per_group(reports)
        for side, report in zip(self.sides, reports, strict=True):
            side.apply(report)

    def _per_group(self, items: Sequence[object]) -> None:
        if len(items) != len(self.sides):
            raise InvalidArgumentError(
                f"{len(items)} per-group item(s) for {len(self.sides)} KV cache group(s)"
            )

    # -- state ----------------------------------------------------------------------------------
    @property
    def jobs_in_flight(self) -> int:
        """Every group's jobs planned and not yet reported by every rank."""
        return sum(s.jobs_in_flight for s in self.sides)

    @property
    def fenced_blocks(self) -> list[int]:
        """Freed blocks that in-flight gathers of any group still read, sorted."""
        return self.sides[0].fenced_blocks  # one Fences for every group

    def tracked_requests(self) -> list[str]:
        """Requests some group still tracks, sorted."""
        return sorted({r for s in self.sides for r in s.tracked_requests()})

    def close(self) -> None:
        """Close every group's shared store probe; idempotent."""
        for side in self.sides:
            side.close()

    def check_integrity(self) -> None:
        """:meth:`SchedulerSide.check_integrity` of every group once no group has a job in
        flight (the fences are shared); before, each group's tier invariants."""
        if self.jobs_in_flight:
            for side in self.sides:
                side.book.check_integrity(False)
            return
        for side in self.sides:
            side.check_integrity()
