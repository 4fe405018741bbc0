"""The prefix index's holdings and its longest-prefix answers, per worker and tier."""

from __future__ import annotations

from kvplane.ids import ChunkKey
from kvplane.serving.kv_events import AllCleared, ChunksRemoved, ChunksStored
from kvplane.serving.router.prefix_index import PrefixIndex, PrefixMatch

K = [ChunkKey(bytes([i]) * 8) for i in range(6)]


def test_longest_prefix_per_worker_and_tier() -> None:
    idx = PrefixIndex()
    idx.apply("a", [ChunksStored(tuple(K[:4]), "host"), ChunksStored(tuple(K[:2]), "disk")])
    idx.apply("b", [ChunksStored((K[0],), "host"), ChunksStored((K[1], K[2]), "disk")])
    idx.apply("c", [ChunksStored((K[1],), "host")])  # no K[0]: no prefix at all
    assert idx.longest_prefix(K) == {
        "a": PrefixMatch("a", 4, {"disk": 2, "host": 4}),
        "b": PrefixMatch("b", 3, {"host": 1}),  # host K0, disk K1-K2: 3 in any tier
    }
    assert idx.longest_prefix([K[5]]) == {} and idx.longest_prefix([]) == {}
    assert len(idx) == 4 and idx.workers() == ["a", "b", "c"]


def test_removals_clears_and_idempotence() -> None:
    idx = PrefixIndex()
    idx.apply("a", [ChunksStored((K[0], K[1]), "host"), ChunksStored((K[0],), "host")])
    idx.apply("a", [ChunksRemoved((K[1], K[5]), "host")])  # K5 never held: nothing changes
    assert idx.holdings("a") == {"host": frozenset({K[0]})}
    idx.apply("b", [ChunksStored((K[0],), "disk")])
    idx.apply("a", [AllCleared(), ChunksStored((K[2],), "disk")])
    assert idx.holdings("a") == {"disk": frozenset({K[2]})}
    assert idx.longest_prefix([K[0]]) == {"b": PrefixMatch("b", 1, {"disk": 1})}
    idx.clear("b")
    assert idx.holdings("b") == {} and idx.longest_prefix([K[0]]) == {} and len(idx) == 1
