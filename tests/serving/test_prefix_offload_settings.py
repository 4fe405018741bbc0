"""``PrefixSettings.pending_wait_s`` follows the one wait rule (``prefix_waits.check_wait_s``:
a duration in [0, 1e6] s): a bad value is refused by the settings, one line, so no tier or job
thread of a prefix offload is ever started for it."""

from __future__ import annotations

import threading

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.offload import OffloadConfig
from kvplane.serving.prefix_offload import PrefixSettings
from kvplane.serving.prefix_waits import PENDING_WAIT_S

CONFIG = OffloadConfig(host_slots=8, admission_min_lookups=0, pin_memory=False)


def test_a_wait_in_0_to_1e6_s_is_kept_and_the_default_is_the_waits_bound() -> None:
    assert PrefixSettings(CONFIG).pending_wait_s == PENDING_WAIT_S == 2.0
    waits = [PrefixSettings(CONFIG, 2, pending_wait_s=w).pending_wait_s for w in (0, 0.5, 1e6)]
    assert waits == [0, 0.5, 1e6]


@pytest.mark.parametrize(
    ("value", "shown"),
    [(-1, "-1"), (1e6 + 1, "1000001.0"), (float("nan"), "nan"), (float("inf"), "inf"),
     (True, "True"), ("2", "'2'")],
)  # fmt: skip
def test_a_wait_that_is_not_a_duration_is_refused_before_any_thread_starts(
    value: object, shown: str
) -> None:
    before = set(threading.enumerate())
    with pytest.raises(InvalidArgumentError) as info:
        PrefixSettings(CONFIG, 2, pending_wait_s=value)  # type: ignore[arg-type]
    assert str(info.value) == (
        "PrefixSettings.pending_wait_s must be a finite number >= 0 and at most 1e+06 s, "
        f"got {shown}"
    )
    assert set(threading.enumerate()) == before
