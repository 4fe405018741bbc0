"""Timing candidates against each other on a noisy machine: interleaved rounds, best of each.

A :class:`Timer` times a set of named candidates together (``timer({name: thunk}) -> {name:
seconds}``), so that a ranking is judged from measurements taken under the same conditions.
:class:`PerfCounterTimer` does it the robust way for a shared CPU:

- ``warmup`` untimed runs of every candidate first (first-touch page faults, lazy kernels,
  allocator growth);
- then *rounds*: each round runs every candidate once, in an order rotated by one each round, so
  a burst of load from another process lands on all candidates alike and none always runs first
  (or right after a cache-trashing neighbour);
- at least ``rounds`` rounds, and more (up to ``max_rounds``) while the timed rounds have taken
  less than ``min_seconds``, so cheap problems get many samples for the price of one slow one;
- each candidate's time is the *minimum* of its samples: on a shared machine noise only ever
  adds time, so the minimum is the estimate least disturbed by it.

On CUDA every sample is bracketed by ``torch.cuda.synchronize()``.
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
