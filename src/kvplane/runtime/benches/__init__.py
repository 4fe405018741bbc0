"""Benchmark modules for ``kvplane bench``, and what they share: the settle pause."""

SETTLE_S = 0.03
"""Pause before every timed run: after a torch op its OpenMP threads spin-wait for several
milliseconds, stealing the cores of whatever runs next (measured: a copy right after the limit's
``copy_`` lost a third of its speed); each run starts on a quiet machine instead."""
