"""The load path of one pool's prefix offload: a request's leading hits into its blocks.

Owns the loads in flight, the hits with nothing to load (wholly before their window), the
leading chunks a window load left unfilled per request table, and the hit counters and metrics.
Reads the cascade, the state store and the prefix waits its
:class:`~kvplane.serving.prefix_offload.PrefixOffload` shares with it; stores nothing
(:mod:`~kvplane.serving.prefix_stores`) and knows no KV cache groups.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvplane.blocks import BlockPool, BlockTable
from kvplane.ids import ChunkKey, RequestId
from kvplane.layout import KVLayout
from kvplane.offload import LoadDone
from kvplane.serving.prefix_state import PrefixState
from kvplane.serving.prefix_values import LoadFinished, LoadStarted, PoolParts
from kvplane.serving.prefix_waits import Parked


@dataclass(frozen=True, slots=True)
class _Load:
    """A load in flight: whose, from which tiers, the request's chunk keys and state slot,
    and the leading chunks it skips (before the hit's window) in the request's ``table``."""

    request_id: RequestId
    sources: tuple[str, ...]
    keys: tuple[ChunkKey, ...]
    state_slot: int | None
    skip: int = 0
    table: BlockTable | None = None


class PrefixLoads:
    """One pool's prefix loads (see the module docstring): looked up, parked, submitted to the
    cascade and finished. Not thread-safe: the worker loop owns it."""

    def __init__(
        self,
        parts: PoolParts,
        layout: KVLayout,
        state: PrefixState | None = None,
        pool: BlockPool | None = None,
    ) -> None:
        """``layout``: the pool's (its windows); ``state``: the pool's state store, if any;
        ``pool``: its block pool (a table grown step by step grows to cover a hit)."""
        self.parts, self.layout, self.state, self.pool = parts, layout, state, pool
        self._span = math.lcm(1, *parts.cascade.book.spans.values())
        self.unfilled: weakref.WeakKeyDictionary[BlockTable, int] = weakref.WeakKeyDictionary()
        """Per request table, its leading chunks a window load left without KV (never stored)."""
        self.hits: Counter[str] = Counter()
        """Chunks loaded into the device pool, by the tier they came from."""
        self._loads: dict[int, _Load] = {}
        self._ready: list[LoadFinished] = []
        """Hits with nothing to load, reported by the next :meth:`take_ready`."""
        self._m_hits = parts.registry.counter(
            "prefill_prefix_chunks", "Prefix chunks loaded instead of computed, by tier", ["tier"]
        )
        self._m_tokens = parts.registry.counter(
            "prefill_prefix_tokens", "Prompt tokens loaded from the offload tiers"
        )

    def __len__(self) -> int:
        """Loads in flight plus hits with nothing to load not yet taken."""
        return len(self._loads) + len(self._ready)

    @property
    def has_ready(self) -> bool:
        """A hit with nothing to load waits for :meth:`take_ready` (a poll must not block)."""
        return bool(self._ready)

    def take_ready(self) -> list[LoadFinished]:
        """The finished hits with nothing to load, in order; they are reported once."""
        out, self._ready = self._ready, []
        return out

    def begin(
        self,
        request_id: RequestId,
        table: BlockTable,
        state_slot: int | None,
        keys: list[ChunkKey],
        *,
        park: bool,
    ) -> LoadStarted | None:
        """:meth:`~kvplane.serving.prefix_offload.PrefixOffload.begin_load` of one pool after
        its checks (``keys``: ``table``'s chunk keys); ``park``: a wait is allowed."""
        found = self.parts.cascade.lookup(keys)
        limit = (table.num_tokens - 1) // self.parts.spec.tokens_per_chunk
        loadable = min(found.hit_run, limit)
        if park:
            covered = self.parts.waits.cover(
                keys[:limit], found.where[:limit], found.pending[:limit]
            )
            if covered.run > loadable:
                deadline = time.monotonic() + self.parts.waits.wait_s
                parked = Parked(request_id, table, state_slot, deadline,
                                set(covered.jobs), set(covered.requests))  # fmt: skip
                self.parts.waits.park(parked)
                self.parts.counts["pending_waits"] += 1
                return LoadStarted(0, 0, (), waiting=covered.run - loadable)
        if self.state is not None:
            with_state = self.state.loadable(keys[:loadable])
            self.parts.counts["chunks_without_state"] += loadable - with_state
            loadable = with_state
        if loadable == 0:
            return None
        return self.load_run(request_id, table, state_slot, keys, loadable)

    def load_run(self, request_id: RequestId, table: BlockTable, state_slot: int | None,
                 keys: list[ChunkKey], loadable: int) -> LoadStarted | None:  # fmt: skip
        """Load the first ``loadable`` chunks of ``keys`` (those its window reads) into
        ``table``'s blocks (a table grown step by step first grows to cover them, from its
        reservation then the pool's available blocks); None: the cascade loads none of them,
        or the pool lacks the blocks."""
        skip = self.window_skip(loadable) if self.state is None else 0
        if skip == loadable:
            return self._nothing_to_load(request_id, table, skip)
        end = loadable * self.parts.spec.tokens_per_chunk
        if table.num_covered_tokens < end and (
            self.pool is None or not table.grow_to(self.pool, end)
        ):
            return None
        bpc = self.parts.spec.blocks_per_chunk
        blocks = np.asarray(table.block_ids[skip * bpc : loadable * bpc], dtype=np.int64)
        # keys past the limit: tier context; a skip is whole lower-tier chunks, so they align
        ticket = self.parts.cascade.load(keys[skip:], blocks, limit=loadable - skip)
        if ticket is None:
            return None
        load = _Load(request_id, ticket.sources, tuple(keys), state_slot, skip, table)
        self._loads[ticket.ticket_id] = load
        if skip:
            self.unfilled[table] = skip
            self.parts.counts["chunks_skipped_window"] += skip
        return LoadStarted(ticket.ticket_id, len(ticket.keys), ticket.sources)

    def _nothing_to_load(
        self, request_id: RequestId, table: BlockTable, chunks: int
    ) -> LoadStarted:
        """A ``chunks``-chunk hit wholly before its window: none loaded, all ``chunks`` left
        unfilled (never stored from ``table``), its tokens reported by the next poll."""
        tokens = chunks * self.parts.spec.tokens_per_chunk
        self.unfilled[table] = chunks
        self.parts.counts["chunks_skipped_window"] += chunks
        self._m_tokens.inc(tokens)
        self._ready.append(LoadFinished(request_id, tokens, 0, 0))
        return LoadStarted(0, 0, ())

    def window_skip(self, loadable: int) -> int:
        """The leading chunks of a ``loadable``-chunk hit no layer reads again: wholly before
        the hit's window (:meth:`KVLayout.window_start`; 0 when a layer is full), rounded down
        to whole chunks of every lower tier."""
        start = self.layout.window_start(loadable * self.parts.spec.tokens_per_chunk)
        return start // self.parts.spec.tokens_per_chunk // self._span * self._span

    def finished(self, ev: LoadDone) -> LoadFinished:
        """Apply the cascade's end of a load this submitted: restore its state (with a state
        pool, which may shorten it), count its hits by tier and report its tokens."""
        load = self._loads.pop(ev.ticket_id)
        usable = ev.usable
        if self.state is not None and load.state_slot is not None:
            usable = self.state.restore(load.keys, usable, load.state_slot)
        for tier in load.sources[:usable]:
            self.hits[tier] += 1
            self._m_hits.labels(tier).inc()
        tokens = self._hit_tokens(load, usable)
        self._m_tokens.inc(tokens)
        return LoadFinished(load.request_id, tokens, usable, len(ev.keys) - usable)

    def unpark(self) -> list[LoadFinished]:
        """Look the prefix of each parked request that is due up again: a miss finishes at
        once (nothing loaded), a hit loads as :meth:`begin` does."""
        out: list[LoadFinished] = []
        for parked in self.parts.waits.due(time.monotonic()):
            if parked.jobs or parked.requests:
                self.parts.counts["pending_waits_timed_out"] += 1
            rid, table = parked.request_id, parked.table
            keys = self.parts.spec.chunk_keys(table.block_hashes)
            if self.begin(rid, table, parked.state_slot, keys, park=False) is None:
                out.append(LoadFinished(rid, 0, 0, 0))
        return out

    def _hit_tokens(self, load: _Load, usable: int) -> int:
        """The leading tokens a load of ``usable`` chunks (after its skip) lets the request
        skip computing: all of them, unless a short load of a skipping one leaves its window
        partly unloaded (then 0: compute everything, and every block is filled again)."""
        tokens = (load.skip + usable) * self.parts.spec.tokens_per_chunk if usable else 0
        if (
            load.skip
            and self.layout.window_start(tokens) < load.skip * self.parts.spec.tokens_per_chunk
        ):
            tokens = 0
        if tokens == 0 and load.table is not None:
            self.unfilled.pop(load.table, None)
        return tokens
