"""Whole-run properties: prefix hits equal an exact offline count with an infinite cache and
grow with cache size; every request ends once; stored bytes are accounted; no negative queue
time; the same seed gives the same result."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from simulate_testlib import device_tier, tiny_spec

from kvplane.simulate.parse import load_cluster
from kvplane.simulate.spec import FailureSpec
from kvplane.simulate.summary import simulate
from kvplane.simulate.workload import Request, poisson_requests, read_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "examples" / "traces" / "mooncake_synthetic.jsonl"


def offline_hit_tokens(requests: list[Request]) -> int:
    """Infinite cache, requests in arrival order: a request reuses the leading blocks already
    seen among its blocks before its last token, then every full block of it is seen."""
    seen: set[int] = set()
    hits = 0
    for r in requests:
        n = 0
        for h in r.hash_ids[: (r.input_tokens - 1) // 512]:
            if h not in seen:
                break
            n += 1
        hits += n * 512
        seen.update(r.hash_ids[: r.input_tokens // 512])
    return hits


def test_infinite_cache_hits_equal_the_offline_count_on_the_shipped_trace() -> None:
    requests = list(read_trace(TRACE)[:400])
    spec = tiny_spec(tiers=(device_tier(10**9),))
    result, sim = simulate(spec, requests)
    expected = offline_hit_tokens(requests)
    assert expected > 0
    assert sim.lookup_hits == expected
    assert result.prefix_hit_rate == expected / sum(r.input_tokens for r in requests)


def _trace(picks: list[tuple[int, int, int]]) -> list[Request]:
    """Requests reading prefixes of 4 documents: block j of document d has id 100 * d + j."""
    return [
        Request(
            i, float(i), blocks * 512 + extra, 2, tuple(100 * doc + j for j in range(blocks + 1))
        )
        for i, (doc, blocks, extra) in enumerate(picks)
    ]


@settings(max_examples=100, deadline=None)
@given(
    picks=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 8), st.integers(1, 511)),
        min_size=1,
        max_size=25,
    ),
    small=st.integers(0, 12),
    extra=st.integers(1, 12),
    chunk=st.sampled_from([512, 1024]),
)
def test_hits_grow_with_cache_size(
    picks: list[tuple[int, int, int]], small: int, extra: int, chunk: int
) -> None:
    requests = _trace(picks)
    hits = []
    for chunks in (small, small + extra):
        _, sim = simulate(tiny_spec(tiers=(device_tier(chunks, chunk),)), requests)
        hits.append(sim.lookup_hits)
    assert hits[0] <= hits[1]


def test_conservation_queues_and_determinism_with_failures() -> None:
    spec = load_cluster(ROOT / "examples" / "cpu2.toml")
    spec = dataclasses.replace(
        spec,
        prefill_workers=3,
        decode_workers=2,
        router="prefix-aware",
        failures=(FailureSpec("prefill", 1, 5.0), FailureSpec("decode", 0, 8.0)),
    )
    requests = poisson_requests(20.0, 400, spec.poisson, seed=3)
    first, sim = simulate(spec, requests)  # simulate() checks every invariant
    assert first.completed == 400
    assert all(f.finished == 1 for f in sim.flights)
    for o in sim.outcomes():
        assert o.queue_s >= 0
        assert o.decode_start_s >= o.ready_s
    for tier in first.tiers:
        assert tier.stored_bytes == tier.resident_bytes + tier.evicted_bytes
    assert [f.role for f in first.failures] == ["prefill", "decode"]
    assert all(f.rerouted > 0 for f in first.failures)
    again, _ = simulate(spec, poisson_requests(20.0, 400, spec.poisson, seed=3))
    assert again == first
    other, _ = simulate(spec, poisson_requests(20.0, 400, spec.poisson, seed=4))
    assert other != first
