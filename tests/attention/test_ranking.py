"""Workload buckets and the ranking cache (memory and atomic JSON file)."""

from __future__ import annotations

import json
from pathlib import Path

from kvplane.attention import QueryLayout, RankingCache, WorkloadBucket
from kvplane.attention.ranking import RankedCandidate, pow2_bucket


def test_pow2_bucket() -> None:
    assert [pow2_bucket(n) for n in (0, 1, 2, 3, 128, 129, 8192)] == [1, 1, 2, 4, 128, 256, 8192]


def test_bucket_key(mla_inputs) -> None:
    b = WorkloadBucket.of(mla_inputs([1, 1], [5, 100]).problem)
    assert b.key() == "mla|b2|single1|kv128|h4|d64x16x0x0|ps4|float32|cpu|causal|packed"
    v = WorkloadBucket.of(mla_inputs([1, 3], [5, 100], causal=False).problem)
    assert v.key() == "mla|b2|varlen|kv128|h4|d64x16x0x0|ps4|float32|cpu|full|packed"
    # same bucket for a different length in the same power-of-two range
    assert WorkloadBucket.of(mla_inputs([1, 1], [70, 90]).problem) == b


def test_cache_persists_and_ignores_garbage(tmp_path: Path, mla_inputs) -> None:
    path = tmp_path / "sub" / "rank.json"
    bucket = WorkloadBucket.of(mla_inputs([1], [5]).problem)
    ranking = (RankedCandidate("sdpa", 0.5), RankedCandidate("torch", 1.5))
    cache = RankingCache(path)
    assert cache.get(bucket) is None and len(cache) == 0
    cache.put(bucket, ranking)
    assert RankingCache(path).get(bucket) == ranking
    assert [p.name for p in path.parent.iterdir()] == ["rank.json"]  # no temp file left
    path.write_text("{not json")
    assert len(RankingCache(path)) == 0
    path.write_text('{"format": "other", "rankings": {}}')
    assert len(RankingCache(path)) == 0
    path.write_text(
        '{"format": "kvplane.attention.rankings/2", '
        '"rankings": {"k": [["a", "x"]], "j": [["b", 2]]}}'
    )
    loaded = RankingCache(path)
    assert len(loaded) == 1


def test_query_layout_is_part_of_the_bucket(mla_inputs) -> None:
    packed = WorkloadBucket.of(mla_inputs([1, 1], [5, 100]).problem)
    split = WorkloadBucket.of(mla_inputs([1, 1], [5, 100], layout=QueryLayout.SPLIT).problem)
    assert (packed.layout, split.layout) == ("packed", "split")
    assert packed != split
    assert split.key() == "mla|b2|single1|kv128|h4|d64x16x0x0|ps4|float32|cpu|causal|split"


def test_a_file_of_the_older_key_format_is_ignored_and_replaced(tmp_path: Path, mla_inputs) -> None:
    """Format /1 keys have no query layout: they can never match, so they are not kept and
    rewritten on every save."""
    path = tmp_path / "rank.json"
    bucket = WorkloadBucket.of(mla_inputs([1, 1], [5, 100]).problem)
    old_key = "mla|b2|single1|kv128|h4|d64x16x0x0|ps4|float32|cpu|causal"  # no layout
    path.write_text(
        '{"format": "kvplane.attention.rankings/1", '
        f'"rankings": {{"{old_key}": [["sdpa", 0.5]]}}}}'
    )
    cache = RankingCache(path)
    assert len(cache) == 0 and cache.get(bucket) is None
    new = (RankedCandidate("torch", 1.0),)
    cache.put(bucket, new)
    again = RankingCache(path)
    assert len(again) == 1 and again.get(bucket) == new
    assert json.loads(path.read_text())["format"] == "kvplane.attention.rankings/2"
