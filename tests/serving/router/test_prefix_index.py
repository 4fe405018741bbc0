"""The prefix index's holdings and its longest-prefix answers, per worker and tier, and its
pending holdings: expected, confirmed by events, expired, failed, cleared."""

from __future__ import annotations

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.serving.kv_events import (
    AllCleared,
    ChunksRemoved,
    ChunksStored,
    EventBatch,
    Frame,
    Origin,
)
from kvplane.serving.router.kv_feed import EventFeed
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


def test_pending_chunks_count_as_held_in_host_until_confirmed() -> None:
    idx = PrefixIndex()
    idx.apply("a", [ChunksStored((K[0],), "disk")])
    # routed to a: K0 it holds is not recorded; K1-K3 are expected (tier host)
    assert idx.expect("r1", "a", K[:4], until=10.0) == 3
    assert idx.longest_prefix(K[:4], now=1.0) == {"a": PrefixMatch("a", 4, {"disk": 1}, pending=3)}
    assert idx.expect("r2", "b", K[:2], until=10.0) == 2  # nobody held K0 for b: b from K0
    assert idx.longest_prefix(K[:4], now=1.0)["b"] == PrefixMatch("b", 2, {"host": 2}, 2)
    assert idx.longest_prefix(K[:4]) == {"a": PrefixMatch("a", 1, {"disk": 1})}  # confirmed only
    # a's events confirm K1 and K2: confirmed, no longer pending; K3 still expected
    idx.apply("a", [ChunksStored((K[1], K[2]), "host")])
    assert idx.pending("a", now=1.0) == frozenset({K[3]})
    assert idx.longest_prefix(K[:4], now=1.0)["a"] == PrefixMatch("a", 4, {"disk": 1}, 1)
    # a confirmed chunk evicted later is gone: its expectation ended at the confirmation
    idx.apply("a", [ChunksRemoved((K[2],), "host")])
    assert idx.longest_prefix(K[:4], now=1.0)["a"] == PrefixMatch("a", 2, {"disk": 1}, 0)
    with pytest.raises(InvalidArgumentError, match="'r1' are already expected"):
        idx.expect("r1", "b", K[4:], until=10.0)
    assert idx.pending("b", now=1.0) == frozenset(K[:2])


def test_pending_chunks_end_at_expiry_failure_or_a_cleared_worker() -> None:
    idx = PrefixIndex()
    idx.expect("ok", "a", K[:2], until=100.0)
    idx.expect("failed", "a", K[2:4], until=100.0)
    idx.expect("slow", "b", K[:1], until=5.0)
    idx.settle("ok", ok=True, until=7.0)  # succeeded: expected 7.0 at the latest
    idx.settle("failed", ok=False, until=7.0)  # failed or cancelled: dropped now
    idx.settle("unknown", ok=False, until=7.0)  # changes nothing
    assert idx.pending("a", now=4.0) == frozenset(K[:2])
    assert idx.longest_prefix(K[:2], now=4.0) == {
        "a": PrefixMatch("a", 2, {"host": 2}, 2),
        "b": PrefixMatch("b", 1, {"host": 1}, 1),
    }
    assert idx.longest_prefix(K[:2], now=5.0) == {"a": PrefixMatch("a", 2, {"host": 2}, 2)}
    assert idx.longest_prefix(K[:2], now=7.0) == {} and idx.pending("a", now=7.0) == frozenset()
    idx.settle("ok", ok=True, until=99.0)  # expired: gone, a later settle changes nothing
    assert idx.pending("a", now=7.0) == frozenset()
    idx.expect("c1", "c", K[:3], until=100.0)
    idx.apply("c", [AllCleared()])  # its tiers cleared: what it was sent will still be stored
    assert idx.pending("c", now=1.0) == frozenset(K[:3])
    idx.clear("c")  # a restarted or departed worker: its expected chunks go with its holdings
    assert idx.pending("c", now=1.0) == frozenset() and idx.longest_prefix(K, now=1.0) == {}


def test_a_restarted_router_rebuilds_holdings_from_replay_with_nothing_pending() -> None:
    """Pending holdings live in the router's memory only: a new router's index starts with
    none, its feed replays each worker from seq 0 (the first frame clears the worker), and
    only what the events say is held counts, however many requests the old one had routed."""
    old = PrefixIndex()
    old.expect("r1", "a", K[:3], until=100.0)
    stored = EventBatch(0.0, (AllCleared(), ChunksStored((K[0], K[1]), "host")))
    EventFeed(old).receive(Frame(Origin("a", 1), 0, stored))  # first frame: a cleared
    assert old.pending("a", now=1.0) == frozenset()
    new = PrefixIndex()
    feed = EventFeed(new)
    feed.receive(Frame(Origin("a", 1), 0, stored))
    assert new.longest_prefix(K[:3], now=1.0) == {"a": PrefixMatch("a", 2, {"host": 2})}
    assert new.expect("r1", "a", K[:3], until=100.0) == 1  # the same token, a new router
    feed.receive(Frame(Origin("a", 1), 1, EventBatch(0.0, (ChunksStored((K[2],), "host"),))))
    assert new.pending("a", now=1.0) == frozenset()
    assert new.longest_prefix(K[:3], now=1.0) == {"a": PrefixMatch("a", 3, {"host": 3})}
