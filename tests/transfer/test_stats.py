"""Plan statistics: contiguous runs counted from descriptors alone, and the stats summary."""

from __future__ import annotations

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.transfer.stats import compute_stats, contiguous_runs
from kvplane.transports.base import DescriptorList


def test_contiguous_runs_need_both_sides_to_continue() -> None:
    # unsorted on purpose: 0→100 and 10→110 continue each other; 20→300 breaks the destination
    src = DescriptorList.of([(0, 10, 10), (0, 0, 10), (0, 20, 5)])
    dst = DescriptorList.of([(1, 110, 10), (1, 100, 10), (1, 300, 5)])
    assert contiguous_runs(src, dst) == 2
    # same offsets but the second pair lives in another destination region
    dst_other = DescriptorList.of([(2, 110, 10), (1, 100, 10), (1, 300, 5)])
    assert contiguous_runs(src, dst_other) == 3
    chain = DescriptorList.of([(0, i * 4, 4) for i in range(6)])
    assert contiguous_runs(chain, DescriptorList.of([(1, 64 + i * 4, 4) for i in range(6)])) == 1
    assert contiguous_runs(DescriptorList.empty(), DescriptorList.empty()) == 0
    assert contiguous_runs(DescriptorList.of([(0, 0, 1)]), DescriptorList.of([(1, 0, 1)])) == 1


def test_compute_stats_exact() -> None:
    src = DescriptorList.of([(0, 0, 10), (0, 10, 10), (0, 40, 4)])
    dst = DescriptorList.of([(1, 100, 10), (1, 110, 10), (1, 0, 4)])
    stats = compute_stats([2, 1], src, dst, logical_bytes=24)
    assert stats.as_dict() == {
        "num_bytes": 24,
        "logical_bytes": 24,
        "ops": 2,
        "descriptors": 3,
        "max_descriptors_per_op": 2,
        "mean_descriptors_per_op": 1.5,
        "amplification": 1.0,
        "contiguous_runs": 2,
    }
    assert compute_stats([3], src, dst, logical_bytes=12).amplification == 2.0
    assert compute_stats([], DescriptorList.empty(), DescriptorList.empty(), 0).ops == 0
    with pytest.raises(InvalidArgumentError, match="negative"):
        compute_stats([3], src, dst, logical_bytes=-1)
