"""Requests: the shipped Mooncake trace, bad trace lines, seeded Poisson arrivals."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvplane.errors import ConfigError
from kvplane.simulate.spec import PoissonSpec
from kvplane.simulate.workload import (
    parse_trace_line,
    poisson_requests,
    read_trace,
    reusable_blocks,
    stored_blocks,
)

TRACE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "mooncake_synthetic.jsonl"


def test_shipped_trace() -> None:
    reqs = read_trace(TRACE)
    assert len(reqs) == 3993
    first = reqs[0]
    assert (first.rid, first.arrival_s, first.input_tokens, first.output_tokens) == (
        0,
        0.0,
        40160,
        6,
    )
    assert len(first.hash_ids) == 79
    assert reqs[-1].arrival_s == 1022.025
    assert sorted(r.rid for r in reqs) == list(range(3993))


def test_block_counts() -> None:
    assert (stored_blocks(1024), reusable_blocks(1024)) == (2, 1)  # the last token is computed
    assert (stored_blocks(1025), reusable_blocks(1025)) == (2, 2)
    assert (stored_blocks(511), reusable_blocks(511)) == (0, 0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{", "not JSON"),
        ("[1]", "not a JSON object"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 1, "output_length": true, "hash_ids": [1]}', "output"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1]}', "cover"),
    ],
)
def test_bad_trace_lines(line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"t.jsonl line 3: .*{message}"):
        parse_trace_line(line, 0, "t.jsonl line 3")


def test_empty_or_missing_trace(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match="cannot be read"):
        read_trace(tmp_path / "none.jsonl")


def test_poisson_is_seeded_and_shares_prefixes() -> None:
    spec = PoissonSpec(input_tokens=2048, output_tokens=8, prefix_groups=2, shared_blocks=2)
    a = poisson_requests(10.0, 50, spec, seed=1)
    assert a == poisson_requests(10.0, 50, spec, seed=1)
    assert a != poisson_requests(10.0, 50, spec, seed=2)
    assert all(1024 <= r.input_tokens <= 3072 and 4 <= r.output_tokens <= 12 for r in a)
    assert all(len(r.hash_ids) == -(-r.input_tokens // 512) for r in a)
    assert {r.hash_ids[:2] for r in a} == {(0, 1), (2, 3)}  # the two groups' prefixes
    rest = [h for r in a for h in r.hash_ids[2:]]
    assert len(rest) == len(set(rest))  # every other block is unique
    assert all(x.arrival_s < y.arrival_s for x, y in itertools.pairwise(a))
