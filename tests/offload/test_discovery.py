"""Discovery in a shared store: which keys a lookup asks, adopting the held run, the book's
two calls, and a running cascade finding chunks another engine published after it started
(real Redis, two cascades in one process)."""

from __future__ import annotations

import pytest
import redis
import torch
from offload_testlib import filled_pool, keys, tiny_layout

from kvplane.errors import IllegalTransitionError, InvalidArgumentError
from kvplane.ids import BlockId, SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload import (
    LoadDone,
    OffloadConfig,
    OffloadManager,
    SlotStatus,
    TierBook,
    build_cascade,
)
from kvplane.offload.discovery import adopt_held, ask_keys

BPC = 2
EMPTY, READY = SlotStatus.EMPTY, SlotStatus.READY


def ready(mgr: OffloadManager, *idx: int) -> None:
    ks = keys(*idx)
    mgr.prepare_store(ks, bypass_admission=True)
    mgr.complete_store(ks, True)


def shared_book(span: int = 1, slots: int = 4) -> TierBook:
    host = OffloadManager("host", 4)
    lower = [OffloadManager("disk", 4), OffloadManager("remote", slots)]
    return TierBook(host, lower, {"remote": span}, shared="remote")


def test_ask_keys_from_the_first_unserved_chunk() -> None:
    b = shared_book()
    ready(b.host, 0)
    ready(b.lower["disk"], 2)
    assert b.to_discover(keys(0, 1, 2, 3)) == tuple(keys(1, 3))  # 2 is served by disk
    assert b.to_discover(keys(0)) == ()  # every chunk served: no round trip
    ready(b.lower["remote"], 1)
    assert b.to_discover(keys(0, 1, 2, 3)) == tuple(keys(3))
    b.host.prepare_store(keys(3), bypass_admission=True)  # a host store in flight: it will be a hit
    assert b.to_discover(keys(0, 1, 2, 3)) == ()


def test_ask_keys_stops_at_a_shared_store_in_flight_and_at_the_slot_count() -> None:
    b = shared_book(slots=2)
    b.lower["remote"].prepare_store(keys(1), bypass_admission=True)
    assert b.to_discover(keys(0, 1, 2)) == tuple(keys(0))
    assert b.to_discover(keys(5, 6, 7, 8)) == tuple(keys(5, 6))


def test_ask_keys_at_span_two_names_whole_groups() -> None:
    b = shared_book(span=2)
    assert b.to_discover(keys(0, 1, 2, 3, 4)) == tuple(keys(1, 3))  # chunk 4: no whole group
    ready(b.host, 0, 1)
    assert b.to_discover(keys(0, 1, 2, 3)) == tuple(keys(3))


def test_no_shared_tier_asks_nothing() -> None:
    b = TierBook(OffloadManager("host", 2), [OffloadManager("remote", 2)])
    assert b.shared is None and b.to_discover(keys(0, 1)) == ()
    with pytest.raises(IllegalTransitionError):
        b.discovered(keys(0), [True])
    with pytest.raises(InvalidArgumentError, match="shared tier 'x'"):
        TierBook(OffloadManager("host", 2), [OffloadManager("remote", 2)], shared="x")


def test_adopt_held_takes_the_leading_run_and_evicts_through_the_policy() -> None:
    b = shared_book(slots=3)
    remote = b.lower["remote"]
    ready(remote, 9)
    assert b.discovered(keys(0, 1, 2, 3), [True, True, False, True]) == tuple(keys(0, 1))
    assert [remote.status(k) for k in keys(0, 1, 2, 3, 9)] == [READY, READY, EMPTY, EMPTY, READY]
    found = b.lookup(keys(0, 1, 2))
    assert found.where == ("remote", "remote", None) and found.hit_run == 2
    remote.prepare_load(keys(1))  # pinned: of the full tier, 9 then 0 (LRU) make room
    assert adopt_held(remote, keys(5, 6, 4), [True] * 3) == tuple(keys(5, 6))
    assert [remote.status(k) for k in keys(9, 0)] == [EMPTY, EMPTY]
    assert remote.policy.order() == keys(1, 5, 6)
    remote.prepare_load(keys(5, 6))  # all pinned: no room at all
    assert adopt_held(remote, keys(7), [True]) == ()
    with pytest.raises(InvalidArgumentError, match="2 answers"):
        adopt_held(remote, keys(7, 8), [True])
    with pytest.raises(InvalidArgumentError, match="sources"):
        ask_keys(b.host, remote, 1, keys(0), [])


def test_a_running_cascade_finds_a_prefix_published_after_it_started(
    redis_url: str, redis_namespace: str
) -> None:
    """Engine B's cascade is built (and its tier re-indexed) before A stores a prefix; B's
    next lookup asks the store once, adopts the chunks and loads A's bytes exactly."""
    lay = tiny_layout(num_blocks=32)
    cfg = OffloadConfig(
        host_slots=8, pin_memory=False, admission_min_lookups=0, remote_url=redis_url,
        remote_mode="shared", remote_namespace=redis_namespace,
    )  # fmt: skip
    pool_a, pool_b = filled_pool(lay, seed=5), torch.zeros(lay.shape)
    m = MetricsRegistry()
    b = build_cascade(cfg, lay, BPC, pool_b, metrics=m)
    a = build_cascade(cfg, lay, BPC, pool_a)
    client = redis.Redis.from_url(redis_url)
    try:
        ks = keys(0, 1, 2)
        assert b.lookup(ks).where == (None, None, None)
        a.lookup(ks)
        a.store(ks, [BlockId(i) for i in range(6)])
        a.drain()
        before = client.info("commandstats")["cmdstat_exists"]["calls"]
        found = b.lookup(ks)
        assert found.where == ("remote",) * 3 and found.hit_run == 3
        assert client.info("commandstats")["cmdstat_exists"]["calls"] - before == 3
        assert b.lookup(ks).hit_run == 3  # known now: no round trip
        assert client.info("commandstats")["cmdstat_exists"]["calls"] - before == 3
        ticket = b.load(ks, [BlockId(i) for i in range(10, 16)])
        assert ticket is not None and ticket.sources == ("remote",) * 3
        [done] = [e for e in b.drain() if isinstance(e, LoadDone)]
        assert done.ok == (True,) * 3
        canon_a, canon_b = lay.canonical_view(pool_a), lay.canonical_view(pool_b)
        assert torch.equal(canon_b[10:16], canon_a[0:6])
        hits = m.value("offload_chunk_hits", {"tier": "remote"}, "_total")
        assert hits == 6.0  # the two lookups after discovery
        b.check_integrity()
        assert b.book.lower["remote"].table.slot_of(ks[0]) == SlotId(0)
    finally:
        client.close()
        a.close()
        b.close()
