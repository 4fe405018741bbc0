"""The store path of one pool's prefix offload: a prompt's full chunks device -> host -> below.

A request stores its chunks step by step, as its prefill completes them: each step's newly
full chunks (up to a boundary of every lower tier's larger chunks, so no such chunk is split
between two jobs; the last step all the rest) go out as one job, each chunk once. Owns the
store jobs in flight (whose they are, which chunks of which table they read), how far each
table's chunks were issued, the promises of computing requests to store their prefix, and the
count, metric and one-time log of chunks no tier will hold (beyond the host tier's slots).
Writes the prefix waits its
:class:`~kvplane.serving.prefix_offload.PrefixOffload` shares with it; loads nothing
(:mod:`~kvplane.serving.prefix_loads`) and knows no KV cache groups.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import numpy as np

from kvplane.blocks import BlockTable
from kvplane.ids import ChunkKey, JobId, RequestId
from kvplane.offload import StoreDone
from kvplane.serving.prefix_values import PoolParts, StoreFinished

log = logging.getLogger("kvplane.serving.prefix_offload")
"""The offload's logger (its one warning has always been logged under this name)."""


@dataclass(frozen=True, slots=True)
class _Store:
    """A store job in flight: whose, its chunk keys, and which table's chunks from ``first``
    on it reads (the table keeps their blocks until it ends)."""

    request_id: RequestId
    keys: tuple[ChunkKey, ...]
    table: BlockTable
    first: int


class PrefixStores:
    """One pool's prefix stores (see the module docstring). Not thread-safe: the worker loop
    owns it."""

    def __init__(self, parts: PoolParts, host_slots: int) -> None:
        """``host_slots``: the most chunks one store holds (the host tier's slots)."""
        self.parts, self.host_slots = parts, host_slots
        self._span = math.lcm(1, *parts.cascade.book.spans.values())
        self._stores: dict[JobId, _Store] = {}
        self._issued: weakref.WeakKeyDictionary[BlockTable, int] = weakref.WeakKeyDictionary()
        """Per request table, the chunks before this one were issued (or skipped)."""
        self._m_unstored = parts.registry.counter(
            "prefill_prefix_chunks_unstored",
            "Prompt chunks not offloaded: the prompt has more chunks than the host tier slots",
        )
        self._told_unstored = False

    @property
    def unit(self) -> int:
        """Positions a step's store ends on a boundary of: a chunk of every lower tier."""
        return self.parts.spec.tokens_per_chunk * self._span

    def expect(self, request_id: RequestId, keys: list[ChunkKey]) -> None:
        """``request_id`` starts computing the chunks of ``keys`` (those it would store): until
        its :meth:`store` (or :meth:`forget`), a request admitted with them waits for it."""
        self.parts.waits.promise(request_id, keys[: self.host_slots])

    def forget(self, request_id: RequestId) -> None:
        """``request_id`` stopped: it will not store what :meth:`expect` promised."""
        self.parts.waits.forget(request_id)

    def reads_from(self, table: BlockTable, first: int) -> int | None:
        """The first position a store of ``table`` (its chunks from ``first`` on; those before
        were left unfilled by a window load) reads: a job in flight's, else the first chunk
        not issued yet if one will be; None when none will read any. Pure: what the request
        must keep until the stores reading it end."""
        tokens = self.parts.spec.tokens_per_chunk
        flying = [s.first for s in self._stores.values() if s.table is table]
        start = max(first, self._issued.get(table, 0))
        if start < min(table.num_tokens // tokens, first + self.host_slots):
            flying.append(start)
        return min(flying) * tokens if flying else None

    def store(
        self, request_id: RequestId, table: BlockTable, first: int, upto: int | None = None
    ) -> int:
        """Offload the full chunks of ``table`` from chunk ``first`` on not issued yet: with
        ``upto``, a step's, those whole by position ``upto`` (its tokens computed) up to a
        boundary of every lower tier's chunks; without, the last step's, all the rest (then
        the request's promise ends). At most :attr:`host_slots` chunks of a table in all.
        Returns how many chunks the job carries (0: none due, all already held, not admitted
        or no room)."""
        spec = self.parts.spec
        keys = spec.chunk_keys(table.block_hashes)
        stop = (
            len(keys) if upto is None else upto // spec.tokens_per_chunk // self._span * self._span
        )
        if upto is None and len(keys) - first > self.host_slots:
            self._unstored(len(keys) - first)
        start = max(first, self._issued.get(table, 0))
        stop = min(stop, len(keys), first + self.host_slots)
        job = None
        if stop > start:
            self._issued[table] = stop
            bpc = spec.blocks_per_chunk
            blocks = np.asarray(table.block_ids[start * bpc : stop * bpc], np.int64)
            job = self.parts.cascade.store(keys[start:stop], blocks, first=start)
            if job is not None:
                self._stores[job] = _Store(request_id, tuple(keys[start:stop]), table, start)
                self.parts.counts["store_jobs"] += 1
        if upto is None:
            self._ended(request_id)
        return 0 if job is None else stop - start

    def _ended(self, request_id: RequestId) -> None:
        """The request's last store was issued: its promise ends, and whoever waits on it
        waits for its latest job in flight (jobs end in order), the others known as pending."""
        mine = [(j, s.keys) for j, s in self._stores.items() if s.request_id == request_id]
        if not mine:
            self.parts.waits.storing(request_id, None, ())
        for job, keys in reversed(mine):
            self.parts.waits.storing(request_id, job, keys)

    def finished(self, ev: StoreDone) -> StoreFinished:
        """Apply the cascade's end of a store job: count the chunks that reached the host tier
        and wake the prefix waits on it."""
        done = self._stores.pop(ev.job_id, None)
        rid = RequestId("") if done is None else done.request_id
        stored = sum(ev.ok)
        self.parts.counts["chunks_stored"] += stored
        self.parts.waits.stored(ev.job_id)
        return StoreFinished(rid, stored)

    def _unstored(self, chunks: int) -> None:
        """Count the chunks of a ``chunks``-chunk prompt that no tier will hold; log once."""
        over = chunks - self.host_slots
        self.parts.counts["chunks_unstored"] += over
        self._m_unstored.inc(over)
        if not self._told_unstored:
            self._told_unstored = True
            log.warning(
                "prefix offload: a prompt of %d chunks exceeds the host tier's %d slots; only its "
                "first %d chunks are stored (raise --offload-host-slots; counted in "
                "kvplane_prefill_prefix_chunks_unstored_total, logged once)",
                chunks, self.host_slots, self.host_slots,
            )  # fmt: skip
