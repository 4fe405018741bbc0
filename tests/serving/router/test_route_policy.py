"""Cache-aware routing as a pure function: exact predicted TTFTs, and properties over random
candidates (never a dead or unpaired worker; equal load: the longest cached prefix; equal
cache: the least loaded); the policy names and the chunk key scheme match the worker's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.serving.messages import WorkerInfo
from kvplane.serving.router.prefix_index import PrefixMatch
from kvplane.serving.router.route_policy import (
    CacheRouting,
    Candidate,
    ChunkKeyScheme,
    RouteCosts,
    RoutePolicy,
    pick_cache_aware,
    predicted_ttft,
)

COSTS = RouteCosts(
    prefill_s_per_token=1.0, bytes_per_token=1.0, tier_bytes_per_s={"host": 4.0, "disk": 2.0},
    unknown_tier_bytes_per_s=1.0,
)  # fmt: skip
TPC = 4  # tokens per chunk


def match(any_tier: int, **by_tier: int) -> PrefixMatch:
    return PrefixMatch("w", any_tier, by_tier)


def test_predicted_ttft_is_compute_plus_loads_plus_queue() -> None:
    # 20 tokens, no cache, 3 queued: 23 tokens at 1 s
    assert predicted_ttft(Candidate("a", queued_tokens=3), 20, TPC, COSTS) == 23.0
    # 3 chunks in host (12 tokens / 4 B/s = 3 s) and 8 computed
    assert predicted_ttft(Candidate("a", match=match(3, host=3)), 20, TPC, COSTS) == 11.0
    # host 1 chunk, disk 3: chunk 0 from host (1 s), chunks 1-2 from disk (4 s); 8 computed
    assert predicted_ttft(Candidate("a", match=match(3, host=1, disk=3)), 20, TPC, COSTS) == 13.0
    # held chunk by chunk across tiers (no tier's run reaches 2): chunk 1 at the slowest (2 B/s)
    assert predicted_ttft(Candidate("a", match=match(2, host=1, disk=0)), 20, TPC, COSTS) == 15.0
    # the chunk holding the last token is computed, never loaded: 8 tokens, 1 chunk loadable
    assert predicted_ttft(Candidate("a", match=match(2, host=2)), 8, TPC, COSTS) == 5.0


def test_ties_go_to_the_longest_prefix_then_the_fewest_queued_then_the_first() -> None:
    cands = [Candidate("a"), Candidate("b"), Candidate("c", queued_tokens=0)]
    assert pick_cache_aware(cands, 10, TPC, COSTS) == 0
    free = RouteCosts(prefill_s_per_token=1.0, bytes_per_token=1e-9)  # loads cost ~nothing
    longer = [Candidate("a", match=match(1, host=1)), Candidate("b", match=match(2, host=2))]
    assert pick_cache_aware(longer, 8, TPC, free) == 1  # both load 1 chunk; b holds more
    assert pick_cache_aware([Candidate("a", up=False), Candidate("b", paired=False)], 8, TPC,
                            COSTS) is None  # fmt: skip


def test_cache_routing_rotates_exact_ties_and_counts_queues() -> None:
    routing = CacheRouting(None, COSTS)
    picks = [routing.pick(["a", "b"], t, queued={}, matches={}, prompt_tokens=8) for t in range(4)]
    assert picks == [0, 1, 0, 1]
    assert routing.pick(["a", "b"], 0, queued={"a": 5}, matches={}, prompt_tokens=8) == 1
    held = {"a": match(1, host=1)}
    keyed = CacheRouting(ChunkKeyScheme(BlockHasher(0, b"f"), ChunkSpec(2, 2)), COSTS)
    assert keyed.pick(["a", "b"], 1, queued={}, matches=held, prompt_tokens=8) == 0


def test_policy_names_and_bad_costs_are_refused() -> None:
    assert RoutePolicy.parse("cache-aware") is RoutePolicy.CACHE_AWARE
    assert [p.value for p in RoutePolicy] == ["round-robin", "cache-aware"]
    with pytest.raises(InvalidArgumentError, match="one of round-robin, cache-aware"):
        RoutePolicy.parse("least-loaded")
    with pytest.raises(InvalidArgumentError, match=r"tier_bytes_per_s\['disk'\]"):
        RouteCosts(tier_bytes_per_s={"disk": 0.0})
    with pytest.raises(InvalidArgumentError, match="queued_tokens"):
        Candidate("a", queued_tokens=-1)


def test_the_scheme_keys_are_the_workers_block_hashes_at_chunk_ends() -> None:
    hasher, spec = BlockHasher(seed=7, fingerprint=b"model"), ChunkSpec(4, 2)
    tokens = list(range(21))  # 5 full blocks: 2 full chunks, keyed by blocks 1 and 3
    hashes = hasher.hash_blocks(tokens, 4)
    assert ChunkKeyScheme(hasher, spec).keys(tokens) == [ChunkKey(hashes[1]), ChunkKey(hashes[3])]
    assert ChunkKeyScheme(hasher, spec).keys(tokens[:7]) == []


TIERS = st.sampled_from(["host", "disk", "redis"])


@st.composite
def candidates(draw: st.DrawFn) -> list[Candidate]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        held = draw(st.integers(0, 8))
        m = PrefixMatch(f"w{i}", held, {draw(TIERS): held}) if held else None
        out.append(Candidate(f"w{i}", draw(st.booleans()), draw(st.booleans()),
                             draw(st.integers(0, 500)), m))  # fmt: skip
    return out


@given(candidates(), st.integers(1, 40))
def test_never_a_dead_or_unpaired_worker(cands: list[Candidate], tokens: int) -> None:
    got = pick_cache_aware(cands, tokens, TPC, RouteCosts())
    live = [i for i, c in enumerate(cands) if c.up and c.paired]
    assert got in live if live else got is None


@given(st.lists(st.integers(0, 8), min_size=1, max_size=6), TIERS, st.integers(0, 300),
       st.integers(1, 40))  # fmt: skip
def test_equal_load_picks_the_longest_cached_prefix(
    helds: list[int], tier: str, queued: int, tokens: int
) -> None:
    cands = [Candidate(f"w{i}", queued_tokens=queued,
                       match=PrefixMatch(f"w{i}", h, {tier: h}) if h else None)
             for i, h in enumerate(helds)]  # fmt: skip
    got = pick_cache_aware(cands, tokens, TPC, RouteCosts())
    assert got is not None
    usable = [min(h, (tokens - 1) // TPC) for h in helds]
    assert usable[got] == max(usable)
    assert helds[got] == max(h for h, u in zip(helds, usable, strict=True) if u == max(usable))


@given(st.lists(st.integers(0, 500), min_size=1, max_size=6), st.integers(0, 8), TIERS,
       st.integers(1, 40))  # fmt: skip
def test_equal_cache_picks_the_least_loaded(
    queues: list[int], held: int, tier: str, tokens: int
) -> None:
    cands = [Candidate(f"w{i}", queued_tokens=q,
                       match=PrefixMatch(f"w{i}", held, {tier: held}) if held else None)
             for i, q in enumerate(queues)]  # fmt: skip
    got = pick_cache_aware(cands, tokens, TPC, RouteCosts())
    assert got == queues.index(min(queues))


def test_adopt_takes_the_first_prefill_workers_advertised_scheme() -> None:
    def info(role: str, chunks: int, seed: int) -> WorkerInfo:
        return WorkerInfo(
            role=role, peer_id=f"{role}{seed}", pd_address="tcp://h:1", incarnation=1,
            transport="tcp", hash_seed=seed, hash_fingerprint=b"fp", block_size=4,
            blocks_per_chunk=chunks,
        )  # fmt: skip

    none = CacheRouting()
    assert none.adopt([None, info("decode", 2, 1), info("prefill", 0, 2)]) is none
    got = none.adopt([info("decode", 2, 1), info("prefill", 2, 3), info("prefill", 1, 4)])
    assert got.scheme == ChunkKeyScheme(BlockHasher(seed=3, fingerprint=b"fp"), ChunkSpec(4, 2))
    assert got.adopt([info("prefill", 1, 4)]) is got  # kept once adopted
    tokens = list(range(9))
    assert got.scheme is not None
    assert got.scheme.keys(tokens) == ChunkSpec(4, 2).chunk_keys(
        BlockHasher(seed=3, fingerprint=b"fp").hash_blocks(tokens, 4)
    )
