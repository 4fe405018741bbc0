"""A ratio's spread over paired repeats, the repeat-until-stable loop, and the bench row."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.apps.bench.spread import (
    Row,
    Spread,
    repeat_rows_until_stable,
    repeat_until_stable,
    spread,
    spread_of,
)
from kvplane.errors import InvalidArgumentError


def test_spread_of_reports_min_median_max_and_the_middle_half() -> None:
    # Sorted: 0.5, 0.98, 1.0, 1.02, 3.0 -> middle half is indices 1..3, within ±5% of 1.0.
    got = spread_of([1.0, 3.0, 0.98, 0.5, 1.02])
    assert got == Spread(5, 0.5, 1.0, 3.0, True)
    assert got.fields() == {
        "repeats": 5, "ratio_min": 0.5, "ratio_median": 1.0, "ratio_max": 3.0, "stable": True,
    }  # fmt: skip
    # A 0.9 is in the middle half (indices 1..3) and 10% below the median: unstable at 5%.
    assert not spread_of([0.9, 0.9, 1.0, 1.0, 1.0]).stable
    assert spread_of([0.9, 0.9, 1.0, 1.0, 1.0], tolerance=0.15).stable
    assert spread_of([0.9, 1.0, 1.0, 1.0]).stable  # of four, the middle is indices 1..2
    # Under four ratios the middle is all of them.
    assert not spread_of([1.0, 1.2]).stable
    # One or two ratios are never called stable.
    assert spread_of([2.0]) == Spread(1, 2.0, 2.0, 2.0, False)
    assert not spread_of([1.0, 1.0]).stable and spread_of([1.0] * 3).stable


def test_spread_pairs_each_repeat_with_its_own_limit() -> None:
    ours, limit = [2.0, 8.0, 2.0], [1.0, 4.0, 1.0]  # repeat 2 ran 4x slower on both sides
    assert spread(ours, limit) == Spread(3, 0.5, 0.5, 0.5, True)
    assert spread(ours, limit, higher_is_better=False) == Spread(3, 2.0, 2.0, 2.0, True)
    assert spread([1.0, 4.0, 2.0], [2.0, 1.0, 1.0]) == Spread(3, 0.25, 0.5, 2.0, False)


@pytest.mark.parametrize(
    ("ours", "limit"), [([1.0, 2.0], [1.0]), ([], []), ([0.0], [1.0]), ([1.0], [float("nan")])]
)
def test_spread_refuses_unpaired_empty_or_non_positive_seconds(
    ours: list[float], limit: list[float]
) -> None:
    with pytest.raises(InvalidArgumentError):
        spread(ours, limit)


def test_spread_of_refuses_bad_ratios_and_tolerance() -> None:
    for bad in ([], [-1.0], [float("inf")], [True]):
        with pytest.raises(InvalidArgumentError):
            spread_of(bad)
    with pytest.raises(InvalidArgumentError):
        spread_of([1.0], tolerance=-0.1)


def _pairs(values: list[tuple[float, float]]) -> Iterator[tuple[float, float]]:
    yield from values


def test_repeat_until_stable_stops_once_the_middle_half_settles() -> None:
    # Ratios 0.5, 1, 1, 1, 1, ...: stable after the 5th repeat (middle half all 1.0).
    feed = _pairs([(2.0, 1.0)] + [(1.0, 1.0)] * 20)
    ours, limit = repeat_until_stable(lambda: next(feed), settle_s=0.0)
    assert ours == [2.0, 1.0, 1.0, 1.0, 1.0] and limit == [1.0] * 5
    # Never stable: runs to max_repeats.
    feed = _pairs([(1.0, 1.0), (1.0, 2.0)] * 10)
    ours, _ = repeat_until_stable(lambda: next(feed), max_repeats=8, settle_s=0.0)
    assert len(ours) == 8


def test_repeat_until_stable_stops_at_the_time_cap() -> None:
    ticks = iter([0.0, 1.0, 2.0, 3.0, 4.0])  # the start, then one tick per repeat
    ours, _ = repeat_until_stable(
        lambda: (1.0, 2.0), min_repeats=10, cap_s=2.5, settle_s=0.0, clock=lambda: next(ticks)
    )
    assert ours == [1.0, 1.0, 1.0]
    # Past the cap at the first repeat: one repeat is still run.
    ticks = iter([0.0, 100.0])
    ours, _ = repeat_until_stable(
        lambda: (1.0, 2.0), cap_s=1.0, settle_s=0.0, clock=lambda: next(ticks)
    )
    assert ours == [1.0]


def test_repeat_until_stable_refuses_bad_bounds() -> None:
    with pytest.raises(InvalidArgumentError):
        repeat_until_stable(lambda: (1.0, 1.0), min_repeats=0)
    with pytest.raises(InvalidArgumentError):
        repeat_until_stable(lambda: (1.0, 1.0), min_repeats=5, max_repeats=4)
    with pytest.raises(InvalidArgumentError):
        repeat_until_stable(lambda: (1.0, 1.0), cap_s=0.0)


def test_row_is_met_in_its_direction_and_flat() -> None:
    s = Spread(5, 0.81234, 0.912345, 1.0, True)
    row = Row("attention", "decode_gbps_vs_readonly", 12.34567, "GB/s", 13.5, "read-only pass",
              s, 0.9, True)  # fmt: skip
    assert row.met is True
    assert row.as_dict() == {
        "bench": "attention", "row": "decode_gbps_vs_readonly", "figure": 12.35, "unit": "GB/s",
        "limit": 13.5, "limit_name": "read-only pass", "repeats": 5, "ratio_min": 0.8123,
        "ratio_median": 0.9123, "ratio_max": 1.0, "stable": True, "target": 0.9, "met": True,
    }  # fmt: skip
    lower = Row("pd", "ttft_ms", 5.0, "ms", 4.0, "floor", s, 0.9, False)
    assert lower.met is False
    assert Row("pd", "x", 1.0, "ms", 1.0, "floor", s, None, True).met is None


def test_repeat_rows_until_stable_waits_for_every_row() -> None:
    # Row 0 is stable from the start; row 1's ratios 2, 1, 1 are not (of three, the middle is
    # all three), 2, 1, 1, 1 are (sorted 1, 1, 1, 2: the middle is indices 1..2).
    feed = iter([[(1.0, 1.0), (1.0, 2.0)]] + [[(1.0, 1.0), (1.0, 1.0)]] * 20)
    rows = repeat_rows_until_stable(lambda: next(feed), min_repeats=3, settle_s=0.0)
    assert [len(ours) for ours, _ in rows] == [4, 4]
    feed = iter([[(1.0, 1.0), (1.0, 2.0)], [(1.0, 1.0), (1.0, 3.0)]] + [[(1.0, 1.0)] * 2] * 20)
    rows = repeat_rows_until_stable(lambda: next(feed), min_repeats=3, settle_s=0.0)
    # Sorted 1 x 6, 2, 3: the middle (indices 2..5) is all 1 at the 8th repeat, not before.
    assert rows[1] == ([1.0] * 8, [2.0, 3.0] + [1.0] * 6)
    with pytest.raises(InvalidArgumentError):
        steps = iter([[(1.0, 1.0)], [(1.0, 1.0), (1.0, 1.0)]])
        repeat_rows_until_stable(lambda: next(steps), settle_s=0.0)
