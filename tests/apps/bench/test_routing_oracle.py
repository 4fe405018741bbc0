"""The exact cache models behind ``bench routing``'s oracle: hand-computed assignments and
hit counts."""

from __future__ import annotations

import pytest

from kvplane.apps.bench.routing_oracle import (
    WorkerCache,
    oracle_choice,
    replay,
    router_round_robin,
)
from kvplane.apps.bench.routing_trace import block_of
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey

SPEC = ChunkSpec(16, 2)  # 32 tokens a chunk


def _prompts() -> list[list[int]]:
    """P0 = abc+1, P1 = def+1, P2 = abc+1', P3 = dex+1 (letters: 32-token blocks)."""
    a, b, c, d, e, f, x = (block_of(h, 32, 1024) for h in range(7))
    return [a + b + c + [1], d + e + f + [1], a + b + c + [2], d + e + x + [1]]


def test_the_oracle_sends_each_prefix_where_it_is_cached() -> None:
    got = replay(_prompts(), 2, 8, SPEC, oracle_choice)
    assert got.workers == (0, 1, 0, 1)
    assert got.loaded == (0, 0, 3, 2)
    assert got.prompt_tokens == 4 * 97
    assert got.hit_rate == 5 * 32 / (4 * 97)


def test_the_routers_round_robin_splits_each_prefix_from_its_repeat() -> None:
    got = replay(_prompts(), 2, 8, SPEC, router_round_robin(2, 2))
    assert got.workers == (0, 0, 1, 1)  # decode n % 2, then that decode's own cursor
    assert got.loaded == (0, 0, 0, 0)
    assert replay(_prompts(), 1, 8, SPEC, lambda n, loadable: 0).loaded == (0, 0, 3, 2)


def test_the_cache_model_is_the_tiers_lru_and_never_loads_the_last_token() -> None:
    a, b, c = (block_of(h, 32, 1024) for h in range(3))
    exact = a + b + c  # 96 tokens: the third chunk holds the last token
    assert replay([exact, exact], 1, 8, SPEC, lambda n, loadable: 0).loaded == (0, 2)
    p = _prompts()
    # 3 slots: P1's store evicts all of P0's chunks, so P2 misses
    assert replay([p[0], p[1], p[2]], 1, 3, SPEC, lambda n, loadable: 0).loaded == (0, 0, 0)
    # 6 slots: both fit
    assert replay([p[0], p[1], p[2]], 1, 6, SPEC, lambda n, loadable: 0).loaded == (0, 0, 3)
    cache = WorkerCache(4, SPEC)
    keys = [ChunkKey(bytes([i]) * 32) for i in range(6)]
    assert cache.serve(keys, 6 * 32) == 0  # stores only the first 4 (its slots)
    assert cache.loadable(keys, 6 * 32) == 4
    with pytest.raises(InvalidArgumentError, match="worker 2 chosen, of 2"):
        replay(p, 2, 8, SPEC, lambda n, loadable: 2)
