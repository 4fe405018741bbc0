"""Tier caches: LRU eviction, write-through accounting, the prefix walk across chunk sizes."""

from __future__ import annotations

import pytest
from simulate_testlib import BYTES_PER_TOKEN, device_tier

from kvplane.simulate.spec import TierSpec
from kvplane.simulate.tiers import TierCache, hit_tokens, prefix_walk


def test_store_evicts_least_recent_and_counts() -> None:
    tier = TierCache(device_tier(2), BYTES_PER_TOKEN)
    assert tier.capacity == 2
    assert tier.store([1, 2], 2, 0.0) == 2
    tier.load([1], 0.0)  # 1 is now the most recent
    assert tier.store([3], 1, 0.0) == 1
    assert list(tier.keys) == [1, 3]
    assert (tier.stored, tier.evicted, tier.hit_chunks) == (3, 1, 1)
    tier.check_integrity()
    tier.clear()
    assert (len(tier.keys), tier.evicted) == (0, 3)
    tier.check_integrity()


def test_chunks_are_keyed_by_their_last_block_and_stored_whole() -> None:
    tier = TierCache(device_tier(10, chunk_tokens=1024), BYTES_PER_TOKEN)
    assert tier.store([7, 8, 9], 3, 0.0) == 1  # one full 2-block chunk; block 9 waits
    assert list(tier.keys) == [8]


def test_zero_capacity_stores_nothing() -> None:
    tier = TierCache(device_tier(0), BYTES_PER_TOKEN)
    assert tier.store([1, 2], 2, 0.0) == 0
    assert tier.stored == 0


def test_load_time_is_ops_plus_bytes() -> None:
    spec = TierSpec("host", 10**9, bandwidth_bytes_s=512 * BYTES_PER_TOKEN, op_overhead_s=0.5)
    tier = TierCache(spec, BYTES_PER_TOKEN)
    tier.store([4, 5], 2, 0.0)  # holds the lane 2 * 0.5 + 2 s
    assert tier.load([4, 5], 1.0) == pytest.approx(3.0 + 3.0)  # behind the store


def test_prefix_walk_takes_the_fastest_tier_at_each_position() -> None:
    fast = TierCache(device_tier(10), BYTES_PER_TOKEN)
    slow = TierCache(TierSpec("host", 10**9, 1e9, chunk_tokens=1024), BYTES_PER_TOKEN)
    fast.store([10, 11, 12, 13, 14], 1, 0.0)  # block 0 only
    slow.store([10, 11, 12, 13, 14], 4, 0.0)  # chunks ending at blocks 1 and 3
    walk = prefix_walk([fast, slow], [10, 11, 12, 13, 14], 5)
    # block 0 from fast; block 1 starts no slow chunk (not aligned) and fast lacks it: stop
    assert walk == [(0, 0)]
    fast.keys.clear()
    walk = prefix_walk([fast, slow], [10, 11, 12, 13, 14], 5)
    assert walk == [(1, 1), (1, 3)]
    assert hit_tokens(walk) == 4 * 512
    assert prefix_walk([fast, slow], [10, 11, 12, 13, 14], 3) == [(1, 1)]  # chunk 2-3 too long
    assert hit_tokens([]) == 0
