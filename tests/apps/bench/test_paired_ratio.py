"""The benches' ratio against a limit: the median of per-repeat ratios."""

from __future__ import annotations

import pytest
import torch

from kvplane.apps.bench.common import paired_ratio, stream_memcpy
from kvplane.apps.bench.transport import _row
from kvplane.transports.native_copy import kernel


def test_each_repeat_is_divided_by_its_own_limit() -> None:
    # Repeat 2 ran on a slowed machine (both sides 4x slower): a paired ratio is unmoved by it.
    ours, limit = [2.0, 8.0, 2.0], [1.0, 4.0, 1.0]
    assert paired_ratio(ours, limit) == 0.5
    # The ratio of medians would divide times taken under different loads.
    assert paired_ratio([1.0, 4.0, 2.0], [2.0, 1.0, 1.0]) == 0.5  # ratios 2, 0.25, 0.5


def test_unequal_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])


def test_transport_row_reports_medians_and_the_paired_ratios() -> None:
    total = 64 << 20
    ours = [total / 1e9, 4 * total / 1e9, total / 2e9]
    row, _ = _row("tcp", 4096, (ours, [], [total / 2e9] * 3, [], [total / 1e9] * 3))
    assert row["gbps"] == 1.0 and row["limit_gbps"] == 2.0
    assert row["ratio"] == 0.5  # per-repeat ratios 0.5, 0.125, 1.0
    assert "stream_ratio" not in row
    assert row["scatter_limit_gbps"] == 1.0
    assert row["scatter_ratio"] == 1.0  # per-repeat ratios 1.0, 0.25, 2.0
    stream = [total / 4e9, total / 1e9, total / 4e9]
    row, lines = _row("local", 4096, (ours, [], [total / 2e9] * 3, stream, []))
    assert row["stream_limit_gbps"] == 4.0
    assert row["stream_ratio"] == 0.25  # per-repeat ratios 0.25, 0.25, 0.5
    assert "scatter_ratio" not in row
    assert [(r.row, r.as_dict()["limit"], r.spread.ratio_median) for r in lines] == [
        ("local 4 KiB fresh", 2.0, 0.5), ("local 4 KiB vs stream", 4.0, 0.25),
    ]  # fmt: skip


def test_stream_memcpy_copies_every_byte_or_is_absent() -> None:
    src = torch.arange(3 << 20, dtype=torch.int64).view(torch.uint8)[: (5 << 20) + 3]
    dst = torch.zeros_like(src)
    copy = stream_memcpy(src, dst)
    if kernel().library is None:
        assert copy is None
        return
    assert copy is not None and not dst.any()  # nothing moves until it is called
    copy()
    assert torch.equal(dst, src)
    assert stream_memcpy(src, dst[:-1]) is None  # sizes differ: no thunk
    assert stream_memcpy(src[::2], dst[::2]) is None  # not contiguous
