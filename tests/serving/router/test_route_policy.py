"""Cache-aware routing as a pure function: exact predicted TTFTs, and properties over random
candidates (never a dead or unpaired worker; equal load: the longest cached prefix; equal
cache: the least loaded; a longer prefix within affinity; exact ties by rendezvous hashing of
the first chunk key); the policy names and the chunk key scheme match the worker's."""

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
    loadable_chunks,
    pick_cache_aware,
    predicted_ttft,
    rendezvous,
)

COSTS = RouteCosts(
    prefill_s_per_token=1.0, bytes_per_token=1.0, tier_bytes_per_s={"host": 4.0, "disk": 2.0},
    unknown_tier_bytes_per_s=1.0, affinity=0.5,
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
    # what a request adds to its worker's queue: the tokens it computes (4 per chunk here)
    assert keyed.uncached_tokens(None, 9) == 9
    assert keyed.uncached_tokens(match(3, host=3), 9) == 1  # 2 chunks loaded, 1 token computed
    assert keyed.uncached_tokens(match(3, host=3), 8) == 4  # the last token's chunk: computed
    assert routing.uncached_tokens(match(3, host=3), 8) == 5  # no scheme: 1-token "chunks"


def test_a_longer_prefix_wins_within_affinity_and_load_wins_beyond() -> None:
    # 20 tokens: a holds 3 chunks (host, 3 s) and has 6 queued: 8 + 3 + 6 = 17 s; b idle: 20 s
    # (with affinity 0.5, anything up to 30 s is "not clearly busier" than the best)
    a = Candidate("a", queued_tokens=6, match=match(3, host=3))
    assert pick_cache_aware([Candidate("b"), a], 20, TPC, COSTS) == 1
    # a 14 queued: 25 s, slower than b's 20 s but within 1.5x: a's prefix still wins
    a = Candidate("a", queued_tokens=14, match=match(3, host=3))
    assert pick_cache_aware([Candidate("b"), a], 20, TPC, COSTS) == 1
    # a 20 queued: 31 s > 1.5 x 20 s, clearly busier: load wins
    a = Candidate("a", queued_tokens=20, match=match(3, host=3))
    assert pick_cache_aware([Candidate("b"), a], 20, TPC, COSTS) == 0
    strict = RouteCosts(prefill_s_per_token=1.0, bytes_per_token=1.0,
                        tier_bytes_per_s={"host": 4.0}, affinity=0.0)  # fmt: skip
    a = Candidate("a", queued_tokens=14, match=match(3, host=3))
    assert pick_cache_aware([Candidate("b"), a], 20, TPC, strict) == 0  # the least TTFT only


def test_ties_go_to_the_first_keys_rendezvous_winner_in_any_order() -> None:
    key = [ChunkKey(bytes([i]) * 8) for i in range(3)]
    assert rendezvous(key[0], "a") == 8915331413840308778  # the same in every process
    # no holder, no load: key 0 picks c among a-c, a among a-b; key 2 picks b
    names = ["a", "b", "c"]
    for k, want in ((key[0], "c"), (key[1], "a"), (key[2], "b")):
        for start in range(3):
            cands = [Candidate(names[(start + i) % 3]) for i in range(3)]
            got = pick_cache_aware(cands, 10, TPC, COSTS, k)
            assert got is not None and cands[got].worker == want
    assert pick_cache_aware([Candidate("a"), Candidate("b")], 10, TPC, COSTS, key[0]) == 0
    # held equally (1 chunk: 6 tokens computed + 1 s load = 7 s): c, its key's winner, even a
    # little busier (3 queued: 10 s <= 1.5 x 7 s); clearly busier (4 queued: 11 s), a of a-b
    eq = [Candidate(w, match=PrefixMatch(w, 1, {"host": 1})) for w in names]
    assert pick_cache_aware(eq, 10, TPC, COSTS, key[0]) == 2
    eq[2] = Candidate("c", queued_tokens=3, match=PrefixMatch("c", 1, {"host": 1}))
    assert pick_cache_aware(eq, 10, TPC, COSTS, key[0]) == 2
    eq[2] = Candidate("c", queued_tokens=4, match=PrefixMatch("c", 1, {"host": 1}))
    assert pick_cache_aware(eq, 10, TPC, COSTS, key[0]) == 0
    routing = CacheRouting(None, COSTS)
    picks = [
        routing.pick(["a", "b"], t, queued={}, matches={}, prompt_tokens=8, first_key=key[2])
        for t in range(4)
    ]
    assert picks == [1, 1, 1, 1]  # a first key: no rotation


def test_policy_names_and_bad_costs_are_refused() -> None:
    assert RoutePolicy.parse("cache-aware") is RoutePolicy.CACHE_AWARE
    assert [p.value for p in RoutePolicy] == ["round-robin", "cache-aware"]
    with pytest.raises(InvalidArgumentError, match="one of round-robin, cache-aware"):
        RoutePolicy.parse("least-loaded")
    with pytest.raises(InvalidArgumentError, match=r"tier_bytes_per_s\['disk'\]"):
        RouteCosts(tier_bytes_per_s={"disk": 0.0})
    with pytest.raises(InvalidArgumentError, match=r"RouteCosts\.affinity"):
        RouteCosts(affinity=-0.1)
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


@given(candidates(), st.integers(1, 40), st.binary(min_size=8, max_size=8))
def test_a_keyed_pick_is_the_longest_prefix_among_the_not_clearly_busier(
    cands: list[Candidate], tokens: int, key: bytes
) -> None:
    costs = RouteCosts()
    bound = 1 + costs.affinity
    got = pick_cache_aware(cands, tokens, TPC, costs, ChunkKey(key))
    live = [c for c in cands if c.up and c.paired]
    if not live:
        assert got is None
        return
    assert got is not None and cands[got] in live
    ttft = [predicted_ttft(c, tokens, TPC, costs) for c in live]
    near = [c for c, t in zip(live, ttft, strict=True) if t <= min(ttft) * bound]
    assert predicted_ttft(cands[got], tokens, TPC, costs) <= min(ttft) * bound
    assert loadable_chunks(cands[got].match, tokens, TPC) == max(
        loadable_chunks(c.match, tokens, TPC) for c in near
    )
