"""Timing candidates against each other on a noisy machine: interleaved rounds, best of each.

:class:`Timer` is the injectable protocol; :class:`PerfCounterTimer` warms up, rotates the
order each round and takes each candidate's minimum. See docs/attention.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from kvplane.errors import InvalidArgumentError

Thunks = Mapping[str, Callable[[], object]]


class Timer(Protocol):
    """Times every candidate of ``thunks``; returns seconds per name (lower is faster)."""

    def __call__(self, thunks: Thunks) -> Mapping[str, float]: ...


class PerfCounterTimer:
    """Interleaved rounds of ``time.perf_counter`` samples, best of each; see the module
    docstring."""

    def __init__(
        self,
        warmup: int = 1,
        rounds: int = 3,
        *,
        min_seconds: float = 0.0,
        max_rounds: int = 100,
    ) -> None:
        if warmup < 0 or rounds < 1 or max_rounds < rounds or not min_seconds >= 0:
            raise InvalidArgumentError(
                f"need warmup >= 0, 1 <= rounds <= max_rounds and min_seconds >= 0, got "
                f"warmup={warmup}, rounds={rounds}, max_rounds={max_rounds}, "
                f"min_seconds={min_seconds}"
            )
        self.warmup, self.rounds = warmup, rounds
        self.min_seconds, self.max_rounds = min_seconds, max_rounds

    def __call__(self, thunks: Thunks) -> dict[str, float]:
        names = list(thunks)
        for _ in range(self.warmup):
            for name in names:
                thunks[name]()
        samples: dict[str, list[float]] = {name: [] for name in names}
        spent, done = 0.0, 0
        while names and (
            done < self.rounds or (done < self.max_rounds and spent < self.min_seconds)
        ):
            turn = done % len(names)
            for name in names[turn:] + names[:turn]:
                seconds = _sample(thunks[name])
                samples[name].append(seconds)
                spent += seconds
            done += 1
        return {name: min(times) for name, times in samples.items()}


def _sample(fn: Callable[[], object]) -> float:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start
