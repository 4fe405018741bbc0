"""The benches' ratio against a limit: the median of per-repeat ratios."""

from __future__ import annotations

import pytest

from kvplane.runtime.benches import paired_ratio
from kvplane.runtime.benches.transport import _row


def test_each_repeat_is_divided_by_its_own_limit() -> None:
    # Repeat 2 ran on a slowed machine (both sides 4x slower): a paired ratio is unmoved by it.
    ours, limit = [2.0, 8.0, 2.0], [1.0, 4.0, 1.0]
    assert paired_ratio(ours, limit) == 0.5
    # The ratio of medians would divide times taken under different loads.
    assert paired_ratio([1.0, 4.0, 2.0], [2.0, 1.0, 1.0]) == 0.5  # ratios 2, 0.25, 0.5


def test_unequal_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])


def test_transport_row_reports_medians_and_the_paired_ratio() -> None:
    total = 64 << 20
    row = _row("tcp", 4096, [total / 1e9, 4 * total / 1e9, total / 2e9], [total / 2e9] * 3)
    assert row["gbps"] == 1.0 and row["limit_gbps"] == 2.0
    assert row["ratio"] == 0.5  # per-repeat ratios 0.5, 0.125, 1.0
