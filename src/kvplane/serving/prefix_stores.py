"""The store path of one pool's prefix offload: a prompt's full chunks device -> host -> below.

Owns the store jobs in flight (whose they are), the promises of computing requests to store
their prefix, and the count, metric and one-time log of chunks no tier will hold (beyond the
host tier's slots). Writes the prefix waits its
:class:`~kvplane.serving.prefix_offload.PrefixOffload` shares with it; loads nothing
(:mod:`~kvplane.serving.prefix_loads`) and knows no KV cache groups.
"""

from __future__ import annotations

import logging

import numpy as np

from kvplane.blocks import BlockTable
from kvplane.ids import ChunkKey, JobId, RequestId
from kvplane.offload import StoreDone
from kvplane.serving.prefix_values import PoolParts, StoreFinished

log = logging.getLogger("kvplane.serving.prefix_offload")
"""The offload's logger (its one warning has always been logged under this name)."""


class PrefixStores:
    """One pool's prefix stores (see the module docstring). Not thread-safe: the worker loop
    owns it."""

    def __init__(self, parts: PoolParts, host_slots: int) -> None:
        """``host_slots``: the most chunks one store holds (the host tier's slots)."""
        self.parts, self.host_slots = parts, host_slots
        self._stores: dict[JobId, RequestId] = {}
        self._m_unstored = parts.registry.counter(
            "prefill_prefix_chunks_unstored",
            "Prompt chunks not offloaded: the prompt has more chunks than the host tier slots",
        )
        self._told_unstored = False

    def expect(self, request_id: RequestId, keys: list[ChunkKey]) -> None:
        """``request_id`` starts computing the chunks of ``keys`` (those it would store): until
        its :meth:`store` (or :meth:`forget`), a request admitted with them waits for it."""
        self.parts.waits.promise(request_id, keys[: self.host_slots])

    def forget(self, request_id: RequestId) -> None:
        """``request_id`` stopped: it will not store what :meth:`expect` promised."""
        self.parts.waits.forget(request_id)

    def reads_from(self, table: BlockTable, first: int) -> int | None:
        """The first position :meth:`store` of ``table`` from chunk ``first`` on would read
        (``first``'s), None when it would store no chunk (the prompt has no full chunk past
        it). Pure: what the request must keep until it stores."""
        tokens = self.parts.spec.tokens_per_chunk
        return first * tokens if table.num_tokens // tokens > first else None

    def store(self, request_id: RequestId, table: BlockTable, first: int) -> int:
        """Offload the full chunks of ``table`` (its tokens computed) from chunk ``first`` on
        (those before it were left unfilled by a window load); returns how many chunks the
        store job carries (0: all already held, not admitted or no room)."""
        keys = self.parts.spec.chunk_keys(table.block_hashes)[first:]
        if len(keys) > self.host_slots:
            self._unstored(len(keys))
            keys = keys[: self.host_slots]
        if not keys:
            self.parts.waits.storing(request_id, None, ())
            return 0
        bpc = self.parts.spec.blocks_per_chunk
        blocks = np.asarray(table.block_ids[first * bpc : (first + len(keys)) * bpc], np.int64)
        job = self.parts.cascade.store(keys, blocks, first=first)
        self.parts.waits.storing(request_id, job, keys)
        if job is None:
            return 0
        self._stores[job] = request_id
        self.parts.counts["store_jobs"] += 1
        return len(keys)

    def finished(self, ev: StoreDone) -> StoreFinished:
        """Apply the cascade's end of a store job: count the chunks that reached the host tier
        and wake the prefix waits on it."""
        rid = self._stores.pop(ev.job_id, RequestId(""))
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
