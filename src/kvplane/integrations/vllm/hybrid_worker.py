"""The connector's worker side over vLLM's KV cache groups: one :class:`WorkerSide` each.

Owns :class:`HybridWorker`: each group's worker moves its own layers' blocks (its own pool,
host tier, lower tiers and job runner) under its group's step; this joins what vLLM hears as
one: a request's KV arrived once every group's load of it ended, and with several groups a
failed load is a failed receive of the request (vLLM cannot map per-group block ids back). One
:class:`~.wakeup.StepSource` for :func:`~.wakeup.end_step`. With one group every call is that
worker's own. Decides nothing; no vLLM import. See ``docs/vllm.md`` ("Sliding windows and
hybrids").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.errors import InvalidArgumentError
from kvplane.integrations.vllm.messages import StepMeta, TierIndex, WorkerReport
from kvplane.integrations.vllm.store_probe import StoreId
from kvplane.integrations.vllm.worker import WorkerSide


class HybridWorker:
    """The :class:`WorkerSide` of each group (in vLLM's group order, sharing one wake-up).
    Not thread-safe (vLLM's worker thread calls it)."""

    def __init__(self, sides: Sequence[WorkerSide]) -> None:
        if not sides:
            raise InvalidArgumentError("a hybrid worker needs at least one group's worker")
        self.sides = tuple(sides)
        self.wake = self.sides[0].wake
        self._arrived: dict[str, int] = {}  # request -> groups whose async load of it ended
        self._failed: set[str] = set()  # requests with a failed load in some group
        self._failed_out: set[str] = set()  # arrived everywhere: to name as failed receives

    @property
    def hybrid(self) -> bool:
        """True with several groups."""
        return len(self.sides) > 1

    @property
    def indices(self) -> tuple[TierIndex, ...]:
        """Each group's start-up handshake (fingerprint, lower-tier re-index)."""
        return tuple(s.index for s in self.sides)

    @property
    def stores(self) -> tuple[StoreId | None, ...]:
        """Each group's shared store id (None without one)."""
        return tuple(s.store for s in self.sides)

    def _each(self, steps: Sequence[StepMeta]) -> zip[tuple[WorkerSide, StepMeta]]:
        if len(steps) != len(self.sides):
            raise InvalidArgumentError(
                f"{len(steps)} step(s) for {len(self.sides)} KV cache group(s)"
            )
        return zip(self.sides, steps, strict=True)

    # -- step hooks (each group's own) ---------------------------------------------------------
    def begin_step(self, steps: Sequence[StepMeta]) -> None:
        for side, step in self._each(steps):
            side.begin_step(step)

    def start_loads(self, steps: Sequence[StepMeta]) -> None:
        for side, step in self._each(steps):
            side.start_loads(step)

    def wait_loads(self) -> None:
        for side in self.sides:
            side.wait_loads()

    def submit_stores(self, steps: Sequence[StepMeta]) -> None:
        for side, step in self._each(steps):
            side.submit_stores(step)

    # -- StepSource ----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return any(s.busy for s in self.sides)

    @property
    def has_news(self) -> bool:
        return bool(self._failed_out) or any(s.has_news for s in self.sides)

    def finished(self, finished_req_ids: Sequence[str] = ()) -> tuple[set[str], set[str]]:
        """(nothing: offload never delays a free, requests whose asynchronous load ended in
        every group), each request once."""
        if not self.hybrid:
            side = self.sides[0]
            side.take_failed_loads()  # one group: its failed blocks go to vLLM as they are
            return side.finished(finished_req_ids)
        done: set[str] = set()
        for side in self.sides:
            _sent, got = side.finished(finished_req_ids)
            self._failed |= side.take_failed_loads()
            for req in got:
                n = self._arrived.get(req, 0) + 1
                if n < len(self.sides):
                    self._arrived[req] = n
                    continue
                self._arrived.pop(req, None)
                done.add(req)
                if req in self._failed:
                    self._failed.discard(req)
                    self._failed_out.add(req)
        return set(), done

    def take_load_errors(self) -> set[int]:
        """Failed blocks for vLLM: one group's as they are; with several groups none (block
        ids are per group: :meth:`take_failed` names the requests instead)."""
        errors: set[int] = set()
        for side in self.sides:
            errors |= side.take_load_errors()
        return errors if not self.hybrid else set()

    def take_failed(self) -> set[str]:
        """Requests to name as failed receives (several groups: their load failed in some
        group and ended in every group), each once."""
        failed, self._failed_out = self._failed_out, set()
        return failed

    def take_reports(self) -> tuple[WorkerReport, ...]:
        """Each group's report since the last call."""
        return tuple(s.take_report() for s in self.sides)

    # -- shutdown ------------------------------------------------------------------------------
    def drain(self, timeout: float = 120.0) -> None:
        """Finish every group's jobs (each up to ``timeout`` seconds)."""
        for side in self.sides:
            side.drain(timeout)

    def close(self) -> None:
        """Drain and close every group's worker; idempotent."""
        for side in self.sides:
            side.close()
