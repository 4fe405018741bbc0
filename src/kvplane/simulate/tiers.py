"""Simulated cache tiers: LRU chunk stores with a bandwidth lane and hit/store accounting.

A :class:`TierCache` holds chunk keys only (a chunk's key is the id of its last block, which
commits to the whole prefix); :func:`prefix_walk` finds a prompt's cached prefix across a list of
tiers without changing them. Stores write through to every tier (so a load from a slow tier
promotes the chunk upward). Must not import the engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvplane.simulate.spec import TRACE_BLOCK_TOKENS, TierSpec
from kvplane.simulate.timing import Lane, batch_s


class TierCache:
    """One tier instance (a worker's, or the cluster's when shared): at most ``capacity``
    chunks of ``chunk_bytes`` each, least recently used evicted first."""

    __slots__ = (
        "capacity",
        "chunk_blocks",
        "chunk_bytes",
        "evicted",
        "hit_chunks",
        "keys",
        "lane",
        "occupancy",
        "spec",
        "stored",
    )

    def __init__(self, spec: TierSpec, bytes_per_token: int) -> None:
        self.spec = spec
        self.chunk_blocks = spec.chunk_blocks
        self.chunk_bytes = spec.chunk_tokens * bytes_per_token
        self.capacity = spec.capacity_bytes // self.chunk_bytes
        self.keys: OrderedDict[int, None] = OrderedDict()
        self.lane = Lane()
        self.hit_chunks = self.stored = self.evicted = 0
        self.occupancy: list[tuple[float, int]] = [(0.0, 0)]
        """``(time, resident chunks)`` at each change of the count (a full tier's stores
        evict as many as they add, so they record nothing)."""

    def load(self, keys: Sequence[int], now: float) -> float:
        """Count hits on ``keys`` (resident), refresh their recency, and book their load on the
        lane from ``now``; return when the load ends."""
        for key in keys:
            self.keys.move_to_end(key)
        self.hit_chunks += len(keys)
        hold = batch_s(len(keys), len(keys) * self.chunk_bytes, self.spec.op_overhead_s,
                       self.spec.bandwidth_bytes_s)  # fmt: skip
        return self.lane.reserve(now, hold)

    def store(self, hash_ids: Sequence[int], blocks: int, now: float) -> int:
        """Write the full chunks of ``hash_ids[:blocks]`` (refreshing those resident, evicting
        the least recent for new ones) and book the writes from ``now``; return how many were
        new. A tier of zero capacity stores nothing."""
        if self.capacity == 0:
            return 0
        c = self.chunk_blocks
        keys = self.keys
        new = 0
        for i in range(c - 1, blocks, c):
            key = hash_ids[i]
            if key in keys:
                keys.move_to_end(key)
                continue
            if len(keys) >= self.capacity:
                keys.popitem(last=False)
                self.evicted += 1
            keys[key] = None
            new += 1
        if new:
            if len(keys) != self.occupancy[-1][1]:
                self.occupancy.append((now, len(keys)))
            self.stored += new
            hold = batch_s(new, new * self.chunk_bytes, self.spec.op_overhead_s,
                           self.spec.bandwidth_bytes_s)  # fmt: skip
            self.lane.reserve(now, hold)
        return new

    def clear(self, now: float = 0.0) -> None:
        """Lose every chunk at ``now`` (the worker holding this tier died); counted as
        evicted."""
        self.evicted += len(self.keys)
        self.keys.clear()
        self.occupancy.append((max(now, self.occupancy[-1][0]), 0))

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless stored = resident + evicted and capacity holds,
        now and in every occupancy sample."""
        peak = max(n for _, n in self.occupancy)
        if (
            self.stored != len(self.keys) + self.evicted
            or max(peak, len(self.keys)) > self.capacity
        ):
            raise AssertionError(
                f"tier {self.spec.name}: stored {self.stored}, resident {len(self.keys)}, "
                f"evicted {self.evicted}, capacity {self.capacity}"
            )


def prefix_walk(
    tiers: Sequence[TierCache], hash_ids: Sequence[int], blocks: int
) -> list[tuple[int, int]]:
    """The cached prefix of ``hash_ids[:blocks]``: ``(tier index, block index of the chunk's
    last block)`` per chunk, in order. At each block position the fastest tier holding the
    chunk that starts there serves it; the walk ends at the first position none does."""
    out = []
    p = 0
    while p < blocks:
        for ti, tier in enumerate(tiers):
            c = tier.chunk_blocks
            if p % c == 0 and p + c <= blocks and hash_ids[p + c - 1] in tier.keys:
                out.append((ti, p + c - 1))
                p += c
                break
        else:
            break
    return out


def hit_tokens(walk: Sequence[tuple[int, int]]) -> int:
    """Tokens covered by a :func:`prefix_walk`."""
    return (walk[-1][1] + 1) * TRACE_BLOCK_TOKENS if walk else 0
