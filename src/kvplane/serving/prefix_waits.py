"""Prefix loads that wait for this worker's own in-flight stores instead of recomputing.

Owns the book of which chunk keys a store job in flight carries, which keys a computing request
will store when its prefill ends (its promise), and which admitted requests are parked on
either; answers which parked requests may look their prefix up again (all they waited for has
landed, failed or was dropped, or their bound passed) and drops a parked request that was
cancelled, so it is never looked up again. Plain bookkeeping: no tiers, no bytes, no clock of
its own; the worker loop's :class:`~kvplane.serving.prefix_offload.PrefixOffload` owns it. See
docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplane.blocks import BlockTable
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey, JobId, RequestId
from kvplane.validators import Error, require_finite_positive

PENDING_WAIT_S = 2.0
"""The default bound of a prefix wait (``PrefixSettings.pending_wait_s``, serve's
``--offload-pending-wait``): a lost wake-up costs at most this long."""


def check_wait_s(what: str, value: object, *, error: Error = InvalidArgumentError) -> float:
    """The rule of :attr:`PrefixWaits.wait_s` and of its serve flag: a duration in seconds, 0
    allowed (a request never waits); ``error`` naming ``what`` otherwise."""
    return require_finite_positive(what, value, error, zero=True)


@dataclass(frozen=True, slots=True)
class Covered:
    """What a lookup's misses wait for: the leading ``run`` chunks are hits, chunks a store
    ``jobs`` in flight carries, or chunks computing ``requests`` promised."""

    run: int
    jobs: frozenset[JobId]
    requests: frozenset[RequestId]


@dataclass(slots=True, eq=False)
class Parked:
    """An admitted request waiting for ``jobs`` and ``requests`` (until ``deadline``, a
    ``time.monotonic()`` value) before its prefix is looked up again."""

    request_id: RequestId
    table: BlockTable
    state_slot: int | None
    deadline: float
    jobs: set[JobId] = field(default_factory=set)
    requests: set[RequestId] = field(default_factory=set)


class PrefixWaits:
    """See the module docstring. ``wait_s``: the longest a request stays parked (0: never)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = check_wait_s("PrefixWaits.wait_s", wait_s)
        self._storing: dict[JobId, frozenset[ChunkKey]] = {}
        self._promised: dict[RequestId, frozenset[ChunkKey]] = {}
        self._parked: dict[RequestId, Parked] = {}

    def __len__(self) -> int:
        """Requests parked."""
        return len(self._parked)

    # -- what is in flight -------------------------------------------------------------------
    def promise(self, request_id: RequestId, keys: Sequence[ChunkKey]) -> None:
        """``request_id`` is computing and will store ``keys`` when its prefill ends."""
        self._promised[request_id] = frozenset(keys)

    def storing(self, request_id: RequestId, job: JobId | None, keys: Sequence[ChunkKey]) -> None:
        """``request_id``'s store began: job ``job`` carries ``keys`` (``None``: nothing was
        submitted). Its promise ends; requests parked on it now wait for ``job``, if any."""
        self._promised.pop(request_id, None)
        if job is not None:
            self._storing[job] = frozenset(keys)
        for parked in self._parked.values():
            if request_id in parked.requests:
                parked.requests.discard(request_id)
                if job is not None:
                    parked.jobs.add(job)

    def stored(self, job: JobId) -> None:
        """Store ``job`` ended (its chunks landed or failed): nobody waits for it any more."""
        self._storing.pop(job, None)
        for parked in self._parked.values():
            parked.jobs.discard(job)

    def forget(self, request_id: RequestId) -> None:
        """``request_id`` stopped before its store: its promise is void. Idempotent."""
        if self._promised.pop(request_id, None) is None:
            return
        for parked in self._parked.values():
            parked.requests.discard(request_id)

    # -- who waits ---------------------------------------------------------------------------
    def cover(
        self, keys: Sequence[ChunkKey], where: Sequence[str | None], pending: Sequence[bool]
    ) -> Covered:
        """The leading run of ``keys`` (a lookup's ``where`` and ``pending`` for each) that are
        hits, pending in a store job this book knows, or promised, and what it waits for. A
        chunk pending in a store nobody here tracks ends the run (nothing to wake on)."""
        jobs: set[JobId] = set()
        requests: set[RequestId] = set()
        run = 0
        for key, tier, is_pending in zip(keys, where, pending, strict=True):
            if tier is None:
                job = next((j for j, ks in self._storing.items() if key in ks), None)
                if is_pending and job is not None:
                    jobs.add(job)
                else:
                    rid = next((r for r, ks in self._promised.items() if key in ks), None)
                    if rid is None:
                        break
                    requests.add(rid)
            run += 1
        return Covered(run, frozenset(jobs), frozenset(requests))

    def park(self, parked: Parked) -> None:
        """Park a request (one at a time per id)."""
        self._parked[parked.request_id] = parked

    def due(self, now: float) -> list[Parked]:
        """Unpark and return, in parking order, the requests with nothing left to wait for or
        whose deadline is at or before ``now``."""
        out = [p for p in self._parked.values() if not (p.jobs or p.requests) or p.deadline <= now]
        for parked in out:
            del self._parked[parked.request_id]
        return out

    def drop(self, request_id: RequestId) -> Parked | None:
        """Unpark ``request_id`` without a lookup (it was cancelled): :meth:`due` never returns
        it, so nothing loads into its blocks once they are freed. Its record, or ``None`` when
        it is not parked (idempotent)."""
        return self._parked.pop(request_id, None)
