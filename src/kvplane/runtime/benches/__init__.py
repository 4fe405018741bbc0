"""Benchmark modules for ``kvplane bench``, and what they share: the settle pause and the
paired ratio against a limit."""

import statistics
from collections.abc import Sequence

SETTLE_S = 0.03
"""Pause before every timed run: after a torch op its OpenMP threads spin-wait for several
milliseconds, stealing the cores of whatever runs next (measured: a copy right after the limit's
``copy_`` lost a third of its speed); each run starts on a quiet machine instead."""


def paired_ratio(ours_s: Sequence[float], limit_s: Sequence[float]) -> float:
    """Throughput ratio ours / limit from seconds per repeat: the median of the per-repeat
    ratios ``limit_s[i] / ours_s[i]``. Repeat ``i`` timed both back to back, under the same
    machine load; on a shared host the load drifts between repeats, and a ratio of the two
    medians would divide times taken under different conditions. Equal-length, positive
    sequences (the caller's timings)."""
    return statistics.median(lim / us for us, lim in zip(ours_s, limit_s, strict=True))
