"""The router's prefix index: which worker holds which chunk in which tier, from KV events.

:class:`PrefixIndex` applies each worker's event batches in the order the feed (``kv_feed``)
hands them over (sequencing, gaps and restarts are the feed's), and answers the cache-aware
question: for a request's chunk keys (block hashes at chunk ends, each committing to its
prefix), how many leading chunks each worker holds, per tier and in any tier. It also keeps
*pending* holdings: the chunks a worker is expected to store because the router just sent it a
request (:meth:`PrefixIndex.expect`), held in tier ``pending_tier`` until its events confirm
each, the request fails (:meth:`PrefixIndex.settle`) or their time runs out. Thread-safe (one
lock). See docs/serving.md ("KV events", "Cache-aware routing").
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvplane.errors import InvalidArgumentError
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
    pending: int = 0
    """Chunks of the ``any_tier`` run only expected, not yet confirmed (see the module)."""


@dataclass(slots=True)
class _Expected:
    """One routed request's pending chunks on ``worker``, live while ``until`` > now."""

    worker: str
    keys: set[ChunkKey]
    until: float


class PrefixIndex:
    """Chunk holdings of every worker heard from (see the module docstring)."""

    def __init__(self, *, pending_tier: str = "host") -> None:
        self.pending_tier = pending_tier
        self._lock = threading.Lock()
        self._where: dict[ChunkKey, set[Holder]] = {}
        self._held: dict[str, dict[str, set[ChunkKey]]] = {}
        self._expected: dict[str, _Expected] = {}  # by the request's token
        self._pending: dict[ChunkKey, dict[str, set[str]]] = {}  # key -> worker -> tokens

    # -- applying (the feed) ---------------------------------------------------------------
    def apply(self, worker: str, events: Sequence[AnyEvent]) -> None:
        """Apply one batch of ``worker``'s events in order; a key stored twice or removed
        while not held changes nothing (events are idempotent sets)."""
        with self._lock:
            for ev in events:
                if isinstance(ev, AllCleared):  # its tiers: what it was sent since still stores
                    self._clear(worker, pending=False)
                    continue
                tiers = self._held.setdefault(worker, {})
                keys = tiers.setdefault(ev.medium, set())
                holder = (worker, ev.medium)
                if isinstance(ev, ChunksStored):
                    for key in ev.block_hashes:
                        keys.add(ChunkKey(key))
                        self._where.setdefault(ChunkKey(key), set()).add(holder)
                        self._confirm(worker, ChunkKey(key))
                else:
                    for key in ev.block_hashes:
                        keys.discard(ChunkKey(key))
                        self._unplace(ChunkKey(key), holder)

    def clear(self, worker: str) -> None:
        """Forget everything ``worker`` held or was expected to (a new incarnation, a worker
        gone, or its events replayed from seq 0)."""
        with self._lock:
            self._clear(worker, pending=True)

    def _clear(self, worker: str, *, pending: bool) -> None:
        for tier, keys in self._held.pop(worker, {}).items():
            for key in keys:
                self._unplace(key, (worker, tier))
        for token in [t for t, e in self._expected.items() if e.worker == worker and pending]:
            self._drop(token)

    def _unplace(self, key: ChunkKey, holder: Holder) -> None:
        holders = self._where.get(key)
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._where[key]

    # -- pending holdings (the router) -----------------------------------------------------
    def expect(self, token: str, worker: str, keys: Sequence[ChunkKey], *, until: float) -> int:
        """Record ``worker`` as the expected holder of those of ``keys`` it does not hold yet,
        under ``token`` (the routed request's id), live until ``until`` (a monotonic time):
        each key until ``worker`` reports it stored, all of them at :meth:`settle` with
        ``ok=False``. The number of keys recorded. ``InvalidArgumentError`` if ``token`` is
        already expected (nothing recorded)."""
        with self._lock:
            if token in self._expected:
                raise InvalidArgumentError(f"chunks of {token!r} are already expected")
            held: set[ChunkKey] = set().union(*self._held.get(worker, {}).values())
            mine = {k for k in keys if k not in held}
            if mine:
                self._expected[token] = _Expected(worker, mine, until)
                for key in mine:
                    self._pending.setdefault(key, {}).setdefault(worker, set()).add(token)
            return len(mine)

    def settle(self, token: str, *, ok: bool, until: float) -> None:
        """The request of ``token`` ended: succeeded (``ok``: its keys stay expected until
        ``until`` at the latest, for its worker's events to arrive) or not (dropped now). An
        unknown token changes nothing."""
        with self._lock:
            got = self._expected.get(token)
            if got is not None and ok:
                got.until = min(got.until, until)
            elif got is not None:
                self._drop(token)

    def pending(self, worker: str, *, now: float) -> frozenset[ChunkKey]:
        """The chunks ``worker`` is expected to hold and does not yet, at time ``now``."""
        with self._lock:
            self._expire(now)
            return frozenset(k for e in self._expected.values() if e.worker == worker
                             for k in e.keys)  # fmt: skip

    def _confirm(self, worker: str, key: ChunkKey) -> None:
        for token in self._pending.get(key, {}).pop(worker, set()):
            self._expected[token].keys.discard(key)
            if not self._expected[token].keys:
                del self._expected[token]
        if not self._pending.get(key, True):
            del self._pending[key]

    def _drop(self, token: str) -> None:
        got = self._expected.pop(token)
        for key in got.keys:
            by = self._pending[key]
            by[got.worker].discard(token)
            if not by[got.worker]:
                del by[got.worker]
                if not by:
                    del self._pending[key]

    def _expire(self, now: float) -> None:
        for token in [t for t, e in self._expected.items() if e.until <= now]:
            self._drop(token)

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

    def longest_prefix(
        self, keys: Sequence[ChunkKey], *, now: float | None = None
    ) -> dict[str, PrefixMatch]:
        """Per worker holding ``keys[0]`` somewhere: its leading run of ``keys`` per tier and
        in any tier. Stops at the first key no worker still in the running holds; a worker
        without ``keys[0]`` is left out (a zero match). With ``now``, the pending holdings
        live then count as held in ``pending_tier`` (``pending``: how many of the run);
        without, only the confirmed ones."""
        by: dict[Holder, int] = {}
        any_run: dict[str, int] = {}
        only: Counter[str] = Counter()  # per worker: run chunks held only as pending
        with self._lock:
            if now is not None:
                self._expire(now)
            tiers: set[Holder] = set()
            workers: set[str] = set()
            for i, key in enumerate(keys):
                holders = self._where.get(key, set())
                if now is not None and key in self._pending:
                    held = {w for w, _t in holders}
                    extra = set(self._pending[key]) - held
                    holders = holders | {(w, self.pending_tier) for w in extra}
                    only.update(w for w in extra if w in workers or i == 0)
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
            out[worker] = PrefixMatch(worker, n, mine, only[worker])
        return out
