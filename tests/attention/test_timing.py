"""PerfCounterTimer: warmup, interleaved rotated rounds, more rounds for cheap candidates, the
best sample of each; on a scripted clock, so every number is exact."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvplane.attention import timing
from kvplane.attention.timing import PerfCounterTimer
from kvplane.errors import InvalidArgumentError


class Clock:
    """A fake ``time.perf_counter`` that a candidate advances by its scripted cost."""

    def __init__(self) -> None:
        self.now = 0.0
        self.log: list[str] = []

    def __call__(self) -> float:
        return self.now

    def candidate(self, name: str, costs: list[float]) -> Callable[[], None]:
        def run() -> None:
            self.log.append(name)
            self.now += costs.pop(0) if costs else 1.0

        return run


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", c)
    return c


def test_rounds_rotate_and_the_best_sample_wins(clock: Clock) -> None:
    thunks = {
        "a": clock.candidate("a", [9.0, 5.0, 4.0, 6.0]),  # warmup, then three rounds
        "b": clock.candidate("b", [9.0, 3.0, 7.0, 2.0]),
        "c": clock.candidate("c", [9.0, 8.0, 8.0, 8.0]),
    }
    got = PerfCounterTimer(warmup=1, rounds=3)(thunks)
    assert got == {"a": 4.0, "b": 2.0, "c": 8.0}
    assert clock.log == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_cheap_candidates_get_more_rounds_up_to_the_cap(clock: Clock) -> None:
    thunks = {"x": clock.candidate("x", [0.25] * 50), "y": clock.candidate("y", [0.5] * 50)}
    got = PerfCounterTimer(warmup=0, rounds=2, min_seconds=3.0)(thunks)
    assert got == {"x": 0.25, "y": 0.5}
    assert len(clock.log) == 2 * 4  # 0.75 s a round: 4 rounds reach 3 s
    clock.log.clear()
    PerfCounterTimer(warmup=0, rounds=2, min_seconds=10.0, max_rounds=3)(thunks)
    assert len(clock.log) == 2 * 3


def test_no_candidates_and_bad_settings(clock: Clock) -> None:
    assert PerfCounterTimer(min_seconds=1.0)({}) == {}
    for bad in (
        {"warmup": -1},
        {"rounds": 0},
        {"rounds": 5, "max_rounds": 4},
        {"min_seconds": -1.0},
        {"min_seconds": float("nan")},
    ):
        with pytest.raises(InvalidArgumentError, match="need warmup >= 0"):
            PerfCounterTimer(**bad)  # type: ignore[arg-type]
