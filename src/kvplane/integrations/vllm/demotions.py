"""The scheduler side's write-downs to tiers of larger chunks, as :class:`~.messages.DemoteOp`.

Owns :class:`Demotions`: after a store's gather is reported, it asks the scheduler's
:class:`~kvplane.offload.book.TierBook` to write down every whole group of host chunks host
now holds (:meth:`~kvplane.offload.book.TierBook.write_down`; its deferred ones by
``retry_deferred``), turns each tier write into a :class:`~.messages.DemoteOp` for the next
step (units by :func:`~kvplane.offload.rechunk.demote_units`, the cascade's own) and applies
the workers' reports of them (``written``). Decides nothing the book does not; no tensors, no
I/O, no vLLM. Why a round trip: ``docs/vllm.md`` ("Per-tier chunk sizes").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.messages import DemoteOp, JobReport, TierWrite
from kvplane.offload.book import TierBook
from kvplane.offload.book_types import WriteDown
from kvplane.offload.rechunk import demote_units


@dataclass(frozen=True, slots=True)
class _Demotion:
    """A demotion in flight: the write-down's host keys and the one tier write it carries."""

    keys: tuple[ChunkKey, ...]
    write: TierWrite


class Demotions:
    """Write-downs of ``book`` from their decision to their report; ``ids`` hands out job ids
    (the scheduler side's, so they never clash with its store and load jobs). Not
    thread-safe: the scheduler side's one thread calls it."""

    def __init__(self, book: TierBook, ids: Iterator[int]) -> None:
        self.book = book
        self._ids = ids
        self._jobs: dict[int, _Demotion] = {}
        self._out: list[DemoteOp] = []

    def gathered(self, asked: Sequence[ChunkKey], good: Sequence[ChunkKey]) -> None:
        """A gather published ``good`` host chunks; ``asked`` is the request's chunk keys from
        its first chunk through the store's last: queue the write-downs they complete."""
        if good:
            self._queue(self.book.write_down(asked, fresh=good))

    def retry(self) -> None:
        """Queue the deferred write-downs whose doomed lower-tier copy is gone now."""
        for down in self.book.retry_deferred():
            self._queue(down)

    def _queue(self, down: WriteDown) -> None:
        for write in down.writes:
            units = demote_units(write, down.keys, lambda i: self.book.host_slot(down.keys[i]))
            op = DemoteOp(
                next(self._ids),
                write.tier,
                tuple(int(slot) for slot, _k, _h in units),
                tuple(key for _s, key, _h in units),
                tuple(tuple(int(h) for h in hosts) for _s, _k, hosts in units),
            )
            self._jobs[op.job_id] = _Demotion(down.keys, write)
            self._out.append(op)

    def take(self) -> tuple[DemoteOp, ...]:
        """The demotions queued since the last call, for the next step's worker."""
        out, self._out = tuple(self._out), []
        return out

    def owns(self, job_id: int) -> bool:
        return job_id in self._jobs

    def apply(self, job: JobReport) -> None:
        """The workers wrote a demotion (``job.ok`` per tier chunk, joined over the ranks):
        publish or free its tier slots and unpin its host chunks."""
        got = self._jobs.get(job.job_id)
        if got is None or job.tier != got.write.tier:
            raise InvalidArgumentError(f"worker reported unknown demotion {job.job_id}")
        del self._jobs[job.job_id]
        self.book.written(got.keys, got.write, (True,) * len(got.keys), job.ok)

    @property
    def in_flight(self) -> int:
        """Demotions decided and not yet reported (queued ones included)."""
        return len(self._jobs)
