"""Timings validation and the timer queue (deadlines are never extended)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.pd.timers import TimerQueue, Timings


def test_defaults_and_sender_deadline() -> None:
    t = Timings()
    assert t.sender_deadline_s == t.deadline_s + t.verdict_grace_s == 40.0


@pytest.mark.parametrize(
    "kwargs",
    [{"deadline_s": 0}, {"drain_s": -1.0}, {"in_doubt_s": math.inf}, {"retransmit_s": True},
     {"heartbeat_s": 2.0, "lease_s": 2.0}],
)  # fmt: skip
def test_bad_timings_name_the_field(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs)) if len(kwargs) == 1 else "lease_s"):
        Timings(**kwargs)  # type: ignore[arg-type]


def test_arming_keeps_the_earlier_deadline() -> None:
    q: TimerQueue[str] = TimerQueue()
    assert q.arm("a", 5.0) == 5.0
    assert q.arm("a", 9.0) == 5.0  # never extended
    assert q.arm("a", 2.0) == 2.0  # may be brought forward
    q.arm("b", 3.0)
    assert q.next_deadline() == 2.0 and len(q) == 2 and "a" in q
    assert q.due(1.9) == []
    assert q.due(3.0) == ["a", "b"]
    assert q.due(10.0) == [] and q.next_deadline() is None


def test_cancel_and_finite_deadlines() -> None:
    q: TimerQueue[int] = TimerQueue()
    q.arm(1, 1.0)
    assert q.cancel(1) and not q.cancel(1)
    assert q.due(5.0) == [] and q.deadline(1) is None
    with pytest.raises(InvalidArgumentError):
        q.arm(1, math.nan)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0, 100)), max_size=40), st.floats(0, 100))
def test_due_returns_exactly_the_earliest_deadline_per_key(
    arms: list[tuple[int, float]], now: float
) -> None:
    q: TimerQueue[int] = TimerQueue()
    model: dict[int, float] = {}
    for key, when in arms:
        q.arm(key, when)
        model[key] = min(model.get(key, math.inf), when)
    got = q.due(now)
    assert sorted(got) == sorted(k for k, w in model.items() if w <= now)
    assert [model[k] for k in got] == sorted(model[k] for k in got)  # earliest first
    assert len(q) == len(model) - len(got)
