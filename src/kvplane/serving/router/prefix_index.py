"""The router's prefix index: which worker holds which chunk in which tier, from KV events.

:class:`PrefixIndex` applies the events of each worker's batches in the order the feed
(``kv_feed``) hands them over, and answers the cache-aware question: for a request's chunk keys
(its block hashes at chunk ends, each committing to its whole prefix), how many leading chunks
each worker holds, per tier and in any tier. It trusts the order it is given; sequencing, gaps
and restarts are the feed's. Thread-safe (one lock): the subscriber's thread applies, the
router's threads look up. See docs/serving.md ("KV events").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvplane.ids import ChunkKey
from kvplane.serving.kv_events import AllCleared, AnyEvent, ChunksStored

Holder = tuple[str, str]
"""``(worker, tier)``."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One worker's cached prefix of a request: leading chunks held in each tier
    (``by_tier``, tiers with at least one), and in any tier chunk by chunk (``any_tier``: what
    a load that reads each chunk from wherever it is could use)."""

    worker: str
    any_tier: int
    by_tier: Mapping[str, int] = field(default_factory=dict)


class PrefixIndex:
    """Chunk holdings of every worker heard from (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[ChunkKey, set[Holder]] = {}
        self._held: dict[str, dict[str, set[ChunkKey]]] = {}

    # -- applying (the feed) ---------------------------------------------------------------
    def apply(self, worker: str, events: Sequence[AnyEvent]) -> None:
        """Apply one batch of ``worker``'s events in order; a key stored twice or removed
        while not held changes nothing (events are idempotent sets)."""
        with self._lock:
            for ev in events:
                if isinstance(ev, AllCleared):
                    self._clear(worker)
                    continue
                tiers = self._held.setdefault(worker, {})
                keys = tiers.setdefault(ev.medium, set())
                holder = (worker, ev.medium)
                if isinstance(ev, ChunksStored):
                    for key in ev.block_hashes:
                        keys.add(ChunkKey(key))
                        self._where.setdefault(ChunkKey(key), set()).add(holder)
                else:
                    for key in ev.block_hashes:
                        keys.discard(ChunkKey(key))
                        self._unplace(ChunkKey(key), holder)

    def clear(self, worker: str) -> None:
        """Forget everything ``worker`` held (a new incarnation, or a worker gone)."""
        with self._lock:
            self._clear(worker)

    def _clear(self, worker: str) -> None:
        for tier, keys in self._held.pop(worker, {}).items():
            for key in keys:
                self._unplace(key, (worker, tier))

    def _unplace(self, key: ChunkKey, holder: Holder) -> None:
        holders = self._where.get(key)
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._where[key]

    # -- questions (any thread) ------------------------------------------------------------
    def workers(self) -> list[str]:
        """Workers holding at least one chunk, sorted."""
        with self._lock:
            return sorted(w for w, tiers in self._held.items() if any(tiers.values()))

    def holdings(self, worker: str) -> dict[str, frozenset[ChunkKey]]:
        """``worker``'s chunks per tier (empty tiers left out)."""
        with self._lock:
            tiers = self._held.get(worker, {})
            return {tier: frozenset(keys) for tier, keys in tiers.items() if keys}

    def __len__(self) -> int:
        """Distinct chunks held anywhere."""
        return len(self._where)

    def longest_prefix(self, keys: Sequence[ChunkKey]) -> dict[str, PrefixMatch]:
        """Per worker holding ``keys[0]`` somewhere: its leading run of ``keys`` per tier and
        in any tier. Stops at the first key no worker still in the running holds; a worker
        without ``keys[0]`` is left out (a zero match)."""
        by: dict[Holder, int] = {}
        any_run: dict[str, int] = {}
        with self._lock:
            tiers: set[Holder] = set()
            workers: set[str] = set()
            for i, key in enumerate(keys):
                holders = self._where.get(key, set())
                if i == 0:
                    tiers, workers = set(holders), {w for w, _t in holders}
                else:
                    tiers &= holders
                    workers &= {w for w, _t in holders}
                if not workers:
                    break
                for holder in tiers:
                    by[holder] = i + 1
                for worker in workers:
                    any_run[worker] = i + 1
        out: dict[str, PrefixMatch] = {}
        for worker, n in sorted(any_run.items()):
            mine = {t: m for (w, t), m in sorted(by.items()) if w == worker}
            out[worker] = PrefixMatch(worker, n, mine)
        return out
