"""The trace as ``bench routing`` replays it: scaling, groups, arrivals, rows (exact values)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.apps.bench.routing_trace import (
    TraceRequest,
    arrivals_s,
    block_of,
    load_trace,
    prompt_tokens,
    reused_groups,
    scaled_length,
    split_rounds,
)
from kvplane.errors import ConfigError, InvalidArgumentError


def _req(t: int, hash_ids: tuple[int, ...], length: int = 0) -> TraceRequest:
    return TraceRequest(t, length or 512 * len(hash_ids), 1, hash_ids)


def test_scaling_keeps_the_block_structure() -> None:
    # 2 full blocks -> 64 tokens; the 76-token tail -> ceil(76 * 32 / 512) = 5
    assert scaled_length(_req(0, (7, 8, 9), 1100), 32) == 69
    assert scaled_length(_req(0, (7,), 1), 32) == 1
    a = prompt_tokens(_req(0, (7, 8, 9)), 32, 1024)
    b = prompt_tokens(_req(0, (7, 8, 5)), 32, 1024)
    assert len(a) == 96 and a[:64] == b[:64] and a[64:] != b[64:]
    assert a[:32] == block_of(7, 32, 1024) and a[32:64] == block_of(8, 32, 1024)
    assert all(0 <= t < 1024 for t in a)
    assert prompt_tokens(_req(0, (7, 8, 9)), 32, 1024, salt=1)[:32] != a[:32]
    assert prompt_tokens(_req(0, (7, 8, 9), 1100), 32, 1024, max_blocks=2) == a[:64]
    assert block_of(7, 40, 1024)[:32] == block_of(7, 32, 1024)


def test_arrivals_keep_the_gaps_shape_and_reach_the_mean() -> None:
    reqs = [_req(t, (1,)) for t in (1000, 1100, 1400)]
    assert arrivals_s(reqs, 0.5) == [0.0, 0.25, 1.0]
    assert arrivals_s(reqs[:1], 0.5) == [0.0]
    assert arrivals_s([_req(5, (1,)), _req(5, (2,))], 0.5) == [0.0, 0.0]


def test_reused_groups_take_whole_groups_in_trace_order() -> None:
    reqs = [
        _req(i, ids) for i, ids in enumerate([(1, 2), (3,), (4, 5), (1, 6), (4,), (7,), (7, 8)])
    ]
    got = reused_groups(reqs, 1)
    assert [r.hash_ids for r in got] == [(1, 2), (1, 6)]
    got = reused_groups(reqs, 5)
    assert [r.timestamp_ms for r in got] == [0, 2, 3, 4, 5, 6]


def test_rounds_deal_whole_groups_by_first_arrival_in_trace_order() -> None:
    reqs = [
        _req(i, ids) for i, ids in enumerate([(1, 2), (3,), (4, 5), (1, 6), (4,), (7,), (7, 8)])
    ]
    parts = split_rounds(reqs, 2)  # groups by first arrival: 1, 3, 4, 7 -> parts 0, 1, 0, 1
    assert [[r.timestamp_ms for r in p] for p in parts] == [[0, 2, 3, 4], [1, 5, 6]]
    assert split_rounds(reqs, 1) == [reqs]
    with pytest.raises(InvalidArgumentError, match="5 rounds need as many prefix groups, got 4"):
        split_rounds(reqs, 5)


def test_load_trace_reads_rows_and_refuses_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'
        '{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
    )
    assert load_trace(path) == [TraceRequest(0, 600, 3, (0, 1)), TraceRequest(9, 10, 1, (0,))]
    assert load_trace(path, 1, 1) == [TraceRequest(9, 10, 1, (0,))]
    with pytest.raises(ConfigError, match="3 rows from row 0 asked, 2 there"):
        load_trace(path, 0, 3)
    path.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [0]}\n')
    with pytest.raises(ConfigError, match="row 0"):
        load_trace(path)
    with pytest.raises(InvalidArgumentError, match="hash_ids"):
        TraceRequest(0, 1, 1, ())
